"""`choose_plan`: what one box should train in its time budget, from the paces it measured.

The same config trained 30 times more samples on a 2-core Xeon with AMX than on a 2-core
first-generation EPYC (192 of the 5,520 samples it planned, held-out τ 1.055: not one epoch of
its 276 prompts). A plan made for a fast machine is the wrong plan for a slow one; the time
budget is what the user gives, so the plan follows the machine:

- **unique prompts** (`data.max_prompts_per_category`): the sweep of 12 / 24 / 48 per category
  at the same 400 s on a 2-core Zen 4 gave held-out τ 1.329 / 1.401 / 1.325 at 20 / 10 / 4
  epochs: the drafter wants about `target_epochs` passes over its prompts, and more prompts
  only once it has them. So the plan takes the most prompts that still train that many
  epochs, and where no choice does, the choice that trains the most epochs.
- **answer length** (`sampling.max_tokens`): generation costs tokens, a trainer step a budget of
  tokens; shorter answers buy epochs on a box that cannot afford long ones. The longest
  answers that reach the target come first (the sweep measured 128; shorter answers trade
  positions the drafter learns from for epochs, unmeasured beyond a slow box's need).
- **the core split** while the replica generates (`inference.cpu_threads` beside
  `trainer.torch_threads`): on one box the inference/training ratio is a split of its cores;
  once every answer is generated the trainer takes them all (`torch_threads_when_idle`).

The model of a run, for each choice (U prompts, answers of L tokens, r replica threads, the
trainer on t = max(cores - r, 1) beside it; measured against two runs of the local job on a
2-core Xeon, where the first model, which knew neither the trainer's wait for its first samples
nor the cheaper later epochs, chose 12 prompts a category and lost 0.07 τ against 24):
    busy         the share of its time the trainer steps while the replica generates (it waits
                 for answers otherwise), at the pace answers would arrive unshared
    shares       what each gets of its own pace while both run: r + t <= cores, all of it; one
                 replica thread time-sliced with the trainer (one core), min(1, cores/(r + t·busy))
                 each; a replica team of r >= 2 threads beside a trainer on more threads than the
                 cores left it (2 + 1 on 2 cores), the replica 1 - TEAM_LOSS·busy and the trainer
                 all of its own (measured: OpenMP's team waits on its preempted thread, spinning,
                 and the trainer runs meanwhile)
    generation   G = U·L / (gen_tok_s[r]·replica_share)   (greedy answers: epoch 0 only, reused)
    per step     S = batch_tokens / (prompt_tokens + L) samples
    while G      the trainer waits for its first `first_samples` (the draft vocabulary is counted
                 on them), then trains what arrives: min(U/G, S·trainer_share/first_step_s[t])/s
    after G      the rest of epoch 0 at S/first_step_s[cores] samples/s (a sample's first epoch
                 computes the target's full-vocabulary normaliser), the later epochs at
                 S/later_step_s[cores] (the normaliser cached), to the end of the window
    epochs       trained / U, at most `max_epochs`
Pure: the paces are passed in (probed by the job at its start: `machine_paces`),
and tests inject them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Paces:
    """What this machine does. `generation_tok_s[r]`: a replica's tokens/s at r threads at its
    batch; `first_step_s[t]`: a trainer rank's seconds per step at t threads on samples in their
    first epoch; `later_step_s[t]`: on samples in a later epoch; `source`: where they came from."""

    generation_tok_s: dict[int, float]
    first_step_s: dict[int, float]
    later_step_s: dict[int, float]
    source: str = "injected"

    def gen(self, threads: int) -> float:
        return _at(self.generation_tok_s, threads)

    def first(self, threads: int) -> float:
        return _at(self.first_step_s, threads)

    def later(self, threads: int) -> float:
        return _at(self.later_step_s, threads)


def _at(table: dict[int, float], threads: int) -> float:
    """The pace at `threads`, or at the nearest measured thread count below it (above, if none)."""
    below = [t for t in table if t <= threads]
    return table[max(below)] if below else table[min(table)]


@dataclass(frozen=True)
class Workload:
    prompts_per_category: dict[str, int]  # training prompts available in each category
    prompt_tokens: float  # mean tokens of a training prompt (chat template included)
    batch_tokens: int  # a trainer step's token budget
    train_window_s: float  # seconds from the replica's first token to the end of training
    cores: int
    max_epochs: int
    first_samples: int = 64  # stored samples the trainer waits for before its first step


@dataclass(frozen=True)
class Choices:
    prompts_per_category: tuple[int, ...] = (12, 24, 48)
    answer_tokens: tuple[int, ...] = (64, 96, 128)
    # passes over the prompts before more prompts pay (box_plan.target_epochs); below `min_epochs`
    # the drafter is flagged not worth serving
    target_epochs: float = 6.0
    min_epochs: float = 1.0
    # The config's own (prompts per category, answer tokens): where given, the plan departs from
    # them only where its forecast is off by more than its own error (`FORECAST_ERROR`).
    baseline: tuple[int, int] | None = None
    # ... and its (replica threads, trainer threads while it generates), kept with it: the model's
    # core split rests on a constant measured on one machine (`TEAM_LOSS`), and on a 2-core
    # Emerald Rapids Xeon the config's split (the replica on both cores, the trainer on one
    # beside it) generated 293-356 tok/s where the model's (one each) made 266-283 and trained
    # 8 epochs against 6 in the same budget
    baseline_split: tuple[int, int] | None = None
    # The replica's thread counts to weigh (empty: every split of the cores) and the trainer's
    # while it generates (None: the cores the replica leaves, at least one): one value each
    # where the user set it.
    replica_threads: tuple[int, ...] = ()
    trainer_threads: int | None = None


@dataclass(frozen=True)
class BoxPlan:
    prompts_per_category: int
    prompts: int  # unique training prompts
    answer_tokens: int
    replica_threads: int
    trainer_threads: int  # while the replica generates; every core after
    generation_s: float
    trained_samples: int  # expected
    epochs: float  # expected
    worth_serving: bool  # expected epochs >= min_epochs
    reasons: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


# What a replica's OpenMP team of 2 threads kept of its pace beside a 1-thread trainer stepping
# without pause on 2 cores, all at Ray's worker niceness: 0.35 and 0.34 (86 and 89 tok/s against
# 246-260 alone; the trainer kept its own pace, 0.97 s a step against 1.04 alone), where the
# proportional share would be 2/3; the same replica on 1 thread beside it kept 0.88-1.01
# (benchmarks/generation.py, 2-core Xeon, Ice Lake). In the local job there (its trainer stepping
# about half the time while the replica generated), the team's rate fell from 269-290 tok/s
# before the trainer's first step to 206-240 over the whole generation, where this says 0.67.
TEAM_LOSS = 0.65

# How far the forecast of a run (a probe of seconds turned into minutes by the model above) has
# been from the run: 1.8x too many epochs on a 2-core Xeon with AMX (7.2 expected, 4.0 trained:
# steps 0.6-0.7 s, not the probe's 0.40-0.54), 1.8x too few on a 2-core Emerald Rapids Xeon
# (11.0 expected, all 20 trained). A plan that trusted it inside that error chose 48 a category
# on the first (held-out tau 1.297 against the config's 24: 1.420) and 12 on the second. So the
# config's choice stands unless the forecast is off by more than this.
FORECAST_ERROR = 2.0


def shares(cores: int, replica_threads: int, trainer_threads: int, busy: float) -> tuple[float, float]:
    """(the replica's, the trainer's) share of its own pace while both run; `busy`: the share of
    its time the trainer steps. See the module's model."""
    r, t = replica_threads, trainer_threads
    if r + t <= cores:
        return 1.0, 1.0
    if r == 1:  # single threads time-sliced
        share = min(1.0, cores / (r + t * busy))
        return share, share
    return 1.0 - TEAM_LOSS * busy, 1.0


