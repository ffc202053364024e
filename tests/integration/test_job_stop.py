"""The job under a real Ray head, as a user runs it: `ray job submit` to a head started with `ray
start` (loopback, token authentication, as scripts/run_local.sh starts it), `ray job stop` in
each phase, and a driver started by hand beside that head.

- `ray job stop` during start-up, during the first answers' wait and during the end (export,
  evaluation): the driver ends by itself before Ray's stop wait runs out, Ray says STOPPED, and
  `result.json` says `stopped` with the phase it stopped in and how to resume.
- With the head up, `python jobs/train_kimi_k3.py ... trainer.max_steps=8` from a shell that has
  none of the head's Ray settings joins that head (it used to wait without end on the machine's
  address, where nothing listens) and finishes.

A head of its own (its own ports and temporary directory), not the test session's Ray: that one
has no job API (no dashboard). Removed at the end by its processes, never `ray stop` (which would
end every Ray on the machine, the session's too). Slow: four job starts, ~8 minutes on 2 cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.test_faults import N, replay_job

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
RAY_CLI = str(Path(sys.executable).parent / "ray")
STOP_WAIT_S = 120  # Ray kills the driver this long after `ray job stop`'s SIGTERM
JOB_DEADLINE_S = 600


def _free_ports(n: int) -> list[int]:
    from cluster.store import free_port

    ports: list[int] = []
    for _ in range(n):
        ports.append(free_port(avoid=ports))
    return ports


def _end_processes(marker: str, deadline_s: float = 15.0) -> None:
    """Every process whose command line names `marker` (the head's temporary directory: its GCS,
    raylet, dashboard, monitors), with their children (the workers, whose titles no longer
    name it): SIGTERM, then SIGKILL what is left after `deadline_s`."""
    import psutil

    roots = [p for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])]
    procs = {p.pid: p for r in roots for p in [r, *r.children(recursive=True)]}
    for p in procs.values():
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(list(procs.values()), timeout=deadline_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


@pytest.fixture(scope="module")
def ray_head(smol_target):
    """A Ray head as scripts/run_local.sh starts one: on 127.0.0.1 with Ray's one-machine switch,
    the dashboard and job API on loopback, the session's token, the stop wait the local job
    wants. Yields (GCS address, dashboard URL, the environment of the CLI calls)."""
    port, dash, client, agent = _free_ports(4)
    temp = Path(f"/tmp/rh-{os.getpid()}")  # Ray's socket paths must stay short
    env = {
        **os.environ,
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_AUTH_MODE": "token",
        "RAY_JOB_STOP_WAIT_TIME_S": str(STOP_WAIT_S),
    }
    head = (
        f"start --head --node-ip-address 127.0.0.1 --port {port} --dashboard-host 127.0.0.1 --dashboard-port {dash} "
        f"--ray-client-server-port {client} --dashboard-agent-listen-port {agent} --num-cpus 8 --num-gpus 0 "
        f"--disable-usage-stats --temp-dir {temp}"
    )
    started = subprocess.run(
        [RAY_CLI, *head.split()],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    try:
        assert started.returncode == 0, started.stdout[-3000:] + started.stderr[-3000:]
        yield f"127.0.0.1:{port}", f"http://127.0.0.1:{dash}", env
    finally:
        _end_processes(str(temp))
        subprocess.run(["rm", "-rf", str(temp)], check=False)


def _job_args(tmp_path, replay_dir, name: str, extra: list[str]) -> list[str]:
    return ["--config", str(ROOT / "configs" / "local.yaml"), *replay_job(tmp_path, replay_dir, name), *extra]


def _submit(dash: str, env: dict, sid: str, args: list[str]) -> None:
    # The arguments travel in the job's environment, as scripts/run_local.sh submits them.
    sys.path.insert(0, str(ROOT / "scripts"))
    from runtime_env import runtime_env

    renv = runtime_env(args, env)
    renv.pop("excludes")  # no working directory is uploaded: the driver runs this checkout
    out = subprocess.run(
        [RAY_CLI, "job", "submit", "--address", dash, "--no-wait", "--submission-id", sid,
         "--runtime-env-json", json.dumps(renv), "--", sys.executable, str(ROOT / "jobs" / "train_kimi_k3.py")],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]


def _wait_for_log(client, sid: str, marker: str, deadline_s: float = 300) -> str:
    deadline = time.monotonic() + deadline_s
    logs = ""
    while time.monotonic() < deadline:
        logs = client.get_job_logs(sid)
        if marker in logs:
            return logs
        status = client.get_job_status(sid)
        assert not status.is_terminal(), f"job {sid} ended ({status}) before {marker!r}:\n{logs[-4000:]}"
        time.sleep(0.5)
    raise AssertionError(f"no {marker!r} in job {sid}'s log within {deadline_s:.0f}s:\n{logs[-4000:]}")


def _wait_terminal(client, sid: str, deadline_s: float):
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        status = client.get_job_status(sid)
        if status.is_terminal():
            return status
        time.sleep(1)
    raise AssertionError(f"job {sid} still {client.get_job_status(sid)} after {deadline_s:.0f}s")


# (the phase to stop in, what the job's log says once it is in it, extra settings, the phase result.json names)
PHASES = {
    "start-up": ("placement:", [], "start-up"),
    # a draft vocabulary waits for the first answers (they are counted for it); slow producers
    # keep the wait open for a minute
    "first answers": (
        "waiting for the first",
        ["drafter.draft_vocab_size=2048", "inference.replay_samples_per_s=0.5"],
        "the first answers' wait",
    ),
    "end": ("exactly-once:", [], "the end"),  # 40 prompts x 2 epochs, all trained: `N`
}


@pytest.mark.parametrize("phase", list(PHASES))
def test_ray_job_stop_in_each_phase_leaves_a_stopped_result(ray_head, smol_target, replay_dir, tmp_path, phase):
    from ray.job_submission import JobStatus, JobSubmissionClient

    _, dash, env = ray_head
    marker, extra, named = PHASES[phase]
    name = f"stop-{phase.replace(' ', '-')}"
    sid = f"{name}-{os.getpid()}-{int(time.time())}"
    client = JobSubmissionClient(dash)
    _submit(dash, env, sid, _job_args(tmp_path, replay_dir, name, extra))
    _wait_for_log(client, sid, marker)
    stop = subprocess.run(
        [RAY_CLI, "job", "stop", "--address", dash, "--no-wait", sid], env=env, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert stop.returncode == 0, stop.stdout[-2000:] + stop.stderr[-2000:]
    status = _wait_terminal(client, sid, STOP_WAIT_S + 60)
    logs = client.get_job_logs(sid)
    assert status == JobStatus.STOPPED, f"{status}:\n{logs[-4000:]}"
    result_path = tmp_path / name / "result.json"
    assert result_path.exists(), f"no result.json after a stop during {phase}:\n{logs[-4000:]}"
    result = json.loads(result_path.read_text())
    assert result["status"] == "stopped" and "SIGTERM" in result["reason"], result
    assert result["phase"].startswith(named), (result["phase"], result["reason"])
    assert f"run_name={name}" in result["resume"], result["resume"]
    # the driver ended by itself (its own last words), not by Ray's SIGKILL after the stop wait
    assert "stopped (" in logs, logs[-4000:]
    if phase == "end":  # the last checkpoint holds every trained sample: a resume only ends the job
        proof = result["exactly_once"]
        assert result["checkpoint"] and proof["trained"] == 2 * N and not proof["failed"], result


def test_a_driver_started_by_hand_joins_the_head_beside_it(ray_head, smol_target, replay_dir, tmp_path):
    """The README's order: the local job's head still up, a job started by hand with RAY_ADDRESS
    (and the token) only — none of the head's Ray settings — joins it on loopback and finishes."""
    address, dash, env = ray_head
    own = {k: v for k, v in env.items() if not k.startswith("RAY_") and k != "WANDB_SERVICE"}
    own |= {"RAY_ADDRESS": address, "RAY_AUTH_MODE": "token"}
    own |= {k: env[k] for k in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH") if k in env}  # the session's token
    cmd = [sys.executable, str(ROOT / "jobs" / "train_kimi_k3.py"), *_job_args(tmp_path, replay_dir, "beside", [])]
    run = subprocess.run([*cmd, "trainer.max_steps=8"], env=own, capture_output=True, text=True, timeout=JOB_DEADLINE_S)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    result = json.loads((tmp_path / "beside" / "result.json").read_text())
    assert result["status"] == "completed" and result["steps"] == 8, result
    # it ran on that head (a driver that started a Ray of its own would not be listed there)
    listed = subprocess.run(
        [RAY_CLI, "list", "jobs", "--address", address, "--format", "json", "--limit", "100"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr[-2000:]
    drivers = [j for j in json.loads(listed.stdout) if j.get("type") == "DRIVER"]
    assert any(f"output_dir={tmp_path}" in (j.get("entrypoint") or "") for j in drivers), drivers
