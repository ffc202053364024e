"""Train a drafter from a folder of hidden-state dumps (one safetensors file per sample).

    python -m dspark.train_offline --target TARGET_DIR --data DUMP_DIR --out OUT_DIR [options]

For users who already have dumps. Held-out samples (a deterministic hash split of the file
names) calibrate the confidence head at the end. Checkpoints go to OUT/checkpoints/step-N/
{drafter,trainer}; the final drafter to OUT/final. Re-running with `--resume` (or on an OUT
that has checkpoints) continues from the newest checkpoint, mid-epoch.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .checkpoint import load_drafter, load_state, save_drafter, save_state
from .config import DSparkConfig
from .losses import LossWeights
from .model import DSparkDrafter
from .prompts import is_heldout
from .samples import CorruptSampleError, read_sample
from .training import DrafterObjective, OptimConfig, build_optimizer, calibrate_confidence, token_budget_batches
from .vocab import build_vocab_mapping, token_frequencies

log = logging.getLogger("dspark.train_offline")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="HF checkpoint dir of the target model")
    p.add_argument("--data", required=True, help="folder of per-sample .safetensors files")
    p.add_argument("--out", required=True)
    p.add_argument("--mode", choices=["dspark", "dflash"], default="dspark")
    p.add_argument("--num-layers", type=int, default=1)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--aux-layer-ids", type=lambda s: [int(x) for x in s.split(",")], default=None)
    p.add_argument("--markov-rank", type=int, default=256)
    p.add_argument("--markov-head-type", choices=["vanilla", "gated", "rnn"], default="vanilla")
    p.add_argument("--draft-vocab-size", type=int, default=None)
    p.add_argument(
        "--init",
        choices=["random", "target_layers"],
        default="random",
        help="target_layers: start the draft layers from the target's last layers",
    )
    p.add_argument("--epochs", type=float, default=1.0, help="passes over the training split")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    p.add_argument("--batch-tokens", type=int, default=4096)
    p.add_argument("--num-anchors", type=int, default=64, help="blocks per sample per step")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup-steps", type=int, default=30)
    p.add_argument("--ce-weight", type=float, default=0.1)
    p.add_argument("--l1-weight", type=float, default=0.9)
    p.add_argument("--confidence-weight", type=float, default=1.0)
    p.add_argument("--decay", type=float, default=4.0)
    p.add_argument("--heldout-fraction", type=float, default=0.05)
    p.add_argument("--checkpoint-every", type=int, default=200)
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    p.add_argument(
        "--stop-at-step",
        type=int,
        default=None,
        help="exit after checkpointing at this step, as if interrupted (the schedule still spans --max-steps)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast for the drafter (target logits stay fp32)")
    return p.parse_args(argv)


def list_samples(data_dir: Path, heldout_fraction: float, seed: int) -> tuple[list[Path], list[Path]]:
    files = sorted(data_dir.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"no .safetensors samples in {data_dir}")
    held = [f for f in files if is_heldout(f.stem, heldout_fraction, seed, purpose="calibration")]
    train = [f for f in files if not is_heldout(f.stem, heldout_fraction, seed, purpose="calibration")]
    return train, held


def read_tokens(path: Path) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Token ids and loss mask only (cheap); None for an unreadable file, which the sample
    reader reports when training reaches it."""
    try:
        with safe_open(str(path), framework="pt") as f:
            ids = f.get_tensor("token_ids")
            mask = f.get_tensor("loss_mask") if "loss_mask" in f.keys() else torch.ones_like(ids, dtype=torch.bool)
    except (SafetensorError, OSError):
        return None
    return ids, mask


class SampleReader:
    """Reads samples, setting corrupt ones aside with their reason (reported, never silent)."""

    def __init__(self, layer_ids: list[int]) -> None:
        self.layer_ids, self.corrupt = layer_ids, {}

    def __call__(self, paths, start: int = 0):
        """Yields (position, sample) so a trainer can record exactly which files it consumed."""
        for i, path in enumerate(paths[start:], start=start):
            try:
                yield i, read_sample(path, self.layer_ids)
            except CorruptSampleError as e:
                if str(path) not in self.corrupt:
                    log.warning("skipping corrupt sample: %s", e)
                self.corrupt[str(path)] = str(e)


