#!/usr/bin/env bash
# The main job on the embedded default (configs/local.yaml): sets up the environment, starts a
# local Ray head with its dashboard on 127.0.0.1:8265 if none is running, submits the job with
# `ray job submit` and streams its log. Extra arguments are config overrides (key=value), after an
# optional `--config FILE` (default configs/local.yaml; configs/local_2groups.yaml runs two groups).
# Submitting again with the same run_name resumes from the last checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CONFIG=configs/local.yaml
if [ "${1:-}" = "--config" ]; then CONFIG=$2; shift 2; fi
scripts/bootstrap.sh
# shellcheck disable=SC1091
. .venv/bin/activate
export DSPARK_CACHE=${DSPARK_CACHE:-$ROOT/.cache}
export RAY_AUTH_MODE=disabled
DASH=http://127.0.0.1:8265
# A port probe, not `ray status`: that one takes about a minute to give up when no head runs.
if ! python -c "import socket; socket.create_connection(('127.0.0.1', 6379), 2)" 2>/dev/null; then
    echo "[run_local] starting a local Ray head (dashboard: $DASH)"
    ray start --head --node-ip-address 127.0.0.1 --port 6379 --dashboard-host 127.0.0.1 --dashboard-port 8265 \
        --num-cpus "${DSPARK_RAY_CPUS:-4}" --num-gpus 0 --disable-usage-stats >/dev/null
fi
ENV_JSON=$(python - <<PY
import json, os
print(json.dumps({
    "excludes": [".git", ".venv", "outputs", ".cache", "**/__pycache__", "*.egg-info"],
    "env_vars": {
        "DSPARK_CACHE": os.environ["DSPARK_CACHE"],
        "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", os.environ["DSPARK_CACHE"] + "/torch_extensions"),
        "RAY_AUTH_MODE": "disabled", "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "MC_STORE_MEMCPY": "0",
        "PYTHONUNBUFFERED": "1", "GLOG_minloglevel": "2",
    },
}))
PY
)
exec ray job submit --address "$DASH" --working-dir . --runtime-env-json "$ENV_JSON" -- \
    python jobs/train_kimi_k3.py --config "$CONFIG" "output_dir=$ROOT/outputs" "$@"
