"""The ledger's training side: the calls of the training loop (step assembly, commits, restarts)
on the `SampleLedger` state (cluster/data/ledger.py, whose docstring tells the whole life of a
sample). A mixin: it holds no state of its own.

Here: `peek_stored`, `reserved_rows`, `reserved_waiting`, `lease_step`, `checkpoint_state`,
`checkpoint_delta`, `release`, `commit`, `trainer_restarted`, `release_lease`, and the poison-sample search's
`lease_only` and `quarantine_sample` (`cluster.job.poison`). The producers' calls are in
`ledger_generation`; the plan, the accounting and the saved state (`shorten`, `counts`,
`outcome`, `abandoned_keys`, `load_state_dict`, ...) in `ledger`. Each is called through one line
of `LedgerClient` (cluster/data/ledger_client.py)."""

from __future__ import annotations

import heapq
from collections import defaultdict
from operator import attrgetter

from cluster.data.ledger_entry import (
    FAILED,
    GENERATING,
    LEASED,
    PENDING,
    POISON,
    QUARANTINE,
    STORED,
    TRAINED,
    UNBOUNDED,
    Entry,
    nonfinite_step,
    saved_row,
)
from cluster.data.ledger_rows import LeasedSample, read_failure_blamed

tokens_of = attrgetter("tokens")


