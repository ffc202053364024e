"""A stop in every phase outside the training loop's steps (the first answers' wait, a trainer
restart, the end's calibration wait and evaluation) ends the job after what it is doing, and
`stopped` always writes result.json (`status: stopped`, the phase, how to resume): the parts
with fakes, the job's own `ControlChannel`."""

from __future__ import annotations

import json
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from cluster.config import JobConfig
from cluster.control import ControlChannel, JobStopped, Stop
from cluster.data import LedgerCounts
from cluster.job.evaluation import Evaluator
from cluster.job.events import EventLog
from cluster.job.recovery import TrainerWorld
from cluster.job.results import RunFacts, stopped


def world(control: ControlChannel, ledger) -> TrainerWorld:
    cfg = JobConfig(run_name="r")
    cfg.drafter.draft_vocab_size = 100
    supervisor = SimpleNamespace(check=lambda: None)
    return TrainerWorld(
        cfg,
        gang=None,
        services=None,
        ledger=ledger,
        record=None,
        checkpoints=None,
        committer=None,
        supervisor=supervisor,
        events=EventLog(),
        vocab_texts=[],
        train_prompts=10,
        resume_from=None,
        stop_check=control.raise_if_stopped,
    )


def test_a_stop_during_the_first_answers_wait_ends_it_naming_the_phase():
    control, polls = ControlChannel(), []

    def peek_stored(n):
        polls.append(n)
        if len(polls) == 3:
            control.send(Stop("SIGTERM received"))
        return []

    ledger = SimpleNamespace(
        peek_stored=peek_stored, counts=lambda: LedgerCounts(pending=10, to_generate=10, total=10, epochs=1)
    )
    with pytest.raises(JobStopped, match="stopped during the first answers' wait: SIGTERM received") as e:
        world(control, ledger).fresh_model_init()
    assert e.value.phase == "the first answers' wait" and len(polls) == 3  # the next poll, not the 3600 s deadline


def test_a_stop_before_a_trainer_restart_ends_the_job_instead():
    control = ControlChannel()
    control.send(Stop("SIGTERM received"))
    w = world(control, ledger=None)
    w.gang = SimpleNamespace(layout=lambda: {"g0": 1})
    with pytest.raises(JobStopped, match="during a trainer restart"):
        w.restart(RuntimeError("rank 0 died"))
    assert w.restarts.total == 0


def test_stopped_writes_result_json_even_when_its_checkpoint_fails(tmp_path):
    """A stop whose world cannot save (it died): result.json still says stopped, the phase, the
    checkpoint before and how to resume; the failed save is in its events."""
    from cluster.training import CheckpointDir

    cfg = JobConfig(run_name="r", output_dir=str(tmp_path))
    run = RunFacts(cfg, tmp_path / "r", time.monotonic(), ["an event"])
    run.run_dir.mkdir()

    def commit(step):
        raise RuntimeError("rank 0 is gone")

    committer = SimpleNamespace(uncommitted=["a row"], commit=commit)
    result = stopped(
        run,
        "SIGTERM received",
        "training",
        12,
        30.0,
        committer,
        CheckpointDir(run.run_dir / "checkpoints"),
        record=None,
        ledger=None,
    )
    written = json.loads((run.run_dir / "result.json").read_text())
    assert written == json.loads(json.dumps(result, default=str))
    assert written["status"] == "stopped" and written["phase"] == "training" and written["steps"] == 12
    assert written["checkpoint"] is None and "it starts over" in written["resume"]
    assert written["events"][0] == "an event"
    assert "the stop's checkpoint at step 12 failed (RuntimeError: rank 0 is gone)" in written["events"][1]


def test_a_stop_during_the_evaluation_ends_its_subprocess_at_once(tmp_path):
    control = ControlChannel()
    evaluator = Evaluator(
        JobConfig(run_name="r"), inputs=None, run_dir=tmp_path, placed=[], stop_check=control.raise_if_stopped
    )
    marker = tmp_path / "still-running"
    cmd = [sys.executable, "-c", f"import time, pathlib; time.sleep(60); pathlib.Path({str(marker)!r}).write_text('x')"]
    started = time.monotonic()
    threading.Timer(1.5, lambda: control.send(Stop("SIGTERM received"))).start()
    with pytest.raises(JobStopped, match=r"during the end \(evaluation\)"):
        evaluator.run_stoppable(cmd, env=None, timeout_s=120)
    assert time.monotonic() - started < 20 and not marker.exists()
    with pytest.raises(Exception, match="returned non-zero exit status 3"):
        Evaluator(JobConfig(run_name="r"), None, tmp_path, [], ControlChannel().raise_if_stopped).run_stoppable(
            [sys.executable, "-c", "raise SystemExit(3)"], env=None, timeout_s=60
        )
