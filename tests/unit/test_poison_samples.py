"""Poison samples (`cluster.job.poison`): the real `TrainingLoop`, `TrainerWorld`, `Committer` and
`SampleLedger` over a fake trainer world whose step fails whenever a given prompt's sample is in
it. The poison is found among a step's 8 samples in at most 3 + 1 restarts, quarantined in every
epoch, listed as result.json lists it, and still quarantined (never leased) after a resubmission;
a world that fails on every step ends the job naming the world, blaming no sample."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from cluster.config import JobConfig
from cluster.control import ControlChannel
from cluster.data import FAILED, ProducedSample, SampleLedger, TrainingRecord, poison_samples, quarantined
from cluster.job.checkpointing import Committer
from cluster.job.events import EventLog
from cluster.job.loop import TrainingLoop
from cluster.job.poison import BROKEN_WORLD, POISON, PoisonSearch
from cluster.job.progress import TrainingStats
from cluster.job.recovery import TrainerWorld
from cluster.store import SampleRef
from cluster.training import StepResult, TrainerFailure

PROMPTS = [{"id": f"p{i}", "messages": [{"role": "user", "content": str(i)}]} for i in range(8)]
TOKENS = 5  # every sample's; batch_tokens 20 over 2 ranks: a step holds all 8 of an epoch


@dataclass
class Settings:
    total_steps: int = 1000
    store: object = None


class FakeWorld:
    """The trainer gang: its step fails (a rank's death, or a hang past the call deadline) when it
    holds a sample of a prompt in `poison`, or always (`broken`). Counts its starts."""

    def __init__(self, checkpoints: Checkpoints, poison=(), broken=False, hang=False) -> None:
        self.checkpoints, self.poison, self.broken, self.hang = checkpoints, set(poison), broken, hang
        self.rank_groups, self.settings, self.size = ["g0", "g0"], Settings(), 2
        self.starts, self.steps_held = 0, []  # every train_step's uids, failed or not

    def layout(self):
        return {"g0": 2}

    def start(self, placed):
        self.starts += 1

    def stop(self):
        pass

    def setup(self, model_init, resume, resized):
        return self.checkpoints.meta(resume)["step"] if resume else 0

    def read_drafter(self, path):
        return {}

    def fetch(self, step, lease):
        return {}

    def train_step(self, step, lease):
        uids = [row.uid for rows in lease for row in rows]
        self.steps_held.append(uids)
        if self.broken or any(u.rsplit("@", 1)[0] in self.poison for u in uids):
            if self.hang:
                raise TrainerFailure(f"trainer ranks did not finish step {step} within 900s (trainer.call_timeout_s)")
            raise TrainerFailure(f"a trainer rank died during step {step}: exit code 1 (CUDA out of memory)")
        return [
            StepResult(step, r, False, False, TOKENS * len(rows), 0.1, 1e-4, [x.uid for x in rows], rows, {"loss": 1.0})
            for r, rows in enumerate(lease)
        ]

    def parameters_finite(self):
        return True

    def save_checkpoint(self, tmp, dest, step, ledger_state, meta):
        self.checkpoints.saved[dest] = ({**meta, "world_size": self.size}, json.loads(json.dumps(ledger_state)))
        return dest

    def remove_keys(self, keys, abandoned=()):
        return len(keys)


class Checkpoints:
    """`CheckpointDir` in memory: what each checkpoint's meta.json and ledger.json would hold."""

    def __init__(self) -> None:
        self.saved: dict[Path, tuple[dict, dict]] = {}

    def paths(self, step):
        return Path(f"tmp-{step}"), Path(f"step-{step:06d}")

    def latest(self):
        return max(self.saved, key=lambda p: self.saved[p][0]["step"], default=None)

    def meta(self, path):
        return self.saved[path][0]

    def rotate(self):
        pass


def produce(ledger: SampleLedger) -> None:
    """The producers: every prompt the ledger hands out is stored at once."""
    while handed := ledger.request_prompts("r0", 100, "g0"):
        ledger.report_produced("r0", [ProducedSample(p.uid, SampleRef(p.key, TOKENS, (), 0)) for p in handed])


def run_to_the_end(loop: TrainingLoop) -> str:
    """`loop.run`, then the job's last commit (after the end's calibration: `TrainingJob.finish_training`)."""
    ended_by = loop.run()
    loop.committer.commit(loop.stats.step)
    return ended_by


def job(tmp_path: Path, ledger: SampleLedger, world_kw: dict, checkpoints: Checkpoints | None = None):
    """The training loop as `TrainingJob` builds it, on fakes for Ray's parts; returns
    (loop, world, fake gang, record, events, checkpoints)."""
    cfg = JobConfig(run_name="r", output_dir=str(tmp_path))
    cfg.drafter.draft_vocab_size = None
    cfg.trainer.batch_tokens, cfg.trainer.checkpoint_interval = 4 * TOKENS, 2
    checkpoints = checkpoints or Checkpoints()
    gang = FakeWorld(checkpoints, **world_kw)
    record = TrainingRecord(tmp_path / "trained.jsonl")
    if checkpoints.latest() is None:
        record.reset()
    events = EventLog()
    committer = Committer(gang, ledger, record, checkpoints)
    supervisor = SimpleNamespace(check=lambda: produce(ledger))
    services = SimpleNamespace(
        check=lambda force: None, ensure_node_stores=lambda placed: None, store_config=lambda: None
    )
    control = ControlChannel()
    world = TrainerWorld(
        cfg, gang, services, ledger, record, checkpoints, committer, supervisor, events, [], 8,
        checkpoints.latest(), control.raise_if_stopped,
    )  # fmt: skip
    planner = SimpleNamespace(expired=lambda: False, on_step=lambda *a: None, ready=lambda: False)
    reporter = SimpleNamespace(on_step=lambda step, per_rank: None)
    loop = TrainingLoop(
        cfg.trainer, False, ledger, gang, world, committer, record, supervisor, reporter, planner,
        TrainingStats(), control, events,
    )  # fmt: skip
    return loop, world, gang, record, events, checkpoints


@pytest.fixture(autouse=True)
def no_placement(monkeypatch):
    """A restarted world is placed nowhere (the fake gang needs no placement group)."""
    monkeypatch.setattr("cluster.scaling.place_all", lambda cfg, specs: [])
    monkeypatch.setattr("cluster.scaling.trainer_specs", lambda cfg, layout, generation: [])


@pytest.mark.parametrize("hang", [False, True], ids=["death", "hang"])
@pytest.mark.parametrize("poison", range(8))
def test_a_poison_sample_is_found_quarantined_in_every_epoch_and_listed(tmp_path, poison, hang):
    ledger = SampleLedger(PROMPTS, epochs=2, reuse_across_epochs=True)
    loop, world, gang, record, events, _ = job(tmp_path, ledger, {"poison": [f"p{poison}"], "hang": hang})
    assert run_to_the_end(loop) == "data"
    assert len(gang.steps_held[0]) == 8  # the first step held the whole epoch
    restarts = gang.starts  # (the fake world is started by each restart only)
    assert 2 <= restarts <= 3 + 1 and world.restarts.total == 1  # only the first failure took of the budget
    uid = f"p{poison}@0"
    failing = [held for held in gang.steps_held if any(u.startswith(f"p{poison}@") for u in held)]
    assert len(failing) == restarts and failing[-1] == [uid]  # it failed alone, last
    outcome = ledger.outcome()
    assert sorted(outcome["failed"]) == [f"p{poison}@0", f"p{poison}@1"] and not outcome["unfinished"]
    assert len(outcome["trained"]) == 14
    record.verify(outcome, complete=True)  # the exactly-once proof, the restarts' rollbacks included
    listed = poison_samples(outcome["failed"])
    assert list(listed) == [uid] and listed[uid]["prompt_id"] == f"p{poison}"
    assert listed[uid]["copies"] == [f"p{poison}@0", f"p{poison}@1"]
    cause = listed[uid]["cause"]
    assert "failed on it alone at step" in cause and ("did not finish step" if hang else "exit code 1") in cause
    assert quarantined(outcome["failed"])[f"p{poison}"]["failed"] == uid  # beside the poison prompts
    said = [e for e in events.lines if e.startswith(f"poison sample {uid} (prompt p{poison}) quarantined")]
    assert len(said) == 1 and cause in said[0]


def test_the_quarantine_survives_a_resubmission_and_is_never_leased(tmp_path):
    ledger = SampleLedger(PROMPTS, epochs=2, reuse_across_epochs=True)
    loop, _, _, _, _, checkpoints = job(tmp_path, ledger, {"poison": ["p5"]})
    assert run_to_the_end(loop) == "data"
    meta, state = checkpoints.saved[checkpoints.latest()]
    assert meta["step"] == loop.stats.step and not ledger.outcome()["unfinished"]
    # submitted again, with a third epoch: a new ledger from the checkpoint's state, the same poison
    again = SampleLedger(PROMPTS, epochs=3, reuse_across_epochs=True)
    again.load_state_dict(state)
    assert all(again.entries[f"p5@{e}"].state == FAILED for e in range(3))
    loop2, world2, gang2, record2, _, _ = job(tmp_path, again, {"poison": ["p5"]}, checkpoints)
    assert run_to_the_end(loop2) == "data"
    assert world2.restarts.total == 0 and gang2.starts == 0  # it never killed the world again
    assert not any(u.startswith("p5@") for held in gang2.steps_held for u in held)
    outcome = again.outcome()
    assert sorted(outcome["failed"]) == ["p5@0", "p5@1", "p5@2"] and len(outcome["trained"]) == 21
    record2.verify(outcome, complete=True)
    assert list(poison_samples(outcome["failed"])) == ["p5@0"]


def test_a_world_that_fails_on_every_step_ends_the_job_naming_it(tmp_path):
    ledger = SampleLedger(PROMPTS, epochs=2, reuse_across_epochs=True)
    loop, world, gang, _, events, _ = job(tmp_path, ledger, {"broken": True})
    with pytest.raises(RuntimeError, match=r"the trainer world fails whatever its samples: .*a broken node, GPU or"):
        loop.run()
    # the first failure, the halves (4, 2, 1: 3 = log2 8 failures) and the control (the 7 set aside)
    assert [len(held) for held in gang.steps_held] == [8, 4, 2, 1, 7]
    assert world.restarts.total == 1 and gang.starts == 3 + 1
    assert not ledger.outcome()["failed"]  # no sample blamed
    assert any("retried in halves" in e for e in events.lines)


def test_a_failure_its_samples_do_not_repeat_blames_none(tmp_path):
    ledger = SampleLedger(PROMPTS, epochs=2, reuse_across_epochs=True)
    loop, _, gang, record, events, _ = job(tmp_path, ledger, {"broken": True})
    train_step = gang.train_step

    def fails_once(step, lease):
        try:
            return train_step(step, lease)
        finally:
            gang.broken = False

    gang.train_step = fails_once
    assert run_to_the_end(loop) == "data"
    outcome = ledger.outcome()
    assert not outcome["failed"] and len(outcome["trained"]) == 16 and gang.starts == 1
    record.verify(outcome, complete=True)
    assert any("did not happen again with any of its 8 samples: not a poison sample" in e for e in events.lines)


def test_the_search_alone_halves_its_suspects_and_needs_the_world_to_train_once():
    search = PoisonSearch()
    suspects = [f"p{i}@0" for i in range(8)]
    search.start(3, suspects, "rank 1 died")
    assert search.bound() == 3
    for half in (suspects[:4], suspects[:2], suspects[:1]):
        assert search.next_test() == half
        assert search.tested(half, half) is None
        assert search.failed(4, half, "rank 0 died") is None
    # failed alone before anything trained: the world must train the 7 others before it is blamed
    assert sorted(search.next_test()) == sorted(suspects[1:])
    verdict = search.passed(5, search.next_test())
    assert verdict.kind == POISON and verdict.uid == "p0@0" and "alone at step 4: rank 0 died" in verdict.cause
    assert not search.active()
    search.start(3, suspects[:1], "rank 1 died")  # a step of one sample: no other to control with
    assert search.failed(4, suspects[:1], "rank 0 died") is None and search.next_test() == []
    assert search.tested([], []).kind == POISON
    search.start(3, suspects[:2], "rank 1 died")
    assert search.failed(4, suspects[:1], "x") is None and search.next_test() == suspects[1:2]
    assert search.failed(5, suspects[1:2], "y").kind == BROKEN_WORLD


def test_a_suspect_no_longer_stored_leaves_the_search():
    search = PoisonSearch()
    search.start(3, ["a@0", "b@0"], "rank 0 died")
    assert search.tested(["a@0"], []) is None and search.next_test() == ["b@0"]
    verdict = search.tested(["b@0"], [])
    assert verdict.kind == "gone" and not search.active()


def test_lease_only_leases_just_those_stored_and_quarantine_takes_every_epoch():
    ledger = SampleLedger(PROMPTS, epochs=3, reuse_across_epochs=True)
    produce(ledger)
    lease = ledger.lease_only(1, ["p1@0", "p2@0", "p9@0", "p1@1"], ["g0", "g1"], 20)
    assert [[r.uid for r in rows] for rows in lease] == [["p1@0", "p2@0"], []]  # own group first
    assert ledger.lease_only(1, ["p3@0"], ["g0", "g1"], 20) == lease  # the step is leased already
    assert ledger.entries["p1@1"].state == "stored"  # reuse: the next epoch inherits the sample
    keys = {ledger.entries["p1@0"].ref.key}
    why = "the trainer world failed on it alone at step 1: boom"
    failed = ledger.quarantine_sample("p1@0", why)
    assert failed == ["p1@0", "p1@2", "p1@1"]
    assert all(ledger.entries[f"p1@{e}"].state == FAILED for e in range(3))
    assert set(ledger.abandoned_keys()) == keys  # its bytes leave the store with the next commit
    assert ledger.quarantine_sample("p1@0", "again") == []
    assert ledger.entries["p1@1"].errors[-1] == f"quarantined with p1@0: poison sample: {why}"
