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


def test_a_damaged_deepspeed_shard_falls_back_to_the_previous_checkpoint(tmp_path):
    """Each file's size and digest are recorded at save (`file_digests`); a shard truncated,
    overwritten with bytes of the same length, or gone makes the checkpoint unusable before any
    rank loads it."""
    import torch

    from cluster.training.checkpoints import file_digests

    ckpts = CheckpointDir(tmp_path / "checkpoints")

    def with_shard(step: int):
        d = write(ckpts.root, step)
        shard = d / "trainer" / f"global_step{step}" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
        shard.parent.mkdir()
        torch.save({"state": torch.arange(1000.0)}, shard)
        meta = json.loads((d / "meta.json").read_text())
        (d / "meta.json").write_text(json.dumps({**meta, "files": file_digests(d)}))
        return d, shard

    with_shard(40)
    d, shard = with_shard(80)
    assert CheckpointDir.problem(d) is None and ckpts.latest() == d
    whole = shard.read_bytes()
    shard.write_bytes(whole[: len(whole) // 2])
    assert "optim_states.pt has" in CheckpointDir.problem(d) and ckpts.latest().name == "step-000040"
    shard.write_bytes(b"\0" * len(whole))
    assert CheckpointDir.problem(d).endswith("optim_states.pt is not a whole torch archive")
    assert ckpts.latest().name == "step-000040"
    shard.unlink()
    assert CheckpointDir.problem(d).endswith("optim_states.pt missing") and ckpts.latest().name == "step-000040"


def test_a_same_size_corruption_falls_back_and_an_older_size_list_still_reads(tmp_path):
    """A drafter file changed in place, same length (a bit flip on disk, a partial overwrite):
    the size check passes it, its digest does not, and the resume takes the checkpoint before
    (it was retried until trainer.max_restarts). A checkpoint written before the digests (plain
    sizes in meta.json) is still checked by size."""
    from cluster.training.checkpoints import file_digests

    ckpts = CheckpointDir(tmp_path / "checkpoints")
    for step in (40, 80):
        d = write(ckpts.root, step)
        meta = json.loads((d / "meta.json").read_text())
        (d / "meta.json").write_text(json.dumps({**meta, "files": file_digests(d)}))
    weights = d / "drafter" / "model.safetensors"
    original = weights.read_bytes()
    weights.write_bytes(bytes([original[0] ^ 1]) + original[1:])
    assert CheckpointDir.problem(d) is None  # sizes only: what rotation checks at every commit
    assert "drafter/model.safetensors differs from what was written" in CheckpointDir.problem(d, contents=True)
    assert ckpts.latest().name == "step-000040"
    weights.write_bytes(original)
    assert ckpts.latest() == d
    meta = json.loads((d / "meta.json").read_text())
    (d / "meta.json").write_text(json.dumps({**meta, "files": {k: v["bytes"] for k, v in meta["files"].items()}}))
    assert ckpts.latest() == d
    weights.write_bytes(original[:-1])
    assert "model.safetensors has" in CheckpointDir.problem(d, contents=True) and ckpts.latest().name == "step-000040"


def test_stray_folders_are_not_checkpoints_and_unfinished_saves_are_cleaned(tmp_path):
    """`step-foo` (or a user's copy, `step-000040.bak`) in the checkpoint folder is not a
    checkpoint: listing skips it (it crashed on int("foo")); a `.step-N.tmp` left by a save that
    never finished goes at the next rotation."""
    ckpts = CheckpointDir(tmp_path / "checkpoints")
    write(ckpts.root, 40)
    for stray in ("step-foo", "step-000040.bak", "step-"):
        (ckpts.root / stray).mkdir()
        (ckpts.root / stray / "meta.json").write_text("{}")
    tmp, _ = ckpts.paths(120)
    tmp.mkdir()
    (tmp / "half-written").write_text("x")
    assert [p.name for p in ckpts.steps()] == ["step-000040"] and ckpts.latest().name == "step-000040"
    ckpts.rotate()
    assert not tmp.exists() and (ckpts.root / "step-foo").is_dir() and (ckpts.root / "step-000040").is_dir()


def test_a_damaged_ledger_delta_falls_back_and_the_chain_survives_rotation(tmp_path):
    """The ledger as a chain (a base at step 40, deltas at 80 and 120 linked to it): each file's
    digest is the one it was written with, so a delta changed in place (same size) or cut short
    makes its checkpoint unusable and the resume takes the one before, as a damaged ledger.json
    did; rotation deletes the step that wrote the base, the later ones still load it."""
    from cluster.data import ProducedSample, SampleLedger
    from cluster.data.ledger_checkpoint import LedgerChain, chain_files, load_ledger_state, write_ledger_state
    from cluster.store import SampleRef
    from cluster.training.checkpoints import file_digests

    ckpts, chain = CheckpointDir(tmp_path / "checkpoints"), LedgerChain()
    ledger = SampleLedger([{"id": f"p{i}", "messages": []} for i in range(50)])

    def checkpoint(step: int):
        handed = ledger.request_prompts("r0", 10, "g0")
        ledger.report_produced("r0", [ProducedSample(p.uid, SampleRef(p.key, 5, (0,), 4, "float32")) for p in handed])
        ledger.lease_step(step, ["g0"], 20)
        state = None if chain.wants_base() else ledger.checkpoint_delta(step)
        state = chain.link(state if state is not None else ledger.checkpoint_state(step), state is not None)
        tmp, dest = ckpts.paths(step)
        write(tmp.parent, step)  # (the drafter and trainer parts, as `write` makes them)...
        (tmp.parent / f"step-{step:06d}").rename(tmp)
        (tmp / "ledger.json").unlink()  # ...but the ledger as the chain
        write_ledger_state(tmp, state)
        meta = json.loads((tmp / "meta.json").read_text())
        (tmp / "meta.json").write_text(json.dumps({**meta, "files": file_digests(tmp)}))
        tmp.rename(dest)
        chain.published(dest)
        ledger.commit(step)
        ckpts.rotate()
        return dest

    first = checkpoint(40)
    base = chain_files(first)[0]["name"]
    second = checkpoint(80)
    assert [f["name"] for f in chain_files(second)][0] == base and len(chain_files(second)) == 2
    assert CheckpointDir.meta(second)["files"][base] == CheckpointDir.meta(first)["files"][base]
    third = checkpoint(120)
    assert [p.name for p in ckpts.steps()] == ["step-000080", "step-000120"]  # the base's step rotated away
    assert ckpts.latest() == third and load_ledger_state(third)["committed_step"] == 120
    assert {d["state"] for d in load_ledger_state(third)["entries"]} == {"trained", "stored"}
    delta = third / chain_files(third)[-1]["name"]
    original = delta.read_bytes()
    delta.write_bytes(original.replace(b'"stored"', b'"storeD"', 1))  # same size, other contents
    assert CheckpointDir.problem(third) is None  # (sizes only: what rotation checks)
    assert "differs from what was written" in CheckpointDir.problem(third, contents=True)
    assert ckpts.latest() == second and load_ledger_state(second)["committed_step"] == 80
    delta.write_bytes(original[:-10])
    assert "has" in CheckpointDir.problem(third) and ckpts.latest() == second
    delta.unlink()
    assert CheckpointDir.problem(third).endswith("missing") and ckpts.latest() == second
