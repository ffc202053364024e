#!/usr/bin/env bash
# Idempotent set-up of a CPU development environment in ./.venv.
# Safe to run again: every step checks whether it is already done.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${DSPARK_VENV:-$ROOT/.venv}
STAMP="$VENV/.dspark-bootstrap"
# The stamp records the inputs of the install; a change to any of them reinstalls.
WANT=$(cat pyproject.toml constraints/cpu.lock scripts/bootstrap.sh | sha256sum | cut -c1-16)

# Mooncake's TCP transport links against libibverbs even without RDMA hardware; vLLM's CPU guide
# preloads tcmalloc into its engines (inference.preload: +12% generation measured on a 2-core EPYC).
# (not `ldconfig -p | grep -q`: grep stops at the first match, and under pipefail ldconfig's
# SIGPIPE then reads as "not installed", which reinstalled libibverbs1 on every run)
NEED=""
LIBS=$(ldconfig -p 2>/dev/null || true)
grep libibverbs.so.1 <<<"$LIBS" >/dev/null || NEED="$NEED libibverbs1"
grep libtcmalloc_minimal.so.4 <<<"$LIBS" >/dev/null || NEED="$NEED libtcmalloc-minimal4"
# Prometheus and promtool (scripts/monitor.sh, the alerting rules' tests, scripts/test.sh's check).
command -v promtool >/dev/null && command -v prometheus >/dev/null || NEED="$NEED prometheus"
if [ -n "$NEED" ]; then
    echo "[bootstrap] installing$NEED"
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
    # shellcheck disable=SC2086
    $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends $NEED >/dev/null
    if [[ " $NEED " == *" prometheus "* ]]; then
        # Debian's package enables a service of its own (every interface, port 9090) and starts it
        # where an init system lets it (a container's policy-rc.d refuses): stopped and disabled;
        # ours is scripts/monitor.sh's, on loopback.
        if [ -d /run/systemd/system ]; then
            $SUDO systemctl disable --now prometheus >/dev/null 2>&1 || true
        else
            $SUDO update-rc.d prometheus disable >/dev/null 2>&1 || true
            if [ -s /run/prometheus/prometheus.pid ]; then $SUDO /etc/init.d/prometheus stop >/dev/null 2>&1 || true; fi
        fi
    fi
fi

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
    exit 0
fi

echo "[bootstrap] creating $VENV"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# Every package at the version constraints/cpu.lock records, with --no-deps: no resolution, so
# nothing moves between machines and nothing the lock leaves out (torchvision & co.) comes in.
# The installer: uv by default, DSPARK_INSTALLER=pip for pip. A fresh clone on a 2-core Xeon
# (Ice Lake), empty caches, this script end to end: uv 1:44, pip 3:05 from the same lock, and
# 3:25 for pip resolving pyproject.toml as before the lock (1:32 for uv with its cache warm; about
# 40 s of each is DeepSpeed's op build and the import check). uv reads none of pip's settings:
# it is pointed at the same find-links (where a machine keeps the CPU build of torch).
INSTALLER=${DSPARK_INSTALLER:-uv}
if [ "$INSTALLER" = uv ]; then
    "$VENV/bin/python" -m pip install -q uv==0.13.9
    export UV_FIND_LINKS=${UV_FIND_LINKS:-${PIP_FIND_LINKS:-}}
    INSTALL=("$VENV/bin/uv" pip install -q --python "$VENV/bin/python")
else
    "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
    INSTALL=("$VENV/bin/python" -m pip install -q)
fi
"${INSTALL[@]}" --no-deps -r constraints/cpu.lock \
    || { echo "[bootstrap] installing constraints/cpu.lock failed; torch==2.13.0+cpu is on PyTorch's CPU index" \
              "(PIP_EXTRA_INDEX_URL / UV_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu)" >&2; exit 1; }
DS_BUILD_OPS=0 "${INSTALL[@]}" --no-deps -e .
"$VENV/bin/python" -c "import torch, transformers, vllm, mooncake, ray, deepspeed, speculators" 2>/dev/null \
    || { echo "[bootstrap] import check failed" >&2; exit 1; }
# DeepSpeed's shared-memory allreduce op (the gloo trainer's), built now with the venv's ninja as
# the trainer builds it (cluster/training/trainer_rank.py), into the cache the jobs and tests use: not inside the
# first job's start-up.
PATH="$VENV/bin:$PATH" TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-${DSPARK_CACHE:-$ROOT/.cache}/torch_extensions} \
    "$VENV/bin/python" -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" \
    >/dev/null || { echo "[bootstrap] building DeepSpeed's shm op failed" >&2; exit 1; }
echo "$WANT" > "$STAMP"
echo "[bootstrap] environment ready"