def expected(
    work: Workload, paces: Paces, cap: int, answer: int, replica_threads: int, trainer_threads: int | None = None
) -> tuple[int, float, float]:
    """(unique prompts, generation seconds, trained samples) of one choice, by the module's model
    (`trainer_threads`: while the replica generates; None: the cores it leaves, at least one)."""
    prompts = sum(min(cap, n) for n in work.prompts_per_category.values())
    r, cores = replica_threads, work.cores
    t = trainer_threads or max(work.cores - replica_threads, 1)
    per_step = max(work.batch_tokens / (work.prompt_tokens + answer), 1.0)
    # the trainer takes its threads only while it steps: the share of its time it does, at the
    # pace answers would arrive without it
    busy = min(1.0, prompts / (prompts * answer / paces.gen(r)) / (per_step / paces.first(t)))
    replica_share, trainer_share = shares(cores, r, t, busy)
    generation_s = prompts * answer / (paces.gen(r) * replica_share)
    arrival = prompts / generation_s
    window = work.train_window_s
    waited = min(work.first_samples, prompts) / arrival  # until the trainer's first step
    during = min(arrival, per_step * trainer_share / paces.first(t)) * max(0.0, min(generation_s, window) - waited)
    if generation_s >= window:
        return prompts, generation_s, min(during, prompts)
    left = window - generation_s
    first_rate, later_rate = per_step / paces.first(cores), per_step / paces.later(cores)
    rest_of_first = prompts - during  # epoch 0's samples not yet trained when generation ends
    if rest_of_first / first_rate >= left:
        return prompts, generation_s, during + first_rate * left
    later = later_rate * (left - rest_of_first / first_rate)
    return prompts, generation_s, min(prompts + later, prompts * work.max_epochs)


