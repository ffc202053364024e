"""The pull loop every sample producer runs (vLLM replicas and the replay backend): ask the
job's ledger for prompts on behalf of its group, produce their samples into the store, report,
repeat until stopped. The ledger answering with nothing is backpressure on the group (or the
end): the loop idles."""

from __future__ import annotations

import threading

from cluster.data import ProducedSample, PromptTask


class Producer:
    def __init__(self, replica_id: str, group: str) -> None:
        self.replica_id, self.group = replica_id, group
        self._stopping = threading.Event()  # set by stop(): an idle producer ends at once
        self.totals = {"prompts": 0, "prompt_tokens": 0, "generated_tokens": 0, "seconds": 0.0, "failed": 0}

    def produce(self, prompts: list[PromptTask]) -> list[ProducedSample]:
        """One report per prompt: its stored sample's reference, or the error."""
        raise NotImplementedError

    def serve(self, ledger, batch_size: int, idle_s: float = 0.2) -> dict:
        """`ledger`: a `cluster.data.LedgerClient` (its deadline bounds each call)."""
        # The flag is not reset here: `stop` may run before this starts (a replica replaced just
        # as the job ends gets both calls queued, and a threaded actor runs them in any order);
        # resetting it would serve until the pool's drain deadline.
        while not self._stopping.is_set():
            prompts = ledger.request_prompts(self.replica_id, batch_size, self.group)
            if not prompts:
                self._stopping.wait(idle_s)  # backpressure (or the end): ask again after idle_s
                continue
            ledger.report_produced(self.replica_id, self.produce(prompts))
        return self.stats()

    def stop(self) -> None:
        self._stopping.set()

    def stats(self) -> dict:
        t = dict(self.totals)
        secs = max(t["seconds"], 1e-9)
        t["generated_tokens_per_s"] = t["generated_tokens"] / secs
        t["tokens_per_s"] = (t["prompt_tokens"] + t["generated_tokens"]) / secs
        t["samples_per_s"] = t["prompts"] / secs
        t["replica_id"] = self.replica_id
        return t
