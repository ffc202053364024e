"""The Ray job end to end on the local target (real vLLM CPU, Mooncake, DeepSpeed gloo), small:
exactly-once counts, a checkpoint speculators loads, a held-out τ, metrics on Ray's Prometheus
endpoint, every Grafana panel's query answered by a real Prometheus that scraped the job, every
listener of its processes on loopback or behind the token, and (slow) kill + resubmit resuming
from the last checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from cluster.config_load import load_config
from dspark import evaluate
from tests.helpers import FIXED_PLAN, QUICK_EVAL, eager_target, untrained_copy
from tests.integration.test_security import ListenerWatch

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
# Small, but trained enough to beat its untrained start: every category of the held-out prompts
# seen (3 prompts each), 4 epochs of 512-token steps after a short warm-up.
SMALL = [
    "data.epochs=4",
    "sampling.max_tokens=48",
    "trainer.checkpoint_interval=6",
    "data.eval_limit=3",
    "data.eval_max_new_tokens=32",
    "logging.progress_interval_s=5",
    "transport.segment_mb=256",
    "data.max_prompts_per_category=3",
    "trainer.batch_tokens=512",
    "trainer.warmup_steps=4",
    "data.calibration_prompts=6",
    FIXED_PLAN,
    *QUICK_EVAL,
]  # (the end-to-end test turns both sets back on)


def scrape(metric: str, run: str, timeout: float = 60.0) -> list[str]:
    """The Prometheus lines of `metric` that carry this run's tag (other tests' runs share the
    endpoint), waiting until the first one appears."""
    import ray

    node = ray._private.worker.global_worker.node
    url = f"http://{node.node_ip_address}:{node.metrics_export_port}/metrics"
    deadline = time.monotonic() + timeout
    lines = []
    while time.monotonic() < deadline:
        try:
            text = urllib.request.urlopen(url, timeout=5).read().decode()
        except OSError:
            text = ""
        # Ray exports application metrics with a `ray_` prefix.
        lines = [
            ln for ln in text.splitlines() if ln.split("{")[0] in (metric, "ray_" + metric) and f'run="{run}"' in ln
        ]
        if lines:
            return lines
        time.sleep(2)
    return lines


@pytest.fixture
def prometheus(ray_cluster, tmp_path):
    """A real Prometheus (scripts/monitor.sh's, cluster.monitoring) on a free loopback port, scraping
    this session's Ray node every 2 s with the shipped alerting rules loaded; killed at the end. (The
    session's Ray runs without its dashboard, which writes the service-discovery file: the node's
    metrics port is given instead.)"""
    from cluster.monitoring import Prometheus, config_text

    node = ray_cluster._private.worker.global_worker.node
    prom = Prometheus(tmp_path / "prometheus")
    try:
        prom.start(config_text(targets=[f"{node.node_ip_address}:{node.metrics_export_port}"], scrape_interval_s=2), 60)
        deadline = time.monotonic() + 30
        while not prom.targets_up() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert prom.targets_up(), prom.api("targets")
        yield prom
    finally:
        prom.stop()


def check_panels(prom, run: str, start: float) -> None:
    """Every panel's query of the Grafana dashboard evaluated through Prometheus over the job's
    time range: one that returns nothing for a series the job set fails, with the panel's title;
    the shipped alerting rules evaluated on the job's series without an error."""
    from tests.unit.test_dashboard import evaluate_panels, format_table

    # the job's last series (the held-out τ, set as it ended) scraped once more
    assert prom.wait_for(f'ray_dspark_heldout_tau{{run="{run}"}}', 30), "Prometheus never scraped the held-out τ"
    rows, failures = evaluate_panels(prom, run, start, time.time())
    print(f"[panels] run {run!r}, {time.time() - start:.0f} s of it, scraped every 2 s\n{format_table(rows)}")
    assert not failures, "\n".join(failures)
    rules = prom.rules()
    print("[alerts] " + ", ".join(f"{r['name']}: {r['health']}/{r.get('state', '-')}" for r in rules))
    assert rules and all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]