def choose_plan(work: Workload, paces: Paces, choices: Choices = Choices()) -> BoxPlan:
    """With a baseline (the config's own prompts and answers), the plan keeps it unless its
    forecast is off by more than `FORECAST_ERROR`: more prompts (at the baseline's answers) only
    where the forecast trains `target_epochs` that many times over; fewer prompts or shorter
    answers only where it says the baseline trains less than `target_epochs` by that factor.
    Without one, or on a box that slow, among the choices (not above the baseline): those that
    train `target_epochs`: the longest answers (what the sweep measured; shorter ones are a slow
    box's remedy), then the most prompts, then the most epochs. Where none reaches it: the most
    epochs, then the shortest generation. The reasons say which and why, with the figures."""
    splits = choices.replica_threads or range(1, work.cores + 1)

    def trainer_threads(r: int) -> int:
        return choices.trainer_threads or max(work.cores - r, 1)

    def option(cap: int, answer: int, split: tuple[int, int] | None = None) -> tuple:
        if split is not None:  # the config's own
            r, t = split
            prompts, generation_s, trained = expected(work, paces, cap, answer, r, t)
            return (cap, answer, r, prompts, generation_s, trained, trained / max(prompts, 1), t)
        # the split that trains the most samples for this choice
        best = max(
            ((expected(work, paces, cap, answer, r, choices.trainer_threads), r) for r in splits), key=lambda x: x[0][2]
        )
        (prompts, generation_s, trained), r = best
        return (cap, answer, r, prompts, generation_s, trained, trained / max(prompts, 1), trainer_threads(r))

    options = [
        option(cap, answer)
        for cap in sorted(set(choices.prompts_per_category))
        for answer in sorted(set(choices.answer_tokens))
    ]
    target, chosen, why = choices.target_epochs, None, ""
    if choices.baseline is not None:
        split = choices.baseline_split
        base = option(*choices.baseline, split)
        if base[6] * FORECAST_ERROR >= target:
            caps = sorted(c for c in set(choices.prompts_per_category) if c > base[0])
            richer = [o for o in (option(c, base[1], split) for c in caps) if o[6] >= target * FORECAST_ERROR]
            chosen = max(richer, key=lambda o: o[3]) if richer else base
            why = (
                f"more prompts than the config's {base[0]} a category: the forecast trains {chosen[6]:.1f} epochs, "
                f"more than {FORECAST_ERROR:g} x {target:g} (the forecast's own error)"
                if richer
                else f"the config's {base[0]} prompts a category and answers of up to {base[1]} tokens: the forecast "
                f"({base[6]:.1f} epochs) is within its error ({FORECAST_ERROR:g}x) of {target:g} epochs"
            )
        else:  # a box too slow for the baseline: the choices below it
            options = [o for o in options if o[0] <= base[0] and o[1] <= base[1]] or [option(*choices.baseline)]
            why = (
                f"the config's {base[0]} prompts a category would train {base[6]:.1f} epochs, less than "
                f"{target:g} / {FORECAST_ERROR:g}: "
            )
    if chosen is None:
        reaching = [o for o in options if o[6] >= target]
        if reaching:
            chosen = max(reaching, key=lambda o: (o[1], o[3], o[6]))
            why += (
                f"the longest answers, and with them the most prompts, that still train {target:g} "
                f"epochs in {work.train_window_s:.0f} s (more prompts pay only once each is seen that often)"
            )
        else:
            chosen = max(options, key=lambda o: (round(o[6], 2), -o[4]))
            why += f"no choice trains {target:g} epochs in {work.train_window_s:.0f} s: the one that trains most"
    cap, answer, r, prompts, generation_s, trained, epochs, t = chosen
    reasons = [
        why,
        f"paces ({paces.source}): generation {paces.gen(r):.0f} tok/s at {r} thread(s), a trainer step "
        f"{paces.first(t):.2f} s at {t} thread(s) beside it, then "
        f"{paces.first(work.cores):.2f} s (a sample's first epoch) and {paces.later(work.cores):.2f} s (later "
        f"ones) at {work.cores}",
        f"expected: {prompts} prompts × answers of up to {answer} tokens generated in {generation_s:.0f} s, "
        f"{trained:.0f} samples trained ({epochs:.1f} epochs)",
    ]
    worth = epochs >= choices.min_epochs
    if not worth and generation_s >= work.train_window_s:
        reasons.append(
            f"generating one answer per prompt takes {generation_s:.0f} s, more than the "
            f"{work.train_window_s:.0f} s the budget leaves: raise trainer.time_budget_s by more than "
            f"{generation_s - work.train_window_s:.0f} s"
        )
    elif not worth:
        reasons.append(
            f"less than {choices.min_epochs:g} epoch of even the smallest choice fits: raise "
            f"trainer.time_budget_s (about {work.train_window_s * choices.min_epochs / max(epochs, 1e-3):.0f} s "
            f"of training for one epoch)"
        )
    return BoxPlan(
        cap,
        prompts,
        answer,
        r,
        t,
        round(generation_s, 1),
        int(trained),
        round(epochs, 2),
        worth,
        reasons,
    )


