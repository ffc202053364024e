"""Measure a drafter's acceptance length τ against its target, and check losslessness.

    python -m dspark.evaluate --target DIR --drafter CKPT --prompts FILE.jsonl \
        [--max-new-tokens N] [--temperature T] [--limit K] --json OUT.json

Prompts: JSONL with `messages` (OpenAI chat) or `prompt` (one user turn) per line (ShareGPT
`conversations` and `datasets` folders work too). For each prompt the target first decodes
alone, then with the drafter. OUT.json holds `tau`, `per_position_acceptance`, `num_prompts`,
`generated_tokens`, `lossless` (greedy: speculative output identical to the target's own, token
for token; null when sampling), `target_only_tokens_per_s`, `speculative_tokens_per_s`, the
figures drafters are judged by (`per_category` — from each prompt's `category` —, `macro_tau`,
`percentiles` of per-request τ, `by_prompt_length`; see `dspark.tau_report`) and the
per-request details. `--limit` takes prompts round-robin over categories.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

from .checkpoint import load_drafter
from .decoder import SpeculativeDecoder, target_generate
from .prompts import read_conversations, split
from .scheduler import StepRateTable
from .tau_report import RequestResult, fmt, format_length_table, format_table, stratified, summarize
from .chat import ChatFormat, render_prompt
from .targets import load_target

log = logging.getLogger("dspark.evaluate")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True, help="drafter checkpoint dir (speculators format)")
    p.add_argument("--prompts", required=True)
    p.add_argument("--json", required=True, dest="json_out")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--draft-sample-method", choices=["greedy", "probabilistic"], default="greedy")
    p.add_argument("--rejection-sample-method", choices=["standard", "block"], default="standard")
    p.add_argument("--num-speculative-tokens", type=int, default=None)
    p.add_argument("--split", choices=["all", "train", "heldout"], default="all",
                   help="evaluate only one side of the deterministic prompt split")
    p.add_argument("--heldout-fraction", type=float, default=0.1)
    p.add_argument("--split-seed", type=int, default=0)
    p.add_argument("--step-rates", default=None,
                   help="JSON file {batch_tokens: [...], steps_per_s: [...]} enabling the prefix scheduler")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def evaluate(args: argparse.Namespace) -> dict:
    dtype = getattr(torch, args.dtype)
    convs, report = read_conversations(args.prompts)
    if report.bad:
        log.warning("%s", report.summary())
    if args.split != "all":
        train, held = split(convs, args.heldout_fraction, args.split_seed)
        convs = held if args.split == "heldout" else train
    convs = stratified(convs, lambda c: c.category, args.limit)
    if not convs:
        raise SystemExit("no prompts to evaluate")
    drafter = load_drafter(args.drafter, args.target, dtype=dtype).eval()
    # The target read and the conversations rendered as the drafter's training data were: its
    # checkpoint records both (a drafter judged on another chat template is judged on data it
    # never saw).
    model, tok = load_target(args.target, dtype, trust_remote_code=drafter.config.target_trust_remote_code)
    chat = ChatFormat.from_record(drafter.config.chat_format)
    rates = None
    if args.step_rates:
        raw = json.loads(Path(args.step_rates).read_text())
        rates = StepRateTable(raw["batch_tokens"], raw["steps_per_s"])
    decoder = SpeculativeDecoder(
        model, drafter, args.draft_sample_method, args.rejection_sample_method, args.temperature,
        args.num_speculative_tokens, rates, args.seed,
    )
    stop = {tok.eos_token_id}
    greedy = args.temperature <= 0
    rows: list[RequestResult] = []
    requests, lossless = [], True if greedy else None
    t_target = t_spec = 0.0
    n_target = n_spec = 0
    gen = torch.Generator().manual_seed(args.seed)
    for c in convs:
        ids = render_prompt(tok, c.prompt_messages, chat)
        t0 = time.perf_counter()
        ref = target_generate(model, ids, args.max_new_tokens, stop, args.temperature, gen)
        t1 = time.perf_counter()
        out, stats = decoder.generate(ids, args.max_new_tokens, stop)
        t2 = time.perf_counter()
        t_target, t_spec = t_target + t1 - t0, t_spec + t2 - t1
        n_target, n_spec = n_target + len(ref), n_spec + len(out)
        same = ref == out
        if greedy:
            lossless = lossless and same
            if not same:
                log.error("LOSSLESS VIOLATION on %s", c.id)
        rows.append(RequestResult(c.id, c.category, len(ids), stats))
        log.info("%d/%d %s (%d prompt tokens): tau %s, %.1f s", len(rows), len(convs), c.id, len(ids),
                 fmt(stats.tau if stats.steps else None), t2 - t0)
        requests.append({"id": c.id, "category": c.category, "prompt_tokens": len(ids),
                         "tau": stats.tau if stats.steps else None,
                         "steps": stats.steps, "accepted": stats.accepted, "generated_tokens": len(out),
                         "identical_to_target": same if greedy else None})
    figures = summarize(rows)
    return {
        **figures,
        "generated_tokens": n_spec,
        "lossless": lossless,
        "target_only_tokens_per_s": n_target / t_target if t_target else 0.0,
        "speculative_tokens_per_s": n_spec / t_spec if t_spec else 0.0,
        "speedup": (n_spec / t_spec) / (n_target / t_target) if t_target and t_spec and n_target else None,
        "num_draft_tokens": sum(r.stats.drafted for r in rows),
        "num_accepted_tokens": sum(r.stats.accepted for r in rows),
        "settings": {
            "temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
            "draft_sample_method": args.draft_sample_method, "rejection_sample_method": args.rejection_sample_method,
            "num_speculative_tokens": decoder.k, "block_size": drafter.config.block_size, "mode": drafter.config.mode,
            "split": args.split, "dtype": args.dtype, "prefix_scheduler": bool(rates),
        },
        "requests": requests,
    }


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    result = evaluate(args)
    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_out).write_text(json.dumps(result, indent=2, allow_nan=False))
    log.info("tau %s over %d prompts (%d tokens); lossless=%s; target %.1f tok/s, speculative %.1f tok/s",
             fmt(result["tau"]), result["num_prompts"], result["generated_tokens"], result["lossless"],
             result["target_only_tokens_per_s"], result["speculative_tokens_per_s"])
    print(format_table(result))
    if len(result["by_prompt_length"]) > 1:
        print(format_length_table(result["by_prompt_length"]))
    return 0 if result["lossless"] in (True, None) else 1


if __name__ == "__main__":
    sys.exit(main())
