"""`revise_prompts`: the box plan's second look, once the job's own replica has answered.

The plan chose its prompts at the start, from a probe's paces and a forecast of the run: a
replica of one process at the probe's threads, a start-up of `box_plan.startup_s`. The job's
replica may be another (tensor parallel: with `target.tensor_parallel_size=2` on 2 cores it
generated 810 tok/s where the probe measured 4,376 at one thread) and its start-up longer (2.4
min there, of a 3-min budget: the plan of 276 prompts trained 0.9 of an epoch). When the first
answers' wait ends, the job knows both: the time left and the pace its replica really generates
at. The plan's model (`plan.choose_plan`) runs again with that pace, for the time from the
replica's first answer to the end of training, among the prompt counts up to the one planned:
where the planned count is far short of its epochs target (by more than the forecast's own
error, `plan.FORECAST_ERROR`: the trainer's pace is still the probe's), the most prompts that
reach the target, or else the most epochs. The prompts dropped were never handed out
(`SampleLedger.drop_prompts`), so what is generated is kept. It never adds prompts, nor
changes the answers or threads: the replica has started with them. Pure: the job measures and
applies (`cluster.job.loop`).
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.box.plan import FORECAST_ERROR, Choices, Paces, Workload, choose_plan, expected


@dataclass(frozen=True)
class Revision:
    prompts_per_category: int  # the new cap (below the planned one)
    expected_epochs: float  # with it, by the model at the measured pace
    planned_epochs: float  # the planned cap's, at the same pace
    reason: str


def revise_prompts(
    plan: dict,
    generation_tok_s: float,
    generated_tokens: int,
    time_left_s: float,
    batch_tokens: int,
    max_epochs: int,
    cap_choices: tuple[int, ...],
    target_epochs: float,
) -> Revision | None:
    """`plan`: what `plan_box` recorded; `generation_tok_s`: the replica's measured pace, over
    `generated_tokens` so far; `time_left_s`: until training ends. None: the plan stands."""
    paces = plan["paces"]
    measured = Paces(
        {plan["replica_threads"]: generation_tok_s},
        {int(t): s for t, s in paces["first_step_s"].items()},
        {int(t): s for t, s in paces["later_step_s"].items()},
        source="measured generation, probed trainer",
    )
    w = plan["workload"]
    # the model counts from the replica's first token: the time it has generated so far, and what is left
    work = Workload(
        w["prompts_per_category"],
        w["prompt_tokens"],
        batch_tokens,
        generated_tokens / generation_tok_s + time_left_s,
        w["usable_cores"],
        max_epochs,
    )
    cap, answer, r, t = (
        plan["prompts_per_category"],
        plan["answer_tokens"],
        plan["replica_threads"],
        plan["trainer_threads"],
    )
    prompts, _, trained = expected(work, measured, cap, answer, r, t)
    planned_epochs = trained / max(prompts, 1)
    if planned_epochs * FORECAST_ERROR >= target_epochs:
        return None
    caps = tuple(c for c in cap_choices if c < cap) + (cap,)
    chosen = choose_plan(
        work,
        measured,
        Choices(caps, (answer,), target_epochs, replica_threads=(r,), trainer_threads=t),
    )
    if chosen.prompts_per_category >= cap:
        return None
    return Revision(
        chosen.prompts_per_category,
        chosen.epochs,
        round(planned_epochs, 2),
        f"the replica generates {generation_tok_s:.0f} tok/s and {time_left_s:.0f} s of training are left: "
        f"{cap} prompts a category would train {planned_epochs:.1f} epochs, less than {target_epochs:g} / "
        f"{FORECAST_ERROR:g}; {chosen.prompts_per_category} a category: {chosen.epochs:.1f} ({chosen.reasons[0]})",
    )


def prompts_beyond(train: list, cap: int, seed: int, caps: dict[str, int] | None) -> list[str]:
    """The ids of the training prompts a cap of `cap` a category would not have kept, in their
    order: the same choice `data.max_prompts_per_category=cap` makes (`cap_per_category`, its
    seed and per-category caps), so a revised run trains what a run planned so would have."""
    from dspark.prompts import cap_per_category

    kept = {c.id for c in cap_per_category(train, cap, seed, caps)}
    return [c.id for c in train if c.id not in kept]
