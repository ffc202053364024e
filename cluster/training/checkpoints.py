"""`CheckpointDir`: the job's checkpoints, `step-NNNNNN/` under one root, each written to a
temporary sibling and renamed into place whole (a crash leaves the previous one intact).

Each holds the DeepSpeed shards of every rank (`trainer/`), the drafter in the speculators
format (`drafter/`), the ledger as it is once that step is committed (its chain of a base and
deltas, `cluster.data.ledger_checkpoint`; `ledger.json` in older checkpoints) and `meta.json`
(step, world layout, how many lines of the training record it committed, each file's digest).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
import zipfile
from pathlib import Path

from cluster.data import ledger_problem, written_digests

log = logging.getLogger("dspark.checkpoints")
KEEP = 2  # the newest two: a crash while writing the next one still leaves one intact, so does a corrupt one
STEP_DIR = re.compile(r"step-(\d{6,})")  # what `paths` names a checkpoint; anything else in the root is not one


class CheckpointDir:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def steps(self) -> list[Path]:
        """The written checkpoints, oldest first: `step-NNNNNN` folders with their meta.json (a
        folder of another name, `step-foo` or a copy, is not one of them and is left alone)."""
        done = [
            p for p in self.root.iterdir() if STEP_DIR.fullmatch(p.name) and p.is_dir() and (p / "meta.json").exists()
        ]
        return sorted(done, key=step_of)

    def latest(self) -> Path | None:
        """The newest checkpoint that is whole, its files' contents checked against their digests;
        a damaged newer one is reported and skipped (the previous one is used), never deleted."""
        for path in reversed(self.steps()):
            problem = self.problem(path, contents=True)
            if problem is None:
                return path
            log.warning("checkpoint %s is unusable (%s); falling back to the previous one", path, problem)
        return None

    @staticmethod
    def problem(path: Path, contents: bool = False) -> str | None:
        """Why `path` cannot be resumed from, or None: every part present and its JSON readable,
        each file of the size written (and with `contents`, of the digest written: a same-size
        corruption)."""
        try:
            meta = json.loads((path / "meta.json").read_text())
            json.loads((path / "drafter" / "config.json").read_text())
        except (OSError, ValueError) as e:
            return f"{type(e).__name__}: {e}"
        ledger = ledger_problem(path)  # (a chain's files are not parsed here: rotation asks at every commit)
        if ledger is not None:
            return ledger
        for part in ("drafter/model.safetensors", "trainer/latest"):
            if not (path / part).is_file() or not (path / part).stat().st_size:
                return f"{part} missing or empty"
        if not {"step", "world_size", "record_rows"} <= set(meta):
            return f"meta.json lacks {sorted({'step', 'world_size', 'record_rows'} - set(meta))}"
        return damaged_file(path, meta.get("files", {}), contents)  # (older checkpoints list no files)

    def paths(self, step: int) -> tuple[Path, Path]:
        """(temporary dir to write into, final name)."""
        return self.root / f".step-{step:06d}.tmp", self.root / f"step-{step:06d}"

    @staticmethod
    def meta(path: Path) -> dict:
        return json.loads((path / "meta.json").read_text())

    def rotate(self) -> None:
        """Keep the newest KEEP whole checkpoints (and anything newer than the oldest of them);
        temporary folders of saves that never finished go (a save just published has none)."""
        whole = [p for p in self.steps() if self.problem(p) is None]
        if len(whole) > KEEP:
            for old in [p for p in self.steps() if step_of(p) < step_of(whole[-KEEP])]:
                shutil.rmtree(old, ignore_errors=True)
        for tmp in self.root.glob(".step-*.tmp"):
            log.info("removing %s, a checkpoint whose save never finished", tmp)
            shutil.rmtree(tmp, ignore_errors=True)

    def archive(self) -> Path | None:
        """Move an earlier run's checkpoints aside (a fresh start with `trainer.resume=never`),
        so that rotation never deletes the new run's steps in favour of the old, higher ones."""
        if not any(self.root.iterdir()):
            return None
        dest = self.root.with_name(f"{self.root.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
        self.root.rename(dest)
        self.root.mkdir()
        return dest


def step_of(path: Path) -> int:
    return int(STEP_DIR.fullmatch(path.name)[1])


def digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def file_digests(root: Path) -> dict[str, dict]:
    """Every file of a checkpoint being written, by path relative to it, with its size and
    SHA-256 (but `meta.json`, which lists them). The ledger chain's files come with the digests
    they were written with (`written_digests`): most are links to the previous checkpoint's,
    and hashing them again would cost the whole ledger at every checkpoint."""
    known = written_digests(root)
    files = [f for f in sorted(root.rglob("*")) if f.is_file() and f != root / "meta.json"]
    return {
        str(f.relative_to(root)): known.get(str(f.relative_to(root)))
        or {"bytes": f.stat().st_size, "sha256": digest(f)}
        for f in files
    }


def damaged_file(root: Path, written: dict[str, dict | int], contents: bool = False) -> str | None:
    """Why a checkpoint's files differ from what was written (`file_digests` at save; a plain
    size in checkpoints of before the digests), or None. A torch file (`.pt`, a zip archive)
    must also have its directory at its end: a truncated or overwritten DeepSpeed shard fails
    here, before the world tries (and retries) to load it. With `contents`, each file's SHA-256
    too: a same-size corruption fails here, not in every restart's load."""
    for rel, facts in written.items():
        size, sha = (facts["bytes"], facts.get("sha256")) if isinstance(facts, dict) else (facts, None)
        f = root / rel
        if not f.is_file():
            return f"{rel} missing"
        if f.stat().st_size != size:
            return f"{rel} has {f.stat().st_size} bytes, {size} were written"
        if f.suffix == ".pt" and not zipfile.is_zipfile(f):
            return f"{rel} is not a whole torch archive"
        if contents and sha is not None and digest(f) != sha:
            return f"{rel} differs from what was written (SHA-256 {sha[:12]}…)"
    return None


def publish(tmp: Path, dest: Path) -> None:
    """Move a fully written checkpoint directory into place: its files on disk first, then the
    rename (replacing a `dest` left by an earlier try), then the rename itself on disk."""
    for f in tmp.rglob("*"):  # on disk before the rename makes it the latest
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(tmp, dest)
    fd = os.open(dest.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself
    finally:
        os.close(fd)


def make_universal(trainer_dir: Path) -> None:
    """The universal form of the DeepSpeed checkpoint in `trainer_dir` (to load it under another
    world size), beside it in `universal/`, atomically renamed into place; kept, so that a later
    resize from the same checkpoint reuses it."""
    dest = trainer_dir.parent / "universal"
    if not (dest / "ds").is_dir():
        from argparse import Namespace

        from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

        tmp = dest.with_name(f".universal.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        # inject_missing_state: the conversion asks for Megatron's tensor/pipeline-parallel
        # metadata, which a data-parallel-only checkpoint does not have (nothing to merge);
        # one worker: no process pool inside the rank's actor.
        ds_to_universal(
            Namespace(
                input_folder=str(trainer_dir / "ds"),
                output_folder=str(tmp / "ds"),
                num_extract_workers=1,
                num_merge_workers=1,
                keep_temp_folder=False,
                strict=True,
                inject_missing_state=True,
            )
        )
        (tmp / "latest_universal").write_text("ds")
        os.replace(tmp, dest)
