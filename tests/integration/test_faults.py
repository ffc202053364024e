"""Fault injection against the real job (local Ray, Mooncake master and store daemon, DeepSpeed
gloo; the replay backend instead of a target, whose producers can be told to crash or hang on a
prompt). For each fault the job either finishes, with its exactly-once proof (the training
record against the ledger: every prompt x epoch trained once, none lost, failures named) and the
fault's trace in its events, or stops within a stated time with an error that names the cause.

`test_fault_combined` (the default run's) injects a killed replica, a killed trainer rank, a
hung replica, a poison prompt and a non-finite step into one run;
`test_fault_driver_killed_and_resubmitted` kills the driver and resubmits; it and the
single-fault tests are `slow` (run them with `-m slow`; the suite's time budget)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from cluster.config_load import load_config
from tests.helpers import REPLAY_JOB_PINS

pytestmark = pytest.mark.integration
N = 40  # prompts; 2 epochs (greedy answers reused) = 80 samples


def replay_job(tmp_path, replay_dir, name: str) -> list[str]:
    """The job's settings for these tests: the replay backend, a small drafter, 40 prompts."""
    return [
        f"run_name={name}",
        f"output_dir={tmp_path}",
        "inference.backend=replay",
        f"inference.replay_dir={replay_dir}",
        "inference.replay_samples_per_s=20",
        "inference.prompt_batch=4",
        "drafter.draft_vocab_size=null",
        "drafter.num_anchors=4",
        "drafter.markov_rank=16",
        "trainer.batch_tokens=600",
        "trainer.checkpoint_interval=3",
        f"data.max_prompts={N}",
        "data.epochs=2",
        "data.eval_limit=1",
        "data.eval_max_new_tokens=8",
        "logging.wandb_mode=disabled",
        "logging.progress_interval_s=5",
        "transport.segment_mb=256",
        "inference.restart_backoff_s=0.02",
        "data.max_prompts_per_category=null",
        *REPLAY_JOB_PINS,
    ]


def start_job(tmp_path, replay_dir, name: str, overrides: list[str]):
    from cluster.job import TrainingJob

    return TrainingJob(load_config("configs/local.yaml", replay_job(tmp_path, replay_dir, name) + overrides))


def run_with(job, faults: list[tuple], timeout_s: float = 400.0):
    """Run `job`; each fault is (when(job) -> bool, inject(job)), fired once, in order, from a
    thread beside the training loop. Returns the result and what each injection returned."""
    fired, done = [], threading.Event()

    def ready(when) -> bool:
        try:
            return bool(job.gang is not None and job.gang.ranks and job.pools and when(job))
        except (KeyError, StopIteration, AttributeError):  # the job is still starting its parts
            return False

    def injector():
        deadline = time.monotonic() + timeout_s
        for when, inject in faults:
            while not done.is_set() and time.monotonic() < deadline:
                if ready(when):
                    try:
                        fired.append(inject(job))
                    except Exception as e:  # noqa: BLE001 - reported by the assertion below
                        fired.append(f"injection failed: {e!r}")
                    break
                time.sleep(0.1)

    threading.Thread(target=injector, daemon=True).start()
    try:
        result = job.run()
    finally:
        done.set()
    assert len(fired) == len(faults) and not any(str(f).startswith("injection failed") for f in fired), (
        f"{len(fired)} of {len(faults)} faults were injected: {fired}"
    )
    return result, fired


def at_step(n: int):
    return lambda job: job.stats.step >= n


def kill_replica(job):
    import ray

    pool = job.pools["g0"]
    rid, rep = next(iter(pool.replicas.items()))
    ray.kill(rep.actor)
    return rid


def kill_rank(job):
    import ray

    ray.kill(job.gang.ranks[0])
    return "rank0"


def assert_exactly_once(result, failed=(), epochs=2):
    proof = result["exactly_once"]
    assert sorted(proof["failed"]) == sorted(failed), proof["failed"]
    expect = {e: N - sum(u.endswith(f"@{e}") for u in failed) for e in range(epochs)}
    assert proof["per_epoch"] == {str(e): n for e, n in expect.items()}, proof
    assert proof["trained"] == epochs * N - len(failed) and result["ended_by"] == "data"


