"""The job's commit point: a collective checkpoint with which the training record and the
ledger commit, after which the committed samples leave the store."""

from __future__ import annotations

import logging
from pathlib import Path

from cluster.training import TrainerFailure

log = logging.getLogger("dspark.job")


def checkpoint(job) -> Path:
    """Collective save; the record and the ledger commit with it; committed samples leave
    the store; older checkpoints rotate away (the last two stay). A model with a non-finite
    weight is never saved: the world restarts from the last good checkpoint instead."""
    step = job.stats.step
    if not job.gang.parameters_finite():
        raise TrainerFailure(f"non-finite weights at step {step}: not saved")
    tmp, dest = job.checkpoints.paths(step)
    state = job.ledger.checkpoint_state(step)
    rows = job.record.commit(step)  # before the rename: a crash in between rolls these rows back
    job.gang.save_checkpoint(tmp, dest, step, state, {"step": step, "record_rows": rows, "lr_horizon": job.total_steps})
    keys = job.ledger.commit(step)
    # with what was trained, the objects of attempts given up on (a replica that died mid-put)
    job.gang.remove_keys(keys, job.ledger.abandoned_keys())
    job.uncommitted = []
    job.checkpoints.rotate()
    log.info("checkpoint at step %d (%d record rows; %d samples left the store)", step, rows, len(keys))
    return dest
