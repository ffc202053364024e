"""The ledger's generation side: the calls of the producers (inference replicas, replay) on the
`SampleLedger` state (cluster/data/ledger.py, whose docstring tells the whole life of a sample).
A mixin: it holds no state of its own."""

from __future__ import annotations

from cluster.data.ledger_entry import GENERATING, PENDING, STORED, UNBOUNDED, Entry


class GenerationSide:
    def request_prompts(self, replica: str, max_n: int, group: str = "g0") -> list[dict]:
        """Up to `max_n` prompts for a replica of `group`; [] while that group is paused. The
        samples in generation count against the group's high watermark at their expected size,
        so that a batch cannot overfill the store: a producer reports its batch at the end, and
        until then nobody could free the room its puts wait for."""
        self._update_pause()
        if self.paused.get(group):
            return []
        max_n = min(max_n, self._room_for(group))
        chosen: list[Entry] = []
        for e in self._generation_candidates():
            if len(chosen) >= max_n:
                break
            if e.suspect:  # alone, so that a prompt that kills replicas takes no other prompt with it
                if not chosen:
                    chosen = [e]
                    break
                continue
            chosen.append(e)
        out = []
        for e in chosen:  # (after the scan: _set edits the pools)
            e.attempts += 1
            self._set(e, GENERATING, replica=replica, group=group)
            out.append(
                {"id": e.prompt_id, "uid": e.uid, "key": self.key_for(e, group), "messages": self.messages[e.prompt_id]}
            )
        return out

    def full(self, group: str) -> bool:
        """The group's producers get no prompts: paused at the high watermark, or no room left
        under it beside the samples in generation. Then only training (and, for what is trained,
        a commit) makes room: the trainer may lease later epochs and checkpoints early."""
        return bool(self.paused.get(group)) or (self._room_for(group) == 0 and self.queued_bytes(group) > 0)

    def _room_for(self, group: str) -> int:
        """How many more samples of `group` fit under its high watermark, counting those in
        generation at the group's mean sample size so far (or the estimate); at least one when
        the group holds nothing, so that it always makes progress."""
        t = self.group_totals.get(group, {})
        size = t["produced_bytes"] / t["produced_samples"] if t.get("produced_samples") else self.sample_bytes_estimate
        if not size:
            return 1 << 30
        generating = sum(e.group == group for e in self._in(GENERATING))
        free = self.watermarks.get(group, UNBOUNDED)[0] - self.queued_bytes(group) - generating * size
        return max(int(free // size), 0 if generating or self.queued_bytes(group) else 1)

    def _generation_candidates(self):
        """Pending entries to generate next: the current epoch's; with reuse, epoch 0's and the
        later-epoch entries with no sample to inherit (the others get their previous epoch's)."""
        if not self.reuse:
            epoch = self.current_epoch()
            pools = [self._pending[epoch]] if epoch < self.epochs else []
        else:
            pools = [self._pending.get(0, {}), self._orphans]
        for pool in pools:
            for uid in pool:
                yield self.entries[uid]

    def report_produced(self, replica: str, results: list[dict]) -> None:
        """`results`: {"uid", "ref" or "error", "tokens", "nbytes"} per prompt handed out."""
        for r in results:
            e = self.entries.get(r["uid"])
            if e is None or e.state != GENERATING or e.replica != replica:
                # A late report for a prompt already returned to pending (replica declared dead):
                # ignore it, the prompt is being regenerated elsewhere.
                self.events.append({"event": "stale_report", "uid": r["uid"], "replica": replica})
                if r.get("ref"):
                    self._abandoned.append(r["ref"]["key"])
                continue
            if r.get("error") or not r.get("ref"):
                self._retry_or_fail(e, str(r.get("error")), r.get("blamed", True))
                continue
            self._set(
                e, STORED, ref=r["ref"], tokens=int(r["tokens"]), nbytes=int(r["nbytes"]), replica=None, suspect=False
            )
            for totals in (self.totals, self.group_totals[e.group]):
                totals["produced_samples"] += 1
                totals["produced_tokens"] += int(r["tokens"])
                totals["produced_bytes"] += int(r["nbytes"])
        self._update_pause()

    def replica_died(self, replica: str, cause: str = "") -> int:
        """Its prompts go back to pending; each death counts as an attempt of every prompt it
        was generating, and they are retried one per request: a prompt that kills every replica
        that takes it ends FAILED alone, the others of its batch go through."""
        lost = [e for e in self._in(GENERATING) if e.replica == replica]
        for e in lost:
            self._abandoned.append(self.key_for(e, e.group))
            e.suspect = True
            self._retry_or_fail(e, f"replica {replica} died while generating it" + (f": {cause}" if cause else ""))
        self.events.append({"event": "replica_died", "replica": replica, "returned": len(lost)})
        return len(lost)

    def hung_replicas(self, timeout_s: float) -> dict[str, float]:
        """Replicas with a prompt generating for longer than `timeout_s`: replica -> seconds."""
        now, out = self.clock(), {}
        for e in self._in(GENERATING):
            if now - e.since > timeout_s:
                out[e.replica] = max(out.get(e.replica, 0.0), now - e.since)
        return out

    def master_restarted(self, generation: int) -> int:
        """A new master generation has no keys: stored samples must be regenerated.

        Leased samples stay leased: if the trainer already read them they are in the model and
        only await their commit; if it had not, its read fails and `release_lease` returns them.
        """
        if generation <= self.master_generation:
            return 0
        self.master_generation = generation
        lost = self._in(STORED)
        for e in lost:
            self._set(e, PENDING, ref=None, step=None, rank=None, nbytes=0, group=None)
        self.events.append({"event": "master_restarted", "generation": generation, "returned": len(lost)})
        self._update_pause()
        return len(lost)
