#!/usr/bin/env bash
# A Prometheus beside the local Ray head (scripts/run_local.sh starts both): `scripts/monitor.sh
# [start|stop|status]`. It listens on 127.0.0.1:${DSPARK_PROMETHEUS_PORT:-9090} only, scrapes the
# targets Ray's head writes to its service-discovery file (/tmp/ray/prom_metrics_service_discovery.json),
# loads deploy/prometheus/dspark_alerts.yaml, keeps its data in ${DSPARK_PROMETHEUS_DIR:-outputs/prometheus}
# (15 days, 1 GB at most) and stops with the head: a watcher probes the head's GCS port every 5 s.
# Ray's dashboard reads it when the head was started with RAY_PROMETHEUS_HOST naming it (run_local.sh
# does). The binary: Debian's `prometheus` package (scripts/bootstrap.sh installs it).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${DSPARK_PYTHON:-$ROOT/.venv/bin/python}
exec env PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m cluster.monitoring "${1:-start}" \
    --dir "${DSPARK_PROMETHEUS_DIR:-$ROOT/outputs/prometheus}" --port "${DSPARK_PROMETHEUS_PORT:-9090}" \
    --head "${DSPARK_RAY_HEAD:-127.0.0.1:6379}"
