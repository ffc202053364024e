"""The serving recipe that ships with a drafter: `serve.sh` (the exact `vllm serve` line) and a
model card (`README.md`: target, data, τ per domain and how it was measured).

A drafter without its recipe gets served with guessed settings, and the guesses that matter
fail silently: a `num_speculative_tokens` that does not match the block, or probabilistic
drafting over a reduced draft vocabulary (vLLM's `dflash`/EAGLE proposers sample draft
probabilities in the draft vocabulary, which the target-vocabulary rejection sampler cannot
use; only greedy drafting is valid for them), so the recipe is derived from the checkpoint's
own `config.json`, never written by hand.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

from .tau_report import fmt


def speculative_config(drafter_config: dict, model: str, method: str | None = None) -> dict:
    """vLLM's `--speculative-config` for a checkpoint (its `config.json` as a dict).

    `num_speculative_tokens`: as the checkpoint's proposal method says (every block slot drafts
    when `sample_from_anchor` is set, the DSpark convention). `draft_sample_method`: probabilistic
    (lossless at any temperature, and what the DSpark paper serves) when the drafter drafts
    over the target's whole vocabulary, greedy when its vocabulary is reduced.
    """
    k = drafter_config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]  # what the exporter wrote
    method = method or drafter_config["speculators_model_type"]
    target_vocab = drafter_config["transformer_layer_config"]["vocab_size"]
    reduced = (drafter_config.get("draft_vocab_size") or target_vocab) < target_vocab
    return {"model": model, "method": method, "num_speculative_tokens": k,
            "draft_sample_method": "greedy" if reduced else "probabilistic"}


def verifier(drafter_config: dict) -> str:
    return drafter_config["speculators_config"]["verifier"]["name_or_path"]


CHAT_TEMPLATE_FILE = "chat_template.jinja"


def target_arguments(drafter_config: dict) -> list[str]:
    """`vllm serve` arguments that make the server read the target as training did: the chat
    template the answers were rendered with (written beside the drafter as CHAT_TEMPLATE_FILE,
    `$DRAFTER` in serve.sh), its options, remote code where the target needed it."""
    ours = drafter_config.get("dspark_cluster", {})
    chat = ours.get("chat_format")
    args = []
    if chat:
        args += ["--chat-template", f"$DRAFTER/{CHAT_TEMPLATE_FILE}"]
        if chat.get("kwargs"):
            args += ["--default-chat-template-kwargs", json.dumps(chat["kwargs"], sort_keys=True)]
    if ours.get("target_trust_remote_code"):
        args.append("--trust-remote-code")
    return args


def shell_words(args: list[str]) -> str:
    """Quoted for bash, `$DRAFTER` left to expand."""
    return " ".join('"$DRAFTER/' + a[len("$DRAFTER/"):] + '"' if a.startswith("$DRAFTER/") else shlex.quote(a)
                    for a in args)


def serve_script(drafter_config: dict) -> str:
    """A shell script that serves the target with the drafter beside it (its own directory)."""
    spec = speculative_config(drafter_config, "DRAFTER_DIR")
    spec_json = json.dumps(spec).replace('"DRAFTER_DIR"', '"\'"$DRAFTER"\'"')
    return f"""#!/usr/bin/env bash
# Serve {verifier(drafter_config)} with this DSpark drafter in vLLM (generated with the checkpoint).
#   TARGET=/path/to/target ./serve.sh [extra vllm serve arguments, e.g. --tensor-parallel-size 8]
# TARGET defaults to the verifier recorded in config.json. draft_sample_method: {spec['draft_sample_method']}
# ({'the draft vocabulary is reduced: only greedy drafting is valid for it' if spec['draft_sample_method'] == 'greedy'
   else 'the drafter drafts over the full vocabulary: probabilistic drafting stays lossless at any temperature'}).
