"""The reference speculative decoder, run with the served recipe (`dspark.recipe`: probabilistic
drafting — the Markov head sampling the block left to right — and block verification, Sun et
al. 2024) at temperature > 0, emits exactly the target's own sampling distribution.

Design. A tiny random Llama target (vocabulary V = 6) and a tiny random DSpark drafter with a
reduced draft vocabulary (4 of the 6 tokens, a non-trivial d2t), both built here in memory. The
decoder generates N sequences from one prompt; the first M = 3 tokens of each are counted over
the V^M = 216 cells. The exact distribution of those tokens under plain sampling from the target
is computed independently, in closed form: the product of the target's softmax(logits / T)
conditionals, from one full forward per prefix (no KV cache, no decoder code). Pearson's
chi-square over the cells (those with an expected count below 5 pooled into one), with the
exact distribution fixed in advance (df = cells − 1), must not reject at α = 1e-3. The seeds
are fixed, so the outcome is deterministic; a correct decoder would fail for 1 seed in 1000.
`max_new_tokens` = 5 makes the first verification step judge 3 drafts, so block verification's
look-ahead weights h_1, h_2 decide what the compared tokens are.

Power, measured once by hand with these models, seeds and N (p of the same statistic): a
verifier that accepts every draft, 5e-116 with N/3 samples (asserted in the second test); block
verification read as h_i = p_i (no look-ahead residual mass), 7e-17; a block verifier that
resamples a rejected position from the target's distribution instead of the residual
norm(max(p_τ·M_b − M_s, 0)), 1e-79. test_verify.py asserts those and more at the verifier level,
where 10^4 steps cost a second. Not detectable at this size: a residual that drops only the
weight p_τ (max(M_b − M_s, 0)), which changes the output by too little (p = 0.02 with 2·10^4
verifier-level steps).
"""

from __future__ import annotations

import itertools

import pytest
import torch

import dspark.decoder as decoder_module
from dspark.config import DSparkConfig
from dspark.decoder import SpeculativeDecoder
from dspark.model import DSparkDrafter
from dspark.recipe import speculative_config
from dspark.verify import _sample
from dspark.vocab import build_vocab_mapping
from tests.stats import chi_square

V, VD, T = 6, 4, 0.8  # target vocabulary, draft vocabulary, sampling temperature
PROMPT, M, MAX_NEW = [0, 3, 2], 3, 5
N, N_BROKEN, ALPHA = 1500, 500, 1e-3


@pytest.fixture(scope="module")
def models():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    target = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper than random init's near-uniform logits: the rules must matter
        target.lm_head.weight.mul_(8.0)
    dcfg = DSparkConfig.from_target(
        cfg, mask_token_id=V - 1, num_layers=1, block_size=4, markov_rank=8, draft_vocab_size=VD, num_aux_layers=2
    )
    dcfg.verifier_name_or_path = "tiny-random-llama"
    torch.manual_seed(1)
    drafter = DSparkDrafter(dcfg)
    with torch.no_grad():  # the target's frozen pieces, as load_target_weights copies them from disk
        drafter.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        drafter.verifier_norm.weight.copy_(target.model.norm.weight)
        drafter.verifier_lm_head.weight.copy_(target.lm_head.weight)
        # draft vocabulary {1, 2, 4, 5}: d2t = [1, 1, 2, 2], so a wrong mapping drafts other tokens
        drafter.set_vocab_mapping(*build_vocab_mapping(torch.tensor([1, 9, 8, 2, 7, 6]), VD))
        drafter.markov_head.markov_w2.weight.mul_(20.0)  # a Markov bias that moves the draft distribution
    assert drafter.draft_to_target_ids().tolist() == [1, 2, 4, 5]
    return target, drafter.eval()


def exact_joint(target) -> torch.Tensor:
    """P(first M tokens) under plain sampling from the target at temperature T, `[V] * M`, float64."""
    joint = torch.ones(1, dtype=torch.float64)
    with torch.no_grad():
        for m in range(M):
            ids = torch.tensor([PROMPT + list(p) for p in itertools.product(range(V), repeat=m)])
            cond = torch.softmax(target(input_ids=ids, use_cache=False).logits[:, -1].double() / T, -1)  # [V^m, V]
            joint = (joint[:, None] * cond).reshape(-1)
    return joint.reshape([V] * M)


def decode_counts(decoder: SpeculativeDecoder, n: int):
    counts = torch.zeros([V] * M)
    accepted, steps, long_blocks = 0, 0, 0
    for _ in range(n):
        out, stats = decoder.generate(PROMPT, MAX_NEW)
        counts[tuple(out[:M])] += 1
        accepted, steps = accepted + stats.accepted, steps + stats.steps
        long_blocks += int(len(stats.accepted_at) > 1 and stats.accepted_at[1] > 0)  # a block kept >= 2 drafts
    return counts, accepted / steps, long_blocks


def recipe_decoder(target, drafter, seed: int = 0) -> SpeculativeDecoder:
    spec = speculative_config(drafter.config.to_speculators_dict(), "drafter")
    assert (spec["draft_sample_method"], spec["rejection_sample_method"]) == ("probabilistic", "block")
    return SpeculativeDecoder.from_recipe(target, drafter, spec, temperature=T, seed=seed)


def test_recipe_is_lossless_at_temperature(models):
    target, drafter = models
    torch.set_num_threads(1)  # tiny matrices: threads only add overhead on the shared cores
    exact = exact_joint(target)
    torch.testing.assert_close(exact.sum(), torch.tensor(1.0, dtype=torch.float64))
    counts, accepted_per_step, long_blocks = decode_counts(recipe_decoder(target, drafter), N)
    stat, df, p = chi_square(counts, exact)
    tv = 0.5 * float((counts / N - exact).abs().sum())
    assert p >= ALPHA, (
        f"speculative output differs from the target's distribution: chi2 {stat:.1f}, df {df}, p {p:.2e}, TV {tv:.3f}"
    )
    # The comparison means something only if drafts were accepted, often several per block
    # (block verification's look-ahead), and not always (then the residual is never used).
    assert 0.3 < accepted_per_step < 2.5, accepted_per_step
    assert long_blocks > N // 20, long_blocks


def test_a_broken_verifier_is_detected(models, monkeypatch):
    """The statistic above rejects a verifier that accepts every draft (the output is then the
    drafter's distribution): checked with a third of the samples."""
    target, drafter = models
    torch.set_num_threads(1)

    def accept_all(draft, draft_probs, target_probs, generator=None):
        return draft.numel(), _sample(target_probs[draft.numel()], generator)

    monkeypatch.setattr(decoder_module, "verify_block", accept_all)
    counts, _, _ = decode_counts(recipe_decoder(target, drafter, seed=1), N_BROKEN)
    stat, df, p = chi_square(counts, exact_joint(target))
    assert p < 1e-6, (stat, df, p)
