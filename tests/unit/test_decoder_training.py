"""Training, inference and evaluation on the tiny target: the inference path agrees with the
teacher-forced training path, decoding is lossless with random and trained drafters, a
trained drafter is accepted, and offline training resumes mid-epoch bit for bit."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dspark import eval_sets, evaluate, train_offline
from dspark.chat import render_prompt
from dspark.checkpoint import load_drafter
from dspark.decoder import SpeculativeDecoder, greedy_mismatches, greedy_mismatches_many, target_generate
from dspark.model import ContextCache
from dspark.samples import PackedBatch, Sample, write_sample
from dspark.scheduler import StepRateTable
from dspark.targets import hidden_states_for, load_target
from tests.helpers import make_drafter

PROMPTS = [f"Tell me about item number {i} and why it matters." for i in range(40)]


@pytest.fixture(scope="module")
def target(tiny_target):
    return load_target(tiny_target, torch.float32)


@pytest.fixture(scope="module")
def sample_dir(tiny_target, target, tmp_path_factory):
    """Conversations answered by the tiny target itself, with its hidden states."""
    model, tok = target
    out = tmp_path_factory.mktemp("samples")
    layer_ids = make_drafter(tiny_target).config.extract_layer_ids
    for i, p in enumerate(PROMPTS):
        # Token ids straight from generation: decoding and re-tokenising the answer would not
        # give back the same tokens (runs of newlines merge), and the drafter must learn these.
        prompt = render_prompt(tok, [{"role": "user", "content": p}])
        answer = target_generate(model, prompt, 40, {tok.eos_token_id})
        ids, mask = prompt + answer, [False] * len(prompt) + [True] * len(answer)
        h = hidden_states_for(model, torch.tensor(ids), layer_ids)
        write_sample(out / f"s{i:03d}.safetensors", Sample(torch.tensor(ids), torch.tensor(mask), h, layer_ids))
    (out / "broken.safetensors").write_bytes(b"not a safetensors file")
    return out


def train_args(tiny_target, sample_dir, out, *extra):
    return [
        "--target",
        str(tiny_target),
        "--data",
        str(sample_dir),
        "--out",
        str(out),
        "--num-layers",
        "1",
        "--block-size",
        "4",
        "--markov-rank",
        "32",
        "--batch-tokens",
        "600",
        "--num-anchors",
        "16",
        "--lr",
        "3e-3",
        "--heldout-fraction",
        "0.1",
        "--checkpoint-every",
        "1000",
        "--threads",
        "2",
        *extra,
    ]


@pytest.fixture(scope="module")
def trained(tiny_target, sample_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("trained")
    # 20 steps: the tiny target is peaked enough that a drafter reaches τ ~4.9 on these prompts
    # (80 steps measured the same; the suite's time budget)
    assert train_offline.main(train_args(tiny_target, sample_dir, out, "--max-steps", "20")) == 0
    return out


def test_inference_matches_teacher_forcing(tiny_target, target):
    """propose() (Markov-sequential, greedy) equals the training forward fed its own drafts."""
    model, tok = target
    drafter = make_drafter(tiny_target, num_layers=2, block_size=4, markov_rank=16, seed=7)
    cfg = drafter.config
    ids = render_prompt(tok, [{"role": "user", "content": "hello there"}])
    hidden = hidden_states_for(model, torch.tensor(ids), cfg.extract_layer_ids)
    n_aux = len(cfg.aux_layer_ids)
    ctx = ContextCache(drafter)
    ctx.extend(hidden[:-1, :n_aux].reshape(len(ids) - 1, -1))
    prop = drafter.propose(ctx, ids[-1])
    seq = torch.tensor(ids + prop.tokens.tolist())
    t = seq.numel()
    aux = torch.zeros(t, n_aux * cfg.hidden_size)
    aux[: len(ids) - 1] = hidden[:-1, :n_aux].reshape(len(ids) - 1, -1)
    batch = PackedBatch(
        seq,
        torch.arange(t),
        torch.zeros(t, dtype=torch.long),
        torch.ones(t, dtype=torch.bool),
        aux,
        torch.zeros(t, cfg.hidden_size),
    )
    out = drafter(batch, torch.tensor([len(ids) - 1]))
    assert out.logits[0].argmax(-1).tolist() == prop.tokens.tolist()
    torch.testing.assert_close(torch.sigmoid(out.confidence_logits[0]), prop.confidence, atol=1e-5, rtol=1e-5)


def test_lossless_with_random_drafter(tiny_target, target):
    model, tok = target
    drafter = make_drafter(tiny_target, block_size=8)
    for p in PROMPTS[:4]:
        ids = render_prompt(tok, [{"role": "user", "content": p + " (held out)"}])
        ref = target_generate(model, ids, 48, {tok.eos_token_id})
        out, stats = SpeculativeDecoder(model, drafter).generate(ids, 48, {tok.eos_token_id})
        assert out == ref
        assert stats.steps > 0


def test_trained_drafter_is_lossless_and_accepted(tiny_target, target, trained):
    model, tok = target
    drafter = load_drafter(trained / "final", tiny_target).eval()
    summary = json.loads((trained / "summary.json").read_text())
    assert [p.rsplit("/", 1)[-1] for p in summary["corrupt_samples"]] == ["broken.safetensors"]
    assert drafter.config.confidence_temperatures is not None
    taus = []
    for p in ["Tell me about item number 7 and why it matters.", "Tell me about number 99 and why it matters."]:
        ids = render_prompt(tok, [{"role": "user", "content": p}])
        ref = target_generate(model, ids, 40, {tok.eos_token_id})
        for method, kwargs in [("greedy", {}), ("scheduled", {"step_rates": StepRateTable.flat()})]:
            out, stats = SpeculativeDecoder(model, drafter, **kwargs).generate(ids, 40, {tok.eos_token_id})
            assert out == ref, method
            taus.append(stats.tau)
    assert min(taus) > 2.0  # the untrained drafter sits at ~1.0; this one measured 4.9


def test_batched_decoding_is_the_sequential_decoding(tiny_target, target, trained):
    """Prompts of different lengths decoded side by side (padding, rejected drafts masked in one
    shared cache, rows leaving as they finish) give each prompt the target's own greedy output
    and the acceptance counts it gets alone; with the prefix scheduler, still lossless."""
    model, tok = target
    drafter = load_drafter(trained / "final", tiny_target).eval()
    texts = [
        "Tell me about item number 7 and why it matters.",
        "Hi",
        PROMPTS[11] + " Please answer at length, " * 6,
        "Tell me about number 99 and 100.",
        PROMPTS[2],
        "Why?",
    ]
    prompts = [render_prompt(tok, [{"role": "user", "content": t}]) for t in texts]
    assert len({len(p) for p in prompts}) >= 5
    stop = {tok.eos_token_id}
    refs = [target_generate(model, p, 40, stop) for p in prompts]
    alone = [SpeculativeDecoder(model, drafter).generate(p, 40, stop) for p in prompts]
    assert [o for o, _ in alone] == refs
    # the whole block per forward, and a block checked one or two drafts per forward (the rest
    # once those survived): the same acceptance as the one-at-a-time decoder's, block by block
    for width in (None, 1, 2):
        together = SpeculativeDecoder(model, drafter, verify_width=width).generate_many(
            prompts, 40, stop, max_batch_rows=4
        )
        assert [o for o, _ in together] == refs, width
        for (_, a), (_, b) in zip(alone, together):
            assert (a.steps, a.accepted_at, a.drafted_at) == (b.steps, b.accepted_at, b.drafted_at), width
    assert any(s.accepted_at[2:3] and s.accepted_at[2] for _, s in together)  # blocks outlived a first forward
    scheduled = SpeculativeDecoder(model, drafter, step_rates=StepRateTable([1, 8, 64], [10.0, 9.0, 2.0]))
    assert [o for o, _ in scheduled.generate_many(prompts, 40, stop)] == refs


def test_one_pass_lossless_check_finds_a_wrong_token(tiny_target, target):
    model, tok = target
    ids = render_prompt(tok, [{"role": "user", "content": PROMPTS[5]}])
    out = target_generate(model, ids, 32, {tok.eos_token_id})
    assert greedy_mismatches(model, ids, out) == []
    for j in (0, len(out) // 2, len(out) - 1):
        wrong = list(out)
        wrong[j] = (wrong[j] + 1) % 49152
        assert greedy_mismatches(model, ids, wrong)[0] == j
    # Batched: left-padded rows of other lengths beside it (and an empty output) change nothing.
    other = render_prompt(tok, [{"role": "user", "content": PROMPTS[1]}])
    short = target_generate(model, other, 12, {tok.eos_token_id})
    wrong = list(out)
    wrong[3] = (wrong[3] + 1) % 49152
    for rows, budget in ((2, 8192), (8, 8192), (8, 1)):  # (8, 1): a forward per row, the token budget binding
        got = greedy_mismatches_many(
            model, [ids, other, ids, other], [out, short, wrong, []], max_rows=rows, max_batch_tokens=budget
        )
        assert got[0] == [] and got[1] == [] and got[2][0] == 3 and got[3] == []


def test_sampling_decoders_run(tiny_target, target, trained):
    model, tok = target
    drafter = load_drafter(trained / "final", tiny_target).eval()
    ids = render_prompt(tok, [{"role": "user", "content": PROMPTS[3]}])
    for rej in ("standard", "block"):
        out, stats = SpeculativeDecoder(model, drafter, "probabilistic", rej, temperature=0.7, seed=1).generate(
            ids, 30, {2}
        )
        assert 0 < len(out) <= 30 and stats.tau >= 1.0


def test_resume_mid_epoch_is_exact(tiny_target, sample_dir, tmp_path):
    straight, interrupted = tmp_path / "a", tmp_path / "b"
    assert train_offline.main(train_args(tiny_target, sample_dir, straight, "--max-steps", "8")) == 0
    assert (
        train_offline.main(train_args(tiny_target, sample_dir, interrupted, "--max-steps", "8", "--stop-at-step", "5"))
        == 0
    )
    assert not (interrupted / "final").exists()
    assert train_offline.main(train_args(tiny_target, sample_dir, interrupted, "--max-steps", "8", "--resume")) == 0
    a = load_drafter(straight / "final", tiny_target).trainable_state_dict()
    b = load_drafter(interrupted / "final", tiny_target).trainable_state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    steps = [json.loads(x)["step"] for x in (interrupted / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))


def test_evaluate_cli_contract(tiny_target, trained, tmp_path):
    prompts = tmp_path / "p.jsonl"
    rows = [
        {"prompt": "Tell me about item number 3 and why it matters.", "category": "explain"},
        {"messages": [{"role": "user", "content": "Tell me about number 12."}], "category": "explain"},
        {"prompt": "Write a haiku about the number 7.", "category": "writing"},
        {"prompt": "List three prime numbers."},
    ]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "r.json"
    rc = evaluate.main(
        [
            "--target",
            str(tiny_target),
            "--drafter",
            str(trained / "final"),
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "24",
            "--json",
            str(out),
        ]
    )
    r = json.loads(out.read_text())
    assert rc == 0 and r["lossless"] is True and r["num_prompts"] == 4
    for key in (
        "tau",
        "per_position_acceptance",
        "generated_tokens",
        "target_only_tokens_per_s",
        "speculative_tokens_per_s",
    ):
        assert key in r
    assert len(r["per_position_acceptance"]) == 4
    assert r["tau"] == pytest.approx(1 + r["num_accepted_tokens"] / r["num_drafts"])
    # Per category, recomputed from the per-request rows: pooled counts, not the mean of τs.
    req = r["requests"]
    assert [q["category"] for q in req] == ["explain", "explain", "writing", None]
    assert sorted(r["per_category"]) == ["explain", "uncategorized", "writing"]
    for cat, members in (("explain", req[:2]), ("writing", req[2:3]), ("uncategorized", req[3:])):
        steps, acc = sum(q["steps"] for q in members), sum(q["accepted"] for q in members)
        assert r["per_category"][cat]["tau"] == pytest.approx((steps + acc) / steps)
        assert r["per_category"][cat]["num_prompts"] == len(members)
    assert r["macro_tau"] == pytest.approx(sum(c["tau"] for c in r["per_category"].values()) / 3)
    assert r["percentiles"]["p50"] == pytest.approx(float(np.percentile([q["tau"] for q in req], 50)))
    assert all(q["prompt_tokens"] > 0 for q in req)
    # Several sets in one call (the job's held-out and eval_sets): each file gets what it gets alone.
    other = tmp_path / "q.jsonl"
    other.write_text(json.dumps({"prompt": "Why does item number 9 matter?", "category": "chat"}) + "\n")
    both = [tmp_path / "both-p.json", tmp_path / "both-q.json"]
    assert (
        evaluate.main(
            [
                "--target",
                str(tiny_target),
                "--drafter",
                str(trained / "final"),
                "--max-new-tokens",
                "24",
                "--prompts",
                str(prompts),
                "--json",
                str(both[0]),
                "--prompts",
                str(other),
                "--json",
                str(both[1]),
            ]
        )
        == 0
    )
    alone = tmp_path / "q-alone.json"
    assert (
        evaluate.main(
            [
                "--target",
                str(tiny_target),
                "--drafter",
                str(trained / "final"),
                "--max-new-tokens",
                "24",
                "--prompts",
                str(other),
                "--json",
                str(alone),
            ]
        )
        == 0
    )
    for got, want in ((both[0], out), (both[1], alone)):
        g, w = json.loads(got.read_text()), json.loads(want.read_text())
        assert g["requests"] == w["requests"] and g["tau"] == w["tau"] and g["num_prompts"] == w["num_prompts"]
    with pytest.raises(SystemExit):  # an output per set
        evaluate.parse_args(["--target", "t", "--drafter", "d", "--prompts", "a", "--prompts", "b", "--json", "o"])


def test_evaluate_plan_judges_each_set_its_own_way(tiny_target, trained, tmp_path):
    """`--plan` (what the job runs): a greedy set is judged as the plain flags judge it; a sampled
    set drafts and verifies as the checkpoint's served recipe says; a long-context set takes
    `per_length_bucket` prompts of each context-length bucket, first in file order."""
    from dspark.recipe import speculative_config

    final = trained / "final"
    short = tmp_path / "short.jsonl"
    short.write_text(
        "".join(
            json.dumps({"id": f"s{i}", "prompt": f"Tell me about item number {i}.", "category": c}) + "\n"
            for i, c in enumerate(["a", "b", "a", "b"])
        )
    )
    long = (
        tmp_path / "long.jsonl"
    )  # two prompts under 512 tokens, two between 512 and 1535 (the tiny target's limit: 1024)
    filler = " ".join(f"item {i}" for i in range(170))  # ~600 tokens
    long.write_text(
        "".join(
            json.dumps({"id": i, "prompt": p, "category": c}) + "\n"
            for i, p, c in [
                ("l0", "Why does item 9 matter?", "x"),
                ("l1", "And item 10?", "y"),
                ("l2", filler + " Which item comes last?", "x"),
                ("l3", filler + " Which item comes first?", "y"),
            ]
        )
    )
    out = {k: str(tmp_path / f"{k}.json") for k in ("greedy", "sampled", "long", "alone")}
    plan = tmp_path / "plan.json"
    plan.write_text(
        json.dumps(
            [
                {"prompts": str(short), "json": out["greedy"], "limit": 2, "max_new_tokens": 16},
                {
                    "prompts": str(short),
                    "json": out["sampled"],
                    "limit": 3,
                    "max_new_tokens": 16,
                    "temperature": 0.7,
                    "recipe": True,
                    "budget_s": 1e-6,
                },  # the first prompt always runs, then nothing fits
                {"prompts": str(long), "json": out["long"], "max_new_tokens": 8, "per_length_bucket": 1},
            ]
        )
    )
    assert evaluate.main(["--target", str(tiny_target), "--drafter", str(final), "--plan", str(plan)]) == 0
    assert (
        evaluate.main(
            [
                "--target",
                str(tiny_target),
                "--drafter",
                str(final),
                "--prompts",
                str(short),
                "--json",
                out["alone"],
                "--limit",
                "2",
                "--max-new-tokens",
                "16",
            ]
        )
        == 0
    )
    greedy, sampled, lc, alone = (json.loads(open(out[k]).read()) for k in ("greedy", "sampled", "long", "alone"))
    assert greedy["requests"] == alone["requests"] and greedy["lossless"] is True
    assert [r["id"] for r in greedy["requests"]] == ["s0", "s1"]  # round-robin over categories

    served = speculative_config(json.loads((final / "config.json").read_text()), "target")
    s = sampled["settings"]
    assert (s["draft_sample_method"], s["rejection_sample_method"], s["num_speculative_tokens"]) == (
        served["draft_sample_method"],
        served["rejection_sample_method"],
        served["num_speculative_tokens"],
    )
    assert s["temperature"] == 0.7 and s["served_recipe"] and sampled["lossless"] is None
    assert [r["id"] for r in sampled["requests"]] == ["s0"] and sampled["tau"] is not None
    assert sampled["left_out_for_time"] == ["s1", "s2"] and greedy["left_out_for_time"] == []

    assert [r["id"] for r in lc["requests"]] == ["l0", "l3"]  # the second bucket starts at the second category
    bins = [(b["min_tokens"], b["num_prompts"]) for b in lc["by_prompt_length"]]
    assert bins == [(0, 1), (512, 1)], bins
    assert lc["requests"][1]["prompt_tokens"] >= 512 > lc["requests"][0]["prompt_tokens"]


def test_per_bucket_takes_each_context_bucket_and_every_category():
    from types import SimpleNamespace

    cats = ["code", "doc", "code", "doc", "code", "doc", "code"]
    lengths = [100, 200, 700, 900, 2000, 2500, 6000]  # buckets 0, 0, 1, 1, 2, 2, 4
    convs = [SimpleNamespace(id=f"c{i}", category=c) for i, c in enumerate(cats)]
    prompts = [[0] * n for n in lengths]

    def ids(*args):
        return [c.id for c in eval_sets.per_bucket(convs, prompts, *args)[0]]

    assert ids(1) == ["c0", "c3", "c4", "c6"]  # bucket k starts at category k mod 2
    assert ids(2) == ["c0", "c1", "c2", "c3", "c4", "c5", "c6"]
    assert ids(1, 3072) == ["c0", "c3", "c4"]  # the 6,000-token prompt left out
    assert [eval_sets.length_bucket(n) for n in (0, 511, 512, 1535, 1536, 5119, 5120)] == [0, 0, 1, 1, 2, 3, 4]


def test_a_budget_leaves_out_the_prompts_that_would_not_fit(monkeypatch):
    """`decode_within`: prompts in order while the next one's expected cost (seconds per token so
    far × its tokens) fits; a fake decoder spends 10 ms per prompt token on a fake clock."""
    clock = [0.0]
    monkeypatch.setattr(evaluate.time, "perf_counter", lambda: clock[0])

    class Decoder:
        def generate_many(self, prompts, max_new_tokens, stop):
            clock[0] += 0.01 * (len(prompts[0]) + max_new_tokens)
            return [([7] * max_new_tokens, None)]

    prompts = [[0] * n for n in (100, 200, 400, 800)]
    outs, spent = evaluate.decode_within(Decoder(), prompts, 0, set(), 5.0)
    assert len(outs) == 2 and spent == pytest.approx(3.0)  # the third: 3 s + 4 s expected > 5 s
    outs, spent = evaluate.decode_within(Decoder(), prompts, 0, set(), 1e-9)
    assert len(outs) == 1  # the first always runs
    outs, _ = evaluate.decode_within(Decoder(), prompts, 0, set(), 100.0)
    assert len(outs) == 4


def test_plan_files_are_checked(tmp_path):
    plan = tmp_path / "plan.json"
    for bad, match in [
        ([], "a JSON list of sets"),
        ([{"prompts": "p"}], "mapping with prompts and json"),
        ([{"prompts": "p", "json": "o", "temprature": 1}], "mapping with prompts and json"),
        ([{"prompts": "p", "json": "o", "per_length_bucket": 0}], "per_length_bucket"),
        ([{"prompts": "p", "json": "o", "max_prompt_tokens": 10}], "goes with per_length_bucket"),
        ([{"prompts": "p", "json": "o", "budget_s": 0}], "budget_s must be > 0"),
    ]:
        plan.write_text(json.dumps(bad))
        with pytest.raises(SystemExit, match=match):
            evaluate.plan_sets(evaluate.parse_args(["--target", "t", "--drafter", "d", "--plan", str(plan)]))
    with pytest.raises(SystemExit):  # a plan or flags, not both
        evaluate.parse_args(["--target", "t", "--drafter", "d", "--plan", str(plan), "--prompts", "a", "--json", "o"])
