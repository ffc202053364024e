#!/usr/bin/env bash
# The test command: sets up the environment if needed, then runs the whole suite
# (unit + integration; end-to-end tests marked `slow` are deselected, the default one is not marked).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
export DSPARK_CACHE=${DSPARK_CACHE:-$PWD/.cache}
export WANDB_MODE=offline TOKENIZERS_PARALLELISM=false  # (Ray's token authentication: tests/conftest.py)
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$DSPARK_CACHE/torch_extensions}
# The code's form first (seconds): ruff's linter and its formatter's check, as pyproject.toml sets
# them (`.venv/bin/ruff format .` fixes the second).
.venv/bin/ruff check --no-cache . && .venv/bin/ruff format --no-cache --check . \
    || { echo "[test] ruff: fix the findings above (ruff format . / ruff check --fix .)" >&2; exit 1; }
# Then the docs site (mkdocs.yml), built strict into a scratch folder: a broken link between
# pages, or a page that is missing, fails here (docs/configuration.md's freshness is a unit test).
SITE=$(mktemp -d)
.venv/bin/mkdocs build --strict -q -d "$SITE" \
    || { rm -rf "$SITE"; echo "[test] mkdocs build --strict: fix the docs findings above" >&2; exit 1; }
rm -rf "$SITE"
# The alerting rules' syntax (seconds; their behaviour: tests/unit/test_alerts.py, promtool test rules).
promtool check rules deploy/prometheus/dspark_alerts.yaml >/dev/null \
    || { promtool check rules deploy/prometheus/dspark_alerts.yaml; echo "[test] promtool: fix the rules above" >&2; exit 1; }
exec .venv/bin/python -m pytest -m "not slow" "$@"
