"""`RunHistory`: the job's figures over time, one JSON line each, in `<run_dir>/history.jsonl`:
a `step` row after every optimizer step (its scalars: loss terms, τ~, acceptance per position,
learning rate) and a `progress` row at every progress report (generation tok/s per group, data
wait and training seconds so far). The end-of-job pictures (`cluster.job.plots`) are drawn from
it, so what a picture shows is what the file holds. Seconds are counted from the job's start
(`clock` injected)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path


class RunHistory:
    def __init__(self, path: Path, started: float, clock=time.monotonic) -> None:
        self.path, self.started, self.clock = Path(path), started, clock
        self._lock = threading.Lock()  # (the loop writes steps, the reporter thread progress)

    def _append(self, row: dict) -> None:
        with self._lock, self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    def step(self, step: int, scalars: dict[str, float]) -> None:
        self._append({"kind": "step", "step": step, "t": self.clock() - self.started, **scalars})

    def progress(self, step: int, tokens_per_s: dict[str, float], data_wait_s: float, train_s: float) -> None:
        self._append(
            {
                "kind": "progress",
                "step": step,
                "t": self.clock() - self.started,
                "tokens_per_s": tokens_per_s,
                "data_wait_s": data_wait_s,
                "train_s": train_s,
            }
        )


def read_history(path: Path) -> list[dict]:
    """The rows of a history file (none if the job wrote none)."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
