"""Pieces every trainer shares (the offline trainer here, the DeepSpeed ranks in `cluster/`):
optimizer groups, warmup + cosine schedule, token-budget batching, the loss step, and the
post-training confidence calibration."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from .calibration import sequential_temperature_scaling, survival_ece
from .losses import LossWeights, draft_slot_index, drafter_loss, loss_counts, target_probs_on_draft_vocab
from .model import DSparkDrafter
from .samples import PackedBatch, Sample, pack


@dataclass
class OptimConfig:
    lr: float = 6e-4
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.95
    warmup_steps: int = 50
    total_steps: int = 1000
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0


class WarmupCosine:
    """The LR multiplier at a step: linear warmup to 1, then cosine down to `min_lr_ratio` at
    `total_steps`. An object rather than a lambda so that the horizon can move while training
    (a job that learns its length as it runs: `cluster.training.budget`); LambdaLR saves its fields with
    the scheduler's state."""

    def __init__(self, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> None:
        self.warmup_steps, self.total_steps, self.min_lr_ratio = warmup_steps, total_steps, min_lr_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Trainable parameters; norms, biases and embeddings-like lookups get no weight decay."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "norm" in name or "markov_w1" in name else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig):
    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, WarmupCosine(cfg.warmup_steps, cfg.total_steps, cfg.min_lr_ratio))
    return opt, sched


def token_budget_batches(items: Iterable, max_tokens: int, size=lambda s: s.num_tokens) -> Iterator[list]:
    """Consecutive groups of items whose total `size` (tokens) stays within `max_tokens`
    (a longer item forms its own batch)."""
    batch: list = []
    total = 0
    for s in items:
        if batch and total + size(s) > max_tokens:
            yield batch
            batch, total = [], 0
        batch.append(s)
        total += size(s)
    if batch:
        yield batch


class DrafterObjective:
    """Anchor sampling + forward + loss for one packed batch.

    `cache_normalizers` (a reduced draft vocabulary only): the L1 term's label is the target's
    distribution over its full vocabulary, whose normaliser (a logsumexp over every logit) needs
    the target head's full product — the most expensive one in a step. It depends only on the
    sample, and a sample is trained again in later epochs, so the normaliser of every position
    computed once is kept per sample key (at most `max_cached_samples`, oldest dropped); later
    steps then compute the target's logits on the draft vocabulary alone. The loss is the same.
    """

    def __init__(
        self,
        model: DSparkDrafter,
        weights: LossWeights,
        num_anchors: int,
        seed: int = 0,
        autocast_dtype: torch.dtype | None = None,
        cache_normalizers: bool = False,
        max_cached_samples: int = 200_000,
    ) -> None:
        self.model, self.weights, self.num_anchors = model, weights, num_anchors
        self.autocast_dtype = autocast_dtype
        self.generator = torch.Generator().manual_seed(seed)
        cfg = model.config
        self.aux_ids, self.last_id = cfg.aux_layer_ids, cfg.target_num_layers
        self.normalizers: OrderedDict[str, torch.Tensor] | None = (
            OrderedDict() if cache_normalizers and model.use_draft_vocab else None
        )
        self.max_cached_samples = max_cached_samples

    def pack(self, samples: list[Sample], device=None, dtype=None, keys: list[str] | None = None) -> PackedBatch:
        """`keys`: one per sample, what identifies it across epochs (its store key)."""
        batch = pack(samples, self.aux_ids, self.last_id)
        if self.normalizers is not None and keys is not None:
            batch.target_log_norm = torch.cat(
                [self.normalizers.get(k, torch.full((s.num_tokens,), float("nan"))) for k, s in zip(keys, samples)]
            )
            batch.sample_keys = list(keys)
        return batch.to(device, dtype)

    def __call__(self, batch: PackedBatch, module=None, share_counts=None):
        """Loss and metrics; `module` is what to call (a DeepSpeed engine wraps the model).

        `share_counts` (data-parallel training): a collective that takes this batch's
        `loss_counts` and returns the divisors of the loss terms for this rank (the world's
        counts over the world size, see `drafter_loss`). It is called once, after the forward
        (under ZeRO-3 the forward's own collectives come first on every rank), unless this batch
        has no block to train: then nothing runs and (None, {}) is returned, and the caller must
        still take part in the world's collectives in that order."""
        m = self.model
        anchors = m.sample_anchors(batch, self.num_anchors, self.generator)
        if anchors.numel() == 0:
            return None, {}
        dev = batch.input_ids.device.type
        with (
            torch.autocast(dev, dtype=self.autocast_dtype or torch.float32, enabled=self.autocast_dtype is not None),
            record_function("dspark.drafter_forward"),
        ):
            out = (module or m)(batch, anchors)
        if batch.sample_keys is not None and out.target_log_norm is not None:
            self._remember(batch, out.target_positions, out.target_log_norm)
        d2t_ids = m.draft_to_target_ids() if m.use_draft_vocab else None
        denominators = share_counts(loss_counts(out, m.t2d)) if share_counts is not None else None
        with record_function("dspark.loss"):
            return drafter_loss(
                out, m.config.block_size, m.config.slot_shift, self.weights, d2t_ids, m.t2d, denominators
            )

    @torch.no_grad()
    def _remember(self, batch: PackedBatch, positions: torch.Tensor, log_norm: torch.Tensor) -> None:
        docs, offsets = batch.doc_ids[positions].cpu(), batch.position_ids[positions].cpu()
        sizes = torch.bincount(batch.doc_ids.cpu(), minlength=len(batch.sample_keys)).tolist()
        for d, key in enumerate(batch.sample_keys):
            here = docs == d
            if not bool(here.any()):
                continue
            row = self.normalizers.pop(key, None)
            if row is None:
                row = torch.full((sizes[d],), float("nan"))
            row[offsets[here]] = log_norm[here.to(log_norm.device)].float().cpu()
            self.normalizers[key] = row  # newest last
        while len(self.normalizers) > self.max_cached_samples:
            self.normalizers.popitem(last=False)


