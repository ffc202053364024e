"""Measure a drafter's acceptance length τ against its target, and check losslessness.

    python -m dspark.evaluate --target DIR --drafter CKPT --prompts FILE.jsonl --json OUT.json \
        [--prompts FILE2.jsonl --json OUT2.json ...] [--max-new-tokens N] [--temperature T] [--limit K]

Prompts: JSONL with `messages` (OpenAI chat) or `prompt` (one user turn) per line (ShareGPT
`conversations` and `datasets` folders work too). A target that ships its own model code
(a drafter trained with `target.trust_remote_code`) needs `--trust-remote-code`: the drafter's
config.json says so, but only the flag lets that code run. Greedy decoding runs the prompts side by side
(`--batch-size`), those of every set in one pass: one drafter pass and one target verification
forward per step for the batch.
Losslessness is then checked with one teacher-forced target pass over each output (every token
must be the target's argmax given those before it; a mismatch is settled by the target's own
decode), or with `--lossless-check decode`, by the target decoding every prompt alone first, as
the first version did (which also measures the target's own speed). OUT.json holds `tau`,
`per_position_acceptance`, `num_prompts`, `generated_tokens`, `lossless` (greedy: speculative
output identical to the target's own, token for token; null when sampling),
`target_only_tokens_per_s` (with the decode check), `speculative_tokens_per_s`, `seconds`, the
figures drafters are judged by (`per_category` — from each prompt's `category` —, `macro_tau`,
`percentiles` of per-request τ, `by_prompt_length`; see `dspark.tau_report`) and the
per-request details. `--limit` takes prompts round-robin over categories.

`--plan FILE.json` judges several sets, each its own way, with one load of the target and the
drafter (what the training job runs): a list of `EvalSet` fields per set, e.g. the held-out split
greedy, the same split sampled at temperature 0.7 with the served recipe's draft sampling and
rejection (`"recipe": true`, `dspark.recipe`), and a long-context set taking `per_length_bucket`
prompts from each context-length bucket.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

from .chat import ChatFormat, render_prompt
from .checkpoint import load_drafter
from .decoder import SpeculativeDecoder, greedy_mismatches_many, target_generate
from .eval_sets import EvalSet, per_bucket
from .prompts import read_conversations, split
from .recipe import speculative_config
from .scheduler import StepRateTable
from .targets import load_target
from .tau_report import RequestResult, fmt, format_length_table, format_table, stratified, summarize

log = logging.getLogger("dspark.evaluate")


def plan_sets(args: argparse.Namespace) -> list[EvalSet]:
    """The sets to judge: the `--plan` file's, or one per `--prompts` with the command's settings."""
    if args.plan:
        try:
            raw = json.loads(Path(args.plan).read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"--plan {args.plan}: {e}") from None
        if not isinstance(raw, list) or not raw:
            raise SystemExit(f"--plan {args.plan}: a JSON list of sets, not {type(raw).__name__}")
        return [EvalSet.from_dict(r, f"--plan {args.plan} set {i}") for i, r in enumerate(raw)]
    return [
        EvalSet(p, o, args.temperature, args.limit, args.max_new_tokens) for p, o in zip(args.prompts, args.json_out)
    ]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True, help="drafter checkpoint dir (speculators format)")
    p.add_argument(
        "--prompts",
        action="append",
        default=[],
        help="repeat it, each with its own --json: the sets are judged with the target and drafter loaded once",
    )
    p.add_argument("--json", action="append", dest="json_out", default=[])
    p.add_argument(
        "--plan",
        default=None,
        help="a JSON list of sets, each with its own settings (EvalSet); in place of --prompts/--json",
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--draft-sample-method", choices=["greedy", "probabilistic"], default="greedy")
    p.add_argument("--rejection-sample-method", choices=["standard", "block"], default="standard")
    p.add_argument("--num-speculative-tokens", type=int, default=None)
    p.add_argument(
        "--split",
        choices=["all", "train", "heldout"],
        default="all",
        help="evaluate only one side of the deterministic prompt split",
    )
    p.add_argument("--heldout-fraction", type=float, default=0.1)
    p.add_argument("--split-seed", type=int, default=0)
    p.add_argument(
        "--step-rates",
        default=None,
        help="JSON file {batch_tokens: [...], steps_per_s: [...]} enabling the prefix scheduler",
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument(
        "--batch-size",
        type=int,
        default=32,
        help="prompts decoded side by side (greedy): one drafter pass and one target forward per step",
    )
    p.add_argument("--batch-tokens", type=int, default=8192, help="at most this many padded prompt tokens in a batch")
    p.add_argument(
        "--lossless-check",
        choices=["one-pass", "decode"],
        default="one-pass",
        help="greedy: one teacher-forced target pass over each output, or the target's own full decode "
        "(which also measures its speed)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the model code shipped in the target's directory (targets trained with "
        "target.trust_remote_code): only on this flag, never on the drafter's say-so",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for the target and the drafter (default: torch's own choice, which follows OMP_NUM_THREADS)",
    )
    # 1: at τ ≈ 1.3 most blocks fail at their first draft, so each forward checks 2 positions
    # per row instead of 3 (the local job's two sets decoded in 42 s instead of 53 s at width 2 on
    # a 2-core AMD EPYC; τ the same to the last digit, as it must be).
    p.add_argument(
        "--verify-width",
        type=int,
        default=1,
        help="greedy: drafts of a block the target checks per forward, the rest only once "
        "these survive (the same acceptance as checking the whole block; 0: the whole block)",
    )
    args = p.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads {args.threads}: at least 1")
    if bool(args.plan) == bool(args.prompts):
        p.error("either --plan or --prompts (with --json), not both, not neither")
    if len(args.prompts) != len(args.json_out):
        p.error(f"{len(args.prompts)} --prompts but {len(args.json_out)} --json: one output per prompt set")
    return args


def check_remote_code(args: argparse.Namespace) -> dict:
    """A drafter whose target needs its own code (config.json `target_trust_remote_code`) is
    evaluated only with --trust-remote-code: the drafter is data, possibly downloaded, and must
    not decide that the target directory's code runs."""
    try:
        raw = json.loads((Path(args.drafter) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"--drafter {args.drafter}: cannot read its config.json ({e})") from None
    if raw.get("dspark_cluster", {}).get("target_trust_remote_code") and not args.trust_remote_code:
        raise SystemExit(
            f"--drafter {args.drafter} was trained on a target that runs its own model code "
            f"(target_trust_remote_code in its config.json): pass --trust-remote-code if you trust the "
            f"code in {args.target}"
        )
    return raw


def read_prompt_set(args: argparse.Namespace, spec: EvalSet) -> list:
    convs, report = read_conversations(spec.prompts)
    if report.bad:
        log.warning("%s", report.summary())
    if args.split != "all":
        train, held = split(convs, args.heldout_fraction, args.split_seed)
        convs = held if args.split == "heldout" else train
    if spec.per_length_bucket is None:
        convs = stratified(convs, lambda c: c.category, spec.limit)
    if not convs:
        raise SystemExit(f"no prompts to evaluate in {spec.prompts}")
    return convs


def evaluate(args: argparse.Namespace) -> dict:
    """The figures of the first (usually only) prompt set."""
    return evaluate_sets(args)[0]


def evaluate_sets(args: argparse.Namespace, specs: list[EvalSet] | None = None) -> list[dict]:
    """Every set (`--plan`, or one per `--prompts`), in order, with one load of the target and
    the drafter."""
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    drafter_record = check_remote_code(args)
    specs = specs or plan_sets(args)
    sets = [read_prompt_set(args, spec) for spec in specs]  # every file read before minutes go into loading
    drafter = load_drafter(args.drafter, args.target, dtype=dtype).eval()
    # The conversations rendered as the drafter's training data were: its checkpoint records the
    # chat format (a drafter judged on another chat template is judged on data it never saw).
    model, tok = load_target(args.target, dtype, trust_remote_code=args.trust_remote_code)
    chat = ChatFormat.from_record(drafter.config.chat_format)
    rates = None
    if args.step_rates:
        raw = json.loads(Path(args.step_rates).read_text())
        rates = StepRateTable(raw["batch_tokens"], raw["steps_per_s"])
    stop = {tok.eos_token_id}
    prompts = [[render_prompt(tok, c.prompt_messages, chat) for c in convs] for convs in sets]
    for k, spec in enumerate(specs):
        if spec.per_length_bucket:
            sets[k], prompts[k] = per_bucket(sets[k], prompts[k], spec.per_length_bucket, spec.max_prompt_tokens)
    decoders = make_decoders(args, specs, model, drafter, drafter_record, rates)
    decoded = decode_sets(args, specs, decoders, prompts, stop)
    results = []
    for spec, convs, ids, decoder, (outs, seconds) in zip(specs, sets, prompts, decoders, decoded):
        n = len(outs)  # fewer than the set's prompts where its budget_s ran out
        result = evaluate_one(args, spec, convs[:n], ids[:n], decoder, stop, (outs, seconds))
        result["left_out_for_time"] = [c.id for c in convs[n:]]
        results.append(result)
    return results


def make_decoders(
    args: argparse.Namespace, specs: list[EvalSet], model, drafter, drafter_record: dict, rates
) -> list[SpeculativeDecoder]:
    """A decoder per set; sets that decode alike share one (and may be decoded in one pass)."""
    made: dict[tuple, SpeculativeDecoder] = {}
    out = []
    for spec in specs:
        if spec.recipe:  # as vLLM serves this checkpoint: τ of the recipe that ships with it
            served = speculative_config(drafter_record, args.target)
            draft, rejection, k = (
                served["draft_sample_method"],
                served["rejection_sample_method"],
                served["num_speculative_tokens"],
            )
        else:
            draft, rejection, k = args.draft_sample_method, args.rejection_sample_method, args.num_speculative_tokens
        key = (spec.temperature, draft, rejection, k)
        if key not in made:
            made[key] = SpeculativeDecoder(
                model, drafter, draft, rejection, spec.temperature, k, rates, args.seed, args.verify_width or None
            )
        out.append(made[key])
    return out


def decode_sets(
    args: argparse.Namespace,
    specs: list[EvalSet],
    decoders: list[SpeculativeDecoder],
    prompts: list[list[list[int]]],
    stop: set[int],
) -> list[tuple[list, float]]:
    """Each set's speculative outputs and decode seconds. Greedy sets (with the one-pass check)
    that share a decoder and an answer length are decoded in one pass: a greedy output does not
    depend on what else is in the batch, and fuller batches (`--batch-size` rows) make the
    target's forwards cheaper per token; a set's seconds are its share of the pass, by generated
    tokens. Other sets one by one, each from the seed (a set's sampled figures do not depend on
    the sets before it)."""
    groups: dict[tuple, list[int]] = {}
    for k, spec in enumerate(specs):
        together = spec.greedy and args.lossless_check == "one-pass" and spec.budget_s is None
        groups.setdefault((id(decoders[k]), spec.max_new_tokens) if together else ("alone", k), []).append(k)
    decoded: list = [None] * len(prompts)
    for group in groups.values():
        decoder, max_new = decoders[group[0]], specs[group[0]].max_new_tokens
        decoder.generator.manual_seed(args.seed)
        if specs[group[0]].budget_s is not None:
            decoded[group[0]] = decode_within(decoder, prompts[group[0]], max_new, stop, specs[group[0]].budget_s)
            continue
        t0 = time.perf_counter()
        outs = decoder.generate_many(
            [p for k in group for p in prompts[k]],
            max_new,
            stop,
            max_batch_tokens=args.batch_tokens,
            max_batch_rows=args.batch_size,
        )
        seconds, total = time.perf_counter() - t0, max(1, sum(len(out) for out, _ in outs))
        start = 0
        for k in group:
            mine = outs[start : start + len(prompts[k])]
            start += len(prompts[k])
            decoded[k] = mine, seconds if len(group) == 1 else seconds * sum(len(out) for out, _ in mine) / total
    return decoded


def decode_within(
    decoder: SpeculativeDecoder, prompts: list[list[int]], max_new_tokens: int, stop: set[int], budget_s: float
) -> tuple[list, float]:
    """The prompts one at a time, in order, while the next one's expected cost — the seconds per
    token so far times its prompt and answer tokens (a long prompt's prefill is most of its
    cost) — still fits in `budget_s`; the first always runs. The outputs of those decoded, and
    the seconds: on a slower machine fewer prompts, not a longer job."""
    outs, spent, units = [], 0.0, 0
    for ids in prompts:
        cost = len(ids) + max_new_tokens
        if outs and spent + spent / units * cost > budget_s:
            break
        t0 = time.perf_counter()
        outs += decoder.generate_many([ids], max_new_tokens, stop)
        spent += time.perf_counter() - t0
        units += cost
    return outs, spent


def evaluate_one(
    args: argparse.Namespace,
    spec: EvalSet,
    convs: list,
    prompts: list[list[int]],
    decoder: SpeculativeDecoder,
    stop: set[int],
    decoded: tuple[list, float],
) -> dict:
    """The figures of one set from its speculative outputs and their decode seconds. Sampled
    output cannot be compared token for token (the distribution is what stays the target's:
    tests/unit/test_speculative_lossless.py); the target decodes alone only with
    `--lossless-check decode`, for its speed."""
    model, drafter = decoder.target, decoder.drafter
    greedy = spec.greedy
    reference = args.lossless_check == "decode"
    t_target = n_target = 0
    refs: list[list[int] | None] = [None] * len(convs)
    if reference:  # the target decodes alone: the old check, and the target's own speed
        gen = torch.Generator().manual_seed(args.seed)
        t0 = time.perf_counter()
        refs = [target_generate(model, ids, spec.max_new_tokens, stop, spec.temperature, gen) for ids in prompts]
        t_target, n_target = time.perf_counter() - t0, sum(map(len, refs))
    decoded, t_spec = decoded
    n_spec = sum(len(out) for out, _ in decoded)
    t0 = time.perf_counter()
    # Greedy output is what the target emits when each token is its argmax given the ones before:
    # one teacher-forced pass (batched) checks that. A mismatch there (an exact tie, or batched
    # arithmetic, can break either way) is settled by the target's own decode.
    mismatches = (
        greedy_mismatches_many(model, prompts, [out for out, _ in decoded])
        if greedy and not reference
        else [None] * len(convs)
    )
    rows: list[RequestResult] = []
    requests, lossless = [], True if greedy else None
    for c, ids, ref, (out, stats), wrong in zip(convs, prompts, refs, decoded, mismatches):
        same = None
        if greedy:
            same = ref == out if ref is not None else not wrong
            if not same and ref is None:
                same = target_generate(model, ids, spec.max_new_tokens, stop) == out
            lossless = lossless and same
            if not same:
                log.error("LOSSLESS VIOLATION on %s", c.id)
        rows.append(RequestResult(c.id, c.category, len(ids), stats))
        log.info("%s (%d prompt tokens): tau %s", c.id, len(ids), fmt(stats.tau if stats.steps else None))
        requests.append(
            {
                "id": c.id,
                "category": c.category,
                "prompt_tokens": len(ids),
                "tau": stats.tau if stats.steps else None,
                "steps": stats.steps,
                "accepted": stats.accepted,
                "generated_tokens": len(out),
                "identical_to_target": same,
            }
        )
    check_s = time.perf_counter() - t0
    figures = summarize(rows)
    return {
        **figures,
        "generated_tokens": n_spec,
        "lossless": lossless,
        "target_only_tokens_per_s": n_target / t_target if t_target else None,
        "speculative_tokens_per_s": n_spec / t_spec if t_spec else 0.0,
        "speedup": (n_spec / t_spec) / (n_target / t_target) if t_target and t_spec and n_target else None,
        "seconds": {"target_only": t_target, "speculative": t_spec, "lossless_check": check_s},
        "num_draft_tokens": sum(r.stats.drafted for r in rows),
        "num_accepted_tokens": sum(r.stats.accepted for r in rows),
        "settings": {
            "temperature": spec.temperature,
            "max_new_tokens": spec.max_new_tokens,
            "draft_sample_method": decoder.draft_sample_method,
            "rejection_sample_method": decoder.rejection_sample_method,
            "served_recipe": spec.recipe,
            "limit": spec.limit,
            "per_length_bucket": spec.per_length_bucket,
            "max_prompt_tokens": spec.max_prompt_tokens,
            "budget_s": spec.budget_s,
            "num_speculative_tokens": decoder.k,
            "block_size": drafter.config.block_size,
            "mode": drafter.config.mode,
            "split": args.split,
            "dtype": args.dtype,
            "prefix_scheduler": decoder.step_rates is not None,
            "lossless_check": args.lossless_check if greedy else None,
            "batch_size": args.batch_size,
            "verify_width": decoder.verify_width if greedy else None,
        },
        "requests": requests,
    }


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    specs = plan_sets(args)
    results = evaluate_sets(args, specs)
    for spec, result in zip(specs, results):
        Path(spec.json).parent.mkdir(parents=True, exist_ok=True)
        Path(spec.json).write_text(json.dumps(result, indent=2, allow_nan=False))
        log.info(
            "%s (T=%s): tau %s over %d prompts (%d tokens); lossless=%s (%s); speculative %.1f tok/s; %.1f s decoding, "
            "%.1f s checking",
            spec.prompts,
            spec.temperature,
            fmt(result["tau"]),
            result["num_prompts"],
            result["generated_tokens"],
            result["lossless"],
            result["settings"]["lossless_check"],
            result["speculative_tokens_per_s"],
            result["seconds"]["speculative"],
            result["seconds"]["lossless_check"],
        )
        print(format_table(result))
        if len(result["by_prompt_length"]) > 1:
            print(format_length_table(result["by_prompt_length"]))
    return 0 if all(r["lossless"] in (True, None) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
