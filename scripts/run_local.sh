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
# Ray's processes listen on every interface whatever --node-ip-address says (GCS, raylet, the
# dashboard agent, the client server): token authentication is what keeps others out. The token
# lives in a file only this user can read; the head, this script's CLI calls and the job's
# processes (started by the head) all use it.
export RAY_AUTH_MODE=token
export RAY_AUTH_TOKEN_PATH=${RAY_AUTH_TOKEN_PATH:-$DSPARK_CACHE/ray-auth-token}
if [ ! -s "$RAY_AUTH_TOKEN_PATH" ]; then
    mkdir -p "$(dirname "$RAY_AUTH_TOKEN_PATH")"
    (umask 077 && python -c "import secrets; print(secrets.token_hex(32))" > "$RAY_AUTH_TOKEN_PATH")
fi
DASH=http://127.0.0.1:8265
# A port probe, not `ray status`: that one takes about a minute to give up when no head runs.
if ! python -c "import socket; socket.create_connection(('127.0.0.1', 6379), 2)" 2>/dev/null; then
    echo "[run_local] starting a local Ray head (dashboard: $DASH, token authentication)"
    ray start --head --node-ip-address 127.0.0.1 --port 6379 --dashboard-host 127.0.0.1 --dashboard-port 8265 \
        --num-cpus "${DSPARK_RAY_CPUS:-4}" --num-gpus 0 --disable-usage-stats >/dev/null
elif ! python - "$DASH" <<'PY'
import sys, urllib.request, os
req = urllib.request.Request(sys.argv[1] + "/api/jobs/", headers={"Authorization": "Bearer " + open(os.environ["RAY_AUTH_TOKEN_PATH"]).read().strip()})
urllib.request.urlopen(req, timeout=10)
PY
then
    echo "[run_local] a Ray head runs on port 6379 but does not accept this token ($RAY_AUTH_TOKEN_PATH):" \
         "it was started otherwise; stop it with 'ray stop' and run this again" >&2
    exit 2
fi
# The config and the overrides go in the job's environment ($DSPARK_JOB_ARGS), not on the
# entrypoint: Ray runs the entrypoint through a shell, which would read a `$` or `;` in them.
ENV_JSON=$(python scripts/runtime_env.py --config "$CONFIG" "output_dir=$ROOT/outputs" "$@")
exec ray job submit --address "$DASH" --working-dir . --runtime-env-json "$ENV_JSON" -- python jobs/train_kimi_k3.py
