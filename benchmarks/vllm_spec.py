"""Shared by the serving benchmarks: run vLLM's offline engine on token-id prompts, with or
without a speculative config, and read its acceptance counters back; run our reference
decoder (`dspark.evaluate`) on the same conversations."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path


def load_prompts(target: str, prompts_file: str, limit: int) -> tuple[list, list[list[int]]]:
    """The first `limit` conversations of a prompt file and their prompt token ids (chat template
    applied, generation prompt added), as both vLLM and the reference decoder see them."""
    from transformers import AutoTokenizer

    from dspark.chat import render_prompt
    from dspark.prompts import read_conversations

    convs, _ = read_conversations(prompts_file)
    convs = convs[:limit]
    tok = AutoTokenizer.from_pretrained(target)
    return convs, [render_prompt(tok, c.prompt_messages) for c in convs]


def speculative_tokens(drafter: str | Path) -> int:
    """k from a speculators-format checkpoint's config."""
    cfg = json.loads((Path(drafter) / "config.json").read_text())
    return cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"]


def generate(
    target: str, prompts: list[list[int]], max_new: int, speculative_config: dict | None = None, **engine
) -> dict:
    """Greedy outputs, tokens/s and, when speculating, τ = 1 + accepted / drafts with the
    per-position acceptance, from vLLM's own `spec_decode` counters."""
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=target,
        enforce_eager=True,
        max_model_len=2048,
        disable_log_stats=False,
        speculative_config=speculative_config,
        **engine,
    )
    t0 = time.perf_counter()
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=max_new), use_tqdm=False
    )
    dt = time.perf_counter() - t0
    counters = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode_num_"):
            counters[m.name] = m.values if hasattr(m, "values") else getattr(m, "value", None)
    drafts = counters.get("vllm:spec_decode_num_drafts", 0)
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens", 0)
    per_pos = counters.get("vllm:spec_decode_num_accepted_tokens_per_pos")
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    del llm
    return {
        "tau": 1 + accepted / drafts if drafts else None,
        "drafts": drafts,
        "accepted": accepted,
        "per_position_acceptance": [a / drafts for a in per_pos] if per_pos and drafts else None,
        "outputs": outputs,
        "tokens_per_s": sum(map(len, outputs)) / dt,
    }


def reference_eval(target: str, drafter: str, convs: list, max_new: int) -> dict:
    """`dspark.evaluate` on exactly these conversations (its JSON, without per-request rows)."""
    from dspark import evaluate

    work = Path(tempfile.mkdtemp(prefix="dspark-reference-"))
    subset = work / "prompts.jsonl"
    subset.write_text("".join(json.dumps({"id": c.id, "messages": c.prompt_messages}) + "\n" for c in convs))
    evaluate.main(
        [
            "--target",
            target,
            "--drafter",
            drafter,
            "--prompts",
            str(subset),
            "--max-new-tokens",
            str(max_new),
            "--json",
            str(work / "ours.json"),
        ]
    )
    out = json.loads((work / "ours.json").read_text())
    out.pop("requests", None)
    return out
