"""What the ledger keeps beside its entries so that a call costs what it touches, not the size
of the data set: a job of 10^6 prompts × 3 epochs holds 3·10^6 entries, and the frequent calls
(a replica's request, a step's lease, the progress line's counts) must not walk them.

`LedgerIndex` follows every entry through its states (the ledger calls `remove(e)` before it
changes an entry and `add(e)` after) and keeps:

- per (state, group), how many entries are generating, stored or leased (reserved ones too:
  they hold store bytes like the others);
- per group, the stored samples that can be leased in ledger order (`StoredQueue`) and, per
  epoch, their bytes:
  a step's assembly takes the head of each group's queue, the deepest queue lends first;
- per group, the store bytes held by untrained samples (`HeldBytes`), a reused sample counted
  once however many entries share its key (its lease and its next epoch's entry);
- per step, its leased entries.

Every structure is derived: `rebuilt(entries)` computes the same from scratch, which the
ledger does after a rare bulk change (a shortened plan) and the tests compare against.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, defaultdict

from cluster.data.ledger_entry import GENERATING, LEASED, RESERVED, STORED, Entry

LIVE = (GENERATING, STORED, LEASED)  # the states that place an entry in a group


class StoredQueue:
    """One group's stored entries, smallest ledger position first: a heap with lazy deletion
    (an entry that leaves is forgotten at once and skipped when it reaches the top; one that
    comes back gets a new ticket, so an old heap item of it never counts twice). The heap is
    rebuilt from the live entries when stale items outnumber them, so it stays O(live)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, str]] = []  # (position, ticket, uid)
        self._live: dict[str, tuple[int, int]] = {}  # uid -> (position, its live ticket)
        self._tickets = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def uids(self) -> list[str]:
        return [uid for _, uid in sorted((pos, uid) for uid, (pos, _) in self._live.items())]

    def add(self, uid: str, position: int) -> None:
        ticket = next(self._tickets)
        self._live[uid] = (position, ticket)
        heapq.heappush(self._heap, (position, ticket, uid))
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = [(pos, t, u) for u, (pos, t) in self._live.items()]
            heapq.heapify(self._heap)

    def discard(self, uid: str) -> None:
        self._live.pop(uid, None)

    def _stale(self, item: tuple[int, int, str]) -> bool:
        live = self._live.get(item[2])
        return live is None or live[1] != item[1]

    def head(self) -> str | None:
        heap = self._heap
        while heap and self._stale(heap[0]):
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def pop(self) -> str:
        uid = self.head()
        if uid is None:
            raise IndexError("pop from an empty StoredQueue")
        heapq.heappop(self._heap)
        del self._live[uid]
        return uid


class HeldBytes:
    """Bytes held in one group's store by untrained samples, each key counted once."""

    def __init__(self) -> None:
        self._holders: dict[str, list[int]] = {}  # key -> [entries holding it, its bytes]
        self.total = 0

    def add(self, key: str, nbytes: int) -> None:
        held = self._holders.get(key)
        if held is None:
            self._holders[key] = [1, nbytes]
            self.total += nbytes
        else:
            held[0] += 1

    def remove(self, key: str) -> None:
        held = self._holders[key]
        held[0] -= 1
        if not held[0]:
            del self._holders[key]
            self.total -= held[1]


def _held_key(e: Entry) -> str | None:
    """The store key whose bytes `e` holds (None: it holds none)."""
    if e.state in (STORED, LEASED) and not e.released:
        return e.ref.key if e.ref is not None else e.uid
    return None


class LedgerIndex:
    def __init__(self, position: dict[str, int]) -> None:
        self.position = position  # the ledger's own uid -> order map (shared, not copied)
        self.live: Counter = Counter()  # (state, group) -> entries
        self.queues: dict[str, StoredQueue] = defaultdict(StoredQueue)
        self.stored_bytes: Counter = Counter()  # (group, epoch) -> bytes of its stored samples
        self.held: dict[str, HeldBytes] = defaultdict(HeldBytes)
        self.by_step: dict[int | None, dict[str, None]] = {}  # step -> its leased uids

    def add(self, e: Entry) -> None:
        if e.state not in LIVE:
            return
        self.live[(e.state, e.group)] += 1
        if e.state == STORED and e.epoch != RESERVED:  # (reserved: never leased)
            self.queues[e.group].add(e.uid, self.position[e.uid])
            self.stored_bytes[(e.group, e.epoch)] += e.nbytes
        elif e.state == LEASED:
            self.by_step.setdefault(e.step, {})[e.uid] = None
        key = _held_key(e)
        if key is not None:
            self.held[e.group].add(key, e.nbytes)

    def remove(self, e: Entry) -> None:
        if e.state not in LIVE:
            return
        self.live[(e.state, e.group)] -= 1
        if e.state == STORED and e.epoch != RESERVED:
            self.queues[e.group].discard(e.uid)
            self.stored_bytes[(e.group, e.epoch)] -= e.nbytes
        elif e.state == LEASED:
            uids = self.by_step[e.step]
            del uids[e.uid]
            if not uids:
                del self.by_step[e.step]
        key = _held_key(e)
        if key is not None:
            self.held[e.group].remove(key)

    # ---- reading -----------------------------------------------------------------------
    def groups(self) -> set[str]:
        """Groups with an entry generating, stored or leased."""
        return {g for (_, g), n in self.live.items() if n and g}

    def count(self, state: str, group: str) -> int:
        return self.live[(state, group)]

    def held_bytes(self, group: str | None = None) -> int:
        if group is not None:
            return self.held[group].total if group in self.held else 0
        return sum(h.total for h in self.held.values())

    def ready_bytes(self, group: str, max_epoch: int | None) -> int:
        """Bytes of the group's stored samples of epochs up to `max_epoch` (None: all)."""
        return sum(n for (g, epoch), n in self.stored_bytes.items()
                   if g == group and (max_epoch is None or epoch <= max_epoch))

    def leased_at(self, step: int) -> list[str]:
        """The uids leased for `step`, in ledger order."""
        return sorted(self.by_step.get(step, ()), key=self.position.__getitem__)

    def summary(self) -> dict:
        """What the index holds, comparable with another index's (tests, `rebuilt`)."""
        return {
            "live": {k: n for k, n in self.live.items() if n},
            "stored": {g: q.uids() for g, q in self.queues.items() if len(q)},
            "stored_bytes": {k: n for k, n in self.stored_bytes.items() if n},
            "held": {g: h.total for g, h in self.held.items() if h.total},
            "by_step": {s: sorted(u) for s, u in self.by_step.items()},
        }


def rebuilt(entries, position: dict[str, int]) -> LedgerIndex:
    """An index computed from scratch over `entries` (in ledger order)."""
    index = LedgerIndex(position)
    for e in entries:
        index.add(e)
    return index
