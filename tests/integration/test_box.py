"""The box's plan on this machine (configs/local.yaml's `box_plan`): the probe (the job's drafter
on the real target's weights, the target's own decode), the plan it chooses applied to the
config, and the record result.json carries; on one core (`taskset`) the plan sees one core."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from cluster.box import Choices, Paces, Workload, choose_plan, plan_box, startup_seconds
from cluster.config_load import load_config
from cluster.data import load_prompts
from cluster.hardware import read_cpu

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # the probe, ~30 s (unit tests judge the choice from injected paces in the default run)
def test_the_plan_is_probed_chosen_and_applied(smol_target):
    # a probe now, not paces kept from an earlier run on this machine
    cfg = load_config(
        ROOT / "configs" / "local.yaml", ["run_name=box", "trainer.time_budget_s=300", "box_plan.keep_paces_s=0"]
    )
    file_cfg = load_config(ROOT / "configs" / "local.yaml")
    written = SimpleNamespace(
        cap=file_cfg.data.max_prompts_per_category,
        answer=file_cfg.sampling.max_tokens,
        split=(file_cfg.inference.cpu_threads, file_cfg.trainer.torch_threads),
    )
    record = plan_box(cfg, None, time.monotonic())
    assert cfg.data.max_prompts_per_category == record["prompts_per_category"] in (12, 24, 48)
    assert cfg.sampling.max_tokens == record["answer_tokens"] in (64, 96, 128)
    assert (cfg.inference.cpu_threads, cfg.trainer.torch_threads) == (
        record["replica_threads"],
        record["trainer_threads"],
    )
    cores = read_cpu().usable_cores
    w, paces = record["workload"], record["paces"]
    assert w["usable_cores"] == cores and cfg.trainer.torch_threads_when_idle == cores
    assert sorted(paces["first_step_s"]) == list(range(1, cores + 1)) and min(paces["first_step_s"].values()) > 0
    assert (
        sorted(paces["generation_tok_s"]) == list(range(1, cores + 1)) and min(paces["generation_tok_s"].values()) > 0
    )
    # a sample's later epoch skips the target's full-vocabulary normaliser: cheaper than its first
    # (within the noise of a few timed steps on a shared machine: the suite's other work beside it
    # once made the later steps 3% slower)
    assert list(paces["later_step_s"]) == [cores] and paces["later_step_s"][cores] < 1.15 * paces["first_step_s"][cores]
    # the window is the budget less the start-up allowance (60 s at the reference pace, more on a
    # slower box) and what the probe itself took
    assert w["startup_s"] == round(startup_seconds(60.0, paces["generation_tok_s"][cores]), 1) >= 60
    assert 300 - w["startup_s"] - 2 * paces["probe_s"] - 5 < w["train_window_s"] < 300 - w["startup_s"]
    # the record alone gives the same plan: the pure function over what was probed
    again = choose_plan(
        Workload(
            w["prompts_per_category"],
            w["prompt_tokens"],
            cfg.trainer.batch_tokens,
            w["train_window_s"],
            cores,
            cfg.data.epochs,
        ),
        Paces(paces["generation_tok_s"], paces["first_step_s"], paces["later_step_s"], paces["source"]),
        # the config's own choice is the baseline (plan_box changed `cfg`: the file's values)
        Choices(
            (12, 24, 48),
            (64, 96, 128),
            cfg.box_plan.target_epochs,
            baseline=(written.cap, written.answer),
            baseline_split=written.split,
        ),
    )
    rounded = ("generation_s", "epochs", "reasons", "trained_samples")  # the record's window is to 0.1 s
    assert {k: record[k] for k in again.to_dict() if k not in rounded} == {
        k: v for k, v in again.to_dict().items() if k not in rounded
    }
    assert abs(record["trained_samples"] - again.trained_samples) <= 2
    # what the job then trains on is the plan's prompts
    train, _ = load_prompts(cfg)
    assert (
        len(train)
        == record["prompts"]
        == sum(min(record["prompts_per_category"], n) for n in w["prompts_per_category"].values())
    )
    json.dumps(record)  # result.json carries it as it is


@pytest.mark.slow  # a second probe, ~40 s
def test_on_one_core_the_plan_sees_one_core(smol_target):
    if not hasattr(__import__("os"), "sched_setaffinity"):
        pytest.skip("no CPU affinity on this platform")
    code = (
        "import json, time; from cluster.config_load import load_config; from cluster.box import plan_box; "
        "cfg = load_config('configs/local.yaml', "
        "['run_name=box1', 'trainer.time_budget_s=300', 'box_plan.keep_paces_s=0']); "
        "r = plan_box(cfg, None, time.monotonic()); "
        "print(json.dumps({'w': r['workload'], 'p': r['paces'], 'r': r['replica_threads'], 't': r['trainer_threads'],"
        " 'idle': cfg.trainer.torch_threads_when_idle}))"
    )
    out = subprocess.run(
        ["taskset", "-c", "0", sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["w"]["usable_cores"] == 1 and (r["r"], r["t"], r["idle"]) == (1, 1, 1)
    assert list(r["p"]["first_step_s"]) == ["1"] and list(r["p"]["generation_tok_s"]) == ["1"]
