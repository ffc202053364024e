"""Small builders shared by tests (not fixtures, so tests can call them with parameters)."""

from __future__ import annotations

import torch

from dspark.config import DSparkConfig
from dspark.model import DSparkDrafter
from dspark.samples import PackedBatch
from dspark.vocab import build_vocab_mapping


def make_drafter(target_dir, seed: int = 0, **settings) -> DSparkDrafter:
    settings.setdefault("num_layers", 2)
    settings.setdefault("block_size", 4)
    settings.setdefault("markov_rank", 16)
    cfg = DSparkConfig.from_target(target_dir, **settings)
    torch.manual_seed(seed)
    model = DSparkDrafter(cfg)
    model.load_target_weights(target_dir)
    if model.use_draft_vocab:
        counts = torch.randint(0, 1000, (cfg.target_vocab_size,), generator=torch.Generator().manual_seed(seed))
        model.set_vocab_mapping(*build_vocab_mapping(counts, cfg.draft_vocab_size))
    with torch.no_grad():  # non-trivial heads so the oracle comparisons are not of zeros
        for name, p in model.named_parameters():
            if p.requires_grad and "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def random_batch(cfg: DSparkConfig, lengths=(40, 27), prompt_len: int = 8, seed: int = 0) -> PackedBatch:
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    ids = torch.randint(20, 5000, (t,), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    mask = pos >= prompt_len
    h = cfg.hidden_size
    aux = torch.randn(t, len(cfg.aux_layer_ids) * h, generator=g)
    last = torch.randn(t, h, generator=g)
    return PackedBatch(ids, pos, doc, mask, aux, last)
