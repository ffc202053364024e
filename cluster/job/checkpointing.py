"""`Committer`: the job's commit point. It holds what was trained since the last checkpoint
(the lease rows); a commit is a collective checkpoint with which the training record and the
ledger commit, after which the committed samples leave the store. The ledger's state goes into
each checkpoint as a link of a chain (a base, or the rows changed since the checkpoint before:
`cluster.data.ledger_checkpoint`), which the committer keeps from one commit to the next."""

from __future__ import annotations

import logging
from pathlib import Path

from cluster.data import LedgerChain, LedgerClient, TrainingRecord
from cluster.training import CheckpointDir, TrainerFailure, TrainerGang

log = logging.getLogger("dspark.job")


class Committer:
    def __init__(
        self, gang: TrainerGang, ledger: LedgerClient, record: TrainingRecord, checkpoints: CheckpointDir
    ) -> None:
        self.gang, self.ledger, self.record, self.checkpoints = gang, ledger, record, checkpoints
        self.uncommitted: list = []  # lease rows trained since the last commit
        self.chain = LedgerChain()  # (the first checkpoint of this job writes a base)

    def add(self, rows: list) -> None:
        self.uncommitted += rows

    def forget(self) -> None:
        """A new world starts from the last checkpoint: what it had not committed is trained again."""
        self.uncommitted = []

    def commit(self, step: int) -> Path:
        """Collective save; the record and the ledger commit with it; committed samples leave
        the store; older checkpoints rotate away (the last two stay). A model with a non-finite
        weight is never saved: the world restarts from the last good checkpoint instead."""
        if not self.gang.parameters_finite():
            raise TrainerFailure(f"non-finite weights at step {step}: not saved")
        tmp, dest = self.checkpoints.paths(step)
        state = None if self.chain.wants_base() else self.ledger.checkpoint_delta(step)
        delta = state is not None  # (None: the ledger has no committed checkpoint to build on)
        state = self.chain.link(state if delta else self.ledger.checkpoint_state(step), delta)
        rows = self.record.commit(step)  # before the rename: a crash in between rolls these rows back
        self.gang.save_checkpoint(
            tmp, dest, step, state, {"step": step, "record_rows": rows, "lr_horizon": self.gang.settings.total_steps}
        )
        self.chain.published(dest)
        keys = self.ledger.commit(step)  # (after the save: the state is in the checkpoint before it says trained)
        # with what was trained, the objects of attempts given up on (a replica that died mid-put)
        self.gang.remove_keys(keys, self.ledger.abandoned_keys())
        self.uncommitted = []
        self.checkpoints.rotate()
        log.info("checkpoint at step %d (%d record rows; %d samples left the store)", step, rows, len(keys))
        return dest
