"""Where training blocks start.

An anchor p is eligible when the first token its block predicts (p + 1) is a loss-masked
(assistant) token and the whole block's targets lie inside the same sample, so every block
trained has all its slots. Up to `num_anchors` distinct anchors are drawn uniformly per sample
and all of a batch's blocks run in one forward pass.
"""

from __future__ import annotations

import torch


def eligible_anchors(loss_mask: torch.Tensor, doc_ids: torch.Tensor, block_size: int, slot_shift: int) -> torch.Tensor:
    """Bool `[T]`: packed positions that may start a block."""
    t = loss_mask.shape[0]
    last_offset = block_size - 1 + slot_shift  # offset of the last predicted token
    ok = torch.zeros(t, dtype=torch.bool, device=loss_mask.device)
    if t <= last_offset:
        return ok
    n = t - last_offset
    same_doc = doc_ids[:n] == doc_ids[last_offset:]
    ok[:n] = loss_mask[1 : n + 1].bool() & same_doc
    return ok


def sample_anchors(
    loss_mask: torch.Tensor,
    doc_ids: torch.Tensor,
    block_size: int,
    num_anchors: int,
    slot_shift: int = 1,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Sorted packed positions, at most `num_anchors` per sample, drawn uniformly without replacement."""
    ok = eligible_anchors(loss_mask, doc_ids, block_size, slot_shift)
    chosen = []
    for d in torch.unique(doc_ids):
        cand = torch.nonzero(ok & (doc_ids == d)).squeeze(-1)
        if cand.numel() > num_anchors:
            perm = torch.randperm(cand.numel(), generator=generator, device="cpu")[:num_anchors]
            cand = cand[perm.to(cand.device)]
        chosen.append(cand)
    if not chosen:
        return torch.zeros(0, dtype=torch.long, device=loss_mask.device)
    return torch.sort(torch.cat(chosen)).values
