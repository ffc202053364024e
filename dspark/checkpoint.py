"""Checkpoints in the speculators format, written atomically, read without unpickling.

A drafter directory holds `config.json` and `model.safetensors` (trained weights, `t2d`/`d2t`
and, for a reduced vocab, the draft LM head; never the target's frozen weights) and is what
vLLM and `speculators` load. Resume state (optimizer, schedule, RNG, data position) lives in a
sibling directory, never inside the drafter directory, as safetensors + JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from .config import FORMAT_VERSION, DSparkConfig
from .model import FROZEN_TARGET_KEYS, DSparkDrafter


@contextmanager
def atomic_directory(dest: str | Path):
    """Yield a temporary sibling directory; on success it replaces `dest` in one rename."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        yield tmp
        for f in tmp.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        old = None
        if dest.exists():
            old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
            os.replace(dest, old)
        os.replace(tmp, dest)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_checkpoint(dest: str | Path, config: DSparkConfig, tensors: dict[str, torch.Tensor]) -> Path:
    sd = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    with atomic_directory(dest) as tmp:
        (tmp / "config.json").write_text(json.dumps(config.to_speculators_dict(), indent=2))
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt", "producer": FORMAT_VERSION})
    return Path(dest)


def save_drafter(model: DSparkDrafter, dest: str | Path) -> Path:
    return _write_checkpoint(dest, model.config, model.trainable_state_dict())


def export_dflash_backbone(model: DSparkDrafter, dest: str | Path) -> Path:
    """The DSpark backbone alone as a `dflash` checkpoint (no Markov or confidence head), keeping
    `sample_from_anchor`. vLLM's `dflash` method runs on CPU where `dspark` does not, so this is
    how a trained drafter's acceptance is checked against a real vLLM engine on a CPU box."""
    import copy

    cfg = copy.deepcopy(model.config)
    cfg.mode, cfg.markov_rank, cfg.enable_confidence_head, cfg.confidence_head_with_markov = "dflash", 0, False, False
    cfg.confidence_temperatures = None
    backbone = {
        k: v for k, v in model.trainable_state_dict().items() if not k.startswith(("markov_head.", "confidence_head."))
    }
    return _write_checkpoint(dest, cfg, backbone)


def load_drafter(
    ckpt_dir: str | Path,
    target_dir: str | Path | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> DSparkDrafter:
    """Load a drafter (ours or speculators-saved) and its frozen parts from the target."""
    ckpt_dir = Path(ckpt_dir)
    raw = json.loads((ckpt_dir / "config.json").read_text())
    target_dir = target_dir or raw["speculators_config"]["verifier"]["name_or_path"]
    cfg = DSparkConfig.from_speculators_dict(raw)
    if "dspark_cluster" not in raw:  # a checkpoint from elsewhere: ask the target its depth
        from transformers import AutoConfig

        tcfg = AutoConfig.from_pretrained(str(target_dir))
        cfg.target_num_layers = getattr(tcfg, "text_config", tcfg).num_hidden_layers
    model = DSparkDrafter(cfg)
    model.load_target_weights(target_dir)
    state = load_file(str(ckpt_dir / "model.safetensors"))
    expected = set(model.trainable_state_dict())
    unexpected = set(state) - expected - set(FROZEN_TARGET_KEYS)
    missing = expected - set(state) - {"lm_head.weight"}
    if unexpected or missing:
        raise ValueError(
            f"{ckpt_dir}: checkpoint does not fit its config: missing {sorted(missing)}, "
            f"unexpected {sorted(unexpected)}"
        )
    state = {k: v for k, v in state.items() if k in expected}
    model.load_state_dict(state, strict=False)
    if model.use_draft_vocab and "lm_head.weight" not in state:
        model.refresh_draft_head()
    return model.to(device=device, dtype=dtype)


# ---- trainer state (resume) ----------------------------------------------------------------


def _flatten(obj: Any, tensors: dict[str, torch.Tensor], path: str) -> Any:
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj.detach().to("cpu").contiguous()
        return {"__tensor__": path}
    if isinstance(obj, dict):
        return {
            "__dict__": [
                [_flatten(k, tensors, f"{path}.k{i}"), _flatten(v, tensors, f"{path}.{i}")]
                for i, (k, v) in enumerate(obj.items())
            ]
        }
    if isinstance(obj, (list, tuple)):
        return {
            "__list__": [_flatten(v, tensors, f"{path}.{i}") for i, v in enumerate(obj)],
            "tuple": isinstance(obj, tuple),
        }
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot store {type(obj).__name__} at {path} in trainer state")


def _unflatten(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__dict__" in obj:
            return {_unflatten(k, tensors): _unflatten(v, tensors) for k, v in obj["__dict__"]}
        if "__list__" in obj:
            items = [_unflatten(v, tensors) for v in obj["__list__"]]
            return tuple(items) if obj.get("tuple") else items
    return obj


def save_state(dest: str | Path, state: dict[str, Any]) -> Path:
    """Atomically store a nested dict of tensors and plain values (optimizer, RNG, counters)."""
    tensors: dict[str, torch.Tensor] = {}
    tree = _flatten(state, tensors, "s")
    with atomic_directory(dest) as tmp:
        save_file(tensors, str(tmp / "tensors.safetensors"))
        (tmp / "state.json").write_text(json.dumps(tree))
    return Path(dest)


def load_state(src: str | Path) -> dict[str, Any]:
    src = Path(src)
    return _unflatten(json.loads((src / "state.json").read_text()), load_file(str(src / "tensors.safetensors")))
