"""The loss against a slot-by-slot re-computation written independently with plain loops."""

from __future__ import annotations

import math

import pytest
import torch

from dspark.losses import LossWeights, drafter_loss, expected_calibration_error, loss_counts, position_weights
from dspark.model import BlockOutputs


def naive_loss(out: BlockOutputs, shift: int, w: LossWeights, d2t_ids):
    n, g, _ = out.logits.shape
    terms = {"ce": [0.0, 0], "l1": [0.0, 0], "bce": [0.0, 0]}
    draft_targets = d2t_ids.tolist() if d2t_ids is not None else None
    for b in range(n):
        for k in range(g):
            if not out.valid[b, k]:
                continue
            j = k - (1 - shift)
            weight = math.exp(-j / w.decay)
            q = torch.softmax(out.logits[b, k].double(), -1)
            p = torch.softmax(out.target_logits[b, k].double(), -1)
            true = int(out.target_ids[b, k])
            if draft_targets is None:
                l1 = float((q - p).abs().sum())
                di = true
            else:
                full_q = torch.zeros_like(p)
                full_q[d2t_ids] = q
                l1 = float((full_q - p).abs().sum())
                di = draft_targets.index(true) if true in draft_targets else None
            if di is not None:
                terms["ce"][0] += weight * -math.log(float(q[di]))
                terms["ce"][1] += 1
            terms["l1"][0] += weight * l1
            terms["l1"][1] += 1
            c_star = 1 - 0.5 * l1
            c = 1 / (1 + math.exp(-float(out.confidence_logits[b, k])))
            terms["bce"][0] += weight * -(c_star * math.log(c) + (1 - c_star) * math.log(1 - c))
            terms["bce"][1] += 1
    mean = {k: s / max(cnt, 1) for k, (s, cnt) in terms.items()}
    return w.ce * mean["ce"] + w.l1 * mean["l1"] + w.confidence * mean["bce"], mean


def random_outputs(n=5, g=4, vd=50, v=80, seed=0, reduced=False):
    gen = torch.Generator().manual_seed(seed)
    valid = torch.rand(n, g, generator=gen) > 0.2
    ids = torch.randint(0, v, (n, g), generator=gen)
    return BlockOutputs(
        logits=torch.randn(n, g, vd if reduced else v, generator=gen) * 2,
        confidence_logits=torch.randn(n, g, generator=gen),
        target_logits=torch.randn(n, g, v, generator=gen) * 2,
        target_ids=ids,
        valid=valid,
        hidden=torch.zeros(n, g, 3),
    )


@pytest.mark.parametrize("shift", [1, 0])
@pytest.mark.parametrize("reduced", [False, True])
def test_loss_matches_naive(shift, reduced):
    out = random_outputs(reduced=reduced, seed=shift + 2 * reduced)
    if shift == 0:
        out.valid[:, 0] = False
    w = LossWeights(ce=0.1, l1=0.9, confidence=1.0, decay=4.0)
    d2t_ids = t2d = None
    if reduced:
        d2t_ids = torch.sort(torch.randperm(80, generator=torch.Generator().manual_seed(5))[:50]).values
        t2d = torch.zeros(80, dtype=torch.bool)
        t2d[d2t_ids] = True
    loss, metrics = drafter_loss(out, 4, shift, w, d2t_ids, t2d)
    ref, parts = naive_loss(out, shift, w, d2t_ids)
    assert float(loss) == pytest.approx(ref, rel=1e-5)
    assert metrics["l1"] == pytest.approx(parts["l1"], rel=1e-5)


def rows_of(out: BlockOutputs, rows: slice) -> BlockOutputs:
    return BlockOutputs(
        logits=out.logits[rows],
        confidence_logits=out.confidence_logits[rows],
        target_logits=out.target_logits[rows],
        target_ids=out.target_ids[rows],
        valid=out.valid[rows],
        hidden=out.hidden[rows],
    )


def test_ranks_with_world_denominators_average_to_the_whole_batch_loss():
    """Data parallelism: blocks split 2 : 9 over two ranks; each rank divides by the world's
    counts over the world size, and the mean of the two losses (what averaging their gradients
    differentiates) is the loss of all the blocks as one batch, by the naive loops. Each rank's
    own mean, as the ranks took before, is not."""
    out = random_outputs(n=11, seed=3, reduced=True)
    d2t_ids = torch.sort(torch.randperm(80, generator=torch.Generator().manual_seed(5))[:50]).values
    t2d = torch.zeros(80, dtype=torch.bool)
    t2d[d2t_ids] = True
    w = LossWeights(ce=0.1, l1=0.9, confidence=1.0, decay=4.0)
    ranks = [rows_of(out, slice(0, 2)), rows_of(out, slice(2, 11))]
    world = sum(loss_counts(r, t2d) for r in ranks)
    assert world.tolist() == loss_counts(out, t2d).tolist()
    shared = [drafter_loss(r, 4, 1, w, d2t_ids, t2d, world / len(ranks)) for r in ranks]
    own = [drafter_loss(r, 4, 1, w, d2t_ids, t2d) for r in ranks]
    whole, _ = naive_loss(out, 1, w, d2t_ids)
    assert float(sum(loss for loss, _ in shared) / len(ranks)) == pytest.approx(whole, rel=1e-5)
    assert float(sum(loss for loss, _ in own) / len(ranks)) != pytest.approx(whole, rel=1e-2)
    # the metrics stay each rank's own means
    assert shared[0][1]["loss"] == pytest.approx(own[0][1]["loss"], rel=1e-6)


