"""DSpark's training objective and the metrics that say how a drafter is doing.

Per draft slot (index j = 0..K-1 within the block), over slots whose target is a loss-masked
token:  loss = w_ce·CE(x_true) + w_l1·‖p_draft − p_target‖₁ + w_conf·BCE(c, c*),  each weighted
by exp(−j / decay). `p_target` is the frozen target's softmax at the same position; the L1 is
over the full target vocabulary, so target mass on tokens outside a reduced draft vocab counts
as distance (it can never be accepted). c* = 1 − ½‖p_draft − p_target‖₁ is the probability that
a token sampled from the draft is accepted by standard rejection sampling (detached).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .model import BlockOutputs


@dataclass
class LossWeights:
    ce: float = 0.1
    l1: float = 0.9
    confidence: float = 1.0
    decay: float = 4.0  # γ_decay of exp(−j/γ_decay); ≈4 suits blocks of 7–8


def draft_slot_index(block_size: int, slot_shift: int, device=None) -> torch.Tensor:
    """Draft index j of each slot (−1 for DFlash's anchor slot, which drafts nothing)."""
    return torch.arange(block_size, device=device) - (1 - slot_shift)


def position_weights(block_size: int, slot_shift: int, decay: float, device=None) -> torch.Tensor:
    j = draft_slot_index(block_size, slot_shift, device).float()
    return torch.where(j >= 0, torch.exp(-j.clamp(min=0) / decay), torch.zeros_like(j))


def target_draft_ids(target_ids: torch.Tensor, t2d: torch.Tensor | None) -> torch.Tensor:
    """Draft-vocab index of each target id, −1 where the token is outside the draft vocab."""
    if t2d is None:
        return target_ids
    index = torch.cumsum(t2d.long(), 0) - 1
    return torch.where(t2d[target_ids], index[target_ids], torch.full_like(target_ids, -1))


def target_probs_on_draft_vocab(
    target_logits: torch.Tensor, d2t_ids: torch.Tensor | None, log_norm: torch.Tensor | None = None
):
    """Target probabilities of the draft-vocab tokens and the mass outside the draft vocab.

    Normalised over the full target vocab, but only the draft columns are exponentiated. With
    `log_norm` (the full vocabulary's logsumexp per row), `target_logits` holds the draft
    columns only.
    """
    t = target_logits.float()
    if log_norm is not None:
        p = torch.exp(t - log_norm.float()[..., None])
        return p, (1.0 - p.sum(-1)).clamp(min=0.0)
    lse = torch.logsumexp(t, dim=-1, keepdim=True)
    if d2t_ids is None:
        return torch.exp(t - lse), torch.zeros(t.shape[:-1], device=t.device)
    p = torch.exp(t[..., d2t_ids] - lse)
    return p, (1.0 - p.sum(-1)).clamp(min=0.0)


def expected_calibration_error(pred: torch.Tensor, label: torch.Tensor, n_bins: int = 15) -> torch.Tensor:
    """ECE with equal-width bins; labels may be soft (probabilities) or hard (0/1)."""
    pred, label = pred.flatten().float(), label.flatten().float()
    if pred.numel() == 0:
        return torch.zeros((), device=pred.device)
    bins = torch.clamp((pred * n_bins).long(), max=n_bins - 1)
    count = torch.bincount(bins, minlength=n_bins).float()
    gap = torch.bincount(bins, weights=pred - label, minlength=n_bins)
    return gap.abs().sum() / count.sum()


def loss_counts(out: BlockOutputs, t2d: torch.Tensor | None = None) -> torch.Tensor:
    """This batch's divisors of `drafter_loss`'s terms, float64 `[2]`: slots with a target (the
    L1 and confidence terms) and those whose target is in the draft vocabulary (the CE term)."""
    ce_valid = out.valid & (target_draft_ids(out.target_ids, t2d) >= 0)
    return torch.stack([out.valid.sum(), ce_valid.sum()]).to(torch.float64)


def drafter_loss(
    out: BlockOutputs,
    block_size: int,
    slot_shift: int,
    weights: LossWeights,
    d2t_ids: torch.Tensor | None = None,
    t2d: torch.Tensor | None = None,
    denominators: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss and metrics for one batch of teacher-forced blocks.

    `d2t_ids` maps draft index → target id (None for a full-vocab drafter).
    `denominators`: what each term's weighted sum is divided by, in the order of `loss_counts`
    (slots with a target, slots whose target is in the draft vocabulary). None: this batch's own
    counts, the mean over its slots. A data-parallel rank passes the world's counts over the world
    size, so that the mean of the ranks' gradients (what DeepSpeed takes) is the gradient of the
    mean over every slot of the global batch, however the slots are spread over the ranks. The
    metrics stay this batch's own means either way.
    """
    valid = out.valid
    vf = valid.float()
    n_valid = vf.sum().clamp(min=1.0)
    pw = position_weights(block_size, slot_shift, weights.decay, valid.device)[None, :]
    logq = F.log_softmax(out.logits.float(), dim=-1)
    q = logq.exp()
    with torch.no_grad():
        p_draft_vocab, outside = target_probs_on_draft_vocab(out.target_logits, d2t_ids, out.target_log_norm)
        if out.target_index is not None:  # per distinct position → per slot (draft-vocab width only)
            p_draft_vocab, outside = p_draft_vocab[out.target_index], outside[out.target_index]
    l1 = (q - p_draft_vocab).abs().sum(-1) + outside  # [N, γ]

    tgt_d = target_draft_ids(out.target_ids, t2d)
    ce_valid = valid & (tgt_d >= 0)
    ce = -logq.gather(-1, tgt_d.clamp(min=0).unsqueeze(-1)).squeeze(-1)

    local = torch.stack([vf.sum(), ce_valid.float().sum()]).clamp(min=1.0)
    # A world's count is zero only where every rank's sum is zero too: any divisor but 0 will do.
    denom = (
        local if denominators is None else torch.where(denominators > 0, denominators.to(vf), torch.ones_like(local))
    )

    def weighted_sum(term: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return (term * pw * mask.float()).sum()

    ce_sum, l1_sum = weighted_sum(ce, ce_valid), weighted_sum(l1, valid)
    loss = weights.ce * ce_sum / denom[1] + weights.l1 * l1_sum / denom[0]
    c_star = (1.0 - 0.5 * l1).detach().clamp(0.0, 1.0)
    metrics: dict[str, float] = {"ce": float(ce_sum.detach() / local[1]), "l1": float(l1_sum.detach() / local[0])}
    local_loss = weights.ce * metrics["ce"] + weights.l1 * metrics["l1"]
    if out.confidence_logits is not None:
        bce = F.binary_cross_entropy_with_logits(out.confidence_logits.float(), c_star, reduction="none")
        bce_sum = weighted_sum(bce, valid)
        loss = loss + weights.confidence * bce_sum / denom[0]
        conf = torch.sigmoid(out.confidence_logits.detach().float())
        metrics["confidence_bce"] = float(bce_sum.detach() / local[0])
        local_loss += weights.confidence * metrics["confidence_bce"]
        metrics["confidence_ece"] = float(expected_calibration_error(conf[valid], c_star[valid]))
    metrics["loss"] = local_loss if denominators is not None else float(loss.detach())

    with torch.no_grad():
        j = draft_slot_index(block_size, slot_shift, valid.device)
        slots = j >= 0
        accept = c_star[:, slots] * vf[:, slots]
        greedy_hit = (out.logits.argmax(-1) == tgt_d).float()[:, slots] * vf[:, slots]
        per_slot_n = vf[:, slots].sum(0).clamp(min=1.0)
        for idx, (a, g) in enumerate(zip(accept.sum(0) / per_slot_n, greedy_hit.sum(0) / per_slot_n)):
            metrics[f"accept_pos{idx}"] = float(a)
            metrics[f"greedy_acc_pos{idx}"] = float(g)
        # Expected acceptance length: bonus token + survival probabilities, per fully valid block.
        full = vf[:, slots].prod(-1) > 0
        if bool(full.any()):
            metrics["expected_tau"] = float((1.0 + torch.cumprod(accept[full], -1).sum(-1)).mean())
            metrics["greedy_tau"] = float((1.0 + torch.cumprod(greedy_hit[full], -1).sum(-1)).mean())
        metrics["valid_slots"] = float(n_valid)
    return loss, metrics