def test_fault_combined(ray_cluster, smol_target, replay_dir, tmp_path):
    """Five faults in one run: a replica hangs on dspark-0020 (killed after 5 s); then the
    replica is killed; then, from step 6, trainer rank 0 (the world restarts from its last
    checkpoint); dspark-0030 kills every replica that takes it (FAILED after 3 attempts, alone:
    the prompts of its batch go through; quarantined in both epochs); step 12's loss is NaN on
    rank 0 (the update is skipped on every rank, its samples retried). Five replica deaths: the
    default budget (inference.max_replica_restarts=5)."""
    job = start_job(
        tmp_path,
        replay_dir,
        "combined",
        [
            "testing.replay_hang_on=[dspark-0020]",
            "testing.replay_crash_on=[dspark-0030]",
            "inference.generation_timeout_s=5",
            "testing.nonfinite_steps=[12]",
            "data.max_failed_fraction=0.05",
        ],
    )
    hung_killed = lambda j: any("hung" in e for e in j.pools["g0"].events) and j.pools["g0"].replicas  # noqa: E731
    result, fired = run_with(job, [(hung_killed, kill_replica), (at_step(6), kill_rank)])
    events = result["events"] + result["groups"]["g0"]["events"]
    assert any(
        e.startswith("trainer world restarted from step-00000") and "a trainer rank died" in e for e in events
    ), events
    assert any("hung: a prompt generating for" in e for e in events), events
    assert any(f"replica {fired[0]} died" in e for e in events), events
    assert any("step 12: non-finite loss on ranks [0]; update skipped" in e for e in events), events
    assert result["failed_examples"]["dspark-0030@0"][-1].startswith("replica g0-r"), result["failed_examples"]
    assert list(result["quarantined"]) == ["dspark-0030"], result["quarantined"]
    assert_exactly_once(result, failed=["dspark-0030@0", "dspark-0030@1"])


@pytest.mark.slow
def test_fault_driver_killed_and_resubmitted(ray_cluster, smol_target, replay_dir, tmp_path):
    """SIGKILL the job's driver (the Ray job's entry script) after its first checkpoint: every
    actor of the job goes with it; the same command again resumes from the checkpoint (ledger
    and training record rolled back to it) and ends with every prompt trained exactly once."""
    import json
    import sys

    from tests.helpers import kill_and_resubmit

    root = Path(__file__).resolve().parents[2]
    cmd = [
        sys.executable,
        str(root / "jobs" / "train_kimi_k3.py"),
        "--config",
        str(root / "configs" / "local.yaml"),
        *replay_job(tmp_path, replay_dir, "resubmit"),
        "inference.replay_samples_per_s=10",
    ]
    _, second = kill_and_resubmit(cmd, tmp_path / "resubmit", tmp_path / "first.log", 300, 600)
    assert second.returncode == 0, second.stdout[-3000:]
    result = json.loads((tmp_path / "resubmit" / "result.json").read_text())
    assert any(e.startswith("resumed from") for e in result["events"]), result["events"]
    assert_exactly_once(result)


@pytest.mark.slow
def test_stop_mid_training_checkpoints_and_the_resubmitted_job_ends_exactly_once(
    ray_cluster, smol_target, replay_dir, tmp_path
):
    """SIGTERM to the driver's process group (what `ray job stop` sends) after its first
    checkpoint: the driver ends by itself with a checkpoint of what it trained and result.json
    saying `stopped` and how to resume; the same command again ends with every prompt trained
    exactly once."""
    import json
    import signal
    import sys

    from tests.helpers import kill_and_resubmit

    root = Path(__file__).resolve().parents[2]
    cmd = [
        sys.executable,
        str(root / "jobs" / "train_kimi_k3.py"),
        "--config",
        str(root / "configs" / "local.yaml"),
        *replay_job(tmp_path, replay_dir, "stopped"),
        "inference.replay_samples_per_s=10",
    ]
    run_dir = tmp_path / "stopped"
    holder = {}

    def stopped_result():  # read between the runs: the second one overwrites result.json
        holder["result"] = json.loads((run_dir / "result.json").read_text())

    killed_at, second = kill_and_resubmit(
        cmd, run_dir, tmp_path / "first.log", 300, 600, sig=signal.SIGTERM, stop_wait_s=120, between=stopped_result
    )
    first = holder["result"]
    assert first["status"] == "stopped" and "SIGTERM" in first["reason"], first
    assert first["checkpoint"].endswith(f"step-{first['steps']:06d}") and killed_at == first["steps"], first
    assert "run_name=stopped" in first["resume"], first["resume"]
    assert first["exactly_once"]["trained"] > 0, first["exactly_once"]
    assert second.returncode == 0, second.stdout[-3000:]
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "completed"
    assert any(e.startswith("resumed from") for e in result["events"]), result["events"]
    assert_exactly_once(result)


