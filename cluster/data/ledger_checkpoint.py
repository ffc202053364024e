"""The ledger's state in a checkpoint directory: a chain of a base and the deltas after it, so that
a checkpoint costs what changed since the one before, not the size of the run (at 10^5 prompts ×
3 epochs a whole `ledger.json` grew to 103 MB and 5.6 s a checkpoint; at 10^6, ten times that).

A checkpoint's ledger files:

- `ledger.chain.json`: the state's header (epochs, committed step, master generation, totals),
  and the chain's files in replay order, each with the bytes and SHA-256 it was written with;
- `ledger.base-SSSSSS-NNN.jsonl`: every saved row (`SampleLedger.checkpoint_state`), one JSON
  line each, at step S; the chain's first file;
- `ledger.delta-SSSSSS-NNN.jsonl`: the rows that changed since the checkpoint before
  (`SampleLedger.checkpoint_delta`); N is the file's place in the chain (a name never repeats
  in one).

Loading replays the files in order, a row replacing the one of the same sample. The files of
earlier checkpoints are hard links to the previous checkpoint's (copies where the filesystem
cannot link): each checkpoint directory holds its whole chain, so rotation may delete any
other, and each file's digest is taken once, when it is written. A new base is written once the
deltas would outgrow it (replaying a chain then reads at most about twice the state: a
checkpoint's amortized cost stays proportional to what changed) or after `MAX_DELTAS` of them.

Checkpoints written before the chain hold the whole state in one `ledger.json`; they still load.
Whoever reads a checkpoint's ledger state calls `load_ledger_state`: no one reads the files by name.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from cluster.data.ledger_entry import saved

CHAIN_FILE = "ledger.chain.json"
WHOLE_FILE = "ledger.json"  # (before the chain: the whole state in one file)
MAX_DELTAS = 256


def load_ledger_state(ckpt: Path) -> dict:
    """The ledger state a checkpoint saved (as `SampleLedger.checkpoint_state` returns it, for
    `load_state_dict`): its chain replayed, or its whole `ledger.json`. Raises OSError or
    ValueError (a JSON error) for a missing or damaged file."""
    ckpt = Path(ckpt)
    if not (ckpt / CHAIN_FILE).exists():
        return json.loads((ckpt / WHOLE_FILE).read_text())
    chain = json.loads((ckpt / CHAIN_FILE).read_text())
    rows: dict[str, dict] = {}
    for f in chain["files"]:
        with open(ckpt / f["name"], encoding="utf-8") as fh:
            for line in fh:
                d = json.loads(line)
                rows[f"{d['prompt_id']}@{d['epoch']}"] = d
    # a row back where a new ledger starts (pending, never handed out nor failed) is not saved, as in a whole state
    return {**chain["header"], "entries": [d for d in rows.values() if saved(d)]}


def chain_files(ckpt: Path) -> list[dict] | None:
    """The chain's files (name, bytes, sha256) in replay order; None for a checkpoint without
    one. Raises as `load_ledger_state` for a damaged `ledger.chain.json`."""
    path = Path(ckpt) / CHAIN_FILE
    return json.loads(path.read_text())["files"] if path.exists() else None


def ledger_problem(ckpt: Path) -> str | None:
    """Why a checkpoint's ledger state cannot be loaded, short of reading it all: a whole
    `ledger.json` must parse; a chain's header must, and each of its files be there with the
    bytes it was written with (their contents are the digests' to check)."""
    try:
        files = chain_files(ckpt)
        if files is None:
            json.loads((Path(ckpt) / WHOLE_FILE).read_text())
            return None
    except (OSError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    for f in files:
        path = Path(ckpt) / f["name"]
        if not path.is_file():
            return f"{f['name']} missing"
        if path.stat().st_size != f["bytes"]:
            return f"{f['name']} has {path.stat().st_size} bytes, {f['bytes']} were written"
    return None


def write_ledger_state(tmp: Path, state: dict) -> None:
    """Write a checkpoint's ledger state into its directory being written (`tmp`): a whole state
    as one `ledger.json` (how it was saved before the chain), a chain link (`LedgerChain.link`)
    as its chain: the earlier files linked from the previous checkpoint, the new one written,
    then the header that names them all."""
    if "chain" not in state:
        (tmp / WHOLE_FILE).write_text(json.dumps(state))
        return
    chain = state["chain"]
    files = list(chain["files"])
    for f in files:
        _link_or_copy(Path(chain["source"]) / f["name"], tmp / f["name"])
    data = "".join(json.dumps(d) + "\n" for d in state["entries"]).encode()
    name = f"ledger.{chain['kind']}-{state['committed_step']:06d}-{len(files):03d}.jsonl"
    (tmp / name).write_bytes(data)
    files.append({"name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    header = {k: v for k, v in state.items() if k not in ("chain", "entries")}
    (tmp / CHAIN_FILE).write_text(json.dumps({"header": header, "files": files}))


def _link_or_copy(src: Path, dest: Path) -> None:
    try:
        os.link(src, dest)
    except OSError:  # (another filesystem, or one without hard links)
        shutil.copy2(src, dest)


def written_digests(tmp: Path) -> dict[str, dict]:
    """The chain's files with the bytes and SHA-256 they were written with, as `file_digests`
    records them (a linked file's digest was taken when it was first written, and is not taken
    again from what may since have changed on disk)."""
    files = chain_files(tmp) or []
    return {f["name"]: {"bytes": f["bytes"], "sha256": f["sha256"]} for f in files}


@dataclass
class LedgerChain:
    """The checkpoints' side of the chain (`Committer` keeps one): the last published checkpoint's
    chain, which the next checkpoint links and adds a delta to, or nothing (then it writes a base).

    Per checkpoint: `wants_base()` says which state to ask the ledger for (`checkpoint_state`,
    or `checkpoint_delta`, which may answer None: then a base too); `link(state)` makes it what
    `write_ledger_state` writes; `published(dest)` once the checkpoint is in place."""

    max_deltas: int = MAX_DELTAS
    source: Path | None = None  # the last published checkpoint
    files: list[dict] = field(default_factory=list)  # its chain

    def wants_base(self) -> bool:
        if self.source is None or not self.files or not (self.source / CHAIN_FILE).is_file():
            return True
        base, deltas = self.files[0]["bytes"], self.files[1:]
        return len(deltas) >= self.max_deltas or sum(f["bytes"] for f in deltas) >= base

    def link(self, state: dict, delta: bool) -> dict:
        """`state` (the ledger's `checkpoint_delta` if `delta`, else its `checkpoint_state`) as the
        next link of this chain."""
        if not delta:
            return {**state, "chain": {"kind": "base", "source": None, "files": []}}
        return {**state, "chain": {"kind": "delta", "source": str(self.source), "files": self.files}}

    def published(self, dest: Path) -> None:
        self.source, self.files = Path(dest), chain_files(dest) or []

    def forget(self) -> None:
        """The next checkpoint writes a base (e.g. after the ledger was loaded again)."""
        self.source, self.files = None, []
