"""The ledger's training side: the calls of the training loop (step assembly, commits, restarts)
on the `SampleLedger` state (cluster/data/ledger.py, whose docstring tells the whole life of a
sample). A mixin: it holds no state of its own."""

from __future__ import annotations

from collections import defaultdict

from cluster.data.ledger_entry import LEASED, PENDING, STORED, TRAINED, UNBOUNDED, Entry
from cluster.data.ledger_rows import read_failure_blamed


class TrainingSide:
    def peek_stored(self, n: int) -> list[dict]:
        """Up to `n` stored samples, without leasing them (e.g. to fit a vocab mapping)."""
        return [self._row(e) for e in self._in(STORED)[:n]]

    @staticmethod
    def _row(e: Entry) -> dict:
        return {"uid": e.uid, "ref": e.ref, "group": e.group}

    def lease_step(self, step: int, rank_groups: list[str], batch_tokens: int) -> list[list[dict]] | None:
        """Samples for optimizer step `step`, one list per rank (`rank_groups[r]`: rank r's
        group), assembled as the module docstring says; None when no rank gets anything.
        Re-asking for a step already leased returns the same lease."""
        held = [e for e in self._in(LEASED) if e.step == step]
        if not held:
            held = self._assemble(step, rank_groups, batch_tokens)
            if not held:
                return None
        out: list[list[dict]] = [[] for _ in rank_groups]
        for e in sorted(held, key=lambda x: self.position[x.uid]):
            out[e.rank].append(self._row(e))
        return out

    def _assemble(self, step: int, rank_groups: list[str], batch_tokens: int) -> list[Entry]:
        floor = self.lease_epoch()
        ready: dict[str, list[Entry]] = defaultdict(list)  # per group, epoch-major
        for e in self._in(STORED):
            if e.epoch <= floor or self.full(e.group):
                ready[e.group].append(e)
        queued = {g: sum(e.nbytes for e in q) for g, q in ready.items()}  # each group's ready queue, bytes
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
            queue, chosen, total = ready.get(g, []), [], 0
            while queue and (not chosen or total + queue[0].tokens <= batch_tokens * len(ranks)):
                chosen.append(queue.pop(0))
                total += chosen[-1].tokens
            back = []
            for e in sorted(chosen, key=lambda x: -x.tokens):  # ...balanced largest first, within each rank's budget
                room = [r for r in ranks if has_room(r, e)]
                if room:
                    take(e, min(room, key=loads.__getitem__))
                else:
                    back.append(e)
            queue[:0] = sorted(back, key=lambda x: self.position[x.uid])  # next step's
        for r, g in enumerate(rank_groups):  # 2. borrow where the own group has nothing more ready
            if ready.get(g) or loads[r] >= batch_tokens:
                continue
            for donor in sorted(ready, key=lambda d: -queued[d]):
                queue, low = ready[donor], self.watermarks.get(donor, UNBOUNDED)[1]
                while donor != g and queue and queued[donor] > low and has_room(r, queue[0]):
                    take(queue.pop(0), r)
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
        return bool(
            self.reuse
            and nxt is not None
            and nxt.ref
            and nxt.ref.get("key") == e.ref["key"]
            and nxt.state in (STORED, LEASED)
        )

    def release(self, step: int) -> list[str]:
        """The samples trained at `step` leave the store now (not at their commit); return
        their keys (a sample the next epoch still uses keeps its key)."""
        keys = []
        for e in self._in(LEASED):
            if e.step == step and not e.released and not self._shares_key_with_next(e):
                e.released = True
                keys.append(e.ref["key"])
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
                    keys.append(e.ref["key"])
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
        unusable and go back to pending to be regenerated (an attempt each: FAILED after
        `max_attempts`); with `regenerate=False` (their data is fine, the step was not: a
        non-finite loss) they are leased again as they are, FAILED after `max_attempts` such
        steps. The rest go back to stored, to be leased again."""
        why = missing if isinstance(missing, dict) else dict.fromkeys(missing, reason)
        for e in self._in(LEASED):
            if e.step != step:
                continue
            if e.uid in why and regenerate:
                self._retry_or_fail(e, f"step {step}: {why[e.uid]}", read_failure_blamed(why[e.uid]))
                continue
            if e.uid in why:
                e.errors.append(f"step {step}: {why[e.uid]}")
                if sum(err.startswith("step ") and "non-finite" in err for err in e.errors) >= self.max_attempts:
                    self._fail(e, step=None, rank=None, crossed=False)
                    continue
            self._set(e, STORED, step=None, rank=None, crossed=False)
        self.events.append({"event": "lease_released", "step": step, "missing": len(why)})
        self._update_pause()
