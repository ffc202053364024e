"""The held-out evaluation where the target runs: vLLM serving the target with the new drafter.

A 2.8T-parameter target cannot be loaded on the driver by transformers, so on GPU the job's
final evaluation starts one more engine — the target with the drafter as its speculative
config (`method: dspark`, from the drafter's own serving recipe) — in an inference placement
group after the replicas have stopped, decodes the held-out prompts greedily, and reads the
acceptance of every request from vLLM itself (`per_request_spec_decode_metrics="detailed"`:
the accepted and drafted counts of each verification step). Those become the same
`DecodeStats` the reference decoder produces, so every figure (`dspark.tau_report`) is computed
the same way on both paths. On CPU vLLM executes only the backbone (`method: dflash`); the job
keeps the reference decoder there, and the tests use this path with the backbone.

What this path does not check is losslessness (it would need a second, target-only engine):
`scripts/gpu_check.sh` does, once per machine, against the same engine settings.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

from cluster.inference import InferenceSettings, engine_kwargs
from dspark.decoder import DecodeStats
from dspark.recipe import speculative_config
from dspark.tau_report import RequestResult, summarize


@dataclass
class ServedEvalSettings:
    engine: InferenceSettings  # the replicas' engine settings (extract off here)
    drafter_dir: str
    method: str = "dspark"  # dflash: the backbone alone (what vLLM's CPU runner executes)
    max_new_tokens: int = 128


def decode_stats(per_step_accepted: list[int], per_step_drafted: list[int]) -> DecodeStats:
    """A request's verification steps, as vLLM recorded them, in the reference decoder's terms."""
    stats = DecodeStats()
    for accepted, drafted in zip(per_step_accepted, per_step_drafted, strict=True):
        stats.record(drafted, accepted)
    return stats


class ServedEvaluator:
    """Wrapped with `ray.remote` by the job (placed like a replica); usable in-process too."""

    def __init__(self, s: ServedEvalSettings) -> None:
        self.s = s
        engine = replace(s.engine, extract=False, temperature=0.0, max_tokens=s.max_new_tokens)
        if engine.device == "cpu":
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(engine.cpu_kvcache_space_gb))
        drafter_cfg = json.loads((Path(s.drafter_dir) / "config.json").read_text())
        self.spec = speculative_config(drafter_cfg, s.drafter_dir, s.method)
        self.spec["draft_sample_method"] = "greedy"  # greedy decoding: the draft's probabilities are not used
        from vllm import LLM

        self.llm = LLM(**engine_kwargs(engine), speculative_config=self.spec, per_request_spec_decode_metrics="detailed")
        self.tokenizer = self.llm.get_tokenizer()
        self.engine = engine

    def evaluate(self, prompts: list[dict]) -> dict:
        """`prompts`: {"id", "category", "messages"}; the figures `dspark.evaluate` reports, from vLLM."""
        from vllm import SamplingParams

        from dspark.chat import render_prompt

        ids, fitting, too_long = [], [], []
        for p in prompts:  # as a replica does: a prompt that leaves no room to answer is reported, not fatal
            rendered = render_prompt(self.tokenizer, p["messages"], self.engine.chat)
            if len(rendered) + self.s.max_new_tokens > self.engine.max_model_len:
                too_long.append(p["id"])
            else:
                ids.append(rendered)
                fitting.append(p)
        prompts = fitting
        outs = self.llm.generate([{"prompt_token_ids": i} for i in ids],
                                 SamplingParams(temperature=0.0, max_tokens=self.s.max_new_tokens), use_tqdm=False)
        rows, requests = [], []
        for p, prompt_ids, out in zip(prompts, ids, outs):
            m = out.outputs[0].spec_decode_metrics
            if m is None:
                raise RuntimeError(f"vLLM returned no speculative-decoding metrics for prompt {p['id']} "
                                   f"(speculative config {self.spec})")
            stats = decode_stats(m.per_step_accepted, m.per_step_drafted)
            rows.append(RequestResult(p["id"], p.get("category"), len(prompt_ids), stats))
            requests.append({"id": p["id"], "category": p.get("category"), "prompt_tokens": len(prompt_ids),
                             "tau": stats.tau if stats.steps else None, "steps": stats.steps, "accepted": stats.accepted,
                             "generated_tokens": len(out.outputs[0].token_ids),
                             "output_token_ids": list(out.outputs[0].token_ids)})
        return {**summarize(rows), "generated_tokens": sum(r["generated_tokens"] for r in requests),
                "lossless": None, "backend": "vllm", "skipped_too_long": too_long,
                "num_draft_tokens": sum(r.stats.drafted for r in rows),
                "num_accepted_tokens": sum(r.stats.accepted for r in rows),
                "settings": {"temperature": 0.0, "max_new_tokens": self.s.max_new_tokens, "method": self.s.method,
                             "num_speculative_tokens": self.spec["num_speculative_tokens"], "dtype": self.engine.dtype,
                             "tensor_parallel_size": self.engine.tensor_parallel_size},
                "requests": requests}
