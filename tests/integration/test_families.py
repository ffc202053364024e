"""Target families, each a tiny random-weight model built from its real transformers config class
(`tests/families.py`): Llama, Qwen3, Qwen3-MoE, Gemma 3, GLM-4 MoE, DeepSeek-V3 (MLA + MoE, the
Kimi K2 architecture). For each one, the whole path a drafter takes:

- vLLM (CPU) regenerates the answer: it must be the target's greedy answer in transformers;
- vLLM extracts the aux and final pre-norm states: they must match transformers' (cosine
  >= 0.999 per layer). Where vLLM's model class cannot export them (Gemma 3, GLM-4 MoE in vLLM
  0.32) the test asserts that the job refuses the target up front, and goes on with
  transformers-captured states;
- the drafter built by `DSparkConfig.from_target` has the target's width, the right head
  width (MLA: `v_head_dim`), norm convention and vocabulary, and its frozen norm + LM head
  reproduce the target's logits (tied and untied embeddings);
- it trains (the loss falls on the family's own states), speculative decoding with it is
  lossless, it exports, `speculators` loads it and computes the same outputs, vLLM's config
  reader accepts it; the warm start copies exactly the target weights the family has in the
  drafter's form.

Each test prints one row of the README's family matrix. The default run keeps the two that
differ most (DeepSeek-V3: MLA and MoE through vLLM; Gemma 3: a (1 + w)-norm family vLLM cannot
extract); Llama, Qwen3 dense, Qwen3-MoE and GLM-4 MoE run in the slow set (`pytest -m slow`):
the suite's 15-minute budget.
"""

from __future__ import annotations

import json

import pytest
import torch

from cluster.config import ROOT, ConfigError, SamplingConfig
from cluster.config_load import load_config
from cluster.inference import InferenceActor, InferenceSettings
from dspark.chat import render_prompt
from dspark.checkpoint import save_drafter
from dspark.config import DSparkConfig
from dspark.decoder import SpeculativeDecoder, target_generate
from dspark.losses import LossWeights
from dspark.model import DSparkDrafter
from dspark.samples import Sample, pack, read_sample
from dspark.targets import hidden_states_for, load_target
from dspark.training import DrafterObjective
from tests.families import FAMILIES, build_family_target
from tests.helpers import eager_target, reference_outputs

pytestmark = pytest.mark.integration

PROMPTS = [
    {"id": "p0", "messages": [{"role": "user", "content": "Name three colours of the rainbow."}]},
    {
        "id": "p1",
        "messages": [
            {"role": "user", "content": "Suggest a name for a cat."},
            {"role": "assistant", "content": "How about Pepper?"},
            {"role": "user", "content": "Another one, please."},
        ],
    },
]
MAX_TOKENS = 24
LOCAL_CONFIG = ROOT / "configs" / "local.yaml"


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


def extract_with_vllm(ray, target, layer_ids, out_dir, extract: bool):
    settings = InferenceSettings(
        eager_target(target, dtype="float32", max_model_len=512),
        layer_ids,
        "fam/g0",
        sampling=SamplingConfig(max_tokens=MAX_TOKENS),
        backend="file",
        file_dir=str(out_dir),
        extract=extract,
    )
    actor = ray.remote(num_cpus=1)(InferenceActor).remote(settings)
    try:
        return ray.get(actor.process.remote(PROMPTS), timeout=300)
    finally:
        ray.kill(actor)