def test_stop_during_start_up_releases_what_was_placed(ray_cluster, smol_target, replay_dir, tmp_path):
    """A stop that arrives once the placement groups exist ends the start-up at its next phase:
    result.json says stopped, nothing was trained, and every placement group is removed."""
    from ray.util import placement_group_table

    from cluster.control import Stop

    job = start_job(tmp_path, replay_dir, "stop-start", [])

    def stop_once_placed():
        deadline = time.monotonic() + 120
        while not job.placed and time.monotonic() < deadline:
            time.sleep(0.05)
        job.control.send(Stop("SIGTERM received"))

    threading.Thread(target=stop_once_placed, daemon=True).start()
    result = job.run()
    assert result["status"] == "stopped" and "during start-up" in result["reason"], result
    assert result["steps"] == 0 and result["checkpoint"] is None, result
    groups = {p.pg.id.hex() for p in job.placed}
    assert groups, "nothing was placed before the stop"
    states = {pg_id: info["state"] for pg_id, info in placement_group_table().items() if pg_id in groups}
    assert states and set(states.values()) == {"REMOVED"}, states


def run_one(tmp_path, replay_dir, name, overrides, faults):
    job = start_job(tmp_path, replay_dir, name, overrides)
    result, fired = run_with(job, faults)
    return job, result, fired, result["events"] + [e for g in result["groups"].values() for e in g["events"]]


@pytest.mark.slow
def test_fault_replica_killed(ray_cluster, smol_target, replay_dir, tmp_path):
    _, result, fired, events = run_one(tmp_path, replay_dir, "kill-replica", [], [(at_step(3), kill_replica)])
    assert any(f"replica {fired[0]} died" in e for e in events), events
    assert_exactly_once(result)


@pytest.mark.slow
def test_fault_trainer_rank_killed(ray_cluster, smol_target, replay_dir, tmp_path):
    _, result, _, events = run_one(tmp_path, replay_dir, "kill-rank", [], [(at_step(4), kill_rank)])
    assert any(e.startswith("trainer world restarted from step-000003") for e in events), events
    assert_exactly_once(result)


@pytest.mark.slow
def test_fault_trainer_rank_hung(ray_cluster, smol_target, replay_dir, tmp_path):
    # A rank that stops answering (SIGSTOP) is past trainer.call_timeout_s: the world restarts.
    import os
    import signal

    import ray

    def freeze_rank(job):
        pid = ray.get(job.gang.ranks[0].__ray_call__.remote(lambda self: os.getpid()), timeout=30)
        os.kill(pid, signal.SIGSTOP)
        return pid

    # (30 s: the deadline bounds every call, the ranks' set-up too, which takes ~12 s on a 2-core EPYC)
    _, result, _, events = run_one(
        tmp_path, replay_dir, "hung-rank", ["trainer.call_timeout_s=30"], [(at_step(4), freeze_rank)]
    )
    assert any("did not finish" in e and "trainer.call_timeout_s" in e for e in events), events
    assert_exactly_once(result)


@pytest.mark.slow
def test_fault_replica_hung_in_start_up(ray_cluster, smol_target, replay_dir, tmp_path):
    """The first replica never finishes its constructor (an engine that hangs while it loads):
    after inference.start_timeout_s it is killed and replaced, and the job ends exactly-once."""
    _, result, _, events = run_one(
        tmp_path, replay_dir, "hung-start", ["testing.replay_start_hangs=1", "inference.start_timeout_s=5"], []
    )
    assert any(
        "g0-r0 died (hung in start-up: its engine had not started after" in e and "inference.start_timeout_s=5" in e
        for e in events
    ), events
    assert result["groups"]["g0"]["replicas"] == 1
    assert_exactly_once(result)