def test_position_weights_closed_form():
    assert position_weights(4, 1, 4.0).tolist() == pytest.approx([1, math.exp(-0.25), math.exp(-0.5), math.exp(-0.75)])
    assert position_weights(4, 0, 2.0).tolist() == pytest.approx([0, 1, math.exp(-0.5), math.exp(-1.0)])


def test_c_star_is_rejection_sampling_acceptance():
    """1 − ½‖q − p‖₁ equals Σ min(p, q), the acceptance probability of standard verification."""
    out = random_outputs(n=1, g=1, seed=9)
    out.valid[:] = True
    q = torch.softmax(out.logits[0, 0], -1)
    p = torch.softmax(out.target_logits[0, 0], -1)
    _, m = drafter_loss(out, 1, 1, LossWeights())
    assert m["accept_pos0"] == pytest.approx(float(torch.minimum(p, q).sum()), rel=1e-5)


def test_loss_gradients_reach_trainable_heads():
    out = random_outputs(seed=4)
    out.logits.requires_grad_(True)
    out.confidence_logits.requires_grad_(True)
    loss, _ = drafter_loss(out, 4, 1, LossWeights())
    loss.backward()
    assert out.logits.grad.abs().sum() > 0 and out.confidence_logits.grad.abs().sum() > 0


def test_expected_calibration_error():
    pred = torch.tensor([0.1, 0.1, 0.9, 0.9])
    assert float(expected_calibration_error(pred, torch.tensor([0.1, 0.1, 0.9, 0.9]))) == pytest.approx(0.0)
    # Two bins, each off by 0.4 → ECE 0.4
    assert float(expected_calibration_error(pred, torch.tensor([0.5, 0.5, 0.5, 0.5]))) == pytest.approx(0.4)


def test_cached_target_normalizers_give_the_same_loss(tiny_target, monkeypatch):
    """Steps that reuse the target log-normalisers of earlier steps on the same samples give the
    loss that computing the full-vocabulary target head again gives, and run that head only for
    positions no earlier step covered; the kept normalisers are the target's own."""
    from dataclasses import replace

    from dspark.training import DrafterObjective
    from tests.helpers import make_drafter, random_batch

    drafter = make_drafter(tiny_target, draft_vocab_size=3000)
    batch = random_batch(drafter.config, lengths=(60, 45))
    keys, sizes = ["a", "b"], [60, 45]
    plain = DrafterObjective(drafter, LossWeights(), 6, seed=3)  # same seed: the same anchors each step
    cached = DrafterObjective(drafter, LossWeights(), 6, seed=3, cache_normalizers=True)
    full_rows = []
    real = drafter.verifier_logits
    real_with_norm = drafter.verifier_draft_logits_and_norm

    def counting(h, draft_columns=False):
        full_rows.append(0 if draft_columns else h.shape[0])
        return real(h, draft_columns)

    def counting_with_norm(h):
        full_rows.append(h.shape[0])
        return real_with_norm(h)

    monkeypatch.setattr(drafter, "verifier_logits", counting)
    monkeypatch.setattr(drafter, "verifier_draft_logits_and_norm", counting_with_norm)
    for step in range(4):
        known = torch.cat([cached.normalizers.get(k, torch.full((n,), float("nan"))) for k, n in zip(keys, sizes)])
        mine = replace(batch, target_log_norm=known, sample_keys=keys)
        full_rows.clear()
        ref_loss, ref_m = plain(batch)
        plain_rows = sum(full_rows)
        full_rows.clear()
        loss, m = cached(mine)
        assert float(loss.detach()) == pytest.approx(float(ref_loss.detach()), rel=1e-5)
        assert m["l1"] == pytest.approx(ref_m["l1"], rel=1e-5)
        # The first step knows nothing; by the last, most of its positions were seen before.
        assert sum(full_rows) == plain_rows if step == 0 else sum(full_rows) < plain_rows
    full = torch.logsumexp(real(batch.last_hidden), -1)
    for d, k in enumerate(keys):
        row = cached.normalizers[k]
        seen = ~torch.isnan(row)
        assert seen.any()
        torch.testing.assert_close(row[seen], full[batch.doc_ids == d][seen], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("columns", [1000, 4096, 0])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_blockwise_normaliser_is_the_one_products(tiny_target, columns, softcap):
    """The target head run block by block (an online logsumexp, the draft columns kept as each
    block passes) gives the draft columns and the log-normaliser of the one full-vocabulary
    product: blocks that do not divide the vocabulary, a soft-capped target, draft ids in no
    particular order; 0 is the one product itself."""
    from tests.helpers import make_drafter

    drafter = make_drafter(tiny_target, draft_vocab_size=3000)
    drafter.config.target_logit_softcap = softcap
    drafter.norm_chunk_columns = columns
    assert drafter.config.target_vocab_size % 1000 != 0  # the last block is a partial one
    with torch.no_grad():  # draft ids out of order: the draft columns must follow the ids, not the blocks
        perm = torch.randperm(drafter.d2t.numel(), generator=torch.Generator().manual_seed(1))
        ids = drafter.draft_to_target_ids()[perm]
        drafter.d2t.copy_(ids - torch.arange(ids.numel()))
    h = torch.randn(37, drafter.config.hidden_size, generator=torch.Generator().manual_seed(2)) * 3
    got_cols, got_norm = drafter.verifier_draft_logits_and_norm(h)
    full = drafter.verifier_norm(h.float()) @ drafter.verifier_lm_head.weight.float().t()
    if softcap:
        full = softcap * torch.tanh(full / softcap)
    torch.testing.assert_close(got_cols, full[:, ids])
    torch.testing.assert_close(got_norm, torch.logsumexp(full.double(), -1).float())
