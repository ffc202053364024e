"""`ReplayActor`: an inference replica that replays stored samples instead of running a target.

It speaks the same protocol as `InferenceActor` (`serve(ledger, batch)`, `stop`, `stats`) and
puts real samples (the file format) into the real store, at a configurable rate. Scaling,
backpressure and recovery can then be tested and benchmarked on a small machine without
running the target model.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from cluster.data import ProducedSample, PromptTask
from cluster.inference.producer import Producer
from cluster.store import HiddenStateStore, SampleRef, StoreConfig, put_with_retry, wants_room


@dataclass
class ReplaySettings:
    sample_dir: str
    store: StoreConfig = field(default_factory=StoreConfig)
    samples_per_s: float = 0.0  # 0: as fast as the store takes them
    put_retry_s: float = 300.0
    # Fault injection (tests): asked for one of these prompt ids, the producer's process exits
    # (every time: a poison prompt), or hangs (once: a marker in `fault_dir` remembers it); the
    # first `start_hangs` producers started hang in their constructor (markers count them).
    crash_on: list[str] = field(default_factory=list)
    hang_on: list[str] = field(default_factory=list)
    start_hangs: int = 0
    fault_dir: str | None = None


class ReplayActor(Producer):
    def __init__(self, settings: ReplaySettings, replica_id: str = "replay0", group: str = "g0") -> None:
        from dspark.samples import read_sample

        super().__init__(replica_id, group)
        self.s = settings
        self._hang_at_start(replica_id)
        files = sorted(Path(self.s.sample_dir).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no samples to replay in {self.s.sample_dir}")
        self.samples = [read_sample(f) for f in files]
        self.store = HiddenStateStore(self.s.store).connect()
        self.totals["full_waits"] = 0

    def _hang_at_start(self, replica_id: str) -> None:
        fault_dir = Path(self.s.fault_dir or "/tmp")
        if len(list(fault_dir.glob("hung-start-*"))) < self.s.start_hangs:
            (fault_dir / f"hung-start-{replica_id}").touch()
            while True:
                time.sleep(3600)

    def _inject_fault(self, prompt_id: str) -> None:
        if prompt_id in self.s.crash_on:
            os._exit(3)
        if prompt_id in self.s.hang_on:
            marker = Path(self.s.fault_dir or "/tmp") / f"hung-{prompt_id}"
            if not marker.exists():
                marker.touch()
                while True:
                    time.sleep(3600)

    def _sample_for(self, prompt_id: str):
        h = int.from_bytes(hashlib.sha256(prompt_id.encode()).digest()[:4], "big")
        return self.samples[h % len(self.samples)]

    def _put(self, key: str, sample) -> None:
        _, waits = put_with_retry(self.store, key, sample, self.s.put_retry_s, self._stopping.is_set)
        self.totals["full_waits"] += waits

    def produce(self, prompts: list[PromptTask]) -> list[ProducedSample]:
        reports = []
        for p in prompts:
            self._inject_fault(p.id)
            t0 = time.perf_counter()  # per sample: the rates read mid-batch stay true
            sample = self._sample_for(p.id)
            try:
                self._put(p.key, sample)
            except Exception as e:  # noqa: BLE001 - reported to the ledger, which retries
                # given up for want of room or of a store: no failure of the prompt
                reports.append(ProducedSample(p.uid, error=f"put: {e}", blamed=not wants_room(e)))
                self.totals["failed"] += 1
                continue
            ref = SampleRef.for_sample(p.key, sample)
            reports.append(ProducedSample(p.uid, ref))
            if self.s.samples_per_s > 0:
                time.sleep(1.0 / self.s.samples_per_s)
            self.totals["seconds"] += time.perf_counter() - t0
            self.totals["prompts"] += 1
            self.totals["generated_tokens"] += ref.num_tokens
        return reports
