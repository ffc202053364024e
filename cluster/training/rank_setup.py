"""What a trainer rank is set up from: its settings, its drafter's config, the DeepSpeed config,
the draft vocabulary, torch told to load DeepSpeed checkpoints without running code, and the
world's rendezvous (loopback only when every rank is on one node)."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cluster.config import DrafterConfig, TestingConfig, TrainerConfig
from cluster.hardware import one_node_env
from cluster.store import StoreConfig
from dspark.chat import TOKENIZER_DEFAULT, ChatFormat


@dataclass
class TrainerSettings:
    """What every rank needs, typed (it crosses the Ray boundary as is)."""

    target_path: str
    drafter: DrafterConfig
    trainer: TrainerConfig
    store: StoreConfig
    device: str = "cpu"
    total_steps: int = 1000
    aux_layer_ids: list[int] | None = None
    extensions_dir: str | None = None
    trust_remote_code: bool = False  # target.trust_remote_code
    chat: ChatFormat = TOKENIZER_DEFAULT  # recorded in the exported drafter
    testing: TestingConfig = field(default_factory=TestingConfig)  # the test suite's hooks (faults, a slower step)


def load_checkpoints_without_code() -> None:
    """DeepSpeed reads its checkpoints with `torch.load(weights_only=False)`, which runs whatever
    a pickled file asks for, and resume reads them from shared storage. In this process torch is
    told to load weights only (`TORCH_FORCE_WEIGHTS_ONLY_LOAD` overrides the call site's False),
    with the three plain DeepSpeed types its checkpoints hold allowed (measured with DeepSpeed
    0.19.8, ZeRO 1 and 2, fp32 and bf16): anything else in a checkpoint file is refused."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    torch.serialization.add_safe_globals([LossScaler, ZeroStageEnum, fragment_address])


RENDEZVOUS_PREFIX = "dspark-rendezvous-"


def rendezvous(one_node: bool, stale: str | None = None) -> str:
    """Rank 0's rendezvous for a new world, as torch's `init_method`.

    One node (every rank on this node): a file in a new private directory (mkdtemp: mode 0700,
    only this user), so that no rank opens a rendezvous port at all (torch's TCPStore listens on
    every interface whatever address it is given). Several nodes: TCP on this node's address and
    a port free on every interface (the other nodes' ranks connect); what protects it there is
    the cluster's private network, as for NCCL and gloo themselves. `stale`: the previous world's
    rendezvous, removed if it is still here (its rank 0 was killed before it could)."""
    leave_rendezvous(stale)
    if one_node:
        return "file://" + str(Path(tempfile.mkdtemp(prefix=RENDEZVOUS_PREFIX)) / "store")
    import ray

    from cluster.store import free_port

    host = ray.util.get_node_ip_address()
    return f"tcp://{f'[{host}]' if ':' in host else host}:{free_port('')}"


def leave_rendezvous(init_method: str | None) -> None:
    """Remove a one-node world's rendezvous directory (nothing to do for TCP, or where it is gone)."""
    if init_method and init_method.startswith("file://"):
        d = Path(init_method[len("file://") :]).parent
        if d.name.startswith(RENDEZVOUS_PREFIX):
            shutil.rmtree(d, ignore_errors=True)


def join_world(init_method: str, rank: int, world_size: int, backend: str) -> None:
    """torch.distributed (through DeepSpeed) at `init_method`, from `rendezvous`."""
    import deepspeed

    # DeepSpeed wants LOCAL_RANK (without it, it looks for mpi4py); RANK and WORLD_SIZE for the
    # libraries that read them from the environment.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0")
    if init_method.startswith("file://"):
        # One node: gloo and NCCL's bootstrap on loopback (`one_node_env`: they would listen on the
        # address the host's name resolves to). Each world's ranks are new processes: nothing
        # else in them depends on these.
        os.environ.update(one_node_env())
    else:
        # The TCP rendezvous's address, also for whatever reads the environment; DeepSpeed's CPU
        # shared-memory allreduce names its segments after them (used only with LOCAL_SIZE set,
        # which the job does not set: a file rendezvous needs neither).
        host, port = init_method[len("tcp://") :].rsplit(":", 1)
        os.environ.update(MASTER_ADDR=host.strip("[]"), MASTER_PORT=port)
    deepspeed.init_distributed(
        dist_backend=backend, auto_mpi_discovery=False, init_method=init_method, rank=rank, world_size=world_size
    )


def deepspeed_config(t: TrainerConfig, world_size: int, load_universal: bool = False) -> dict:
    """`load_universal`: the checkpoint to load is in DeepSpeed's universal format (a resize)."""
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world_size,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {"stage": t.zero_stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if t.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if load_universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def drafter_config(s: TrainerSettings, model_init: dict):
    """The drafter's config: a checkpointed one (`model_init["config"]`), or one made from the
    target and the config's drafter section."""
    from dspark.config import DSparkConfig

    if "config" in model_init:
        return DSparkConfig.from_speculators_dict(model_init["config"])
    from transformers import AutoTokenizer

    d = s.drafter
    dspark = d.mode == "dspark"
    tok = AutoTokenizer.from_pretrained(s.target_path, trust_remote_code=s.trust_remote_code)
    return DSparkConfig.from_target(
        s.target_path,
        trust_remote_code=s.trust_remote_code,
        chat_format=s.chat.record(tok),
        mode=d.mode,
        num_layers=d.num_layers,
        block_size=d.block_size,
        markov_rank=d.markov_rank if dspark else 0,
        markov_head_type=d.markov_head_type,
        enable_confidence_head=d.enable_confidence_head if dspark else False,
        draft_vocab_size=d.draft_vocab_size,
        aux_layer_ids=s.aux_layer_ids,
        **({"mask_token_id": d.mask_token_id} if d.mask_token_id is not None else {}),
    )


def vocab_mapping_from(
    samples_tokens: list[tuple[torch.Tensor, torch.Tensor]], vocab_size: int, draft_vocab_size: int, always: list[int]
) -> dict:
    from dspark.vocab import build_vocab_mapping, token_frequencies

    d2t, t2d = build_vocab_mapping(token_frequencies(samples_tokens, vocab_size), draft_vocab_size, always)
    return {"d2t": d2t.tolist(), "t2d": t2d.tolist()}
