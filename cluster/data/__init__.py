"""The data room: what is trained, exactly once.

Owns the job's prompts and their train / held-out split (`prompts`), the exactly-once ledger of every prompt x epoch
(`ledger`, a pure state machine the job runs as a Ray actor: its entries in `ledger_entry`, what producers call in
`ledger_generation`, what the training loop calls in `ledger_training`, the indexes that keep each call cheap in
`ledger_index`; its typed client `ledger_client`, its counts `ledger_counts`, the rows that travel to and from it in
`ledger_rows`) and the training record that proves it at the end (`record`). It stands on the store room (a row carries
a `SampleRef`) and nothing above it:
the producers, the replay one included, are the inference room's.
"""

from cluster.data.ledger import SampleLedger
from cluster.data.ledger_checkpoint import (
    LedgerChain,
    ledger_problem,
    load_ledger_state,
    write_ledger_state,
    written_digests,
)
from cluster.data.ledger_client import LedgerClient
from cluster.data.ledger_counts import GroupCounts, LedgerCounts, Totals
from cluster.data.ledger_entry import (
    FAILED,
    LEASED,
    PENDING,
    STORED,
    TRAINED,
    LedgerError,
    balance,
    poison_samples,
    quarantined,
    trained_outside,
)
from cluster.data.ledger_rows import LeasedSample, ProducedSample, PromptTask
from cluster.data.prompts import calibration_split, check_eval_sets, load_prompts, repo_path
from cluster.data.record import ExactlyOnceViolation, TrainingRecord

__all__ = [
    "FAILED",
    "GroupCounts",
    "LedgerChain",
    "LedgerClient",
    "LedgerCounts",
    "Totals",
    "LEASED",
    "PENDING",
    "STORED",
    "TRAINED",
    "ExactlyOnceViolation",
    "LeasedSample",
    "LedgerError",
    "ProducedSample",
    "PromptTask",
    "SampleLedger",
    "TrainingRecord",
    "balance",
    "calibration_split",
    "check_eval_sets",
    "load_prompts",
    "ledger_problem",
    "load_ledger_state",
    "write_ledger_state",
    "written_digests",
    "poison_samples",
    "quarantined",
    "repo_path",
    "trained_outside",
]
