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
- per step, its leased entries;
- the groups whose held bytes changed since the ledger last looked (`held_changed`: only they
  can cross a watermark) and those any of whose entries changed (`touched`: only their counts
  can differ from the last `counts()`).

Every structure is derived: `rebuilt(entries)` computes the same from scratch, which the
ledger does after a rare bulk change (a shortened plan) and the tests compare against.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, defaultdict

from cluster.data.ledger_entry import GENERATING, LEASED, RESERVED, STORED, Entry

LIVE = frozenset((GENERATING, STORED, LEASED))  # the states that place an entry in a group


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

    def head(self) -> str | None:
        heap, live = self._heap, self._live
        while heap:
            _, ticket, uid = heap[0]
            current = live.get(uid)
            if current is not None and current[1] == ticket:
                return uid
            heapq.heappop(heap)  # stale: the entry left, or came back with a new ticket
        return None

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


class LedgerIndex:
    def __init__(self, position: dict[str, int]) -> None:
        self.position = position  # the ledger's own uid -> order map (shared, not copied)
        self.live: Counter = Counter()  # (state, group) -> entries
        self.queues: dict[str, StoredQueue] = defaultdict(StoredQueue)
        # group -> epoch -> bytes of its stored samples: a group's ready bytes sum its few epochs,
        # not every (group, epoch) of the job (that made a step's assembly cost groups²)
        self.stored_bytes: dict[str, Counter] = defaultdict(Counter)
        self.held: dict[str, HeldBytes] = defaultdict(HeldBytes)
        self.by_step: dict[int | None, dict[str, None]] = {}  # step -> its leased uids
        self.held_changed: set[str] = set()
        self.touched: set[str] = set()

    # (`add` and `remove` run twice per entry a step leases: each looks its fields up once)
    def add(self, e: Entry) -> None:
        state = e.state
        if state not in LIVE:
            return
        group, uid = e.group, e.uid
        self.live[(state, group)] += 1
        self.touched.add(group)
        if state == STORED:
            if e.epoch != RESERVED:  # (reserved: never leased)
                self.queues[group].add(uid, self.position[uid])
                self.stored_bytes[group][e.epoch] += e.nbytes
        elif state == LEASED:
            uids = self.by_step.get(e.step)
            if uids is None:
                uids = self.by_step[e.step] = {}
            uids[uid] = None
        if state != GENERATING and not e.released:  # it holds its ref's key's bytes (stored or leased, not released)
            self.held[group].add(e.ref.key if e.ref is not None else uid, e.nbytes)
            self.held_changed.add(group)

    def remove(self, e: Entry) -> None:
        state = e.state
        if state not in LIVE:
            return
        group, uid = e.group, e.uid
        self.live[(state, group)] -= 1
        self.touched.add(group)
        if state == STORED:
            if e.epoch != RESERVED:
                self.queues[group].discard(uid)
                self.stored_bytes[group][e.epoch] -= e.nbytes
        elif state == LEASED:
            uids = self.by_step[e.step]
            del uids[uid]
            if not uids:
                del self.by_step[e.step]
        if state != GENERATING and not e.released:
            self.held[group].remove(e.ref.key if e.ref is not None else uid)
            self.held_changed.add(group)

    def leased(self, e: Entry) -> None:
        """What `remove(e)` then `add(e)` do to an entry that was stored and is now leased (its
        `step` set), in one pass: a step leases hundreds. A lease keeps the entry's group, key,
        bytes and released flag, so the bytes its group holds stay as they are (a remove and an
        add of the same key); the group is still marked changed, as the two calls mark it."""
        group, uid = e.group, e.uid
        live = self.live
        live[(STORED, group)] -= 1
        live[(LEASED, group)] += 1
        self.touched.add(group)
        self.queues[group].discard(uid)  # (a step's assembly took it off the queue already)
        self.stored_bytes[group][e.epoch] -= e.nbytes
        uids = self.by_step.get(e.step)
        if uids is None:
            uids = self.by_step[e.step] = {}
        uids[uid] = None
        if not e.released:
            self.held_changed.add(group)

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
        per_epoch = self.stored_bytes.get(group)
        if not per_epoch:
            return 0
        return sum(n for epoch, n in per_epoch.items() if max_epoch is None or epoch <= max_epoch)

    def leased_at(self, step: int) -> list[str]:
        """The uids leased for `step`, in ledger order."""
        return sorted(self.by_step.get(step, ()), key=self.position.__getitem__)

    def summary(self) -> dict:
        """What the index holds, comparable with another index's (tests, `rebuilt`)."""
        return {
            "live": {k: n for k, n in self.live.items() if n},
            "stored": {g: q.uids() for g, q in self.queues.items() if len(q)},
            "stored_bytes": {(g, epoch): n for g, c in self.stored_bytes.items() for epoch, n in c.items() if n},
            "held": {g: h.total for g, h in self.held.items() if h.total},
            "by_step": {s: sorted(u) for s, u in self.by_step.items()},
        }


def rebuilt(entries, position: dict[str, int]) -> LedgerIndex:
    """An index computed from scratch over `entries` (in ledger order)."""
    index = LedgerIndex(position)
    for e in entries:
        index.add(e)
    return index
