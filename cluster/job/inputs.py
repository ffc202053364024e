"""`JobInputs`: what the job reads before anything starts, on the driver, checked: the target
(where it is, its config, its chat format), the layers the replicas capture, the prompts split
into training, calibration and evaluated sets, and the first LR horizon. A problem here is a
`ConfigError` and no actor has started."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.config import JobConfig
from cluster.data import calibration_split, check_eval_sets, load_prompts
from cluster.target import TargetFacts, read_target


@dataclass(frozen=True)
class JobInputs:
    target: TargetFacts  # where it is, its config, its chat format
    aux_layer_ids: list[int]
    layer_ids: list[int]  # the aux layers and the last layer: what a sample holds per token
    max_sample_bytes: int  # the largest sample the target can produce (the ledger's first guess)
    train_prompts: list
    heldout: list
    calibration_prompts: list  # held-out prompts the confidence head is calibrated on
    evaluated_prompts: list  # held-out prompts the end evaluation judges

    @property
    def vocab_texts(self) -> list[str]:
        """The prompts' texts, counted with the first answers for the draft vocabulary."""
        return [m["content"] for c in self.train_prompts for m in c.prompt_messages]


def read_inputs(cfg: JobConfig, conversations: list | None) -> JobInputs:
    """`conversations`: the prompts as `cluster.preflight.check_inputs` read them (None: read here)."""
    from dspark.config import default_aux_layer_ids

    target = read_target(cfg)
    tcfg = target.config
    aux = list(cfg.target.aux_layer_ids or default_aux_layer_ids(tcfg.num_hidden_layers, cfg.target.num_aux_layers))
    layer_ids = [*aux, tcfg.num_hidden_layers]
    max_sample_bytes = cfg.target.max_model_len * (
        len(layer_ids) * tcfg.hidden_size * (4 if cfg.target.dtype == "float32" else 2) + 5
    )
    train, heldout = load_prompts(cfg, conversations)
    check_eval_sets(cfg, train)
    head = cfg.drafter.enable_confidence_head and cfg.drafter.mode == "dspark"
    calibration, evaluated = calibration_split(
        heldout, cfg.data.eval_limit, cfg.data.calibration_prompts if head else 0
    )
    return JobInputs(target, aux, layer_ids, max_sample_bytes, train, heldout, calibration, evaluated)


def first_lr_horizon(cfg: JobConfig, train_prompts: int, resumed_horizon: int | None) -> int:
    """The step the LR schedule ends at until the pace is measured (`cluster.training.budget`):
    `trainer.max_steps`, or a resumed run's own plan (not a fresh estimate for every epoch of the
    config), or an estimate from the prompts, epochs and answer length."""
    t = cfg.trainer
    if t.max_steps:
        return t.max_steps
    est_tokens = train_prompts * cfg.data.epochs * (96 + 0.6 * cfg.sampling.max_tokens)
    world = sum(g.trainer_ranks for g in cfg.topology.groups)
    estimate = max(10, int(est_tokens / (t.batch_tokens * world)))
    return resumed_horizon if resumed_horizon is not None else estimate
