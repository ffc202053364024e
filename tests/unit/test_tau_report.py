"""The figures drafters are judged by, against independent computations: numpy's percentiles,
τ recomputed from the raw per-step (drafted, accepted) counts, sorting by hand."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from dspark.decoder import DecodeStats
from dspark.prompts import read_conversations
from dspark.tau_report import RequestResult, by_prompt_length, format_table, percentile, spread, stratified, summarize


def request(rid, category, prompt_tokens, steps):
    stats = DecodeStats()
    for drafted, accepted in steps:
        stats.record(drafted, accepted)
    return RequestResult(rid, category, prompt_tokens, stats)


def random_requests(n=37, seed=0):
    rng = random.Random(seed)
    out, raw = [], {}
    for i in range(n):
        steps = [(4, rng.randint(0, 4)) for _ in range(rng.randint(1, 12))]
        cat = rng.choice(["math", "coding", "translation", None])
        out.append(request(f"r{i}", cat, rng.randint(10, 9000), steps))
        raw[f"r{i}"] = steps
    return out, raw


@pytest.mark.parametrize("q", [0, 10, 37.5, 50, 90, 100])
def test_percentile_matches_numpy(q):
    xs = [random.Random(q).uniform(1, 5) for _ in range(23)]
    assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile([2.0], q) == 2.0


def test_summary_against_raw_counts():
    rows, raw = random_requests()
    s = summarize(rows)
    emitted = lambda ids: sum(a + 1 for i in ids for _d, a in raw[i])  # noqa: E731 - accepted + bonus per step
    steps = lambda ids: sum(len(raw[i]) for i in ids)  # noqa: E731
    every = list(raw)
    assert s["tau"] == pytest.approx(emitted(every) / steps(every))
    cats = {}
    for r in rows:
        cats.setdefault(r.category or "uncategorized", []).append(r.id)
    assert set(s["per_category"]) == set(cats)
    for cat, ids in cats.items():
        c = s["per_category"][cat]
        assert c["tau"] == pytest.approx(emitted(ids) / steps(ids))
        assert c["num_prompts"] == len(ids)
        # acceptance at position j = steps where at least j+1 drafts were accepted / steps
        for j, a in enumerate(c["per_position_acceptance"]):
            assert a == pytest.approx(sum(acc > j for i in ids for _d, acc in raw[i]) / steps(ids))
    assert s["macro_tau"] == pytest.approx(np.mean([emitted(ids) / steps(ids) for ids in cats.values()]))
    per_request = sorted(emitted([i]) / steps([i]) for i in every)
    p = s["percentiles"]
    assert p["p10"] == pytest.approx(float(np.percentile(per_request, 10)))
    assert p["p90"] == pytest.approx(float(np.percentile(per_request, 90)))
    assert p["bottom10_mean"] == pytest.approx(np.mean(per_request[:4]))  # ceil(37 / 10) = 4 requests
    assert p["top10_mean"] == pytest.approx(np.mean(per_request[-4:]))
    assert p["bottom10_mean"] <= p["p10"] <= p["p50"] <= p["p90"] <= p["top10_mean"]


def test_pooled_tau_is_not_the_mean_of_request_taus():
    rows = [request("long", "a", 5, [(4, 4)] * 9), request("short", "a", 5, [(4, 0)])]
    assert summarize(rows)["per_category"]["a"]["tau"] == pytest.approx((9 * 5 + 1) / 10)
    assert spread([5.0, 1.0])["p50"] == pytest.approx(3.0)


def test_length_bins():
    rows, raw = random_requests(60, seed=3)
    edges = (0, 1000, 4000)
    bins = by_prompt_length(rows, edges)
    for b in bins:
        ids = [
            r.id
            for r in rows
            if r.prompt_tokens >= b["min_tokens"] and (b["max_tokens"] is None or r.prompt_tokens < b["max_tokens"])
        ]
        assert b["num_prompts"] == len(ids) > 0
        assert b["tau"] == pytest.approx(sum(a + 1 for i in ids for _d, a in raw[i]) / sum(len(raw[i]) for i in ids))
    assert sum(b["num_prompts"] for b in bins) == 60
    assert bins[-1]["max_tokens"] is None


def test_stratified_limit_covers_every_category_in_order():
    items = [("math", i) for i in range(10)] + [("code", i) for i in range(3)] + [("chat", 0)]
    picked = stratified(items, lambda x: x[0], 6)
    assert picked == [("math", 0), ("code", 0), ("chat", 0), ("math", 1), ("code", 1), ("math", 2)]
    assert stratified(items, lambda x: x[0], None) == items
    assert stratified(items, lambda x: x[0], 100) == items


def test_category_read_from_prompt_files(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"id": "a", "category": "math", "prompt": "1+1?"},
                {"id": "b", "prompt": "hi"},
                {"id": "c", "category": "", "messages": [{"role": "user", "content": "x"}]},
            ]
        )
    )
    convs, _ = read_conversations(f)
    assert [c.category for c in convs] == ["math", None, None]


def test_no_verification_step_gives_none_never_nan():
    """A request that ended at once has no τ; figures over nothing are null in JSON, not NaN."""
    empty = request("e", "chat", 5, [])
    s = summarize([empty, request("m", "math", 5, [(4, 2)])])
    assert s["per_category"]["chat"]["tau"] is None and s["per_category"]["chat"]["num_prompts"] == 1
    assert s["macro_tau"] == pytest.approx(3.0)  # math alone: the empty category does not count as 0
    assert s["percentiles"]["num_requests"] == 1
    nothing = summarize([empty])
    assert nothing["tau"] is None and nothing["macro_tau"] is None and nothing["percentiles"]["p50"] is None
    json.dumps(nothing, allow_nan=False)
    assert summarize([])["macro_tau"] is None
    format_table(nothing)  # prints "-" where there is no figure