@pytest.mark.slow
def test_fault_trainer_rank_killed_in_its_first_set_up(ray_cluster, smol_target, replay_dir, tmp_path):
    """Rank 0 killed as soon as the world exists (its first set-up, or before the first step):
    the world is restarted from scratch like any failed one, not the end of the job."""
    job, result, _, events = run_one(
        tmp_path, replay_dir, "kill-rank-at-start", [], [(lambda j: j.stats.step == 0, kill_rank)]
    )
    assert any(e.startswith("trainer world restarted from scratch") for e in events), events
    assert_exactly_once(result)


@pytest.mark.slow
def test_fault_master_process_killed(ray_cluster, smol_target, replay_dir, tmp_path):
    import ray

    def kill_master_process(job):
        ray.get(job.services.master.kill.remote(), timeout=30)
        return "mooncake_master"

    _, result, _, events = run_one(tmp_path, replay_dir, "kill-master", [], [(at_step(3), kill_master_process)])
    assert any("master restarted (generation 2)" in e for e in events), events
    assert_exactly_once(result)


@pytest.mark.slow
def test_fault_master_actor_killed(ray_cluster, smol_target, replay_dir, tmp_path):
    import ray

    def kill_master_actor(job):
        ray.kill(job.services.master)
        return "master actor"

    job, result, _, events = run_one(tmp_path, replay_dir, "kill-master-actor", [], [(at_step(3), kill_master_actor)])
    assert any("the Mooncake master's actor died" in e for e in job.services.events), job.services.events
    assert any("master restarted (generation 2)" in e for e in events), events
    assert_exactly_once(result)


@pytest.mark.slow
def test_fault_store_daemon_killed(ray_cluster, smol_target, replay_dir, tmp_path):
    import ray

    def kill_daemon_process(job):
        actor, _ = next(iter(job.services.node_stores.values()))
        ray.get(actor.kill.remote(), timeout=30)
        return "mooncake_client"

    # A slower trainer, so that samples wait in the daemon when it dies.
    _, result, _, events = run_one(
        tmp_path, replay_dir, "kill-daemon", ["testing.trainer_throttle_s=0.3"], [(at_step(3), kill_daemon_process)]
    )
    assert any("could not be read" in e for e in events), events  # what it held is regenerated
    assert_exactly_once(result)


@pytest.mark.slow
def test_fault_store_daemon_actor_killed(ray_cluster, smol_target, replay_dir, tmp_path):
    import ray

    def kill_daemon_actor(job):
        actor, _ = next(iter(job.services.node_stores.values()))
        ray.kill(actor)
        return "daemon actor"

    job, result, _, _ = run_one(
        tmp_path, replay_dir, "kill-daemon-actor", ["testing.trainer_throttle_s=0.3"], [(at_step(3), kill_daemon_actor)]
    )
    assert any("store daemon's actor" in e for e in job.services.events), job.services.events
    assert_exactly_once(result)


@pytest.mark.slow
def test_fault_hung_replica(ray_cluster, smol_target, replay_dir, tmp_path):
    _, result, _, events = run_one(
        tmp_path,
        replay_dir,
        "hung-replica",
        ["testing.replay_hang_on=[dspark-0020]", "inference.generation_timeout_s=5"],
        [],
    )
    assert any("hung: a prompt generating for" in e for e in events), events
    assert_exactly_once(result)


@pytest.mark.slow
def test_fault_poison_prompt(ray_cluster, smol_target, replay_dir, tmp_path):
    # 3 epochs, the default restart budget (5 per group): the prompt kills the 3 replicas that
    # take it in epoch 0, then is quarantined in all three epochs (3 deaths, not 9)
    _, result, _, events = run_one(
        tmp_path,
        replay_dir,
        "poison",
        ["testing.replay_crash_on=[dspark-0030]", "data.max_failed_fraction=0.05", "data.epochs=3"],
        [],
    )
    assert sum("died" in e for e in events) == 3
    copies = ["dspark-0030@0", "dspark-0030@1", "dspark-0030@2"]
    assert result["quarantined"] == {
        "dspark-0030": {
            "failed": "dspark-0030@0",
            "copies": copies,
            "cause": result["failed_examples"]["dspark-0030@0"][-1],
        }
    }
    assert_exactly_once(result, failed=copies, epochs=3)


