"""What travels between the ledger and its callers, typed: a prompt handed to a producer
(`PromptTask`), what the producer reports for it (`ProducedSample`), a sample of a step's lease
(`LeasedSample`, also what a rank reports it trained: `cluster.training.StepResult.trained`).
The ledger actor takes and returns them as they are (Ray pickles them between the job's own
processes); a sample's store reference is one `SampleRef` from the producer's put to the
trainer's read. JSON is only the saved ledger state (`ledger_entry.saved_row`)."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.store import SampleRef


@dataclass(frozen=True)
class PromptTask:
    id: str  # the prompt's id
    uid: str  # the sample: prompt id @ epoch
    key: str  # where its sample goes in the store (the attempt is in it: a retry never aliases)
    messages: list[dict]


@dataclass(frozen=True)
class ProducedSample:
    """A stored sample's reference (its tokens and bytes are the ref's), or why there is none;
    `blamed`: whether that is the prompt's failure (counted against `max_attempts`), False when
    the producer gave its put up for want of store room or a store to reach."""

    uid: str
    ref: SampleRef | None = None
    error: str | None = None
    blamed: bool = True


@dataclass(frozen=True)
class LeasedSample:
    uid: str
    ref: SampleRef
    group: str | None  # the group that generated it (its bytes are on that group's nodes)

    @property
    def prompt_id(self) -> str:
        """The prompt this sample answers (its uid is `<prompt id>@<epoch>`)."""
        return self.uid.rsplit("@", 1)[0]


# How the trainer's `fetch` names a sample it cannot train that is the sample's own fault (its
# reasons are `<exception type>: <message>`, or the out-of-vocabulary one it words itself):
# `dspark.samples.CorruptSampleError` (the sample's own check, or its MAC) and token ids outside
# the target's vocabulary. Anything else is the store's (`SampleMissing`: a daemon or the master
# lost it; `StoreUnavailable`; another `StoreError`).
BLAMED_READS = ("CorruptSampleError: ", "token id ")


def read_failure_blamed(why: str) -> bool:
    """Whether a sample that could not be read (`why`, as `TrainerRank.fetch` reports it) counts
    as a failure of its prompt (`SampleLedger.release_lease`)."""
    return why.startswith(BLAMED_READS)
