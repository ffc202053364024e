"""The alerting rules (deploy/prometheus/dspark_alerts.yaml) with promtool: its unit tests
(tests/prometheus/dspark_alerts_test.yaml: series in, alerts out) pass, every alert has a case that
fires it and one that does not, a severity and a runbook; the rules read only series the job
exports, counters as rates and gauges as gauges; the Prometheus operator's copy
(deploy/prometheus/dspark_prometheusrule.yaml) says the same. promtool comes with Debian's
`prometheus` package, which scripts/bootstrap.sh installs."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path

import yaml

from tests.unit.test_dashboard import SERIES, exported_kinds, misread_series

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "dspark_alerts.yaml"
OPERATOR = ROOT / "deploy" / "prometheus" / "dspark_prometheusrule.yaml"
TESTS = ROOT / "tests" / "prometheus" / "dspark_alerts_test.yaml"
LABEL = re.compile(r"\{\{\s*\$labels\.([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}")


def promtool() -> str:
    path = shutil.which("promtool")
    assert path, "no promtool: scripts/bootstrap.sh installs it (Debian's `prometheus` package)"
    return path


def rules() -> dict[str, dict]:
    return {r["alert"]: r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}


def render(template: str, labels: dict) -> str:
    return LABEL.sub(lambda m: str(labels.get(m[1], "")), template)


def with_annotations(tests: dict) -> dict:
    """The test file with every expected alert's annotations, rendered from the rules for its
    labels (those the file writes out itself stay as written)."""
    out, by_name = copy.deepcopy(tests), rules()
    for case in out["tests"]:
        for t in case.get("alert_rule_test", []):
            for alert in t.get("exp_alerts") or []:
                annotations = by_name[t["alertname"]]["annotations"]
                rendered = {k: render(v, alert["exp_labels"]) for k, v in annotations.items()}
                alert["exp_annotations"] = {**rendered, **alert.get("exp_annotations", {})}
                left = [k for k, v in alert["exp_annotations"].items() if "{{" in v]
                assert not left, f"{t['alertname']}: write out the annotations {left} in {TESTS.name}"
    return out


def test_the_alerts_fire_as_their_unit_tests_say(tmp_path):
    tests = with_annotations(yaml.safe_load(TESTS.read_text()))
    tests["rule_files"] = [str(RULES)]
    path = tmp_path / TESTS.name
    path.write_text(yaml.safe_dump(tests, sort_keys=False))
    out = subprocess.run([promtool(), "test", "rules", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert "SUCCESS" in out.stdout


def test_every_alert_is_tested_firing_and_quiet_and_has_a_runbook():
    tests = yaml.safe_load(TESTS.read_text())
    fired, quiet = set(), set()
    for case in tests["tests"]:
        for t in case["alert_rule_test"]:
            (fired if t.get("exp_alerts") else quiet).add(t["alertname"])
    names = set(rules())
    assert names == fired == quiet, (names, fired, quiet)
    for name, rule in rules().items():
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        runbook = rule["annotations"]["runbook"]
        assert "What it means:" in runbook and "What to do:" in runbook, name
        assert "{{ $labels.run }}" in rule["annotations"]["summary"], name


def test_the_rules_read_what_the_job_exports_as_its_kind():
    kinds = exported_kinds()
    for name, rule in rules().items():
        named = set(SERIES.findall(rule["expr"]))
        assert named and named <= set(kinds), (name, sorted(named - set(kinds)))
        assert misread_series(rule["expr"], kinds) == [], (name, rule["expr"])
        # every rule answers per run (Ray's own labels split a run's series by driver)
        assert re.search(r"\bby \(run\b", rule["expr"]), name


def test_promtool_checks_both_rule_files(tmp_path):
    docs = {d["kind"]: d for d in yaml.safe_load_all(OPERATOR.read_text())}
    assert docs["PrometheusRule"]["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]
    assert docs["PodMonitor"]["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    operator_rules = tmp_path / "operator_rules.yaml"
    operator_rules.write_text(yaml.safe_dump({"groups": docs["PrometheusRule"]["spec"]["groups"]}))
    for path in (RULES, operator_rules):
        out = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
