"""What travels between the ledger and its callers, typed: a prompt handed to a producer
(`PromptTask`), what the producer reports for it (`ProducedSample`), a sample of a step's lease
(`LeasedSample`). `LedgerClient` converts them to and from the plain rows the ledger keeps (its
state is saved as JSON inside every checkpoint), so no caller reads a row by key."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.store.wire import SampleRef


@dataclass(frozen=True)
class PromptTask:
    id: str  # the prompt's id
    uid: str  # the sample: prompt id @ epoch
    key: str  # where its sample goes in the store (the attempt is in it: a retry never aliases)
    messages: list[dict]

    @classmethod
    def from_row(cls, row: dict) -> "PromptTask":
        return cls(row["id"], row["uid"], row["key"], row["messages"])


@dataclass(frozen=True)
class ProducedSample:
    """A stored sample's reference, or why there is none."""

    uid: str
    ref: SampleRef | None = None
    error: str | None = None
    extra: dict | None = None  # more of the reference to keep with it (a file backend's path)

    def to_row(self) -> dict:
        if self.ref is None:
            return {"uid": self.uid, "error": self.error or "no sample"}
        return {"uid": self.uid, "ref": {**self.ref.to_dict(), **(self.extra or {})}, "tokens": self.ref.num_tokens,
                "nbytes": self.ref.nbytes}


@dataclass(frozen=True)
class LeasedSample:
    uid: str
    ref: SampleRef
    group: str | None  # the group that generated it (its bytes are on that group's nodes)

    @property
    def prompt_id(self) -> str:
        """The prompt this sample answers (its uid is `<prompt id>@<epoch>`)."""
        return self.uid.rsplit("@", 1)[0]

    @classmethod
    def from_row(cls, row: dict) -> "LeasedSample":
        return cls(row["uid"], SampleRef.from_dict(row["ref"]), row["group"])