def latest_checkpoint(out: Path) -> Path | None:
    steps = sorted((out / "checkpoints").glob("step-*[0-9]"), key=lambda p: int(p.name.split("-")[1]))
    steps = [s for s in steps if (s / "drafter").exists() and (s / "trainer").exists()]
    return steps[-1] if steps else None


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    out, data = Path(args.out), Path(args.data)
    out.mkdir(parents=True, exist_ok=True)
    train_files, held_files = list_samples(data, args.heldout_fraction, args.seed)
    log.info("%d training samples, %d held out", len(train_files), len(held_files))

    resume_from = latest_checkpoint(out) if args.resume or (out / "checkpoints").exists() else None
    if resume_from is not None:
        model = load_drafter(resume_from / "drafter", args.target)
        state = load_state(resume_from / "trainer")
        log.info("resuming from %s (step %d)", resume_from, state["step"])
    else:
        cfg = DSparkConfig.from_target(
            args.target,
            mode=args.mode,
            num_layers=args.num_layers,
            block_size=args.block_size,
            aux_layer_ids=args.aux_layer_ids,
            markov_rank=args.markov_rank if args.mode == "dspark" else 0,
            markov_head_type=args.markov_head_type,
            draft_vocab_size=args.draft_vocab_size,
        )
        torch.manual_seed(args.seed)
        model = DSparkDrafter(cfg)
        model.load_target_weights(args.target)
        if args.init == "target_layers":
            model.init_from_target_layers(args.target)
        if model.use_draft_vocab:
            counts = token_frequencies(
                (t for t in map(read_tokens, train_files) if t is not None), cfg.target_vocab_size
            )
            from transformers import AutoTokenizer

            eos = AutoTokenizer.from_pretrained(args.target).eos_token_id
            model.set_vocab_mapping(*build_vocab_mapping(counts, cfg.draft_vocab_size, always=[eos]))
        state = None
    cfg = model.config
    reader = SampleReader(cfg.extract_layer_ids)
    total_tokens = sum(int(t[0].numel()) for t in map(read_tokens, train_files) if t is not None)
    steps_per_epoch = max(1, round(total_tokens / args.batch_tokens))
    total_steps = args.max_steps or max(1, int(steps_per_epoch * args.epochs))
    optim_cfg = OptimConfig(
        lr=args.lr, warmup_steps=min(args.warmup_steps, total_steps // 5 + 1), total_steps=total_steps
    )
    opt, sched = build_optimizer(model, optim_cfg)
    objective = DrafterObjective(
        model,
        LossWeights(args.ce_weight, args.l1_weight, args.confidence_weight, args.decay),
        args.num_anchors,
        args.seed,
        autocast_dtype=torch.bfloat16 if args.bf16 else None,
    )
    step, epoch, consumed = 0, 0, 0
    if state is not None:
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        step, epoch, consumed = state["step"], state["epoch"], state["consumed"]
        objective.generator.set_state(state["anchor_rng"])
    metrics_file = open(out / "metrics.jsonl", "a")

    def checkpoint(tag: str) -> None:
        base = out / "checkpoints" / tag
        save_drafter(model, base / "drafter")
        save_state(
            base / "trainer",
            {
                "step": step,
                "epoch": epoch,
                "consumed": consumed,
                "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(),
                "anchor_rng": objective.generator.get_state(),
            },
        )

    model.train()
    t0, tokens_seen = time.time(), 0
    while step < total_steps:
        order = list(train_files)
        random.Random(args.seed + epoch).shuffle(order)  # epoch order is a function of the seed
        for items in token_budget_batches(reader(order, consumed), args.batch_tokens, size=lambda it: it[1].num_tokens):
            batch = objective.pack([s for _, s in items])
            loss, metrics = objective(batch)
            consumed = items[-1][0] + 1
            if loss is None:
                continue
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(
                [p for p in model.parameters() if p.requires_grad], optim_cfg.grad_clip
            )
            opt.step()
            sched.step()
            step += 1
            tokens_seen += batch.num_tokens
            metrics.update(step=step, epoch=epoch, lr=sched.get_last_lr()[0], grad_norm=float(grad_norm))
            metrics_file.write(json.dumps(metrics) + "\n")
            if step % 10 == 0 or step == total_steps:
                rate = tokens_seen / max(1e-9, time.time() - t0)
                log.info(
                    "step %d/%d loss %.4f l1 %.3f expected_tau %.3f greedy_tau %.3f %.0f tok/s",
                    step,
                    total_steps,
                    metrics["loss"],
                    metrics["l1"],
                    metrics.get("expected_tau", 0),
                    metrics.get("greedy_tau", 0),
                    rate,
                )
            if step % args.checkpoint_every == 0 or step == args.stop_at_step:
                checkpoint(f"step-{step:06d}")
            if step == args.stop_at_step:
                log.info("stopping at step %d as asked (resume with --resume)", step)
                return 0
            if step >= total_steps:
                break
        else:
            epoch, consumed = epoch + 1, 0
            continue
        break
    metrics_file.close()

    held = [s for _, s in reader(held_files)]
    report = (
        calibrate_confidence(
            model,
            [objective.pack(b) for b in token_budget_batches(held, args.batch_tokens)],
            args.num_anchors,
            args.seed,
        )
        if held
        else {}
    )
    if report:
        log.info(
            "confidence calibration: temperatures %s, ECE %s -> %s",
            [round(t, 2) for t in report["temperatures"]],
            [round(e, 3) for e in report["fit_ece_before"]],
            [round(e, 3) for e in report["fit_ece_after"]],
        )
    save_drafter(model, out / "final")
    summary = {
        "steps": step,
        "train_samples": len(train_files),
        "heldout_samples": len(held_files),
        "corrupt_samples": reader.corrupt,
        "calibration": report,
        "final": str(out / "final"),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    if reader.corrupt:
        log.warning("%d corrupt samples were skipped (listed in summary.json)", len(reader.corrupt))
    log.info("final drafter: %s", out / "final")
    return 0


if __name__ == "__main__":
    sys.exit(main())
