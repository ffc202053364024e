"""The inference side with real parts: vLLM (CPU) in Ray actors, a real mooncake_master, the
real SmolLM2 target. Hidden states read back from the store match transformers', the final
layer reproduces the target's next tokens, the loss mask is exactly the assistant text,
extraction does not change what the target generates, and under an fp8 KV cache the states are
still captured in the model's dtype."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from cluster.config import SamplingConfig
from cluster.inference import InferenceActor, InferenceSettings
from cluster.store import HiddenStateStore, StoreConfig
from dspark.config import DSparkConfig
from dspark.model import find_target_tensors
from dspark.samples import read_sample
from dspark.targets import hidden_states_for, load_target
from tests.helpers import eager_target

pytestmark = pytest.mark.integration
# vLLM's CPU attention keeps an fp8 KV cache only with AVX-512 or AMX (its own test, in
# vllm/v1/attention/backends/cpu_attn.py); elsewhere scripts/gpu_check.py's connector_fp8_kv covers it.
FP8_KV_ON_THIS_CPU = torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()

PROMPTS = [
    {"id": "p0", "messages": [{"role": "user", "content": "Name three colours of the rainbow."}]},
    {"id": "p1", "messages": [{"role": "user", "content": "What is 12 times 7?"}]},
    {
        "id": "p2",
        "messages": [
            {"role": "user", "content": "Suggest a name for a cat."},
            {"role": "assistant", "content": "How about Pepper?"},
            {"role": "user", "content": "Another one, please."},
        ],
    },
]


@pytest.fixture(scope="module")
def produced(ray_cluster, smol_target, mooncake_master, tmp_path_factory):
    ray = ray_cluster
    holder = HiddenStateStore(StoreConfig(master=mooncake_master.address, segment_bytes=256 << 20)).connect()
    layer_ids = DSparkConfig.from_target(smol_target).extract_layer_ids
    base = InferenceSettings(
        eager_target(smol_target, max_model_len=1024),
        layer_ids,
        "test/g0",
        sampling=SamplingConfig(max_tokens=40),
        store=StoreConfig(master=mooncake_master.address),
    )
    Actor = ray.remote(num_cpus=1)(InferenceActor)
    file_dir = tmp_path_factory.mktemp("hs_files")
    actors = {
        "mooncake": Actor.remote(base),
        "file": Actor.remote(replace(base, backend="file", file_dir=str(file_dir))),
        "plain": Actor.remote(replace(base, extract=False)),
    }
    if FP8_KV_ON_THIS_CPU:
        # The production config's fp8 KV cache (configs/kimi_k3.yaml): vLLM's cache-only layer
        # refuses a quantized cache dtype unless the capture model gives it the model's own.
        actors["fp8_kv"] = Actor.remote(
            replace(
                base, backend="file", file_dir=str(file_dir / "fp8"), target=replace(base.target, kv_cache_dtype="fp8")
            )
        )
    out = {name: ray.get(a.process.remote(PROMPTS)) for name, a in actors.items()}
    stats = ray.get(actors["mooncake"].stats.remote())
    for a in actors.values():
        ray.kill(a)
    yield out, holder, layer_ids, stats
    holder.close()


def test_regenerated_response_is_the_targets_greedy_output(produced):
    out, *_ = produced
    for m, p in zip(out["mooncake"], out["plain"]):
        assert m.error is None and m.response_ids == p.response_ids
        assert len(m.response_ids) > 1


def test_hidden_states_match_transformers(produced, smol_target):
    out, holder, layer_ids, stats = produced
    model, tok = load_target(smol_target, torch.float32)
    heads = find_target_tensors(smol_target)
    assert stats["generated_tokens"] > 0 and stats["tokens_per_s"] > 0
    agree = []
    for r in out["mooncake"]:
        ref = r.ref
        s = holder.get_samples([ref])[0]
        assert s.num_tokens == r.prompt_tokens + len(r.response_ids) - 1  # the last token is never fed back
        assert s.token_ids[r.prompt_tokens :].tolist() == r.response_ids[:-1]
        ref_h = hidden_states_for(model, s.token_ids, layer_ids).float()
        got = s.hidden_states.float()
        for li in range(len(layer_ids)):
            flat = torch.nn.functional.cosine_similarity(got[:, li].flatten(), ref_h[:, li].flatten(), dim=0)
            per_token = torch.nn.functional.cosine_similarity(got[:, li], ref_h[:, li], dim=-1)
            assert flat >= 0.999 and per_token.mean() >= 0.999, (layer_ids[li], float(flat), float(per_token.min()))
        agree.append(final_state_picks_the_answer(s, r.prompt_tokens, model.config.rms_norm_eps, heads))
    assert torch.cat(agree).float().mean() >= 0.9


def final_state_picks_the_answer(s, prompt_tokens: int, eps: float, heads: dict) -> torch.Tensor:
    """Per answer token: the stored final pre-norm state, through the target's norm and LM head,
    picks it."""
    last = s.hidden_states[:, -1].float()
    normed = last * torch.rsqrt(last.pow(2).mean(-1, keepdim=True) + eps) * heads["norm"].float()
    logits = normed @ heads["head"].float().t()
    gen = slice(prompt_tokens - 1, s.num_tokens - 1)
    chosen = s.token_ids[prompt_tokens:]
    # vLLM picked its tokens from bf16 logits; recomputed in fp32 from the stored bf16 state
    # a near-tie may flip, but only a near-tie: the chosen token is within bf16 rounding
    # of the best one (one bf16 ulp at |logit| ~ 16-32 is 0.125-0.25).
    gap = logits[gen].max(-1).values - logits[gen].gather(-1, chosen[:, None]).squeeze(-1)
    assert float(gap.max()) <= 0.25, gap[gap > 0].tolist()
    return logits[gen].argmax(-1) == chosen


@pytest.mark.skipif(not FP8_KV_ON_THIS_CPU, reason="vLLM's CPU attention needs AVX-512 or AMX for an fp8 KV cache")
def test_fp8_kv_cache_still_captures_the_model_dtype_states(produced, smol_target):
    out, _, layer_ids, _ = produced
    heads = find_target_tensors(smol_target)
    eps = DSparkConfig.from_target(smol_target).rms_norm_eps
    agree = []
    for r in out["fp8_kv"]:
        assert r.error is None and len(r.response_ids) > 1
        s = read_sample(r.path)
        assert s.hidden_states.dtype == torch.bfloat16 and s.hidden_states.shape[1] == len(layer_ids)
        assert s.token_ids[r.prompt_tokens :].tolist() == r.response_ids[:-1]
        agree.append(final_state_picks_the_answer(s, r.prompt_tokens, eps, heads))
    assert torch.cat(agree).float().mean() >= 0.9


def test_loss_mask_is_exactly_the_assistant_text(produced, smol_target):
    out, holder, *_ = produced
    _, tok = load_target(smol_target, torch.float32)
    for r, p in zip(out["mooncake"], PROMPTS):
        ref = r.ref
        s = holder.get_samples([ref])[0]
        earlier = "".join(m["content"] + tok.eos_token for m in p["messages"] if m["role"] == "assistant")
        expected = earlier + tok.decode(r.response_ids[:-1])
        assert tok.decode(s.token_ids[s.loss_mask]) == expected
        outside = tok.decode(s.token_ids[~s.loss_mask])
        assert "Pepper" not in outside and p["messages"][0]["content"] in outside


def test_file_backend_writes_the_same_sample(produced):
    out, holder, *_ = produced
    for f, m in zip(out["file"], out["mooncake"]):
        from_file = read_sample(f.path)
        ref = m.ref
        from_store = holder.get_samples([ref])[0]
        assert torch.equal(from_file.token_ids, from_store.token_ids)
        assert torch.equal(from_file.loss_mask, from_store.loss_mask)
        torch.testing.assert_close(from_file.hidden_states, from_store.hidden_states)
