"""`LedgerClient`: the job's `SampleLedger` actor behind typed methods, each call with a deadline.

Every part that talks to the ledger across Ray (the training loop, the replica pools, the
producers, the progress reporter, the autoscaler) holds one of these instead of the actor
handle: a renamed ledger method is then an attribute error where it is called, not a string
that fails in a Ray actor minutes into a job. It pickles with its handle, so producers on
other nodes get one too.

Each method is its signature and one call: the typed rows (`ledger_rows`) go to the actor and
come back as they are. What a call does is the `SampleLedger` method of the same name: the
producers' calls in cluster/data/ledger_generation.py, the training loop's in
cluster/data/ledger_training.py, the rest (plan, accounting, saved state) in cluster/data/ledger.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cluster.data.ledger_counts import LedgerCounts
from cluster.data.ledger_rows import LeasedSample, ProducedSample, PromptTask

DEFAULT_TIMEOUT_S = 60.0  # one call on the ledger actor (it answers in milliseconds)


@dataclass(frozen=True)
class LedgerClient:
    handle: object  # the ledger's Ray actor handle
    timeout_s: float = DEFAULT_TIMEOUT_S

    def with_timeout(self, timeout_s: float) -> LedgerClient:
        return replace(self, timeout_s=timeout_s)

    def _get(self, ref):
        import ray

        return ray.get(ref, timeout=self.timeout_s)

    # ---- producers --------------------------------------------------------------------------
    def request_prompts(self, replica: str, max_n: int, group: str) -> list[PromptTask]:
        return self._get(self.handle.request_prompts.remote(replica, max_n, group))

    def report_produced(self, replica: str, results: list[ProducedSample]) -> None:
        self._get(self.handle.report_produced.remote(replica, results))

    def replica_died(self, replica: str, cause: str = "") -> int:
        return self._get(self.handle.replica_died.remote(replica, cause))

    def hung_replicas(self, timeout_s: float) -> dict[str, float]:
        return self._get(self.handle.hung_replicas.remote(timeout_s))

    def master_restarted(self, generation: int) -> int:
        return self._get(self.handle.master_restarted.remote(generation))

    # ---- the training loop ------------------------------------------------------------------
    def peek_stored(self, n: int) -> list[LeasedSample]:
        return self._get(self.handle.peek_stored.remote(n))

    def reserved_rows(self) -> list[LeasedSample]:
        return self._get(self.handle.reserved_rows.remote())

    def reserved_waiting(self) -> int:
        return self._get(self.handle.reserved_waiting.remote())

    def lease_step(self, step: int, rank_groups: list[str], batch_tokens: int) -> list[list[LeasedSample]] | None:
        return self._get(self.handle.lease_step.remote(step, rank_groups, batch_tokens))

    def release_lease(
        self,
        step: int,
        missing: list[str] | dict[str, str],
        reason: str = "gone from the store",
        regenerate: bool = True,
    ) -> None:
        self._get(self.handle.release_lease.remote(step, missing, reason, regenerate))

    def release(self, step: int) -> list[str]:
        return self._get(self.handle.release.remote(step))

    def checkpoint_state(self, step: int) -> dict:
        return self._get(self.handle.checkpoint_state.remote(step))

    def checkpoint_delta(self, step: int) -> dict | None:
        return self._get(self.handle.checkpoint_delta.remote(step))

    def commit(self, step: int) -> list[str]:
        return self._get(self.handle.commit.remote(step))

    def abandoned_keys(self) -> list[str]:
        return self._get(self.handle.abandoned_keys.remote())

    def trainer_restarted(self, committed_step: int) -> int:
        return self._get(self.handle.trainer_restarted.remote(committed_step))

    def lease_only(
        self, step: int, uids: list[str], rank_groups: list[str], batch_tokens: int
    ) -> list[list[LeasedSample]] | None:
        return self._get(self.handle.lease_only.remote(step, uids, rank_groups, batch_tokens))

    def quarantine_sample(self, uid: str, cause: str) -> list[str]:
        return self._get(self.handle.quarantine_sample.remote(uid, cause))

    def load_state_dict(self, state: dict, master_generation: int | None = None) -> list[str]:
        return self._get(self.handle.load_state_dict.remote(state, master_generation))

    def settle(self) -> None:
        return self._get(self.handle.settle.remote())

    # ---- the plan ---------------------------------------------------------------------------
    def remaining_per_epoch(self) -> list[int]:
        return self._get(self.handle.remaining_per_epoch.remote())

    def first_open_epoch(self) -> int:
        return self._get(self.handle.first_open_epoch.remote())

    def drop_prompts(self, prompt_ids: list[str]) -> list[str]:
        return self._get(self.handle.drop_prompts.remote(prompt_ids))

    def shorten(self, epochs: int) -> list[str]:
        return self._get(self.handle.shorten.remote(epochs))

    # ---- accounting -------------------------------------------------------------------------
    def counts(self) -> LedgerCounts:
        return self._get(self.handle.counts.remote())

    def to_generate(self) -> int:
        return self._get(self.handle.to_generate.remote())

    def drained(self) -> bool:
        return self._get(self.handle.drained.remote())

    def outcome(self) -> dict:
        return self._get(self.handle.outcome.remote())
