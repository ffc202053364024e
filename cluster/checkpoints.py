"""`CheckpointDir`: the job's checkpoints, `step-NNNNNN/` under one root, each written to a
temporary sibling and renamed into place whole (a crash leaves the previous one intact).

Each holds the DeepSpeed shards of every rank (`trainer/`), the drafter in the speculators
format (`drafter/`), the ledger as it is once that step is committed (`ledger.json`) and
`meta.json` (step, world layout, how many lines of the training record it committed).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

KEEP = 2  # the newest two: a crash while writing the next one still leaves one intact


class CheckpointDir:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def steps(self) -> list[Path]:
        done = [p for p in self.root.glob("step-*") if p.is_dir() and (p / "meta.json").exists()]
        return sorted(done, key=lambda p: int(p.name.split("-")[1]))

    def latest(self) -> Path | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def paths(self, step: int) -> tuple[Path, Path]:
        """(temporary dir to write into, final name)."""
        return self.root / f".step-{step:06d}.tmp", self.root / f"step-{step:06d}"

    @staticmethod
    def meta(path: Path) -> dict:
        return json.loads((path / "meta.json").read_text())

    def rotate(self) -> None:
        for old in self.steps()[:-KEEP]:
            shutil.rmtree(old, ignore_errors=True)

    def archive(self) -> Path | None:
        """Move an earlier run's checkpoints aside (a fresh start with `trainer.resume=never`),
        so that rotation never deletes the new run's steps in favour of the old, higher ones."""
        if not any(self.root.iterdir()):
            return None
        dest = self.root.with_name(f"{self.root.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
        self.root.rename(dest)
        self.root.mkdir()
        return dest
