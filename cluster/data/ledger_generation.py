"""The ledger's generation side: the calls of the producers (inference replicas, replay) and of
the replica pools' watchers on the `SampleLedger` state (cluster/data/ledger.py, whose docstring
tells the whole life of a sample). A mixin: it holds no state of its own.

Here: `request_prompts`, `report_produced`, `replica_died`, `hung_replicas`, `master_restarted`
(and `full`). The training loop's calls are in `ledger_training`; the plan, the accounting and
the saved state (`shorten`, `counts`, `outcome`, `load_state_dict`, ...) in `ledger`. Each is
called through one line of `LedgerClient` (cluster/data/ledger_client.py)."""

from __future__ import annotations

from cluster.data.ledger_entry import GENERATING, PENDING, RESERVED, STORED, UNBOUNDED, Entry
from cluster.data.ledger_rows import ProducedSample, PromptTask


class GenerationSide:
    def request_prompts(self, replica: str, max_n: int, group: str = "g0") -> list[PromptTask]:
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
            out.append(PromptTask(e.prompt_id, e.uid, self.key_for(e, group), self.messages[e.prompt_id]))
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
        generating = self.index.count(GENERATING, group)
        free = self.watermarks.get(group, UNBOUNDED)[0] - self.queued_bytes(group) - generating * size
        return max(int(free // size), 0 if generating or self.queued_bytes(group) else 1)

    def _generation_candidates(self):
        """Pending entries to generate next: the current epoch's; with reuse, epoch 0's and the
        later-epoch entries with no sample to inherit (the others get their previous epoch's);
        the reserved ones once epoch 0 is handed out."""
        # reserved prompts once epoch 0 is handed out: before the later epochs, when a replica
        # would otherwise idle
        reserved = self._pending[RESERVED] if not self._pending.get(0) else {}
        if not self.reuse:
            epoch = self.current_epoch()
            pools = [reserved, self._pending[epoch]] if epoch < self.epochs else [reserved]
        else:
            pools = [self._pending.get(0, {}), reserved, self._orphans]
        for pool in pools:
            for uid in pool:
                yield self.entries[uid]

    def report_produced(self, replica: str, results: list[ProducedSample]) -> None:
        """One report per prompt handed out: its stored sample's ref, or the error."""
        for r in results:
            e = self.entries.get(r.uid)
            if e is None or e.state != GENERATING or e.replica != replica:
                # A late report for a prompt already returned to pending (replica declared dead):
                # ignore it, the prompt is being regenerated elsewhere.
                self.events.append({"event": "stale_report", "uid": r.uid, "replica": replica})
                if r.ref is not None:  # its object is in the store under a key no entry holds
                    self._abandoned.append(r.ref.key)
                continue
            if r.error or r.ref is None:
                self._retry_or_fail(e, r.error or "no sample", r.blamed)
                continue
            tokens, nbytes = r.ref.num_tokens, r.ref.nbytes
            self._set(e, STORED, ref=r.ref, tokens=tokens, nbytes=nbytes, replica=None, suspect=False)
            for totals in (self.totals, self.group_totals[e.group]):
                totals["produced_samples"] += 1
                totals["produced_tokens"] += tokens
                totals["produced_bytes"] += nbytes
        self._update_pause()

    def replica_died(self, replica: str, cause: str = "") -> int:
        """Its prompts go back to pending; each death counts as a failure of every prompt it was generating (any of them
        may have killed it), and they are retried one per request: a prompt that kills every replica that takes it ends
        FAILED alone, the others of its batch go through."""
        lost = [e for e in self._in(GENERATING) if e.replica == replica]
        for e in lost:
            self._abandoned.append(self.key_for(e, e.group))  # its put may have landed before the death
            e.suspect = True
            self._retry_or_fail(e, f"replica {replica} died while generating it" + (f": {cause}" if cause else ""))
        self.events.append({"event": "replica_died", "replica": replica, "returned": len(lost)})
        return len(lost)

    def hung_replicas(self, timeout_s: float) -> dict[str, float]:
        """Replicas with a prompt generating for longer than `timeout_s`: replica -> seconds."""
        now, hung = self.clock(), []
        # An entry joins GENERATING's members at the end, when its `since` is the (monotonic)
        # clock's latest: the members run oldest first, and the hung ones are a prefix. (The
        # supervisor asks every tick; sorting every prompt in generation cost 1-2 ms a call.)
        for members in (self._members, self._reserved_members):
            for uid in members[GENERATING]:
                e = self.entries[uid]
                if now - e.since <= timeout_s:
                    break
                hung.append(e)
        out = {}
        for e in sorted(hung, key=lambda x: self.position[x.uid]):
            out[e.replica] = max(out.get(e.replica, 0.0), now - e.since)
        return out

    def master_restarted(self, generation: int) -> int:
        """A new master generation has no keys: stored samples must be regenerated (not their
        prompts' failure: it costs them nothing).

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
