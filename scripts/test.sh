#!/usr/bin/env bash
# The test command: sets up the environment if needed, then runs the whole suite
# (unit + integration; end-to-end tests marked `slow` are deselected, the default one is not marked).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
export DSPARK_CACHE=${DSPARK_CACHE:-$PWD/.cache}
export WANDB_MODE=offline TOKENIZERS_PARALLELISM=false  # (Ray's token authentication: tests/conftest.py)
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$DSPARK_CACHE/torch_extensions}
exec .venv/bin/python -m pytest -m "not slow" "$@"
