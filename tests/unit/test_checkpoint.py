from __future__ import annotations

import json

import pytest
import torch

from dspark.checkpoint import atomic_directory, load_drafter, load_state, save_drafter, save_state
from dspark.training import OptimConfig, build_optimizer
from tests.helpers import make_drafter, random_batch


def test_round_trip_and_contents(tiny_target, tmp_path):
    m = make_drafter(tiny_target, seed=1)
    m.config.confidence_temperatures = [1.5, 1.2, 1.0, 0.9]
    save_drafter(m, tmp_path / "d")
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["config.json", "model.safetensors"]
    from safetensors import safe_open

    with safe_open(str(tmp_path / "d" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert not keys & {"embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight", "lm_head.weight"}
    assert {"fc.weight", "markov_head.markov_w1.weight", "confidence_head.proj.bias"} <= keys
    back = load_drafter(tmp_path / "d", tiny_target).eval()
    assert back.config.confidence_temperatures == [1.5, 1.2, 1.0, 0.9]
    b = random_batch(m.config)
    a = m.sample_anchors(b, 3, torch.Generator().manual_seed(0))
    torch.testing.assert_close(back(b, a).logits, m(b, a).logits)


def test_atomic_write_keeps_old_version_on_failure(tiny_target, tmp_path):
    m = make_drafter(tiny_target)
    save_drafter(m, tmp_path / "d")
    before = (tmp_path / "d" / "model.safetensors").read_bytes()
    with pytest.raises(RuntimeError):
        with atomic_directory(tmp_path / "d") as tmp:
            (tmp / "config.json").write_text("{}")
            raise RuntimeError("crash mid-write")
    assert (tmp_path / "d" / "model.safetensors").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["d"]  # no temporary left behind


def test_mismatched_checkpoint_is_rejected(tiny_target, tmp_path):
    save_drafter(make_drafter(tiny_target, num_layers=2), tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    cfg["transformer_layer_config"]["num_hidden_layers"] = 1
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unexpected"):
        load_drafter(tmp_path / "d", tiny_target)


def test_trainer_state_round_trip_without_pickle(tiny_target, tmp_path):
    m = make_drafter(tiny_target).train()
    opt, sched = build_optimizer(m, OptimConfig(total_steps=10, warmup_steps=2))
    b = random_batch(m.config)
    for _ in range(2):
        out = m(b, m.sample_anchors(b, 3))
        out.logits.float().logsumexp(-1).mean().backward()
        opt.step()
        sched.step()
    state = {"optimizer": opt.state_dict(), "step": 2, "rng": torch.get_rng_state(), "nested": {"a": [1, 2.5, None]}}
    save_state(tmp_path / "s", state)
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["state.json", "tensors.safetensors"]
    back = load_state(tmp_path / "s")
    assert back["step"] == 2 and back["nested"] == {"a": [1, 2.5, None]}
    assert torch.equal(back["rng"], state["rng"])
    opt2, _ = build_optimizer(m, OptimConfig(total_steps=10, warmup_steps=2))
    opt2.load_state_dict(back["optimizer"])
    for k, v in opt.state_dict()["state"].items():
        for name, t in v.items():
            assert torch.equal(torch.as_tensor(opt2.state_dict()["state"][k][name]), torch.as_tensor(t))


def test_trainer_checkpoints_load_weights_only(tmp_path):
    """Resume reads DeepSpeed's files from shared storage: a pickle that would run code is refused,
    the plain types DeepSpeed's own checkpoints hold still load."""
    import os
    import pickle

    from deepspeed.runtime.fp16.loss_scaler import LossScaler

    from cluster.training import load_checkpoints_without_code

    class RunsCode:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    evil, fine = tmp_path / "evil.pt", tmp_path / "fine.pt"
    with open(evil, "wb") as f:
        pickle.dump({"module": RunsCode()}, f)
    torch.save({"loss_scaler": LossScaler(1.0), "step": 3, "rng": torch.Generator().get_state()}, fine)
    before = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    try:
        load_checkpoints_without_code()
        with pytest.raises(pickle.UnpicklingError):
            torch.load(evil, weights_only=False)  # what DeepSpeed's checkpoint engine asks for
        assert torch.load(fine, weights_only=False)["step"] == 3
    finally:
        if before is None:
            os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = before
