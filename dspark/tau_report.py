"""Acceptance figures the way drafters are judged: per domain, its macro average, the spread
over requests, and by prompt length.

One global τ hides what users see: a drafter that is excellent at code and useless at
translation averages to "fine", and the mean over requests hides the tail a user is stuck in.
Every figure here is computed from per-request decode counts (`DecodeStats`), pooled the way
vLLM pools its counters: τ of a set of requests = (accepted + steps) / steps over the set, not
the mean of the requests' τ. The spread is over per-request τ. A request that ended before any
verification step (an immediate end of sequence) has no τ: it counts in `num_prompts` but not in
any τ; a figure over no verification step at all is None (JSON null, never NaN).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .decoder import DecodeStats

UNCATEGORIZED = "uncategorized"
# Prompt-length bins (tokens, lower edges) for the long-context table.
DEFAULT_LENGTH_EDGES = (0, 512, 1536, 3072, 5120)  # ~1K, ~2K, ~4K, ~7K land in separate bins


@dataclass
class RequestResult:
    id: str
    category: str | None
    prompt_tokens: int
    stats: DecodeStats


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def pooled(rows: list[RequestResult]) -> dict:
    total = DecodeStats()
    for r in rows:
        total.merge(r.stats)
    return {
        "tau": total.tau if total.steps else None,
        "per_position_acceptance": total.per_position_acceptance,
        "num_prompts": len(rows),
        "num_drafts": total.steps,
    }


def spread(taus: list[float]) -> dict:
    """p10/p50/p90 of per-request τ, and the mean τ of the worst and the best tenth of the
    requests (at least one request each): what the unlucky and the lucky users get."""
    xs = sorted(taus)
    tenth = max(1, math.ceil(len(xs) / 10)) if xs else 0
    mean = lambda v: sum(v) / len(v) if v else None  # noqa: E731
    return {
        "p10": percentile(xs, 10),
        "p50": percentile(xs, 50),
        "p90": percentile(xs, 90),
        "bottom10_mean": mean(xs[:tenth]),
        "top10_mean": mean(xs[-tenth:] if tenth else []),
        "num_requests": len(xs),
    }


def by_category(rows: list[RequestResult]) -> dict[str, dict]:
    groups: dict[str, list[RequestResult]] = {}
    for r in rows:
        groups.setdefault(r.category or UNCATEGORIZED, []).append(r)
    return {cat: pooled(groups[cat]) for cat in sorted(groups)}


def by_prompt_length(rows: list[RequestResult], edges=DEFAULT_LENGTH_EDGES) -> list[dict]:
    """τ per prompt-length bin [edges[i], edges[i+1]) (the last bin is open); empty bins left out."""
    out = []
    for i, lo in enumerate(edges):
        hi = edges[i + 1] if i + 1 < len(edges) else None
        inside = [r for r in rows if r.prompt_tokens >= lo and (hi is None or r.prompt_tokens < hi)]
        if inside:
            out.append(
                {
                    "min_tokens": lo,
                    "max_tokens": hi,
                    **pooled(inside),
                    "mean_prompt_tokens": sum(r.prompt_tokens for r in inside) / len(inside),
                }
            )
    return out


def summarize(rows: list[RequestResult], length_edges=DEFAULT_LENGTH_EDGES) -> dict:
    """The figures `dspark.evaluate --json` and the job's `result.json` carry."""
    cats = by_category(rows)
    taus = [c["tau"] for c in cats.values() if c["tau"] is not None]
    return {
        **pooled(rows),
        "per_category": cats,
        "macro_tau": sum(taus) / len(taus) if taus else None,
        "percentiles": spread([r.stats.tau for r in rows if r.stats.steps]),
        "by_prompt_length": by_prompt_length(rows, length_edges),
    }


def stratified(items: list, key, limit: int | None) -> list:
    """At most `limit` items taken round-robin over `key(item)` (in first-seen order of the
    keys, each key's items in their own order): a small evaluation still covers every domain."""
    if not limit or limit >= len(items):
        return list(items)
    queues: dict[object, list] = {}
    for it in items:
        queues.setdefault(key(it), []).append(it)
    out, depth = [], 0
    while len(out) < limit:
        for q in queues.values():
            if depth < len(q) and len(out) < limit:
                out.append(q[depth])
        depth += 1
    return out


def fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def format_table(summary: dict) -> str:
    """The lines the job and `dspark.evaluate` print."""
    lines = [f"{'category':<16} {'prompts':>7} {'tau':>6}  per-position acceptance"]
    for cat, c in summary["per_category"].items():
        pp = " ".join(f"{a:.2f}" for a in c["per_position_acceptance"])
        lines.append(f"{cat:<16} {c['num_prompts']:>7} {fmt(c['tau']):>6}  {pp}")
    p = summary["percentiles"]
    lines.append(
        f"macro tau {fmt(summary['macro_tau'])} over {len(summary['per_category'])} categories; "
        f"pooled tau {fmt(summary['tau'])} over {summary['num_prompts']} requests"
    )
    lines.append(
        f"per-request tau p10 {fmt(p['p10'])}  p50 {fmt(p['p50'])}  p90 {fmt(p['p90'])}  "
        f"worst 10% {fmt(p['bottom10_mean'])}  best 10% {fmt(p['top10_mean'])}"
    )
    return "\n".join(lines)


def format_length_table(bins: list[dict]) -> str:
    lines = [f"{'prompt tokens':<15} {'prompts':>7} {'tau':>6}"]
    for b in bins:
        span = f"{b['min_tokens']}-{b['max_tokens'] - 1}" if b["max_tokens"] else f">={b['min_tokens']}"
        lines.append(f"{span:<15} {b['num_prompts']:>7} {fmt(b['tau']):>6}")
    return "\n".join(lines)
