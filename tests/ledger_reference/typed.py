"""The frozen reference ledger (`ledger`) speaking the typed rows the ledger speaks (cluster.data:
`PromptTask`, `ProducedSample`, `LeasedSample`): an adapter that converts at its edge to the
dict rows the reference keeps, with no logic of its own. A ref goes in as its `to_dict()` (what
a checkpoint keeps of it, so that both ledgers' saved states compare equal) and comes back as
`SampleRef.from_dict` of it: refs built from their shapes (`SampleRef` itself) survive that."""

from __future__ import annotations

from cluster.data import LeasedSample, ProducedSample, PromptTask
from cluster.store import SampleRef
from tests.ledger_reference.ledger import SampleLedger


def _leased(row: dict) -> LeasedSample:
    return LeasedSample(row["uid"], SampleRef.from_dict(row["ref"]), row["group"])


def _row(r: ProducedSample) -> dict:
    """The dict row the reference takes for a report (what `LedgerClient` made of one before the
    rows were typed)."""
    if r.ref is None:
        return {"uid": r.uid, "error": r.error or "no sample", "blamed": r.blamed}
    return {
        "uid": r.uid,
        "ref": r.ref.to_dict(),
        "tokens": r.ref.num_tokens,
        "nbytes": r.ref.nbytes,
        **({"error": r.error} if r.error else {}),
    }


class TypedReferenceLedger(SampleLedger):
    def request_prompts(self, replica: str, max_n: int, group: str = "g0") -> list[PromptTask]:
        return [
            PromptTask(p["id"], p["uid"], p["key"], p["messages"])
            for p in super().request_prompts(replica, max_n, group)
        ]

    def report_produced(self, replica: str, results: list[ProducedSample]) -> None:
        super().report_produced(replica, [_row(r) for r in results])

    def peek_stored(self, n: int) -> list[LeasedSample]:
        return [_leased(r) for r in super().peek_stored(n)]

    def lease_step(self, step: int, rank_groups: list[str], batch_tokens: int) -> list[list[LeasedSample]] | None:
        lease = super().lease_step(step, rank_groups, batch_tokens)
        return None if lease is None else [[_leased(r) for r in rows] for rows in lease]
