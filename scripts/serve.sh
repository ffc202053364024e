#!/usr/bin/env bash
# Serve the target with a DSpark drafter checkpoint, by the recipe of the checkpoint's config.json:
#   [TARGET=/path/to/target] scripts/serve.sh DRAFTER_DIR [extra vllm serve arguments, e.g. --tensor-parallel-size 8]
# The `vllm serve` command is built here, by dspark/recipe.py (`python -m dspark.recipe --serve`), from
# DRAFTER_DIR/config.json alone: method dspark, num_speculative_tokens from the checkpoint (8 for a block of 8),
# draft_sample_method probabilistic, rejection_sample_method block, the chat template it trained with. Nothing in
# DRAFTER_DIR is executed (a downloaded drafter is someone else's files): its serve.sh is for reading, and the
# verifier name in config.json must be a model id or a plain path. `--trust-remote-code` is passed only when you
# give it among the extra arguments, if you trust the target's own model code; a config.json never turns it on.
# `method: dspark` runs on vLLM's GPU (V2) model runner only; the CPU build of vLLM cannot execute it.
# See `python -m dspark.recipe DRAFTER_DIR` for the config and why.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DRAFTER=${1:?usage: scripts/serve.sh DRAFTER_DIR [vllm serve arguments]}
shift
[ -f "$DRAFTER/config.json" ] || { echo "no config.json in $DRAFTER: not a drafter checkpoint" >&2; exit 2; }
PY=${PYTHON:-}
[ -n "$PY" ] || { [ -x "$ROOT/.venv/bin/python" ] && PY="$ROOT/.venv/bin/python"; } || PY=python3
# -P: dspark is imported from $ROOT, never from the current directory (it may be the drafter's).
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" -P -m dspark.recipe --serve "$DRAFTER" -- "$@"