class TrainingSide:
    def peek_stored(self, n: int) -> list[LeasedSample]:
        """Up to `n` stored samples, without leasing them (e.g. to fit a vocab mapping)."""
        first = heapq.nsmallest(n, self._members[STORED], key=self.position.__getitem__)
        return [self._row(self.entries[u]) for u in first]

    def reserved_rows(self) -> list[LeasedSample]:
        """The reserved samples stored so far (the calibration split and the held-out prompts the
        confidence head is measured on), in the order they were given."""
        stored = sorted(self._reserved_members[STORED], key=self.position.__getitem__)
        return [self._row(self.entries[u]) for u in stored]

    def reserved_waiting(self) -> int:
        """Reserved samples neither stored nor given up on."""
        return sum(len(self._reserved_members[s]) for s in (PENDING, GENERATING))

    @staticmethod
    def _row(e: Entry) -> LeasedSample:
        return LeasedSample(e.uid, e.ref, e.group)

    def _leased_at(self, step: int) -> list[Entry]:
        return [self.entries[u] for u in self.index.leased_at(step)]

    def lease_step(self, step: int, rank_groups: list[str], batch_tokens: int) -> list[list[LeasedSample]] | None:
        """Samples for optimizer step `step`, one list per rank (`rank_groups[r]`: rank r's
        group), assembled as the module docstring says; None when no rank gets anything.
        Re-asking for a step already leased returns the same lease."""
        held = self._leased_at(step) or self._assemble(step, rank_groups, batch_tokens)
        return self._per_rank(held, len(rank_groups))

    def _per_rank(self, held: list[Entry], ranks: int) -> list[list[LeasedSample]] | None:
        """A step's leased entries as one list of rows per rank, in ledger order; None if none."""
        if not held:
            return None
        out: list[list[LeasedSample]] = [[] for _ in range(ranks)]
        position = self.position
        for e in sorted(held, key=lambda x: position[x.uid]):
            out[e.rank].append(LeasedSample(e.uid, e.ref, e.group))
        return out

    def _assemble(self, step: int, rank_groups: list[str], batch_tokens: int) -> list[Entry]:
        """Each group's ready queue is the head of its stored samples in ledger order: those of
        epochs up to the lease floor, or all of them while the group is full (ledger order is
        epoch-major, so either is a prefix). Entries are taken off the index's queues as they
        are chosen; those a step does not take go back."""
        floor = self.lease_epoch()
        queues = self.index.queues
        full: dict[str, bool] = {}  # (asked only of groups with a stored sample; nothing here changes it)

        def is_full(g: str) -> bool:
            if g not in full:
                full[g] = self.full(g)
            return full[g]

        # each group's ready head, looked up once until its queue changes (`pop`, `put_back`):
        # the second pass asks it of every donor for every rank with room
        heads: dict[str, Entry | None] = {}

        def head(g: str) -> Entry | None:
            if g in heads:
                return heads[g]
            uid = queues[g].head() if g in queues else None
            e = self.entries[uid] if uid is not None else None
            e = heads[g] = e if e is not None and (e.epoch <= floor or is_full(g)) else None
            return e

        def pop(g: str) -> None:
            queues[g].pop()
            del heads[g]

        def put_back(e: Entry) -> None:
            queues[e.group].add(e.uid, self.position[e.uid])
            heads.pop(e.group, None)

        # each group's ready queue, bytes; the groups that have one, in the order of their heads
        first = {g: e for g, q in queues.items() if len(q) and (e := head(g)) is not None}
        ready = sorted(first, key=lambda g: self.position[first[g].uid])
        queued = {g: self.index.ready_bytes(g, None if is_full(g) else floor) for g in ready}
        loads = [0] * len(rank_groups)
        picks: list[tuple[Entry, int]] = []

        def take(e: Entry, rank: int) -> None:
            picks.append((e, rank))
            loads[rank] += e.tokens
            queued[e.group] -= e.nbytes

        def has_room(rank: int, e: Entry) -> bool:  # an empty rank takes a sample however long
            return loads[rank] == 0 or loads[rank] + e.tokens <= batch_tokens

        ranks_of: dict[str, list[int]] = defaultdict(list)
        for r, g in enumerate(rank_groups):
            ranks_of[g].append(r)
        for g, ranks in ranks_of.items():  # 1. own group first: a step's worth from the head...
            chosen, total, budget = [], 0, batch_tokens * len(ranks)
            while (e := head(g)) is not None and (not chosen or total + e.tokens <= budget):
                pop(g)
                chosen.append(e)
                total += e.tokens
            # ...balanced largest first (a stable sort: ties keep ledger order), each to the
            # least-loaded rank with room (the first such), within each rank's budget
            for e in sorted(chosen, key=tokens_of, reverse=True):
                rank = None
                for r in ranks:
                    if has_room(r, e) and (rank is None or loads[r] < loads[rank]):
                        rank = r
                if rank is not None:
                    take(e, rank)
                else:
                    put_back(e)  # next step's
        # 2. borrow where the own group has nothing more ready. A donor with nothing ready or at
        # its low watermark stays so for the rest of the step (its queue only shrinks): it leaves
        # the list, so that each rank sorts only the groups that can still lend, not every group.
        lows = {d: self.watermarks.get(d, UNBOUNDED)[1] for d in ready}
        donors = ready
        for r, g in enumerate(rank_groups):
            if head(g) is not None or loads[r] >= batch_tokens:
                continue
            donors = [d for d in donors if queued[d] > lows[d] and head(d) is not None]
            for donor in sorted(donors, key=lambda d: -queued[d]):
                low = lows[donor]
                while donor != g and (e := head(donor)) is not None and queued[donor] > low and has_room(r, e):
                    pop(donor)
                    take(e, r)
        for e, rank in picks:  # (with reuse, the next epoch may train on the sample from now on)
            self._lease(e, step, rank, e.group != rank_groups[rank])
        return [e for e, _ in picks]

    def checkpoint_state(self, step: int) -> dict:
        """The ledger as it will be once `step` is committed, to save inside the checkpoint: whole
        (a checkpoint chain's base; `checkpoint_delta` for what changed since the last one)."""
        self._offer(step)
        return self._as_committed(self.state_dict(), step)

    def checkpoint_delta(self, step: int) -> dict | None:
        """As `checkpoint_state`, but only the rows that changed since the state was last offered
        to a checkpoint that was then committed (those of an offer whose save failed too), to
        save as a delta over that checkpoint's (`cluster.data.ledger_checkpoint`). Its rows may
        be untouched pending ones (back to where they began): replayed, they drop out. None when
        there is no committed checkpoint to build on (a new, loaded or shortened ledger): then
        the checkpoint takes `checkpoint_state`."""
        if not self._chained:
            return None
        self._offer(step)
        uids = self._in_flight.union(self._members[LEASED])  # (every lease: the commit may train it)
        rows = [saved_row(self.entries[u]) for u in sorted(uids, key=self.position.__getitem__)]
        return self._as_committed({**self._saved_header(), "entries": rows}, step)

    def _offer(self, step: int) -> None:
        """The current state goes to a checkpoint of `step`: what changed until now is in flight
        until `commit(step)` says that checkpoint was published."""
        self._in_flight |= self._dirty
        self._dirty, self._offered = set(), step

    def _as_committed(self, state: dict, step: int) -> dict:
        """`state` as it will be once `step` is committed: its leases up to it trained."""
        for d in state["entries"]:
            if d["state"] == LEASED and d["step"] is not None and d["step"] <= step:
                d.update(state=TRAINED, trained_at_step=d["step"])
                for totals in (state["totals"], state["group_totals"].setdefault(d["group"], {})):
                    self._count_trained(totals, d["tokens"], d["crossed"])
        state["committed_step"] = step
        return state

    @staticmethod
    def _count_trained(totals, tokens: int, crossed: bool) -> None:
        for key, n in (("trained_samples", 1), ("trained_tokens", tokens), ("crossed_samples", int(crossed))):
            totals[key] = totals.get(key, 0) + n

    def _shares_key_with_next(self, e: Entry) -> bool:
        nxt = self.entries.get(f"{e.prompt_id}@{e.epoch + 1}")
        return bool(
            self.reuse and nxt is not None and nxt.ref and nxt.ref.key == e.ref.key and nxt.state in (STORED, LEASED)
        )

    def release(self, step: int) -> list[str]:
        """The samples trained at `step` leave the store now (not at their commit); return
        their keys (a sample the next epoch still uses keeps its key)."""
        keys = []
        for e in self._leased_at(step):
            if not e.released and not self._shares_key_with_next(e):
                self._touched(e)
                self.index.remove(e)  # (its bytes leave what the group holds)
                e.released = True
                self.index.add(e)
                keys.append(e.ref.key)
        self._update_pause()
        return keys

    def commit(self, step: int) -> list[str]:
        """Mark everything leased up to `step` trained; return the keys the store can drop
        (a sample the next epoch still uses keeps its key, a released one is gone already)."""
        keys = []
        published = self._offered == step  # (the checkpoint `step`'s state was offered to is saved)
        for e in self._in(LEASED):
            if e.step is not None and e.step <= step:
                saved_so = published and e.uid not in self._dirty  # its row went in trained, as it now is
                self._set(e, TRAINED, trained_at_step=e.step)
                if saved_so:
                    self._dirty.discard(e.uid)
                if not self._shares_key_with_next(e) and not e.released:
                    keys.append(e.ref.key)
                for totals in (self.totals, self.group_totals[e.group]):
                    self._count_trained(totals, e.tokens, e.crossed)
        self.committed_step = max(self.committed_step, step)
        if published:  # the next checkpoint's delta builds on this one
            self._in_flight, self._offered, self._chained = set(), None, True
        self._update_pause()
        return keys

    def trainer_restarted(self, committed_step: int) -> int:
        """The trainer went back to its checkpoint: what it leased after it is trained again,
        re-read if its bytes are still stored, regenerated if they were released."""
        back = [e for e in self._in(LEASED) if e.step is None or e.step > committed_step]
        for e in back:
            if e.released:
                self._set(
                    e, PENDING, ref=None, step=None, rank=None, nbytes=0, group=None, crossed=False, released=False
                )
            else:
                self._set(e, STORED, step=None, rank=None, crossed=False)
        self.events.append({"event": "trainer_restarted", "committed_step": committed_step, "re_leased": len(back)})
        return len(back)

    def release_lease(
        self,
        step: int,
        missing: list[str] | dict[str, str],
        reason: str = "gone from the store",
        regenerate: bool = True,
    ) -> None:
        """Step `step` cannot train: the `missing` samples (a list, or uid -> why) are gone or
        unusable and go back to pending to be regenerated: a failure of the sample where it is to blame
        (`read_failure_blamed`: corrupt, or out of the vocabulary; FAILED after `max_attempts` of them), none where the
        store lost it; with `regenerate=False` (their data is fine, the step was not: a non-finite loss) they are leased
        again as they are, FAILED after `max_attempts` such steps. The rest go back to stored, to be leased again."""
        why = missing if isinstance(missing, dict) else dict.fromkeys(missing, reason)
        for e in self._leased_at(step):
            if e.uid in why and regenerate:
                self._retry_or_fail(e, f"step {step}: {why[e.uid]}", read_failure_blamed(why[e.uid]))
                continue
            if e.uid in why:
                e.errors.append(f"step {step}: {why[e.uid]}")
                if sum(map(nonfinite_step, e.errors)) >= self.max_attempts:
                    self._fail(e, step=None, rank=None, crossed=False)
                    continue
            self._set(e, STORED, step=None, rank=None, crossed=False)
        self.events.append({"event": "lease_released", "step": step, "missing": len(why)})
        self._update_pause()

    # ---- the poison-sample search (cluster/job/poison.py) -----------------------------------
    def lease_only(
        self, step: int, uids: list[str], rank_groups: list[str], batch_tokens: int
    ) -> list[list[LeasedSample]] | None:
        """Step `step` of these samples and no other (those of them stored; the lease floor does
        not apply: they were leased once already), one list per rank as `lease_step`'s: each,
        largest first, to the least-loaded rank of its own group with room (`batch_tokens`, an
        empty rank takes any), else of any group; one that fits nowhere is not leased. None when
        none is. Re-asking for a step already leased returns the same lease."""
        held = self._leased_at(step)
        if not held:
            loads = [0] * len(rank_groups)
            chosen = [e for e in map(self.entries.get, dict.fromkeys(uids)) if e is not None and e.state == STORED]
            for e in sorted(chosen, key=lambda x: (-x.tokens, self.position[x.uid])):
                room = [r for r in range(len(rank_groups)) if loads[r] == 0 or loads[r] + e.tokens <= batch_tokens]
                own = [r for r in room if rank_groups[r] == e.group]
                if not room:
                    continue
                rank = min(own or room, key=loads.__getitem__)
                loads[rank] += e.tokens
                self._lease(e, step, rank, e.group != rank_groups[rank])  # (and with reuse hands it on)
                held.append(e)
        return self._per_rank(held, len(rank_groups))

    def quarantine_sample(self, uid: str, cause: str) -> list[str]:
        """A sample the trainer world fails on alone: FAILED (its error `POISON` + `cause`), and
        its prompt in every epoch with it, as a poison prompt's (`_fail`, `_quarantine`): the
        copies pending, and also those generating, stored or leased (with reuse a stored copy
        holds the very same bytes). Their store objects are removed with the next commit
        (`abandoned_keys`); a copy already trained stays trained. Returns the uids failed (none
        if the sample is trained or failed already)."""
        e = self.entries[uid]
        if e.state in (TRAINED, FAILED):
            return []
        others = [
            c
            for c in (self.entries.get(f"{e.prompt_id}@{epoch}") for epoch in range(self.epochs))
            if c is not None and c is not e
        ]
        copies = [c for c in others if c.state in (GENERATING, STORED, LEASED)]
        pending = [c.uid for c in others if c.state == PENDING]  # (`_fail` quarantines them)
        keys = [c.ref.key for c in (e, *copies) if c.ref is not None and c.state in (STORED, LEASED) and not c.released]
        keys += [self.key_for(c, c.group) for c in copies if c.state == GENERATING]  # (its put may land)
        e.errors.append(POISON + cause)
        self._fail(e, replica=None, ref=None, step=None, rank=None, nbytes=0, crossed=False, released=False)
        for c in copies:
            c.errors.append(f"{QUARANTINE}{e.uid}: {POISON}{cause}")
            self._set(c, FAILED, replica=None, ref=None, step=None, rank=None, nbytes=0, crossed=False, released=False)
        self._abandoned += list(dict.fromkeys(keys))
        self.events.append({"event": "poison_sample", "uid": uid, "cause": cause, "copies": [c.uid for c in copies]})
        self._update_pause()
        return [uid, *pending, *(c.uid for c in copies)]