@pytest.mark.slow
def test_fault_poison_sample_quarantined_and_still_after_a_resubmission(ray_cluster, smol_target, replay_dir, tmp_path):
    # dspark-0030's sample kills the trainer rank that trains it, every time: its step's samples
    # are retried in halves until it fails alone (restarts outside the budget of 3), then it is
    # quarantined in both epochs. Submitted again with a third epoch, the job resumes from the
    # final checkpoint and trains it without the sample: the world never dies again.
    crash = ["testing.trainer_crash_on=[dspark-0030]", "data.max_failed_fraction=0.05"]
    _, result, _, events = run_one(tmp_path, replay_dir, "poison-sample", crash, [])
    copies = ["dspark-0030@0", "dspark-0030@1"]
    restarts = [e for e in events if e.startswith("trainer world restarted")]
    assert 2 <= len(restarts) <= 5 and any("retried in halves" in e for e in events), events
    found = result["poison_samples"]["dspark-0030@0"]
    assert found["copies"] == copies and "failed on it alone at step" in found["cause"], found
    assert "a trainer rank died during step" in found["cause"], found
    assert result["quarantined"]["dspark-0030"]["failed"] == "dspark-0030@0"
    assert_exactly_once(result, failed=copies)
    _, again, _, events = run_one(tmp_path, replay_dir, "poison-sample", [*crash, "data.epochs=3"], [])
    assert any(e.startswith("resumed from") for e in events), events
    assert not any(e.startswith("trainer world restarted") for e in events), events
    assert again["poison_samples"]["dspark-0030@0"]["copies"] == [*copies, "dspark-0030@2"]
    assert_exactly_once(again, failed=[*copies, "dspark-0030@2"], epochs=3)


@pytest.mark.slow
def test_fault_poison_prompts_past_the_failure_budget_fail_the_job(ray_cluster, smol_target, replay_dir, tmp_path):
    from cluster.job import JobFailed

    job = start_job(tmp_path, replay_dir, "poison-budget", ["testing.replay_crash_on=[dspark-0030]"])
    with pytest.raises(
        JobFailed,
        match=r"2 of 80 prompt x epochs failed \(2\.5% > data\.max_failed_fraction=0\.01\), "
        r"e\.g\. dspark-0030@0: replica g0-r\d died while generating it",
    ):
        job.run()
    assert (tmp_path / "poison-budget" / "result.json").exists()  # written before the job says no


@pytest.mark.slow
def test_fault_full_store_without_eviction(ray_cluster, smol_target, replay_dir, tmp_path):
    # 16 MiB of store for batches of 16 samples of ~1.2 MB: the store fills, producers wait
    # (Mooncake's eviction is off: nothing is dropped), the trainer frees it by checkpointing.
    _, result, _, events = run_one(
        tmp_path, replay_dir, "full-store", ["transport.segment_mb=16", "inference.prompt_batch=16"], []
    )
    assert not any("could not be read" in e for e in events), events
    log = (tmp_path / "full-store" / "logs" / "mooncake_master.1.log").read_text()
    assert "evicted_count" not in log
    assert_exactly_once(result)


@pytest.mark.slow
def test_fault_nonfinite_step(ray_cluster, smol_target, replay_dir, tmp_path):
    _, result, _, events = run_one(tmp_path, replay_dir, "nan-step", ["testing.nonfinite_steps=[4]"], [])
    assert any("step 4: non-finite loss on ranks [0]; update skipped" in e for e in events), events
    assert_exactly_once(result)


@pytest.mark.slow
def test_fault_diverged_model_stops_the_job(ray_cluster, smol_target, replay_dir, tmp_path):
    job = start_job(
        tmp_path, replay_dir, "diverged", ["testing.nonfinite_steps=[4,4,4,4]", "trainer.max_nonfinite_steps=3"]
    )
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"3 consecutive steps had a non-finite loss .* the drafter diverged"):
        job.run()
    assert time.monotonic() - t0 < 300
