"""The exactly-once proof: a record of (prompt, epoch, step, rank) per trained sample, committed
with checkpoints, rolled back with them, and checked against the ledger's outcome."""

from __future__ import annotations

import json
from types import SimpleNamespace

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


def test_a_commit_costs_its_own_rows_not_the_file_and_a_rollback_cuts_the_file(tmp_path, monkeypatch):
    """The committed line count is read once (a resumed run's file) and then kept: a commit
    appends its rows without reading the file again (it re-read all of trained.jsonl at every
    checkpoint: O(rows²) over a run). A rollback cuts the file at the checkpoint's row."""
    import builtins

    from cluster.data import TrainingRecord

    path = tmp_path / "trained.jsonl"
    path.write_text("".join(json.dumps({"uid": f"p{i}@0", "step": 1}) + "\n" for i in range(5)))
    rec = TrainingRecord(path)
    assert rec.lines() == 5
    reads = []
    real_open = builtins.open

    def counting_open(file, mode="r", *args, **kwargs):
        if "r" in mode and str(file) == str(path):
            reads.append(mode)
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting_open)
    rows = [SimpleNamespace(uid=f"q{i}@1", group="g0") for i in range(3)]
    rec.add(2, 0, "g0", rows[:2])
    rec.add(3, 0, "g0", rows[2:])
    assert rec.commit(2) == 7 and rec.commit(3) == 8 and not reads
    monkeypatch.setattr(builtins, "open", real_open)
    assert len(path.read_text().splitlines()) == 8
    rec.rollback_to(6)
    assert [json.loads(line)["uid"] for line in path.read_text().splitlines()][-2:] == ["p4@0", "q0@1"]
    assert rec.lines() == 6 and TrainingRecord(path).lines() == 6
    rec.add(4, 1, "g1", rows[:1])
    assert rec.commit(4) == 7 and path.read_text().splitlines()[-1].startswith('{"uid": "q0@1"')
