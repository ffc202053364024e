"""Serve a trained drafter's backbone with vLLM on CPU (`method: dflash`, temperature 0) and
compare vLLM's measured acceptance length with `dspark.evaluate` on the same prompts.

    python benchmarks/serve_dflash_cpu.py --target TARGET --drafter CKPT --prompts FILE.jsonl \
        [--limit 8] [--max-new-tokens 64] [--json OUT.json]

vLLM executes DSpark only on its GPU model runner, but its `dflash` method reads the same
checkpoint format and `sample_from_anchor`, so the backbone (without the Markov head) is the
part of a DSpark drafter a CPU box can serve. Both sides decode greedily with the same
checkpoint; τ = 1 + accepted / drafts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def vllm_runs(target: str, drafter: str, prompts: list[list[int]], k: int, max_new: int) -> tuple[dict, dict]:
    """(target alone, target + drafter as dflash), both greedy in vLLM."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm_spec import generate

    base = generate(target, prompts, max_new, None, dtype="float32")
    spec = generate(
        target, prompts, max_new, {"model": drafter, "method": "dflash", "num_speculative_tokens": k}, dtype="float32"
    )
    return base, spec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from vllm_spec import load_prompts, reference_eval, speculative_tokens

    from dspark.checkpoint import export_dflash_backbone, load_drafter

    work = Path(tempfile.mkdtemp(prefix="dspark-serve-"))
    backbone = export_dflash_backbone(load_drafter(args.drafter, args.target), work / "dflash")
    convs, prompts = load_prompts(args.target, args.prompts, args.limit)
    k = speculative_tokens(backbone)
    ours = reference_eval(args.target, str(backbone), convs, args.max_new_tokens)
    base, theirs = vllm_runs(args.target, str(backbone), prompts, k, args.max_new_tokens)
    lossless = theirs["outputs"] == base["outputs"]
    print(
        f"\nDSpark backbone served as vLLM `dflash` on CPU, greedy, k={k}, "
        f"{len(prompts)} prompts x {args.max_new_tokens} tokens"
    )
    print(f"{'':18} {'tau':>7}  per-position acceptance")
    for name, r in (("vLLM (CPU)", theirs), ("dspark.evaluate", ours)):
        pp = " ".join(f"{a:.2f}" for a in (r["per_position_acceptance"] or []))
        print(f"{name:18} {r['tau']:7.3f}  {pp}")
    print(f"vLLM lossless (speculative == target-only greedy output): {lossless}")
    print(f"tokens/s: target only {base['tokens_per_s']:.1f}, with dflash {theirs['tokens_per_s']:.1f}")
    result = {
        "vllm": {k2: v for k2, v in theirs.items() if k2 != "outputs"},
        "vllm_lossless": lossless,
        "vllm_target_only_tokens_per_s": base["tokens_per_s"],
        "ours": ours,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
