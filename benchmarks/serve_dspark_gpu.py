"""Serve a trained DSpark checkpoint with the CUDA build of vLLM (`method: dspark`) on a GPU
machine, and check it against the target alone and against our reference decoder:

    python benchmarks/serve_dspark_gpu.py --target TARGET --drafter CKPT --prompts FILE.jsonl \
        [--limit 32] [--max-new-tokens 128] [--tp 1] [--dtype auto|float32|bfloat16] \
        [--rejection standard|block] [--adaptive] \
        [--reference] [--json OUT.json]

Prints, in one run: target-only tokens/s; DSpark tokens/s, speed-up and vLLM's measured τ with
per-position acceptance; whether the greedy outputs are token-for-token identical to the
target's (lossless); with `--reference`, τ from `dspark.evaluate` on the same prompts. Exits 1
when greedy decoding is not lossless. Needs a GPU; DSpark execution in vLLM is GPU-only.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--limit", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dtype", default="auto", help="the engine's dtype (float32 to compare τ with the fp32 reference)")
    ap.add_argument("--rejection", default="standard", choices=["standard", "block"])
    ap.add_argument("--adaptive", action="store_true", help="vLLM's confidence-driven verification budget")
    ap.add_argument("--reference", action="store_true", help="also run dspark.evaluate (HF reference decoder)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch
    from vllm_spec import generate, load_prompts, reference_eval, speculative_tokens

    if not torch.cuda.is_available():
        print("no CUDA device: DSpark execution in vLLM is GPU-only", file=sys.stderr)
        return 2
    convs, prompts = load_prompts(args.target, args.prompts, args.limit)
    k = speculative_tokens(args.drafter)
    engine = {"tensor_parallel_size": args.tp, "gpu_memory_utilization": 0.4, "dtype": args.dtype}

    base = generate(args.target, prompts, args.max_new_tokens, None, **engine)
    gc.collect()
    torch.cuda.empty_cache()
    spec_cfg = {
        "model": args.drafter,
        "method": "dspark",
        "num_speculative_tokens": k,
        "rejection_sample_method": args.rejection,
        "enable_adaptive_verification": args.adaptive,
    }
    spec = generate(args.target, prompts, args.max_new_tokens, spec_cfg, **engine)
    lossless = spec["outputs"] == base["outputs"]
    differing = [i for i, (a, b) in enumerate(zip(spec["outputs"], base["outputs"])) if a != b]

    print(
        f"\nDSpark on vLLM (CUDA), greedy, k={k}, rejection={args.rejection}, adaptive={args.adaptive}, "
        f"{len(prompts)} prompts x {args.max_new_tokens} tokens"
    )
    print(f"target only      {base['tokens_per_s']:9.1f} tok/s")
    print(
        f"dspark           {spec['tokens_per_s']:9.1f} tok/s  ({spec['tokens_per_s'] / base['tokens_per_s']:.2f}x)  "
        f"tau {spec['tau']:.3f}  per-position " + " ".join(f"{a:.2f}" for a in spec["per_position_acceptance"] or [])
    )
    print(f"lossless         {lossless}" + ("" if lossless else f" (prompts {differing[:10]} differ)"))
    result = {
        "k": k,
        "target_only": {x: v for x, v in base.items() if x != "outputs"},
        "dspark": {x: v for x, v in spec.items() if x != "outputs"},
        "lossless": lossless,
    }
    if args.reference:
        ours = reference_eval(args.target, args.drafter, convs, args.max_new_tokens)
        print(
            f"dspark.evaluate  tau {ours['tau']:.3f}  per-position "
            + " ".join(f"{a:.2f}" for a in ours["per_position_acceptance"])
        )
        result["reference"] = ours
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if lossless else 1


if __name__ == "__main__":
    sys.exit(main())
