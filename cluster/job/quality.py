"""`assess`: whether a finished job's drafter is worth serving, and if not, what to change.

A drafter's worth is decided by what it learned: on a slow machine the time budget can stop
training before one pass over the prompts (measured: 3.5 % of the plan, held-out τ 1.055 on a
2-core first-generation EPYC, against 1.42 on a Xeon with AMX for the same commit), and nothing
else in the job's output would say so. Pure: the job passes the figures.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Below this held-out τ (tokens per target step, greedy) a drafter's acceptance does not pay for
# its own forward passes on the serving side (the README states it with the same number).
TAU_FLOOR = 1.2


@dataclass(frozen=True)
class Quality:
    worth_serving: bool
    epochs_trained: float  # samples trained / training prompts (one epoch = each prompt once)
    reasons: list[str] = field(default_factory=list)  # why not, when not
    advice: list[str] = field(default_factory=list)  # the settings to change, one line each


def assess(
    trained_samples: int, train_prompts: int, heldout_tau: float | None, ended_by: str, time_budget_s: float | None
) -> Quality:
    epochs = trained_samples / max(train_prompts, 1)
    reasons, advice = [], []
    if epochs < 1:
        reasons.append(
            f"it trained {trained_samples} samples, {epochs:.0%} of one epoch of its {train_prompts} prompts"
            + (f" (ended by {ended_by})" if ended_by != "data" else "")
        )
        if ended_by == "time_budget" and time_budget_s:
            advice.append(
                f"raise trainer.time_budget_s (was {time_budget_s:g}) to about "
                f"{time_budget_s / max(epochs, 0.01):.0f} for one epoch"
            )
        advice.append(
            f"or train on fewer prompts (data.max_prompts, now {train_prompts} kept) or shorter answers "
            f"(sampling.max_tokens)"
        )
    if heldout_tau is not None and heldout_tau < TAU_FLOOR:
        reasons.append(
            f"held-out τ {heldout_tau:.3f} is below {TAU_FLOOR} (too few draft tokens accepted to pay for drafting)"
        )
        if epochs >= 1:
            advice.append("train longer (trainer.time_budget_s, data.epochs) or on prompts closer to what is served")
    return Quality(not reasons, epochs, reasons, advice)
