"""Reduced draft vocabulary: the N most frequent loss-masked tokens.

Saved as speculators/vLLM read it: `d2t[i]` is an offset (`target_id = i + d2t[i]`) over draft
indices sorted by target id, and `t2d` is a bool mask over the target vocabulary. A wrong or
missing mapping silently collapses acceptance in vLLM, so `check_mapping` validates both ways.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def token_frequencies(samples: Iterable[tuple[torch.Tensor, torch.Tensor]], vocab_size: int) -> torch.Tensor:
    """Counts `[V]` of tokens under the loss mask, from (token_ids, loss_mask) pairs."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in samples:
        sel = ids[mask.bool()].long()
        if sel.numel() and int(sel.max()) >= vocab_size:
            raise ValueError(f"token id {int(sel.max())} outside the target vocab ({vocab_size})")
        counts += torch.bincount(sel, minlength=vocab_size)
    return counts


def build_vocab_mapping(
    counts: torch.Tensor, draft_vocab_size: int, always: Iterable[int] = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) for the `draft_vocab_size` most frequent tokens.

    `always` (e.g. the end-of-turn token) is kept whatever its count. Ties and the remainder,
    when the data has fewer distinct tokens than requested, go to the lowest ids, so the
    mapping is deterministic.
    """
    v = counts.numel()
    if not 1 <= draft_vocab_size <= v:
        raise ValueError(f"draft_vocab_size must be in [1, {v}], got {draft_vocab_size}")
    score = counts.double().clone()
    forced = torch.tensor(sorted(set(always)), dtype=torch.long)
    if forced.numel():
        score[forced] = float("inf")
    # Stable sort by descending score keeps lower ids first among equals.
    order = torch.sort(-score, stable=True).indices[:draft_vocab_size]
    draft_ids = torch.sort(order).values
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[draft_ids] = True
    d2t = draft_ids - torch.arange(draft_vocab_size)
    return d2t, t2d


def check_mapping(d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    target = torch.arange(d2t.numel()) + d2t.cpu()
    if int(t2d.sum()) != d2t.numel():
        raise ValueError(f"t2d marks {int(t2d.sum())} tokens but d2t has {d2t.numel()}")
    if not bool(t2d.cpu()[target].all()) or not bool((target[1:] > target[:-1]).all()):
        raise ValueError("d2t does not map draft indices onto the tokens t2d marks, in increasing order")
