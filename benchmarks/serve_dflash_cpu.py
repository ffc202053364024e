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
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def vllm_tau(target: str, drafter: str, prompts: list[list[int]], k: int, max_new: int) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    llm = LLM(model=target, dtype="float32", enforce_eager=True, max_model_len=2048, disable_log_stats=False,
              speculative_config={"model": drafter, "method": "dflash", "num_speculative_tokens": k})
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=max_new),
                        use_tqdm=False)
    dt = time.perf_counter() - t0
    counters = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode_num_"):
            counters[m.name] = getattr(m, "value", None) if not hasattr(m, "values") else m.values
    drafts = counters.get("vllm:spec_decode_num_drafts", 0)
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens", 0)
    per_pos = counters.get("vllm:spec_decode_num_accepted_tokens_per_pos")
    return {"tau": 1 + accepted / drafts if drafts else None, "drafts": drafts, "accepted": accepted,
            "per_position_acceptance": [a / drafts for a in per_pos] if per_pos and drafts else None,
            "outputs": [list(o.outputs[0].token_ids) for o in outs], "tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / dt}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from dspark import evaluate
    from dspark.checkpoint import export_dflash_backbone, load_drafter
    from dspark.prompts import read_conversations
    from dspark.targets import load_target, render_prompt

    work = Path(tempfile.mkdtemp(prefix="dspark-serve-"))
    backbone = export_dflash_backbone(load_drafter(args.drafter, args.target), work / "dflash")
    convs, _ = read_conversations(args.prompts)
    convs = convs[: args.limit]
    _, tok = load_target(args.target)
    prompts = [render_prompt(tok, c.prompt_messages) for c in convs]
    k = json.loads((backbone / "config.json").read_text())["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    ours_json = work / "ours.json"
    subset = work / "prompts.jsonl"
    subset.write_text("".join(json.dumps({"id": c.id, "messages": c.prompt_messages}) + "\n" for c in convs))
    evaluate.main(["--target", args.target, "--drafter", str(backbone), "--prompts", str(subset),
                   "--max-new-tokens", str(args.max_new_tokens), "--json", str(ours_json)])
    ours = json.loads(ours_json.read_text())
    theirs = vllm_tau(args.target, str(backbone), prompts, k, args.max_new_tokens)
    print(f"\nDSpark backbone served as vLLM `dflash` on CPU, greedy, k={k}, {len(prompts)} prompts x {args.max_new_tokens} tokens")
    print(f"{'':18} {'tau':>7}  per-position acceptance")
    for name, r in (("vLLM (CPU)", theirs), ("dspark.evaluate", ours)):
        pp = " ".join(f"{a:.2f}" for a in (r["per_position_acceptance"] or []))
        print(f"{name:18} {r['tau']:7.3f}  {pp}")
    result = {"vllm": {k2: v for k2, v in theirs.items() if k2 != "outputs"}, "ours": {k2: v for k2, v in ours.items() if k2 != "requests"}}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
