"""One prompt x epoch of the job in the ledger (`Entry`), its states, the JSON row a checkpoint
keeps of it (`saved_row`, read back by `SampleLedger.load_state_dict`), and what can be read
from a saved ledger state without a ledger."""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.store import SampleRef

PENDING, GENERATING, STORED, LEASED, TRAINED, FAILED = "pending", "generating", "stored", "leased", "trained", "failed"
STATES = (PENDING, GENERATING, STORED, LEASED, TRAINED, FAILED)
QUARANTINE = "quarantined with "  # the error of a prompt's copies that fail because another copy did
POISON = "poison sample: "  # the error of a sample the trainer world failed on alone (`cluster.job.poison`)
UNBOUNDED = (1 << 62, 1 << 61)  # (high, low) watermark bytes of a group nobody configured
RESERVED = -1  # the epoch of a reserved entry: generated like the others, never trained


@dataclass
class Entry:
    prompt_id: str
    epoch: int
    state: str = PENDING
    replica: str | None = None
    group: str | None = None  # the group that generated the sample: its bytes live on that group's nodes
    ref: SampleRef | None = None  # once stored
    tokens: int = 0
    nbytes: int = 0
    step: int | None = None
    rank: int | None = None
    crossed: bool = False  # leased to a rank of another group
    released: bool = False  # trained, not yet committed, and its bytes already gone from the store
    suspect: bool = False  # was being generated when its replica died: retried alone
    since: float = 0.0  # when the current state began
    attempts: int = 0  # hand-outs (in the store key: a retry never aliases a stale object)
    failures: int = 0  # failures the prompt or its sample is to blame for: FAILED at `max_attempts`
    errors: list[str] = field(default_factory=list)
    trained_at_step: int | None = None

    def __post_init__(self) -> None:
        # the entry's name, computed once (it was a property: 1.4 million f-strings in a short
        # soak); not a field, so neither saved nor compared
        self.uid = f"{self.prompt_id}@{self.epoch}"


def saved_row(e: Entry) -> dict:
    """What a checkpoint keeps of an entry: every field but the live ones (its replica, when its
    state began, whether it is a suspect: a resumed ledger starts them afresh)."""
    return {
        "prompt_id": e.prompt_id,
        "epoch": e.epoch,
        "state": e.state,
        "group": e.group,
        "ref": e.ref.to_dict() if e.ref is not None else None,
        "tokens": e.tokens,
        "nbytes": e.nbytes,
        "step": e.step,
        "rank": e.rank,
        "crossed": e.crossed,
        "released": e.released,
        "attempts": e.attempts,
        "failures": e.failures,
        "errors": list(e.errors),
        "trained_at_step": e.trained_at_step,
    }


def nonfinite_step(error: str) -> bool:
    """An error of a step whose loss was not finite (`release_lease(regenerate=False)`): counted
    on its own, not a failure of the sample."""
    return error.startswith("step ") and "non-finite" in error


def saved_failures(row: dict) -> int:
    """The blamed failures of a saved row. A row saved before they were counted has none: they
    are derived from its errors, every one but a non-finite step's counted as blamed (the old
    rule counted each against `max_attempts` too, so a resumed prompt never has more tries left
    than it had; an innocent one may have fewer, as it did then)."""
    if "failures" in row:
        return row["failures"]
    return sum(not nonfinite_step(err) for err in row.get("errors", []))


def saved(row: dict) -> bool:
    """Whether a checkpoint keeps a row: not when it is where a new ledger starts it (pending,
    never handed out, never failed)."""
    return row["state"] != PENDING or bool(row["attempts"]) or bool(row.get("failures"))


def saved_ref(row: dict) -> SampleRef | None:
    """The `SampleRef` of a saved row (`saved_row`'s; or one written before refs travelled
    typed, which may also carry a file backend's `path`: ignored)."""
    return SampleRef.from_dict(row["ref"]) if row.get("ref") else None


class LedgerError(RuntimeError):
    pass


def trained_outside(state: dict, prompt_ids: set[str], epochs: int) -> list[str]:
    """Sample ids (`prompt@epoch`) a saved ledger state trained that a ledger of these prompts
    and epochs would not hold: what `load_state_dict` would silently drop."""
    return sorted(
        f"{d['prompt_id']}@{d['epoch']}"
        for d in state["entries"]
        if d["state"] == TRAINED and (d["prompt_id"] not in prompt_ids or d["epoch"] >= epochs)
    )


def quarantined(failed: dict[str, list[str]]) -> dict[str, dict]:
    """Prompts given up on in every epoch: prompt id -> the sample whose failures decided it,
    its last error, and every copy that failed."""
    out: dict[str, dict] = {}
    for uid, errors in sorted(failed.items()):
        if errors and errors[-1].startswith(QUARANTINE):
            decided, _, cause = errors[-1][len(QUARANTINE) :].partition(": ")
            out[uid.rsplit("@", 1)[0]] = {"failed": decided, "cause": cause}
    for pid, entry in out.items():
        entry["copies"] = sorted(u for u in failed if u.rsplit("@", 1)[0] == pid)
    return out


def poison_samples(failed: dict[str, list[str]]) -> dict[str, dict]:
    """Samples the trainer world failed on alone (`SampleLedger.quarantine_sample`): uid -> its
    prompt, the cause (the step and the rank's error) and every copy of its prompt that failed
    with it (its other epochs, quarantined)."""
    out: dict[str, dict] = {}
    for uid, errors in sorted(failed.items()):
        if errors and errors[-1].startswith(POISON):
            pid = uid.rsplit("@", 1)[0]
            copies = sorted(u for u in failed if u.rsplit("@", 1)[0] == pid)
            out[uid] = {"prompt_id": pid, "cause": errors[-1][len(POISON) :], "copies": copies}
    return out


def balance(items: list[tuple[str, int]], parts: int) -> list[list[str]]:
    """Split (uid, tokens) into `parts` lists with near-equal token sums (largest first)."""
    bins: list[list[str]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for uid, tokens in sorted(items, key=lambda x: -x[1]):
        i = loads.index(min(loads))
        bins[i].append(uid)
        loads[i] += tokens
    return bins
