"""The `data:` section of the job's configuration: the prompts, their split and epochs, and how
the drafter is judged at the end (the held-out split greedy and sampled, more evaluation sets,
a long-context set, the confidence head's calibration split)."""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.config_fields import AT_LEAST_1, EPOCHS, FRACTION, NON_NEGATIVE, TIMEOUT, Range, choice, ranged


@dataclass
class DataConfig:
    # Prompt files, JSON lines of {"id", "category", "prompt"} (data/prompts/default.jsonl's
    # format); a malformed or non-UTF-8 line is refused, never skipped.
    prompts: list[str] = field(default_factory=lambda: ["data/prompts/default.jsonl"])
    # Share of the prompts held out for calibration and evaluation, never trained on.
    heldout_fraction: float = ranged(
        0.1, Range(0, 1, open_lo=True, open_hi=True, why="the job evaluates the drafter on the held-out prompts")
    )
    split_seed: int = 0  # the seed of the held-out split (changing it on resume is refused)
    # Passes over the training prompts; with trainer.time_budget_s, the most that may be trained.
    epochs: int = ranged(1, EPOCHS)
    # Later epochs train on the stored samples instead of regenerating them; None: when the
    # regeneration would give the same answer anyway (greedy sampling).
    reuse_samples_across_epochs: bool | None = None
    max_prompts: int | None = ranged(None, AT_LEAST_1)  # at most this many prompts in all; None: every one
    # At most this many training prompts of each category (dspark.prompts.cap_per_category): a few
    # large categories do not crowd out the rest when a budget (minutes) limits the prompts;
    # category_caps: category -> its own cap, in place of that one (spent where users ask).
    max_prompts_per_category: int | None = ranged(None, AT_LEAST_1)
    category_caps: dict[str, int] = field(default_factory=dict)  # see max_prompts_per_category
    # Held-out prompts evaluated (round-robin over categories), and so for each of eval_sets; None: all.
    eval_limit: int | None = ranged(40, AT_LEAST_1)
    eval_max_new_tokens: int = ranged(128, AT_LEAST_1)  # tokens decoded per evaluated prompt
    # The sampled evaluation: the first eval_sampled_limit of the evaluated held-out prompts (None:
    # all) again at this temperature, drafted and verified as the served recipe says (`dspark`:
    # probabilistic drafting, block rejection). 0: greedy only.
    eval_temperature: float = ranged(0.7, Range(0, 2))
    eval_sampled_limit: int | None = ranged(None, AT_LEAST_1)  # see eval_temperature
    # Seconds the sampled set (one prompt at a time) and the long-context set may spend decoding:
    # prompts whose expected cost no longer fits are left out and listed (None: no limit); a
    # slower machine judges fewer prompts instead of running longer.
    eval_sampled_budget_s: float | None = ranged(None, TIMEOUT)
    long_context_budget_s: float | None = ranged(None, TIMEOUT)  # see eval_sampled_budget_s
    # A long-context set judged by context length (dspark.tau_report's buckets from 0, 512, 1536,
    # 3072, 5120 prompt tokens): long_context_per_bucket prompts of each, none longer than
    # long_context_max_tokens (None: any), answers of long_context_max_new_tokens. None: no such set.
    long_context_prompts: str | None = None
    long_context_per_bucket: int = ranged(1, AT_LEAST_1)  # see long_context_prompts
    long_context_max_tokens: int | None = ranged(None, AT_LEAST_1)  # see long_context_prompts
    long_context_max_new_tokens: int = ranged(32, AT_LEAST_1)  # see long_context_prompts
    # Held-out prompts the evaluation does not take, set apart to fit the confidence head's
    # temperatures (its ECE measured on the evaluated ones); generated, never trained. 0: none.
    calibration_prompts: int = ranged(32, NON_NEGATIVE)
    calibration_wait_s: float = ranged(300.0, TIMEOUT)  # at the end, for those not yet generated
    eval_timeout_s: float = ranged(
        1800.0, TIMEOUT
    )  # per evaluated set (held-out, each eval_sets split); past it the job fails naming it
    # More evaluation sets, never trained on, judged like the held-out split (eval_limit prompts
    # each): name -> prompts file. `ood`: prompts written apart from the training set, which the
    # held-out split (the same generator as the training prompts) cannot show.
    eval_sets: dict[str, str] = field(default_factory=dict)
    # Who decodes the held-out prompts: `vllm` serves the target with the drafter where the
    # target runs (`dspark` on GPU, the backbone as `dflash` on CPU), `reference` runs
    # dspark.evaluate (transformers, on the driver: small targets only); auto: vllm on cuda.
    eval_backend: str = choice("auto", ("auto", "reference", "vllm"))
    # Prompts that end FAILED (after their attempts) are listed in result.json; above this
    # fraction of all prompt x epochs the job exits with an error.
    max_failed_fraction: float = ranged(0.01, FRACTION)
