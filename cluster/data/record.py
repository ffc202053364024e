"""`TrainingRecord`: the proof of exactly-once, a record of what every rank trained.

Each trainer rank reports, with every step, the samples it actually trained (the uids of the
batch it stepped on, read back from what it packed). The driver keeps those rows in memory
until they are committed by a checkpoint, then appends them to `trained.jsonl` in the run
directory, one JSON line per sample:

    {"uid": "p12@1", "prompt": "p12", "epoch": 1, "step": 37, "rank": 1, "group": "g1", "source": "g0"}

(`group`: the rank's group; `source`: the group that generated the sample.) The checkpoint
records how many lines were committed with it; resuming truncates the file to that count, so
rows of steps that were rolled back (trained, never committed) disappear with them and their
samples are trained again. At the end `verify` checks the record against the ledger's outcome:
every prompt × epoch trained exactly once (no uid twice, none missing), failures listed by id.
The proof is this file, not a count.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cluster.data.ledger_rows import LeasedSample


class ExactlyOnceViolation(RuntimeError):
    pass


class TrainingRecord:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.pending: list[dict] = []  # trained, not yet committed
        self._lines: int | None = None  # committed rows, counted once, then kept: a commit costs its own rows

    def add(self, step: int, rank: int, group: str, trained: list[LeasedSample]) -> None:
        """`trained`: the samples (`LeasedSample`s: their `group` is the record's `source`, where
        the sample was generated) rank `rank` of group `group` trained at `step`."""
        append = self.pending.append  # (a step adds hundreds of rows)
        for t in trained:
            uid = t.uid
            prompt, _, epoch = uid.rpartition("@")
            append(
                {
                    "uid": uid,
                    "prompt": prompt,
                    "epoch": int(epoch),
                    "step": step,
                    "rank": rank,
                    "group": group,
                    "source": t.group,
                }
            )

    def commit(self, step: int) -> int:
        """Append the rows of steps <= `step` (durably); returns the committed line count."""
        done = [r for r in self.pending if r["step"] <= step]
        self.pending = [r for r in self.pending if r["step"] > step]
        lines = self.lines()
        with open(self.path, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in done)
            f.flush()
            os.fsync(f.fileno())
        self._lines = lines + len(done)
        return self._lines

    def reset(self) -> None:
        """A fresh start: no rows."""
        self.pending = []
        self.path.unlink(missing_ok=True)
        self._lines = 0

    def lines(self) -> int:
        """Committed rows: read once from the file (a resumed run's), then counted as committed."""
        if self._lines is None:
            if not self.path.exists():
                return 0
            with open(self.path, "rb") as f:
                self._lines = sum(1 for _ in f)
        return self._lines

    def rollback_to(self, lines: int) -> None:
        """Resume: keep the first `lines` rows (what the checkpoint committed), drop the rest."""
        self.pending = []
        if not self.path.exists():
            if lines:
                raise ExactlyOnceViolation(f"{self.path} is missing but the checkpoint committed {lines} rows to it")
            return
        kept, offset = 0, 0
        with open(self.path, "rb") as f:  # the byte where row `lines` ends: the file is cut there, not rewritten
            for line in f:
                if kept == lines:
                    break
                kept, offset = kept + 1, offset + len(line)
        if kept < lines:
            raise ExactlyOnceViolation(f"{self.path} has {kept} rows; the checkpoint committed {lines}")
        os.truncate(self.path, offset)
        self._lines = lines

    def rows(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path) as f:
            return [json.loads(line) for line in f if line.strip()]

    def verify(self, outcome: dict, complete: bool = True) -> dict:
        """Check the record against the ledger's `outcome()` and report.

        `complete`: the run went through all its data (False when `trainer.max_steps` ended it:
        then untrained samples are allowed and counted, duplicates and unrecorded trainings are
        still violations). Raises ExactlyOnceViolation naming the first offending uids."""
        rows = self.rows()
        seen = Counter(r["uid"] for r in rows)
        trained = set(outcome["trained"])
        twice = sorted(u for u, n in seen.items() if n > 1)
        unrecorded = sorted(trained - set(seen))  # the ledger says trained, no rank said so
        unknown = sorted(set(seen) - trained)  # a rank trained it, the ledger never committed it
        problems = []
        if twice:
            problems.append(f"{len(twice)} samples trained more than once, e.g. {twice[:5]}")
        if unrecorded:
            problems.append(f"{len(unrecorded)} samples committed without a record of training, e.g. {unrecorded[:5]}")
        if unknown:
            problems.append(f"{len(unknown)} samples recorded but not committed, e.g. {unknown[:5]}")
        if complete and outcome["unfinished"]:
            problems.append(
                f"{len(outcome['unfinished'])} samples neither trained nor failed, e.g. {outcome['unfinished'][:5]}"
            )
        if problems:
            raise ExactlyOnceViolation(f"exactly-once violated ({self.path}): " + "; ".join(problems))
        return {
            "trained": len(rows),
            "failed": sorted(outcome["failed"]),
            "not_trained": len(outcome["unfinished"]),
            "per_epoch": dict(sorted(Counter(str(r["epoch"]) for r in rows).items())),
            "generated_by_group": dict(sorted(Counter(r["source"] for r in rows).items())),
            "trained_by_group": dict(sorted(Counter(r["group"] for r in rows).items())),
            "crossed": sum(r["source"] != r["group"] for r in rows),
            "record": str(self.path),
        }