# The end of the local job on a 2-core Xeon (Ice Lake, fp32), each part scaled to the pace of
# 330 tok/s by the probe's reading in its run (280-400 tok/s at full speed): 13-18 s of
# calibration, export and loads ("fixed"); the greedy held-out and OOD sets (decoding and the
# lossless check) 38-57 s per 16 prompts each, 42 the middle of five runs; the sampled set
# 23-28 s (25; its decoding capped by its budget), the long-context set 33-42 s (35; its
# decoding capped, its lossless check not: 15-19 s of it), in three runs. Under a quota of 0.66
# cores the greedy sets took what the probe's pace says (43 per 16 at the reference pace).
REFERENCE_GEN_TOK_S, REFERENCE_LIMIT = 330.0, 16
REFERENCE_END_S = {"fixed": 15.0, "greedy": 42.0, "sampled": 25.0, "long_context": 35.0}


def startup_seconds(startup_s: float, gen_tok_s: float) -> float:
    """The job's start-up (the store, the engine, the trainer world: imports, weights, DeepSpeed)
    on this machine: `startup_s` at the reference pace, in proportion on a slower box (it is CPU
    work too: under a quota of 0.66 of a core the trainer's first step came 2.3-4.8 min after
    the store, against about a minute at full speed), never less."""
    return startup_s * max(1.0, REFERENCE_GEN_TOK_S / gen_tok_s)


@dataclass(frozen=True)
class EvaluationFit:
    eval_limit: int  # prompts of each greedy set
    sampled: bool  # the held-out set sampled with the served recipe kept
    long_context: bool  # the long-context set kept
    expected_s: float


def fit_evaluation(
    gen_tok_s: float,
    end_s: float,
    eval_limit: int,
    sampled: bool,
    long_context: bool,
    min_limit: int = 8,
    extras_min_limit: int = 12,
) -> EvaluationFit:
    """The end evaluation scaled to the machine: within `end_s` at a generation pace of
    `gen_tok_s` (every core), first with fewer greedy prompts down to `extras_min_limit` and the
    sampled and long-context sets kept (they are what no greedy prompt measures), then without
    the long-context set (the costlier, its check uncapped), then without the sampled one too
    and fewer greedy prompts again, not under `min_limit` (fewer would say little). The
    lossless check stays."""
    slow = REFERENCE_GEN_TOK_S / gen_tok_s
    r = REFERENCE_END_S

    def cost(limit: int, with_sampled: bool, with_long: bool) -> float:
        return slow * (
            r["fixed"]
            + r["greedy"] * limit / REFERENCE_LIMIT
            + r["sampled"] * with_sampled
            + r["long_context"] * with_long
        )

    def down_to(floor: int) -> range:
        return range(eval_limit, min(floor, eval_limit) - 1, -1)

    tries = [(n, sampled, long_context) for n in down_to(extras_min_limit)] if sampled or long_context else []
    if sampled and long_context:
        tries += [(n, True, False) for n in down_to(extras_min_limit)]
    tries += [(n, False, False) for n in down_to(min_limit)]
    limit, with_sampled, with_long = next((t for t in tries if cost(*t) <= end_s), tries[-1])
    return EvaluationFit(limit, with_sampled, with_long, round(cost(limit, with_sampled, with_long), 1))
