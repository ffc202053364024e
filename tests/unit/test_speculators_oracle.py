"""Our drafter against the reference implementation (speculators 0.9.0) as an oracle: a
checkpoint saved by either side loads in the other and gives the same logits, Markov bias and
confidence on the same inputs and anchors."""

from __future__ import annotations

import pytest
import torch

from dspark.checkpoint import load_drafter, save_drafter
from tests.helpers import make_drafter, random_batch, reference_outputs

speculators = pytest.importorskip("speculators")
from speculators.model import SpeculatorModel  # noqa: E402

CASES = {
    "vanilla": dict(),
    "gated": dict(markov_head_type="gated"),
    "rnn": dict(markov_head_type="rnn"),
    "reduced_vocab": dict(draft_vocab_size=3000),
    "sliding_causal": dict(
        layer_types=["sliding_attention", "full_attention"], sliding_window=6, sliding_window_non_causal=False
    ),
    "sliding_noncausal": dict(
        layer_types=["sliding_attention", "full_attention"], sliding_window=6, sliding_window_non_causal=True
    ),
    "dflash": dict(mode="dflash"),
}


@pytest.mark.parametrize("case", CASES)
def test_our_checkpoint_in_speculators(case, tiny_target, tmp_path, monkeypatch):
    ours = make_drafter(tiny_target, **CASES[case])
    save_drafter(ours, tmp_path / "ckpt")
    sm = SpeculatorModel.from_pretrained(str(tmp_path / "ckpt")).eval()
    assert type(sm).__name__ == ("DFlashDraftModel" if case == "dflash" else "DSparkDraftModel")
    batch = random_batch(ours.config)
    anchors = ours.sample_anchors(batch, 5, torch.Generator().manual_seed(0))
    out = ours(batch, anchors)
    hidden, logits, targets, conf = reference_outputs(sm, batch, anchors, monkeypatch)
    torch.testing.assert_close(out.hidden, hidden, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.logits, logits, atol=1e-4, rtol=1e-4)
    tl = out.slot_target_logits()
    tl = tl[..., ours.draft_to_target_ids()] if ours.use_draft_vocab else tl
    if not ours.config.sample_from_anchor:  # speculators rolls targets for DFlash; slot 0 is unused there
        tl, targets = tl[:, 1:], targets[:, 1:]
    torch.testing.assert_close(tl, targets, atol=1e-4, rtol=1e-4)
    if ours.confidence_head is not None:
        torch.testing.assert_close(out.confidence_logits, conf, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["vanilla", "reduced_vocab", "rnn"])
def test_speculators_checkpoint_in_ours(case, tiny_target, tmp_path, monkeypatch):
    from speculators.models.dspark import DSparkDraftModel
    from transformers import Qwen3Config

    template = make_drafter(tiny_target, **CASES[case]).config
    t2d = d2t = None
    if template.draft_vocab_size != template.target_vocab_size:
        from dspark.vocab import build_vocab_mapping

        d2t, t2d = build_vocab_mapping(torch.arange(template.target_vocab_size) % 97, template.draft_vocab_size)
    torch.manual_seed(3)
    sm = DSparkDraftModel.from_training_args(
        Qwen3Config(**template.transformer_layer_config()),
        t2d=t2d,
        d2t=d2t,
        verifier_name_or_path=str(tiny_target),
        draft_vocab_size=template.draft_vocab_size,
        target_layer_ids=template.aux_layer_ids,
        mask_token_id=template.mask_token_id,
        block_size=template.block_size,
        markov_rank=template.markov_rank,
        markov_head_type=template.markov_head_type,
    )
    with torch.no_grad():
        for _name, p in sm.named_parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    sm.save_pretrained(str(tmp_path / "spec"))
    ours = load_drafter(tmp_path / "spec", tiny_target).eval()
    assert ours.config.sample_from_anchor and ours.config.markov_rank == template.markov_rank
    batch = random_batch(ours.config, seed=1)
    anchors = ours.sample_anchors(batch, 6, torch.Generator().manual_seed(1))
    out = ours(batch, anchors)
    _, logits, _, conf = reference_outputs(sm.eval(), batch, anchors, monkeypatch)
    torch.testing.assert_close(out.logits, logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.confidence_logits, conf, atol=1e-5, rtol=1e-5)
