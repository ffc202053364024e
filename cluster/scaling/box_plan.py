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

The model of a run, for each choice (U prompts, answers of L tokens, r replica threads):
    generation   G = U·L / gen_tok_s[r]            (greedy answers: epoch 0 only, reused later)
    per step     S = batch_tokens / (prompt_tokens + L) samples
    trained      while generating: min(U/G, S/step_s[cores - r]) samples/s for G seconds,
                 then S/step_s[cores] samples/s for the rest of the training window
    epochs       trained / U, at most `max_epochs`
Pure: the paces are passed in (measured by the job's probe, or by the last run on this machine:
`cluster.job.machine_paces`), and tests inject them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Paces:
    """What this machine does. `generation_tok_s[r]`: a replica's tokens/s at r threads at its
    batch; `step_s[t]`: a trainer rank's seconds per step at t threads; `source`: where they came
    from (a probe at this job's start, or the record of a run on this machine)."""
    generation_tok_s: dict[int, float]
    step_s: dict[int, float]
    source: str = "injected"

    def gen(self, threads: int) -> float:
        return _at(self.generation_tok_s, threads)

    def step(self, threads: int) -> float:
        return _at(self.step_s, threads)


def _at(table: dict[int, float], threads: int) -> float:
    """The pace at `threads`, or at the nearest measured thread count below it (above, if none)."""
    below = [t for t in table if t <= threads]
    return table[max(below)] if below else table[min(table)]


@dataclass(frozen=True)
class Workload:
    prompts_per_category: dict[str, int]  # training prompts available in each category
    prompt_tokens: float  # mean tokens of a training prompt (chat template included)
    batch_tokens: int  # a trainer step's token budget
    train_window_s: float  # seconds from the first sample to the end of training
    cores: int
    max_epochs: int


@dataclass(frozen=True)
class Choices:
    prompts_per_category: tuple[int, ...] = (12, 24, 48)
    answer_tokens: tuple[int, ...] = (64, 96, 128)
    # The sweep's best had 10 epochs; below `min_epochs` the drafter is flagged not worth serving.
    target_epochs: float = 10.0
    min_epochs: float = 1.0


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


def expected(work: Workload, paces: Paces, cap: int, answer: int, replica_threads: int) -> tuple[int, float, float]:
    """(unique prompts, generation seconds, trained samples) of one choice, by the module's model."""
    prompts = sum(min(cap, n) for n in work.prompts_per_category.values())
    trainer_threads = max(work.cores - replica_threads, 1)
    generation_s = prompts * answer / paces.gen(replica_threads)
    if work.cores == 1:  # one core shared: each runs at half its pace while both do
        generation_s *= 2
    per_step = max(work.batch_tokens / (work.prompt_tokens + answer), 1.0)
    during = min(prompts / generation_s, per_step / paces.step(trainer_threads) / (2 if work.cores == 1 else 1))
    window = work.train_window_s
    if generation_s >= window:
        trained = during * window
    else:
        trained = during * generation_s + per_step / paces.step(work.cores) * (window - generation_s)
    trained = min(trained, prompts * work.max_epochs)
    return prompts, generation_s, trained


def choose_plan(work: Workload, paces: Paces, choices: Choices = Choices()) -> BoxPlan:
    """Among the choices that train `target_epochs`: the longest answers (what the sweep
    measured; shorter ones are a slow box's remedy), then the most prompts, then the most
    epochs. Where none reaches it: the most epochs, then the most prompts. The reasons say
    which and why, with the figures."""
    splits = range(1, work.cores) if work.cores > 1 else (1,)
    options = []
    for cap in sorted(set(choices.prompts_per_category)):
        for answer in sorted(set(choices.answer_tokens)):
            # the split that trains the most samples for this choice
            best = max(((expected(work, paces, cap, answer, r), r) for r in splits), key=lambda x: x[0][2])
            (prompts, generation_s, trained), r = best
            options.append((cap, answer, r, prompts, generation_s, trained, trained / max(prompts, 1)))
    reaching = [o for o in options if o[6] >= choices.target_epochs]
    if reaching:
        cap, answer, r, prompts, generation_s, trained, epochs = max(reaching, key=lambda o: (o[1], o[3], o[6]))
        why = (f"the longest answers, and with them the most prompts, that still train {choices.target_epochs:g} "
               f"epochs in {work.train_window_s:.0f} s (more prompts pay only once each is seen that often)")
    else:
        cap, answer, r, prompts, generation_s, trained, epochs = max(options, key=lambda o: (round(o[6], 2), o[3], o[1]))
        why = (f"no choice trains {choices.target_epochs:g} epochs in {work.train_window_s:.0f} s: the one that trains "
               f"the most epochs")
    reasons = [why,
               f"paces ({paces.source}): generation {paces.gen(r):.0f} tok/s at {r} thread(s), a trainer step "
               f"{paces.step(max(work.cores - r, 1)):.2f} s at {max(work.cores - r, 1)} thread(s) beside it and "
               f"{paces.step(work.cores):.2f} s at {work.cores} after",
               f"expected: {prompts} prompts × answers of up to {answer} tokens generated in {generation_s:.0f} s, "
               f"{trained:.0f} samples trained ({epochs:.1f} epochs)"]
    worth = epochs >= choices.min_epochs
    if not worth:
        reasons.append(f"less than {choices.min_epochs:g} epoch of even the smallest choice fits: raise "
                       f"trainer.time_budget_s (about {work.train_window_s * choices.min_epochs / max(epochs, 1e-3):.0f} s "
                       f"of training for one epoch)")
    return BoxPlan(cap, prompts, answer, r, max(work.cores - r, 1), round(generation_s, 1), int(trained),
                   round(epochs, 2), worth, reasons)
