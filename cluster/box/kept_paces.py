"""The paces a probe measured on this machine, kept for the job's later runs
(`box_plan.keep_paces_s`).

The probe costs 20-30 s of the local job's time budget at full speed (on a 2-core Xeon about
0.8 of an epoch of 276 prompts, where the plan chose what the config already said), and each run
measures the same machine again. So its paces are kept in `$DSPARK_CACHE/box_paces.json` under a
key of everything they depend on: the CPU and the cores the job may use (affinity, quota), the
target and its dtype, the drafter's shape and precision, a step's tokens and the samples' shapes,
the replica's batch, and the probe's version (`PROBE_VERSION`: raise it when the probe or its
scale factors change). A later run within `max_age_s` of the probe takes them instead of probing.
The file is JSON this job wrote; one that cannot be read is set aside (probed anew, said in the
log) and rewritten.

Pure but for the file: the clock's reading (`now`, seconds since the epoch) is passed in.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from cluster.box.plan import Paces

log = logging.getLogger("dspark.job")

# 2: the first-epoch step computes the target normaliser by blocks (dspark.model), ~18% shorter
PROBE_VERSION = 2


def paces_key(cfg, cpu, target_dir, prompt_tokens: int, answer_tokens: int) -> dict:
    """What the probe's paces depend on (the key's readable form)."""
    d, t = cfg.drafter, cfg.trainer
    return {
        "probe_version": PROBE_VERSION,
        "cpu": cpu.model,
        "cores": cpu.cores,
        "affinity": cpu.affinity,
        "quota": cpu.quota,
        "target": Path(target_dir).name,
        "dtype": cfg.target.dtype,
        "precision": t.precision,
        "batch_tokens": t.batch_tokens,
        "prompt_tokens": prompt_tokens,
        "answer_tokens": answer_tokens,
        "replica_batch": min(cfg.inference.prompt_batch, cfg.target.max_num_seqs),
        "drafter": [
            d.mode,
            d.num_layers,
            d.block_size,
            d.markov_rank,
            d.draft_vocab_size,
            d.num_anchors,
            cfg.target.num_aux_layers,
        ],
    }


def _digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _read(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        entries = json.loads(path.read_text())
        if not isinstance(entries, dict):
            raise ValueError(f"a {type(entries).__name__}, not an object")
        return entries
    except (OSError, ValueError) as e:
        log.warning("kept paces: %s cannot be read (%s); probing anew", path, e)
        return {}


def kept_paces(path: Path, key: dict, max_age_s: float, now: float) -> tuple[Paces, float, float] | None:
    """(paces, the probe's seconds, when it probed) kept for `key` and at most `max_age_s` old;
    None: probe."""
    entry = _read(path).get(_digest(key))
    if not entry or not max_age_s:
        return None
    try:
        measured_at = float(entry["measured_at"])
        if not 0 <= now - measured_at <= max_age_s:
            return None
        paces = Paces(
            *(
                {int(n): float(v) for n, v in entry[k].items()}
                for k in ("generation_tok_s", "first_step_s", "later_step_s")
            ),
            source=entry["source"],
        )
        return paces, float(entry["probe_s"]), measured_at
    except (KeyError, TypeError, ValueError) as e:
        log.warning("kept paces: the entry for this machine in %s is damaged (%r); probing anew", path, e)
        return None


def keep_paces(path: Path, key: dict, paces: Paces, probe_s: float, now: float) -> None:
    """Keeps this probe's paces for `key` (replacing what was kept for it), written whole and then
    renamed into place: a run stopped mid-write leaves the previous file."""
    entries = _read(path)
    entries[_digest(key)] = {
        "key": key,
        "measured_at": now,
        "probe_s": probe_s,
        "source": paces.source,
        "generation_tok_s": paces.generation_tok_s,
        "first_step_s": paces.first_step_s,
        "later_step_s": paces.later_step_s,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
    tmp.replace(path)
