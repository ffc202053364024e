"""Where a trainer step's time goes, on the local job's drafter and data shapes, same run:

    python benchmarks/trainer_step.py [--samples 48] [--steps 12] [--threads 1,2]

Builds SmolLM2-135M samples (transformers, the target's own dtype on this CPU) of the default
prompt set's conversations, the drafter of `configs/local.yaml` (layers, block, Markov rank,
draft vocabulary, anchors, loss weights), a DeepSpeed engine (world of one, gloo, the job's
ZeRO stage and precision), and times full steps of `trainer.batch_tokens` tokens (forward,
loss, backward, optimizer step), with torch.profiler's totals for the labelled parts: the
frozen target's logits (the L1 term's label) and the drafter's forward. Each variant runs the
same batches:
- `full`: the target's full-vocabulary logits at every step (the first version);
- `cached`: every sample's target log-normaliser kept after its first step, so later steps
  (the sample's later epochs) compute the target's logits on the draft vocabulary only;
- `first`: every timed step a first-epoch step as the job's trainer takes it (normalisers
  cached, but of samples never seen): the target head by blocks of vocabulary rows
  (`DSparkDrafter.norm_chunk_columns`), the draft columns kept as each block passes;
- `first-one`: the same steps with the target head as one full-vocabulary product (the
  baseline of `first`).
Prints the CPU, then per variant and thread count: seconds per step, tokens/s, and the parts.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build(args):
    import torch

    from cluster.config_load import load_config
    from cluster.data import load_prompts
    from cluster.hardware import read_cpu
    from dspark.config import DSparkConfig
    from dspark.hf_dataset import build_samples
    from dspark.prompts import Conversation
    from dspark.samples import read_sample
    from dspark.targets import prepare_smollm2

    cfg = load_config(ROOT / "configs" / "local.yaml")
    target = prepare_smollm2()
    train, _ = load_prompts(cfg)
    texts = [m["content"] for c in train for m in c.prompt_messages]
    # Answers of the job's typical length (~120 tokens): other prompts' text stands in for the
    # target's own answer (timing depends on shapes, not words).
    convs = [
        Conversation(c.id, c.prompt_messages + [{"role": "assistant", "content": " ".join(texts[i + 1 : i + 6])}])
        for i, c in enumerate(train[: args.samples])
    ]
    dtype = getattr(torch, cfg.target.dtype)
    layer_ids = DSparkConfig.from_target(target, num_aux_layers=cfg.target.num_aux_layers).extract_layer_ids
    work = Path(args.work) / cfg.target.dtype
    paths = build_samples(target, convs, work, layer_ids, dtype=dtype)
    samples = [read_sample(p) for p in paths]
    return cfg, target, samples, read_cpu()


def run_variant(cfg, target, samples, variant: str, threads: int, steps: int) -> dict:
    import deepspeed
    import torch
    from torch.profiler import ProfilerActivity, profile

    from cluster.training import deepspeed_config, vocab_mapping_from
    from dspark.config import DSparkConfig
    from dspark.losses import LossWeights
    from dspark.model import DSparkDrafter
    from dspark.training import DrafterObjective, OptimConfig, build_optimizer, token_budget_batches

    torch.set_num_threads(threads)
    d, t = cfg.drafter, cfg.trainer
    dcfg = DSparkConfig.from_target(
        target,
        mode=d.mode,
        num_layers=d.num_layers,
        block_size=d.block_size,
        markov_rank=d.markov_rank,
        draft_vocab_size=d.draft_vocab_size,
        num_aux_layers=cfg.target.num_aux_layers,
    )
    torch.manual_seed(0)
    model = DSparkDrafter(dcfg)
    if variant == "first-one":
        model.norm_chunk_columns = 0
    model.load_target_weights(target)
    vocab = vocab_mapping_from(
        [(s.token_ids, s.loss_mask) for s in samples], dcfg.target_vocab_size, dcfg.draft_vocab_size, []
    )
    model.set_vocab_mapping(torch.tensor(vocab["d2t"]), torch.tensor(vocab["t2d"]))
    opt, sched = build_optimizer(model, OptimConfig(lr=t.lr, warmup_steps=t.warmup_steps, total_steps=1000))
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=opt, lr_scheduler=sched, config=deepspeed_config(t, 1)
    )
    objective = DrafterObjective(
        model,
        LossWeights(d.ce_weight, d.l1_weight, d.confidence_weight, d.decay),
        d.num_anchors,
        autocast_dtype=torch.bfloat16 if t.precision == "bf16-mixed" else None,
        cache_normalizers=variant != "full",
    )
    batches = list(token_budget_batches(samples, t.batch_tokens))
    dtype = torch.float32 if t.precision == "fp32" else torch.bfloat16
    keys = {id(s): f"s{i}" for i, s in enumerate(samples)}

    def step(i: int, timed: bool = False) -> None:
        group = batches[i % len(batches)]
        # `first*`: keys no earlier step saw, so every position's normaliser is computed again
        fresh = f"/{i}" if timed and variant.startswith("first") else ""
        batch = objective.pack(group, dtype=dtype, keys=[keys[id(s)] + fresh for s in group])
        loss, _ = objective(batch, module=engine)
        engine.backward(loss)
        engine.step()

    for i in range(len(batches)):  # every sample seen once: its first epoch
        step(i)
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(steps):
            step(i, timed=True)
    dt = (time.perf_counter() - t0) / steps
    parts = {e.key: e.cpu_time_total / 1e6 / steps for e in prof.key_averages() if e.key.startswith("dspark.")}
    tokens = sum(sum(s.num_tokens for s in batches[i % len(batches)]) for i in range(steps)) / steps
    return {"variant": variant, "threads": threads, "step_s": dt, "tokens_per_s": tokens / dt, **parts}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--variants", default="full,cached,first-one,first")
    ap.add_argument("--work", default=str(ROOT / "outputs" / "bench_trainer_step"))
    args = ap.parse_args()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    cfg, target, samples, cpu = build(args)
    print(
        f"CPU: {cpu.model}, {cpu.cores} cores, native bf16: {cpu.native_bf16}; flags: "
        f"{' '.join(sorted(f for f in cpu.flags if f.startswith(('avx', 'amx'))))}"
    )
    print(
        f"drafter: {cfg.drafter.num_layers} layer(s), block {cfg.drafter.block_size}, draft vocab "
        f"{cfg.drafter.draft_vocab_size}, {cfg.drafter.num_anchors} anchors/sample; batch {cfg.trainer.batch_tokens} "
        f"tokens; precision {cfg.trainer.precision}, target {cfg.target.dtype}; {len(samples)} samples"
    )
    rows = [
        run_variant(cfg, target, samples, v, int(n), args.steps)
        for n in args.threads.split(",")
        for v in args.variants.split(",")
    ]
    labels = sorted({k for r in rows for k in r if k.startswith("dspark.")})
    print(f"\n{'variant':9} {'threads':>7} {'s/step':>7} {'tok/s':>7} " + " ".join(f"{k[7:]:>15}" for k in labels))
    for r in rows:
        print(
            f"{r['variant']:9} {r['threads']:7d} {r['step_s']:7.3f} {r['tokens_per_s']:7.0f} "
            + " ".join(f"{r.get(k, 0.0):14.3f}s" for k in labels)
        )


if __name__ == "__main__":
    main()