set -euo pipefail
DRAFTER="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"
TARGET="${{TARGET:-}}"
[ -n "$TARGET" ] || TARGET={shlex.quote(verifier(drafter_config))}
exec vllm serve "$TARGET" --speculative-config '{spec_json}' {shell_words(target_arguments(drafter_config))} "$@"
"""


def model_card(drafter_config: dict, training: dict, evaluation: dict) -> str:
    """`README.md` for the exported drafter. `training`: target, prompt files, category counts,
    epochs, samples and steps; `evaluation`: `dspark.evaluate`'s summary."""
    spec = speculative_config(drafter_config, "THIS_DIRECTORY")
    s = evaluation.get("settings", {})
    rows = "\n".join(f"| {cat} | {c['num_prompts']} | {fmt(c['tau'])} | "
                     f"{' '.join(f'{a:.2f}' for a in c['per_position_acceptance'])} |"
                     for cat, c in evaluation.get("per_category", {}).items())
    p = evaluation.get("percentiles", {})
    cats = ", ".join(f"{k} {v}" for k, v in sorted(training.get("categories", {}).items()))
    chat = drafter_config.get("dspark_cluster", {}).get("chat_format") or {}
    chat_line = (f"- Chat format: the {'configured' if chat.get('source') == 'config' else 'tokenizer’s own'} template "
                 f"(`{CHAT_TEMPLATE_FILE}` here, sha256 {chat.get('sha256', '?')[:12]}), options "
                 f"`{json.dumps(chat.get('kwargs') or {})}`; serve and evaluate with the same\n" if chat else "")
    if evaluation.get("backend") == "vllm":
        how = (f"by vLLM serving the target with this drafter (`method: {s.get('method')}`), each request's "
               "verification steps read from vLLM's per-request speculative-decoding metrics")
        lossless = ""
    else:
        how = "with `dspark.evaluate` (the reference speculative decoder against the target in transformers)"
        lossless = (" Lossless (speculative output identical to the target's greedy output, token for token): "
                    f"{evaluation.get('lossless')}.")
    return f"""# DSpark drafter for {verifier(drafter_config)}

A {drafter_config['transformer_layer_config']['num_hidden_layers']}-layer DSpark draft model (block size
{drafter_config['block_size']}, draft vocabulary {drafter_config.get('draft_vocab_size')}, aux layers
{drafter_config['aux_hidden_state_layer_ids']}) in the `speculators` format, for vLLM's `method: dspark`.
Trained by dspark-cluster.

## Training data
- Target: `{training.get('target')}` (answers regenerated by the target itself, {training.get('sampling')})
- Prompts: {', '.join(training.get('prompt_files', []))} — {training.get('train_prompts')} training prompts ({cats}),
  {training.get('epochs')} epoch(s); {training.get('trained_samples')} samples trained in {training.get('steps')} steps
{chat_line}- Held out from training: {training.get('heldout_prompts')} prompts (split by a hash of the prompt id)

## Acceptance on the held-out prompts
Measured {how} ({s.get('dtype')}, temperature {s.get('temperature')}, {s.get('num_speculative_tokens')} draft
tokens per step, up to {s.get('max_new_tokens')} new tokens, {evaluation.get('num_prompts')} prompts taken round-robin
over categories). τ = tokens emitted per target verification step, bonus token included (vLLM's
acceptance length).{lossless}

| category | prompts | τ | acceptance per position |
|---|---|---|---|
{rows}

Macro τ over categories: {fmt(evaluation.get('macro_tau'))}; pooled τ: {fmt(evaluation.get('tau'))}.
Per-request τ: p10 {fmt(p.get('p10'))}, p50 {fmt(p.get('p50'))}, p90 {fmt(p.get('p90'))};
the worst 10% of requests average {fmt(p.get('bottom10_mean'))}, the best 10% {fmt(p.get('top10_mean'))}.

## Serving
`./serve.sh` (beside this file) runs:

    vllm serve {verifier(drafter_config)} --speculative-config {shlex.quote(json.dumps(spec))} {shell_words(target_arguments(drafter_config))}

with `model` set to this directory's absolute path. `draft_sample_method` is `{spec['draft_sample_method']}`: probabilistic drafting
needs the drafter's probabilities over the target's whole vocabulary; with a reduced draft vocabulary only greedy
drafting is valid.
"""


def write_recipe(drafter_dir: str | Path, training: dict, evaluation: dict) -> None:
    """Add `README.md` and `serve.sh` to an exported drafter directory (each written atomically)."""
    d = Path(drafter_dir)
    cfg = json.loads((d / "config.json").read_text())
    files = [("README.md", model_card(cfg, training, evaluation), 0o644), ("serve.sh", serve_script(cfg), 0o755)]
    chat = cfg.get("dspark_cluster", {}).get("chat_format")
    if chat:
        files.append((CHAT_TEMPLATE_FILE, chat["template"], 0o644))
    for name, text, mode in files:
        tmp = d / f".{name}.tmp"
        tmp.write_text(text)
        os.chmod(tmp, mode)
        os.replace(tmp, d / name)
