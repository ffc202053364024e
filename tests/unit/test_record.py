"""The exactly-once proof: a record of (prompt, epoch, step, rank) per trained sample, committed
with checkpoints, rolled back with them, and checked against the ledger's outcome."""

from __future__ import annotations

import json

import pytest

from cluster.data import ExactlyOnceViolation, LeasedSample, TrainingRecord
from cluster.store import SampleRef


def trained(uid: str, source: str) -> LeasedSample:
    """A sample a rank trained: its lease row (`source`: the group that generated it)."""
    return LeasedSample(uid, SampleRef(f"run/{source}/{uid}.1", 5, (), 0), source)


def outcome(trained, failed=(), unfinished=()):
    return {"trained": list(trained), "failed": {u: ["boom"] for u in failed}, "unfinished": list(unfinished)}


def test_rows_name_prompt_epoch_step_rank_and_groups(tmp_path):
    rec = TrainingRecord(tmp_path / "trained.jsonl")
    rec.add(1, 0, "g0", [trained("p1@0", "g0")])
    rec.add(2, 1, "g1", [trained("p@x@1", "g0")])  # ids may contain '@': the epoch is after the last
    assert rec.commit(2) == 2
    rows = [json.loads(line) for line in (tmp_path / "trained.jsonl").read_text().splitlines()]
    assert rows[1] == {"uid": "p@x@1", "prompt": "p@x", "epoch": 1, "step": 2, "rank": 1, "group": "g1", "source": "g0"}
    proof = rec.verify(outcome(["p1@0", "p@x@1"]))
    assert proof["trained"] == 2 and proof["crossed"] == 1 and proof["generated_by_group"] == {"g0": 2}


def test_only_committed_steps_are_written_and_a_rollback_drops_the_rest(tmp_path):
    rec = TrainingRecord(tmp_path / "trained.jsonl")
    for step, uid in enumerate(["a@0", "b@0", "c@0"], start=1):
        rec.add(step, 0, "g0", [trained(uid, "g0")])
    assert rec.commit(2) == 2 and [r["uid"] for r in rec.rows()] == ["a@0", "b@0"]
    assert rec.commit(3) == 3
    rec.rollback_to(2)  # the model went back to the checkpoint of step 2
    assert [r["uid"] for r in rec.rows()] == ["a@0", "b@0"] and rec.pending == []
    with pytest.raises(ExactlyOnceViolation, match="has 2 rows"):
        rec.rollback_to(5)


def test_a_sample_trained_twice_is_caught(tmp_path):
    rec = TrainingRecord(tmp_path / "trained.jsonl")
    rec.add(1, 0, "g0", [trained("a@0", "g0")])
    rec.add(2, 1, "g1", [trained("a@0", "g0")])
    rec.commit(2)
    with pytest.raises(ExactlyOnceViolation, match=r"1 samples trained more than once, e.g. \['a@0'\]"):
        rec.verify(outcome(["a@0"]))


def test_gaps_either_way_are_caught(tmp_path):
    rec = TrainingRecord(tmp_path / "trained.jsonl")
    rec.add(1, 0, "g0", [trained("a@0", "g0")])
    rec.commit(1)
    with pytest.raises(ExactlyOnceViolation, match=r"committed without a record of training, e.g. \['b@0'\]"):
        rec.verify(outcome(["a@0", "b@0"]))
    with pytest.raises(ExactlyOnceViolation, match=r"recorded but not committed, e.g. \['a@0'\]"):
        rec.verify(outcome([], unfinished=["a@0"]), complete=False)
    with pytest.raises(ExactlyOnceViolation, match="neither trained nor failed"):
        rec.verify(outcome(["a@0"], unfinished=["c@0"]))


def test_a_run_ended_by_max_steps_reports_what_it_did_not_train(tmp_path):
    rec = TrainingRecord(tmp_path / "trained.jsonl")
    rec.add(1, 0, "g0", [trained("a@0", "g0")])
    rec.commit(1)
    proof = rec.verify(outcome(["a@0"], failed=["f@0"], unfinished=["b@0", "c@0"]), complete=False)
    assert proof["not_trained"] == 2 and proof["failed"] == ["f@0"] and proof["trained"] == 1
