"""The checkpoint directory: a damaged newest checkpoint is skipped for the previous one, never
deleted by rotation, and a fresh start moves an earlier run's checkpoints aside."""

from __future__ import annotations

import json

from cluster.training import CheckpointDir


def write(root, step: int, damage: str | None = None):
    d = root / f"step-{step:06d}"
    (d / "drafter").mkdir(parents=True)
    (d / "trainer").mkdir()
    (d / "drafter" / "config.json").write_text("{}")
    (d / "drafter" / "model.safetensors").write_bytes(b"x" * 8)
    (d / "trainer" / "latest").write_text("ds")
    (d / "ledger.json").write_text(json.dumps({"entries": []}))
    (d / "meta.json").write_text(json.dumps({"step": step, "world_size": 1, "record_rows": step}))
    if damage == "truncated ledger":
        (d / "ledger.json").write_text('{"entries": [')
    elif damage == "no weights":
        (d / "drafter" / "model.safetensors").write_bytes(b"")
    return d


def test_a_damaged_latest_falls_back_to_the_previous_one(tmp_path):
    ckpts = CheckpointDir(tmp_path / "checkpoints")
    write(ckpts.root, 40)
    write(ckpts.root, 80, damage="truncated ledger")
    assert ckpts.latest().name == "step-000040"
    assert "JSONDecodeError" in CheckpointDir.problem(ckpts.root / "step-000080")
    write(ckpts.root, 120, damage="no weights")
    assert ckpts.latest().name == "step-000040"
    assert CheckpointDir.problem(ckpts.root / "step-000120") == "drafter/model.safetensors missing or empty"


def test_rotation_never_removes_the_last_good_checkpoints(tmp_path):
    ckpts = CheckpointDir(tmp_path / "checkpoints")
    write(ckpts.root, 40)
    write(ckpts.root, 80)
    write(ckpts.root, 120, damage="no weights")
    ckpts.rotate()
    assert [p.name for p in ckpts.steps()] == ["step-000040", "step-000080", "step-000120"]
    write(ckpts.root, 160)
    ckpts.rotate()
    assert [p.name for p in ckpts.steps()] == ["step-000080", "step-000120", "step-000160"]


def test_a_fresh_start_moves_old_checkpoints_aside(tmp_path):
    ckpts = CheckpointDir(tmp_path / "checkpoints")
    assert ckpts.archive() is None
    write(ckpts.root, 460)
    moved = ckpts.archive()
    assert moved.name.startswith("checkpoints.old-") and (moved / "step-000460").is_dir()
    assert ckpts.latest() is None and ckpts.root.is_dir()