def test_job_end_to_end(ray_cluster, smol_target, tmp_path, prometheus):
    from cluster.job import TrainingJob

    long = tmp_path / "long.jsonl"  # a long-context set: one prompt under 512 tokens, one past it
    filler = " ".join(f"line {i}: nothing happened." for i in range(100))
    long.write_text(
        json.dumps({"id": "lc0", "prompt": "Summarise: the cat sat.", "category": "doc"})
        + "\n"
        + json.dumps({"id": "lc1", "prompt": filler + " Summarise the log above.", "category": "doc"})
        + "\n"
    )
    cfg = load_config(
        ROOT / "configs" / "local.yaml",
        [
            "run_name=e2e",
            f"output_dir={tmp_path}",
            "data.max_prompts=24",
            *SMALL,
            "data.eval_temperature=0.7",
            "data.eval_sampled_limit=2",
            f"data.long_context_prompts={long}",
            "data.long_context_max_new_tokens=8",
            # both long prompts whatever the hour's pace: at 20 s a slow hour of
            # a 2-core AMD EPYC (Zen 4) left the second out for time (the fit: test_decoder_training)
            "data.long_context_budget_s=120",
        ],
    )
    started = time.time()
    with ListenerWatch() as listeners:  # what tests/integration/test_security.py checks, on this job
        result = TrainingJob(cfg).run()
    # The job's series, first: Ray drops a gauge ~25 s after it was last set (measured on Ray
    # 2.60), and the job set them last as it ended.
    trained = scrape("dspark_samples_trained", "e2e")  # the job's world, all groups
    assert any(float(ln.rsplit(" ", 1)[1]) == 24 * cfg.data.epochs for ln in trained), trained
    assert any('group="g0"' in ln for ln in scrape("dspark_inference_replicas", "e2e"))  # and each group's side
    assert scrape("dspark_train_loss", "e2e") and scrape("dspark_heldout_tau", "e2e")
    check_panels(prometheus, "e2e", started)  # the dashboard against the job's real series
    proof = result["exactly_once"]
    assert proof["per_epoch"] == {str(e): 24 for e in range(cfg.data.epochs)} and proof["failed"] == []
    assert result["steps"] >= 2
    listeners.assert_safe()  # every listener of its processes on loopback or refusing a client without the token
    # what was trained as passes over the prompts; no box plan (FIXED_PLAN): the settings as written
    assert result["epochs"] == {"planned": 4, "kept": 4, "prompts": 24, "trained": 4.0} and result["plan"] is None
    run = tmp_path / "e2e"
    rows = [json.loads(line) for line in (run / "trained.jsonl").read_text().splitlines()]
    epochs = range(cfg.data.epochs)
    assert sorted(r["uid"] for r in rows) == sorted(f"{p}@{e}" for p in {r["prompt"] for r in rows} for e in epochs)
    assert len(rows) == 24 * cfg.data.epochs and all(r["rank"] == 0 and 1 <= r["step"] <= result["steps"] for r in rows)
    ev = result["evaluation"]
    assert ev["lossless"] is True and ev["num_prompts"] == 3
    # The drafter learned something: the same prompts, the same settings, decoded with the
    # drafter the job started from (its config and vocabulary, untrained) accept less.
    untrained = tmp_path / "untrained"
    untrained_copy(result["drafter"], smol_target, untrained, cfg.drafter.init)
    before = tmp_path / "untrained.json"
    assert (
        evaluate.main(
            [
                "--target",
                str(smol_target),
                "--drafter",
                str(untrained),
                "--prompts",
                str(tmp_path / "e2e" / "heldout.jsonl"),
                "--limit",
                str(cfg.data.eval_limit),
                "--max-new-tokens",
                str(cfg.data.eval_max_new_tokens),
                "--json",
                str(before),
            ]
        )
        == 0
    )
    untrained_tau = json.loads(before.read_text())["tau"]
    assert ev["tau"] > untrained_tau, (ev["tau"], untrained_tau)  # (measured: 1.045 against 1.000)
    ood = result["evaluation_sets"]["ood"]  # the never-trained set of configs/local.yaml
    assert ood["lossless"] is True and ood["num_prompts"] == 3 and (run / "eval-ood.json").exists()
    # Figures per category, from the categories of the prompts the evaluation took (round-robin).
    evaluated = json.loads((run / "eval.json").read_text())["requests"]
    assert sorted(ev["per_category"]) == sorted({r["category"] for r in evaluated}) and all(
        r["category"] for r in evaluated
    )
    for cat, c in ev["per_category"].items():  # pooled from eval.json's own rows
        mine = [r for r in evaluated if r["category"] == cat]
        steps = sum(r["steps"] for r in mine)
        assert c["tau"] == pytest.approx((steps + sum(r["accepted"] for r in mine)) / steps)
    # Sampled with the served recipe: the first 2 of the evaluated prompts at temperature 0.7.
    sampled = result["evaluation_sampled"]
    assert sampled["settings"]["temperature"] == 0.7 and sampled["lossless"] is None
    assert (sampled["settings"]["draft_sample_method"], sampled["settings"]["rejection_sample_method"]) == (
        "probabilistic",
        "block",
    )
    sampled_rows = json.loads((run / "eval-sampled.json").read_text())["requests"]
    assert [r["id"] for r in sampled_rows] == [r["id"] for r in evaluated[:2]]
    steps = sum(r["steps"] for r in sampled_rows)
    assert sampled["tau"] == pytest.approx((steps + sum(r["accepted"] for r in sampled_rows)) / steps)
    # The long-context set, by context length: a bucket per prompt, pooled from its rows.
    lc_rows = json.loads((run / "eval-long_context.json").read_text())["requests"]
    assert [r["id"] for r in lc_rows] == ["lc0", "lc1"] and lc_rows[0]["prompt_tokens"] < 512 <= lc_rows[1][
        "prompt_tokens"
    ]
    assert [(b["min_tokens"], b["num_prompts"], b["tau"]) for b in result["long_context"]["by_prompt_length"]] == [
        (0, 1, pytest.approx((lc_rows[0]["steps"] + lc_rows[0]["accepted"]) / lc_rows[0]["steps"])),
        (512, 1, pytest.approx((lc_rows[1]["steps"] + lc_rows[1]["accepted"]) / lc_rows[1]["steps"])),
    ]
    # The confidence head, calibrated on 6 held-out prompts nobody trained on or evaluated, its
    # calibration error measured before and after on the 3 evaluated ones.
    calibration = result["calibration"]
    assert calibration["calibration_prompts"] == 6 and calibration["measured_on_prompts"] == 3, calibration
    assert len(calibration["temperatures"]) == len(calibration["ece_before"]) == len(calibration["ece_after"]) > 0
    assert not set(calibration["prompt_ids"]) & ({r["prompt"] for r in rows} | {r["id"] for r in evaluated})
    # The pictures, drawn from the run's history (a row per step) and its evaluation.
    from cluster.job.history import read_history
    from cluster.job.plots import plot_data

    history = read_history(run / "history.jsonl")
    assert [r["step"] for r in history if r["kind"] == "step"] == list(range(1, result["steps"] + 1))
    assert sorted(result["plots"]) == ["acceptance", "generation", "tau_per_category", "training"]
    assert all(Path(p).read_bytes().startswith(b"\x89PNG") for p in result["plots"].values())
    drawn = plot_data(history, {"held-out": ev, "ood": ood})
    measured = sorted(c for c, f in ev["per_category"].items() if f["tau"] is not None)
    assert drawn["tau_per_category"]["tau per category: held-out"]["tau"] == (
        measured,
        [ev["per_category"][c]["tau"] for c in measured],
    )
    assert drawn["acceptance"]["acceptance per draft position"]["eval ood"][1] == ood["per_position_acceptance"]
    # The serving recipe and model card ship with the drafter.
    card = (Path(result["drafter"]) / "README.md").read_text()
    assert "| category |" in card and f"{ev['macro_tau']:.3f}" in card
    assert "## Acceptance at temperature 0.7" in card and "## Acceptance by context length" in card
    assert (Path(result["drafter"]) / "serve.sh").stat().st_mode & 0o111
    ckpts = sorted((run / "checkpoints").glob("step-*"))
    from cluster.data.ledger_checkpoint import ledger_problem

    assert ckpts and all((c / "drafter" / "config.json").exists() and ledger_problem(c) is None for c in ckpts)
    from speculators.model import SpeculatorModel

    sm = SpeculatorModel.from_pretrained(result["drafter"])
    assert type(sm).__name__ == "DSparkDraftModel" and sm.config.sample_from_anchor
    assert json.loads((run / "result.json").read_text())["tau"] == ev["tau"]
    # The default layout: the node's store daemon held the samples
    assert (run / "logs" / "mooncake_client.1.log").exists()
    # Served by vLLM itself (CPU: the backbone as `dflash`): lossless, and vLLM's τ is ours.
    served = tmp_path / "served.json"
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "serve_dflash_cpu.py"),
            "--target",
            str(smol_target),
            "--drafter",
            result["drafter"],
            "--prompts",
            str(run / "heldout.jsonl"),
            "--limit",
            "2",
            "--max-new-tokens",
            "24",
            "--json",
            str(served),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    s = json.loads(served.read_text())
    assert s["vllm_lossless"] is True and s["vllm"]["drafts"] > 0
    assert abs(s["vllm"]["tau"] - s["ours"]["tau"]) <= 0.05, (s["vllm"], s["ours"])

    # The served evaluation (the job's path where the target runs) reads every request's
    # verification steps from vLLM; pooled, they equal the engine-wide counters above, read
    # by another path in vLLM, for the same engine settings and prompts.
    import ray

    from cluster.inference import InferenceSettings, ServedEvalSettings, ServedEvaluator
    from dspark.checkpoint import export_dflash_backbone, load_drafter

    backbone = export_dflash_backbone(load_drafter(result["drafter"], smol_target), tmp_path / "dflash")
    held = [json.loads(line) for line in (run / "heldout.jsonl").read_text().splitlines()][:2]
    engine = InferenceSettings(eager_target(smol_target, dtype="float32"), [], "eval")
    evaluator = ray.remote(ServedEvaluator).remote(ServedEvalSettings(engine, str(backbone), "dflash", 24))
    served_ev = ray.get(evaluator.evaluate.remote(held), timeout=600)
    ray.kill(evaluator)
    assert served_ev["num_drafts"] == s["vllm"]["drafts"] and served_ev["num_accepted_tokens"] == s["vllm"]["accepted"]
    assert served_ev["per_position_acceptance"] == pytest.approx(s["vllm"]["per_position_acceptance"])
    assert sorted(served_ev["per_category"]) == sorted({h["category"] for h in held})


@pytest.mark.slow
def test_fault_driver_killed_and_resubmitted_with_vllm(ray_cluster, smol_target, tmp_path):
    """SIGKILL the job's driver after its first checkpoint; the rerun resumes from it and ends
    with every prompt trained exactly once."""
    from tests.helpers import kill_and_resubmit

    cmd = [
        sys.executable,
        str(ROOT / "jobs" / "train_kimi_k3.py"),
        "--config",
        str(ROOT / "configs" / "local.yaml"),
        "run_name=resume",
        f"output_dir={tmp_path}",
        "data.max_prompts=48",
        *SMALL,
        "data.max_prompts_per_category=null",
        "data.epochs=2",
    ]
    killed_at, second = kill_and_resubmit(cmd, tmp_path / "resume", tmp_path / "first.log")
    assert second.returncode == 0, second.stdout[-3000:]
    result = json.loads((tmp_path / "resume" / "result.json").read_text())
    assert any("resumed from" in e for e in result["events"])
    proof = result["exactly_once"]  # the record, rolled back to the checkpoint, then completed
    assert proof["per_epoch"] == {"0": 48, "1": 48} and proof["failed"] == [] and result["steps"] > killed_at