def check_family(name: str, ray, smol_target, tmp_path, monkeypatch) -> dict:
    from speculators.model import SpeculatorModel
    from vllm.transformers_utils.config import maybe_override_with_speculators
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    from cluster.target import read_target, vllm_extraction_gap

    family = FAMILIES[name]
    target = build_family_target(name, tmp_path / name, smol_target)
    model, tok = load_target(target, torch.float32)
    tcfg = model.config
    row = {"family": name, "architecture": tcfg.architectures[0]}

    # The drafter's shape and conventions come from the target.
    cfg = DSparkConfig.from_target(target, num_layers=2, block_size=4, markov_rank=16)
    mla = getattr(tcfg, "kv_lora_rank", None)
    assert cfg.hidden_size == tcfg.hidden_size and cfg.target_vocab_size == tcfg.vocab_size
    assert cfg.head_dim == (tcfg.v_head_dim if mla else tcfg.head_dim)
    assert cfg.num_attention_heads * cfg.head_dim >= tcfg.hidden_size // 2
    assert cfg.target_norm_unit_offset == name.startswith("gemma")
    assert 0 <= cfg.mask_token_id < tcfg.vocab_size
    assert cfg.extract_layer_ids[-1] == tcfg.num_hidden_layers

    # vLLM regenerates (and, where the family allows it, extracts); the refusal is up front.
    gap = vllm_extraction_gap(tcfg.architectures)
    assert (gap is None) == family.vllm_extracts, gap
    if gap:
        with pytest.raises(ConfigError, match="SupportsEagle3"):
            read_target(load_config(LOCAL_CONFIG, [f"target.path={target}"]))
    produced = extract_with_vllm(ray, target, cfg.extract_layer_ids, tmp_path / "hs", family.vllm_extracts)
    samples, greedy_match = [], []
    for p, r in zip(PROMPTS, produced):
        assert r.error is None, r.error
        ids = render_prompt(tok, p["messages"])
        assert r.prompt_tokens == len(ids)
        ref = target_generate(model, ids, MAX_TOKENS, {tok.eos_token_id})
        greedy_match.append(r.response_ids == ref)
        assert r.response_ids == ref, (name, p["id"], r.response_ids, ref)
        if family.vllm_extracts:
            s = read_sample(r.path)
            want = hidden_states_for(model, s.token_ids, cfg.extract_layer_ids)
            for li, layer in enumerate(cfg.extract_layer_ids):
                c = cosine(s.hidden_states[:, li], want[:, li])
                assert c >= 0.999, (name, layer, c)
            row["extraction_cosine_min"] = min(
                row.get("extraction_cosine_min", 1.0),
                min(cosine(s.hidden_states[:, i], want[:, i]) for i in range(want.shape[1])),
            )
        else:  # transformers-captured states, as the offline path writes them
            tokens = torch.tensor(ids + r.response_ids[:-1])
            mask = torch.arange(len(tokens)) >= len(ids)
            s = Sample(tokens, mask, hidden_states_for(model, tokens, cfg.extract_layer_ids), cfg.extract_layer_ids)
        samples.append(s)
    row["extraction"] = "vllm" if family.vllm_extracts else f"transformers ({family.why_not})"
    row["greedy_match"] = all(greedy_match)
    row["distinct_answer_tokens"] = len({t for r in produced for t in r.response_ids})

    # Frozen parts: the target's final norm + LM head on its last pre-norm state give its logits.
    torch.manual_seed(0)
    drafter = DSparkDrafter(cfg)
    drafter.load_target_weights(target)
    with torch.no_grad():
        tokens = samples[0].token_ids
        want = model(input_ids=tokens[None]).logits[0].float()
        got = drafter.verifier_logits(hidden_states_for(model, tokens, [tcfg.num_hidden_layers])[:, 0])
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
    tied = bool(getattr(tcfg, "tie_word_embeddings", False))
    assert torch.equal(drafter.verifier_lm_head.weight, model.get_output_embeddings().weight.detach())
    assert torch.equal(drafter.embed_tokens.weight, model.get_input_embeddings().weight.detach())
    row["embeddings"] = "tied" if tied else "untied"

    # Warm start: what the family has in the drafter's form is copied, the rest is listed.
    report = DSparkDrafter(cfg).init_from_target_layers(target)
    skipped = {k.split(".", 1)[-1] for k in report["skipped"]}
    expect_attn = set() if mla else {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"}
    assert expect_attn.isdisjoint(skipped) and (not mla or "self_attn.q_proj" in skipped), report
    last_is_moe = name in ("qwen3_moe", "glm4_moe", "deepseek_v3")
    assert ("mlp.gate_proj" in skipped) == last_is_moe, report

    # It trains on the family's states.
    batch = pack(samples, cfg.aux_layer_ids, cfg.target_num_layers)
    objective = DrafterObjective(drafter, LossWeights(), num_anchors=64, seed=0)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    drafter.train()
    for _ in range(30):
        loss, _ = objective(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert all(map(torch.isfinite, torch.tensor(losses))) and losses[-1] < 0.7 * losses[0], losses
    row["loss_first_last"] = [round(losses[0], 3), round(losses[-1], 3)]
    drafter.eval()

    # Lossless with it.
    decoder = SpeculativeDecoder(model, drafter)
    for p in PROMPTS:
        ids = render_prompt(tok, p["messages"])
        out, stats = decoder.generate(ids, MAX_TOKENS, {tok.eos_token_id})
        assert out == target_generate(model, ids, MAX_TOKENS, {tok.eos_token_id}), (name, p["id"])
    row["lossless"] = True

    # Export; speculators loads it and computes the same thing; vLLM's reader accepts it.
    ckpt = save_drafter(drafter, tmp_path / "drafter")
    sm = SpeculatorModel.from_pretrained(str(ckpt)).eval()
    anchors = drafter.sample_anchors(batch, 6, torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = drafter(batch, anchors)
    hidden, logits, targets, _ = reference_outputs(sm, batch, anchors, monkeypatch)
    torch.testing.assert_close(ours.logits, logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours.slot_target_logits(), targets, atol=1e-3, rtol=1e-3)
    row["speculators"] = True
    verifier, _tok, spec = maybe_override_with_speculators(str(ckpt), None, trust_remote_code=False)
    hf = SpeculatorsConfig.from_pretrained(str(ckpt))
    assert spec["method"] == "dspark" and verifier == str(target)
    assert hf.eagle_aux_hidden_state_layer_ids == cfg.aux_layer_ids and hf.sample_from_anchor is True
    assert (hf.hidden_size, hf.head_dim) == (cfg.hidden_size, cfg.head_dim)
    row["vllm_config"] = True
    print("\nFAMILY", json.dumps(row))
    return row


@pytest.mark.slow
def test_family_llama(ray_cluster, smol_target, tmp_path, monkeypatch):
    check_family("llama", ray_cluster, smol_target, tmp_path, monkeypatch)


@pytest.mark.slow
def test_family_qwen3(ray_cluster, smol_target, tmp_path, monkeypatch):
    check_family("qwen3", ray_cluster, smol_target, tmp_path, monkeypatch)


@pytest.mark.slow
def test_family_qwen3_moe(ray_cluster, smol_target, tmp_path, monkeypatch):
    check_family("qwen3_moe", ray_cluster, smol_target, tmp_path, monkeypatch)


@pytest.mark.slow  # the suite's 15 minutes: the default run keeps one family beside Llama (DeepSeek-V3)
def test_family_gemma3(ray_cluster, smol_target, tmp_path, monkeypatch):
    check_family("gemma3", ray_cluster, smol_target, tmp_path, monkeypatch)


@pytest.mark.slow
def test_family_glm4_moe(ray_cluster, smol_target, tmp_path, monkeypatch):
    check_family("glm4_moe", ray_cluster, smol_target, tmp_path, monkeypatch)


def test_family_deepseek_v3(ray_cluster, smol_target, tmp_path, monkeypatch):
    check_family("deepseek_v3", ray_cluster, smol_target, tmp_path, monkeypatch)
