"""What a prompt set is judged on: `EvalSet` (an entry of `dspark.evaluate --plan`: the file,
the temperature, how many prompts, the answer length, the served recipe or not, a time budget)
and the choice of a long-context set's prompts by context-length bucket."""

from __future__ import annotations

from dataclasses import dataclass, fields

from .tau_report import DEFAULT_LENGTH_EDGES, stratified


@dataclass(frozen=True)
class EvalSet:
    """One prompt set and how it is judged (an entry of `--plan`; the plain flags make one per
    `--prompts`). `recipe`: draft and verify as the drafter's served recipe says (`dspark.recipe`:
    probabilistic drafting and block rejection for `dspark`), instead of the command's methods.
    `per_length_bucket`: this many prompts from each context-length bucket (round-robin over
    categories inside a bucket) instead of `limit` round-robin over categories."""

    prompts: str
    json: str
    temperature: float = 0.0
    limit: int | None = None
    max_new_tokens: int = 128
    recipe: bool = False
    per_length_bucket: int | None = None
    max_prompt_tokens: int | None = None  # with per_length_bucket: longer prompts left out
    # Seconds of decoding the set may take: its prompts run one at a time, in order, while the
    # next one's expected cost fits (the first always runs); the rest are left out and counted.
    budget_s: float | None = None

    @classmethod
    def from_dict(cls, raw: dict, where: str) -> EvalSet:
        known = {f.name for f in fields(cls)}
        if not isinstance(raw, dict) or not {"prompts", "json"} <= set(raw) or set(raw) - known:
            raise SystemExit(
                f"{where}: each set is a mapping with prompts and json, and only {sorted(known)}; got {raw!r}"
            )
        out = cls(**raw)
        if (
            out.temperature < 0
            or out.max_new_tokens < 1
            or (out.limit is not None and out.limit < 1)
            or (out.per_length_bucket is not None and out.per_length_bucket < 1)
        ):
            raise SystemExit(
                f"{where}: a negative temperature, or a limit, per_length_bucket or max_new_tokens below 1: {raw!r}"
            )
        if out.budget_s is not None and not out.budget_s > 0:
            raise SystemExit(f"{where}: budget_s must be > 0: {raw!r}")
        if out.max_prompt_tokens is not None and (out.per_length_bucket is None or out.max_prompt_tokens < 1):
            raise SystemExit(f"{where}: max_prompt_tokens goes with per_length_bucket, and is at least 1: {raw!r}")
        return out

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def length_bucket(tokens: int, edges=DEFAULT_LENGTH_EDGES) -> int:
    """The index of the context-length bucket (`dspark.tau_report`'s bins) `tokens` falls in."""
    return max(i for i, lo in enumerate(edges) if tokens >= lo)


def per_bucket(
    convs: list, prompts: list[list[int]], n: int, max_tokens: int | None = None
) -> tuple[list, list[list[int]]]:
    """`n` prompts from each context-length bucket, round-robin over categories inside it, the
    k-th bucket starting at the k-th category (one prompt per bucket still covers every
    category); prompts over `max_tokens` left out; shortest first. A long-context set judged by
    context length, not by its first lines."""
    cats = list(dict.fromkeys(c.category for c in convs))
    buckets: dict[int, list[int]] = {}
    for i, ids in enumerate(prompts):
        if max_tokens is None or len(ids) <= max_tokens:
            buckets.setdefault(length_bucket(len(ids)), []).append(i)
    keep = []
    for k, (_, members) in enumerate(sorted(buckets.items())):
        first = {c: (j - k) % len(cats) for j, c in enumerate(cats)}  # this bucket's category order
        keep += stratified(sorted(members, key=lambda i: first[convs[i].category]), lambda i: convs[i].category, n)
    keep.sort(key=lambda i: (len(prompts[i]), i))  # shortest first: what a budget_s cuts is the longest
    return [convs[i] for i in keep], [prompts[i] for i in keep]
