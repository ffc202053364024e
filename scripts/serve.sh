#!/usr/bin/env bash
# Serve the target with a DSpark drafter checkpoint, by the checkpoint's own recipe:
#   [TARGET=/path/to/target] scripts/serve.sh DRAFTER_DIR [extra vllm serve arguments, e.g. --tensor-parallel-size 8]
# The recipe is DRAFTER_DIR/serve.sh, which the job writes beside the final checkpoint (dspark/recipe.py, from
# the checkpoint's config.json): method dspark, num_speculative_tokens from the checkpoint (8 for a block of 8),
# draft_sample_method probabilistic, rejection_sample_method block. A checkpoint without one (an intermediate
# checkpoint) gets it written first, by the same code. `method: dspark` runs on vLLM's GPU (V2) model runner
# only; the CPU build of vLLM cannot execute it. See `python -m dspark.recipe DRAFTER_DIR` for the config and why.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DRAFTER=${1:?usage: scripts/serve.sh DRAFTER_DIR [vllm serve arguments]}
shift
[ -f "$DRAFTER/config.json" ] || { echo "no config.json in $DRAFTER: not a drafter checkpoint" >&2; exit 2; }
if [ ! -x "$DRAFTER/serve.sh" ]; then
    PY=${PYTHON:-}
    [ -n "$PY" ] || { [ -x "$ROOT/.venv/bin/python" ] && PY="$ROOT/.venv/bin/python"; } || PY=python3
    PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m dspark.recipe --write-serve "$DRAFTER" >/dev/null
fi
exec "$DRAFTER/serve.sh" "$@"
