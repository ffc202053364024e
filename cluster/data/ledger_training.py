"""The ledger's training side: the calls of the training loop (step assembly, commits, restarts)
on the `SampleLedger` state (cluster/data/ledger.py, whose docstring tells the whole life of a
sample). A mixin: it holds no state of its own.

Here: `peek_stored`, `reserved_rows`, `reserved_waiting`, `lease_step`, `checkpoint_state`,
`release`, `commit`, `trainer_restarted`, `release_lease`. The producers' calls are in
`ledger_generation`; the plan, the accounting and the saved state (`shorten`, `counts`,
`outcome`, `abandoned_keys`, `load_state_dict`, ...) in `ledger`. Each is called through one line
of `LedgerClient` (cluster/data/ledger_client.py)."""

from __future__ import annotations

import heapq
from collections import defaultdict

from cluster.data.ledger_entry import GENERATING, LEASED, PENDING, STORED, TRAINED, UNBOUNDED, Entry
from cluster.data.ledger_rows import LeasedSample


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
        if not held:
            return None
        out: list[list[LeasedSample]] = [[] for _ in rank_groups]
        for e in sorted(held, key=lambda x: self.position[x.uid]):
            out[e.rank].append(self._row(e))
        return out

    def _assemble(self, step: int, rank_groups: list[str], batch_tokens: int) -> list[Entry]:
        """Each group's ready queue is the head of its stored samples in ledger order: those of
        epochs up to the lease floor, or all of them while the group is full (ledger order is
        epoch-major, so either is a prefix). Entries are taken off the index's queues as they
        are chosen; those a step does not take go back."""
        floor = self.lease_epoch()
        full = {g: self.full(g) for g in self.index.queues}
        queues = self.index.queues

        def head(g: str) -> Entry | None:
            uid = queues[g].head() if g in queues else None
            e = self.entries[uid] if uid is not None else None
            return e if e is not None and (e.epoch <= floor or full[g]) else None

        # each group's ready queue, bytes; the groups that have one, in the order of their heads
        ready = sorted((g for g in queues if head(g) is not None), key=lambda g: self.position[head(g).uid])
        queued = {g: self.index.ready_bytes(g, None if full[g] else floor) for g in ready}
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
            chosen, total = [], 0
            while (e := head(g)) is not None and (not chosen or total + e.tokens <= batch_tokens * len(ranks)):
                queues[g].pop()
                chosen.append(e)
                total += e.tokens
            for e in sorted(chosen, key=lambda x: -x.tokens):  # ...balanced largest first, within each rank's budget
                room = [r for r in ranks if has_room(r, e)]
                if room:
                    take(e, min(room, key=loads.__getitem__))
                else:
                    queues[g].add(e.uid, self.position[e.uid])  # next step's
        for r, g in enumerate(rank_groups):  # 2. borrow where the own group has nothing more ready
            if head(g) is not None or loads[r] >= batch_tokens:
                continue
            for donor in sorted(ready, key=lambda d: -queued[d]):
                low = self.watermarks.get(donor, UNBOUNDED)[1]
                while donor != g and (e := head(donor)) is not None and queued[donor] > low and has_room(r, e):
                    queues[donor].pop()
                    take(e, r)
        for e, rank in picks:
            self._set(e, LEASED, step=step, rank=rank, crossed=e.group != rank_groups[rank])
            nxt = self._next_epoch(e)
            if nxt is not None:  # reuse: the next epoch may train on this sample from now on
                self._set(nxt, STORED, ref=e.ref, tokens=e.tokens, nbytes=e.nbytes, group=e.group)
        return [e for e, _ in picks]

    def checkpoint_state(self, step: int) -> dict:
        """The ledger as it will be once `step` is committed, to save inside the checkpoint."""
        state = self.state_dict()
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

    def _next_epoch(self, e: Entry) -> Entry | None:
        nxt = self.entries.get(f"{e.prompt_id}@{e.epoch + 1}")
        return nxt if self.reuse and nxt is not None and nxt.state == PENDING else None

    def _shares_key_with_next(self, e: Entry) -> bool:
        nxt = self.entries.get(f"{e.prompt_id}@{e.epoch + 1}")
        return bool(self.reuse and nxt is not None and nxt.ref and nxt.ref.key == e.ref.key
                    and nxt.state in (STORED, LEASED))

    def release(self, step: int) -> list[str]:
        """The samples trained at `step` leave the store now (not at their commit); return
        their keys (a sample the next epoch still uses keeps its key)."""
        keys = []
        for e in self._leased_at(step):
            if not e.released and not self._shares_key_with_next(e):
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
        for e in self._in(LEASED):
            if e.step is not None and e.step <= step:
                self._set(e, TRAINED, trained_at_step=e.step)
                if not self._shares_key_with_next(e) and not e.released:
                    keys.append(e.ref.key)
                for totals in (self.totals, self.group_totals[e.group]):
                    self._count_trained(totals, e.tokens, e.crossed)
        self.committed_step = max(self.committed_step, step)
        self._update_pause()
        return keys

    def trainer_restarted(self, committed_step: int) -> int:
        """The trainer went back to its checkpoint: what it leased after it is trained again,
        re-read if its bytes are still stored, regenerated if they were released."""
        back = [e for e in self._in(LEASED) if e.step is None or e.step > committed_step]
        for e in back:
            if e.released:
                self._set(e, PENDING, ref=None, step=None, rank=None, nbytes=0, group=None, crossed=False, released=False)
            else:
                self._set(e, STORED, step=None, rank=None, crossed=False)
        self.events.append({"event": "trainer_restarted", "committed_step": committed_step, "re_leased": len(back)})
        return len(back)

    def release_lease(self, step: int, missing: list[str] | dict[str, str], reason: str = "gone from the store",
                      regenerate: bool = True) -> None:
        """Step `step` cannot train: the `missing` samples (a list, or uid -> why) are gone or
        unusable and go back to pending to be regenerated (an attempt each: FAILED after
        `max_attempts`); with `regenerate=False` (their data is fine, the step was not: a
        non-finite loss) they are leased again as they are, FAILED after `max_attempts` such
        steps. The rest go back to stored, to be leased again."""
        why = missing if isinstance(missing, dict) else dict.fromkeys(missing, reason)
        for e in self._leased_at(step):
            if e.uid in why and regenerate:
                self._retry_or_fail(e, f"step {step}: {why[e.uid]}")
                continue
            if e.uid in why:
                e.errors.append(f"step {step}: {why[e.uid]}")
                if sum(err.startswith("step ") and "non-finite" in err for err in e.errors) >= self.max_attempts:
                    self._fail(e, step=None, rank=None, crossed=False)
                    continue
            self._set(e, STORED, step=None, rank=None, crossed=False)
        self.events.append({"event": "lease_released", "step": step, "missing": len(why)})
        self._update_pause()