@torch.no_grad()
def confidence_data(model: DSparkDrafter, batches: Iterable[PackedBatch], num_anchors: int, seed: int = 0):
    """The confidence head's logits `[M, K]`, the analytic acceptance of each draft slot (the
    labels) and which slots are valid, over the blocks of `batches`; None without a block."""
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    slots = draft_slot_index(cfg.block_size, cfg.slot_shift) >= 0
    logits, labels, valid = [], [], []
    was_training = model.training
    model.eval()
    d2t_ids = model.draft_to_target_ids() if model.use_draft_vocab else None
    for batch in batches:
        anchors = model.sample_anchors(batch, num_anchors, gen)
        if anchors.numel() == 0:
            continue
        out = model(batch, anchors)
        q = torch.softmax(out.logits.float(), -1)
        p, _ = target_probs_on_draft_vocab(out.target_logits, d2t_ids, out.target_log_norm)
        if out.target_index is not None:
            p = p[out.target_index]
        accept = torch.minimum(q, p).sum(-1)  # = c* = 1 − ½‖q − p‖₁ over the full target vocab
        logits.append(out.confidence_logits[:, slots].float())
        labels.append(accept[:, slots])
        valid.append(out.valid[:, slots])
    model.train(was_training)
    return (torch.cat(logits), torch.cat(labels), torch.cat(valid)) if logits else None


def calibrate_confidence(
    model: DSparkDrafter,
    batches: Iterable[PackedBatch],
    num_anchors: int,
    seed: int = 0,
    measure_on: Iterable[PackedBatch] = (),
) -> dict:
    """Fit per-slot confidence temperatures on held-out blocks (`batches`) and store them in the
    config; with `measure_on` (other held-out blocks: the evaluation split), the calibration
    error there before and after (`ece_before`/`ece_after`; on the fitted blocks themselves:
    `fit_ece_before`/`fit_ece_after`)."""
    if model.confidence_head is None:
        return {}
    fit = confidence_data(model, batches, num_anchors, seed)
    if fit is None:
        return {}
    temps, before, after = sequential_temperature_scaling(*fit)
    model.config.confidence_temperatures = temps
    report = {
        "temperatures": temps,
        "fit_blocks": int(fit[0].shape[0]),
        "fit_ece_before": before,
        "fit_ece_after": after,
    }
    measured = confidence_data(model, measure_on, num_anchors, seed)
    if measured is not None:
        report.update(
            measured_blocks=int(measured[0].shape[0]),
            ece_before=survival_ece(*measured),
            ece_after=survival_ece(*measured, temperatures=temps),
        )
    return report
