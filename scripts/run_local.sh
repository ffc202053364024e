#!/usr/bin/env bash
# The main job on the embedded default (configs/local.yaml): sets up the environment, starts a
# local Ray head with its dashboard on 127.0.0.1:8265 if none is running, submits the job with
# `ray job submit` and streams its log, with a Prometheus beside the head (scripts/monitor.sh;
# DSPARK_MONITOR=0: none). Extra arguments are config overrides (key=value), after an
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
# Ray turns `--node-ip-address 127.0.0.1` into the machine's address (`resolve_ip_for_localhost`),
# and its processes then listen on every interface or on that address: GCS, raylet, workers, the
# agents, the client server, and the Prometheus endpoints of the autoscaler monitor, the dashboard
# and the metrics agent (those three answer without the token). Ray's switch for a one-machine
# cluster, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (named for its default on Windows and macOS; read by
# every Ray process, which inherit it from `ray start`), makes the node's address 127.0.0.1, and
# every one of them listens on loopback (measured with Ray 2.60: no listener left beyond it). It
# also makes `ray start --address` refuse to add another node, which a local head never has.
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
# Token authentication besides: another user of this machine reaches loopback too. The token
# lives in a file only this user can read; the head, this script's CLI calls and the job's
# processes (started by the head) all use it.
export RAY_AUTH_MODE=token
export RAY_AUTH_TOKEN_PATH=${RAY_AUTH_TOKEN_PATH:-$DSPARK_CACHE/ray-auth-token}
if [ ! -s "$RAY_AUTH_TOKEN_PATH" ]; then
    mkdir -p "$(dirname "$RAY_AUTH_TOKEN_PATH")"
    (umask 077 && python -c "import secrets; print(secrets.token_hex(32))" > "$RAY_AUTH_TOKEN_PATH")
fi
DASH=http://127.0.0.1:8265
# A Prometheus beside the head (scripts/monitor.sh: loopback only, Ray's own scrape targets, the
# alerting rules, stopped with the head); DSPARK_MONITOR=0 goes without. The head's dashboard reads
# it (its Metrics view) through RAY_PROMETHEUS_HOST, which it takes from its environment at `ray start`.
PROM_PORT=${DSPARK_PROMETHEUS_PORT:-9090}
export RAY_PROMETHEUS_HOST=${RAY_PROMETHEUS_HOST:-http://127.0.0.1:$PROM_PORT}
# A port probe, not `ray status`: that one takes about a minute to give up when no head runs.
if ! python -c "import socket; socket.create_connection(('127.0.0.1', 6379), 2)" 2>/dev/null; then
    echo "[run_local] starting a local Ray head (dashboard: $DASH, token authentication)"
    ray start --head --node-ip-address 127.0.0.1 --port 6379 --dashboard-host 127.0.0.1 --dashboard-port 8265 \
        --num-cpus "${DSPARK_RAY_CPUS:-4}" --num-gpus 0 --disable-usage-stats >/dev/null
else
    # A head is ours only if its job API refuses a request without the token and accepts ours: one
    # that answers without the token runs unauthenticated (whoever reaches it can run code as
    # this user), one that refuses ours was started with another token.
    python - "$DASH" <<'PY' || exit 2
import os, sys, urllib.error, urllib.request

def status(headers):
    try:
        return urllib.request.urlopen(urllib.request.Request(sys.argv[1] + "/api/jobs/", headers=headers), timeout=10).status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError as e:
        return f"no answer ({e})"

token = open(os.environ["RAY_AUTH_TOKEN_PATH"]).read().strip()
without, with_ours = status({}), status({"Authorization": "Bearer " + token})
if isinstance(without, str):
    sys.exit(f"[run_local] something listens on port 6379 but no Ray job API answers at {sys.argv[1]}: {without}; "
             "if it is a Ray head without its dashboard, stop it with 'ray stop' and run this again")
if without not in (401, 403):
    sys.exit(f"[run_local] the Ray head on port 6379 answers its job API ({sys.argv[1]}) without a token "
             f"(HTTP {without}): it runs without authentication, and this script will not submit to it; stop "
             "it with 'ray stop' and run this again (it then starts a head with token authentication)")
if with_ours != 200:
    sys.exit(f"[run_local] the Ray head on port 6379 does not accept this token ({os.environ['RAY_AUTH_TOKEN_PATH']}, "
             f"HTTP {with_ours}): it was started otherwise; stop it with 'ray stop' and run this again")
PY
fi
# The config and the overrides go in the job's environment ($DSPARK_JOB_ARGS), not on the
# entrypoint: Ray runs the entrypoint through a shell, which would read a `$` or `;` in them.
if [ "${DSPARK_MONITOR:-1}" != 0 ]; then
    DSPARK_PROMETHEUS_PORT=$PROM_PORT scripts/monitor.sh start \
        || echo "[run_local] no Prometheus beside the head (see above); the job runs without it" >&2
fi
ENV_JSON=$(python scripts/runtime_env.py --config "$CONFIG" "output_dir=$ROOT/outputs" "$@")
exec ray job submit --address "$DASH" --working-dir . --runtime-env-json "$ENV_JSON" -- python jobs/train_kimi_k3.py
