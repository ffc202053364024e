"""The served evaluation's flow without vLLM executing anything (a stand-in `vllm.LLM`): it
serves the drafter's recipe unaltered, reads acceptance per request, and judges losslessness
against a target-only engine started after the speculative one is shut down. What vLLM itself
does with the recipe is checked on a GPU (scripts/gpu_check.py `served_recipe`)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from cluster.inference import InferenceSettings, ServedEvalSettings, ServedEvaluator, compare_greedy, first_difference
from tests.helpers import eager_target

PROMPTS = [
    {"id": f"p{i}", "category": "math" if i % 2 else "coding", "messages": [{"role": "user", "content": str(i)}]}
    for i in range(3)
]
OUTPUT = [5, 6, 7, 8, 9, 10]


class FakeLLM:
    """Records each engine: its speculative config, the sampling of every request, shutdown."""

    engines: list = []

    def __init__(self, **kwargs):
        self.kwargs, self.calls, self.closed = kwargs, [], False
        self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(shutdown=self._shutdown))
        FakeLLM.engines.append(self)

    def _shutdown(self):
        self.closed = True

    def get_tokenizer(self):
        return object()

    def generate(self, prompts, params, use_tqdm=False):
        assert not self.closed
        self.calls.append([(p.temperature, p.seed) for p in params])
        spec = self.kwargs.get("speculative_config")
        out = []
        for i, _ in enumerate(prompts):
            tokens = list(OUTPUT)
            if spec is None and self.kwargs.get("diverge") and i == 1:
                tokens[3] = 99
            metrics = SimpleNamespace(per_step_accepted=[2, 0, 1], per_step_drafted=[8, 8, 8]) if spec else None
            out.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens, spec_decode_metrics=metrics)]))
        return out


@pytest.fixture
def fake_vllm(monkeypatch, tmp_path):
    import vllm

    import dspark.chat

    FakeLLM.engines = []
    for var, default in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("VLLM_CPU_KVCACHE_SPACE", "1")):
        monkeypatch.setenv(var, os.environ.get(var, default))  # the CPU path's setdefault stays inside this test
    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    monkeypatch.setattr(dspark.chat, "render_prompt", lambda tok, messages, chat: [1, 2, 3])
    cfg = {
        "speculators_model_type": "dspark",
        "block_size": 8,
        "draft_vocab_size": 4000,
        "transformer_layer_config": {"vocab_size": 49152},
        "speculators_config": {"proposal_methods": [{"speculative_tokens": 8}], "verifier": {"name_or_path": "t"}},
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def settings(drafter, device="cuda", **kw):
    engine = InferenceSettings(eager_target("t", dtype="float32"), [], "eval", device=device)
    return ServedEvalSettings(engine, str(drafter), "dspark", 6, **kw)


def test_recipe_served_unaltered_and_lossless_checked_on_gpu(fake_vllm):
    ev = ServedEvaluator(settings(fake_vllm))
    result = ev.evaluate(PROMPTS)
    spec_engine, target_engine = FakeLLM.engines
    assert spec_engine.kwargs["speculative_config"] == {
        "model": str(fake_vllm),
        "method": "dspark",
        "num_speculative_tokens": 8,
        "draft_sample_method": "probabilistic",
        "rejection_sample_method": "block",
    }
    assert "speculative_config" not in target_engine.kwargs  # the target alone
    assert spec_engine.closed and target_engine.closed  # one after the other on the GPU
    assert result["lossless"] is True and result["lossless_check"]["prompts"] == 3
    assert result["num_draft_tokens"] == 3 * 24 and result["num_accepted_tokens"] == 3 * 3
    assert result["settings"]["draft_sample_method"] == "probabilistic" and result["settings"]["temperature"] == 0.0
    assert spec_engine.calls == [[(0.0, None)] * 3]
    ev.evaluate(PROMPTS[:1])  # a second call starts the speculative engine again
    assert "speculative_config" in FakeLLM.engines[2].kwargs


def test_a_difference_is_reported_where_it_starts(fake_vllm, monkeypatch):
    original = FakeLLM.__init__
    monkeypatch.setattr(FakeLLM, "__init__", lambda self, **kw: original(self, diverge=True, **kw))
    result = ServedEvaluator(settings(fake_vllm)).evaluate(PROMPTS)
    assert result["lossless"] is False
    assert result["lossless_check"]["differing"] == [
        {"id": "p1", "at_token": 3, "speculative": [8, 9, 10], "target_only": [99, 9, 10]}
    ]


def test_sampled_tau_with_a_greedy_lossless_pass(fake_vllm):
    result = ServedEvaluator(settings(fake_vllm, temperature=0.7, lossless_limit=2, seed=10)).evaluate(PROMPTS)
    spec_engine = FakeLLM.engines[0]
    assert spec_engine.calls == [[(0.7, 10), (0.7, 11), (0.7, 12)], [(0.0, None)] * 2]  # τ at T, then greedy
    assert result["lossless_check"]["prompts"] == 2 and result["settings"]["temperature"] == 0.7


def test_cpu_keeps_the_dflash_path(fake_vllm):
    with pytest.raises(ValueError, match="temperature 0 only"):
        ServedEvaluator(settings(fake_vllm, device="cpu", temperature=0.5))
    ev = ServedEvaluator(ServedEvalSettings(settings(fake_vllm, device="cpu").engine, str(fake_vllm), "dflash", 6))
    result = ev.evaluate(PROMPTS)
    assert ev.spec["draft_sample_method"] == "greedy" and ev.spec["rejection_sample_method"] == "standard"
    assert result["lossless"] is None and len(FakeLLM.engines) == 1  # not asked on CPU: no second engine


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2  # one stopped early
    assert compare_greedy(["a"], [[1, 2]], [[1, 2]])["lossless"] is True
