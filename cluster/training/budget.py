"""`EpochPlanner`: how many of the planned epochs fit in `trainer.time_budget_s`, and the step the
LR schedule should end at.

A job is given a wall-clock budget, not a number of steps: in the same minutes the same config
trained 15-17 epochs on a 2-core Xeon with AMX, where a 2-core AVX2-only EPYC trains about 6. Until every sample is
generated the trainer's pace is set by its producers (epoch 0 is trained as it arrives) and says
nothing about the epochs after it, so the planner measures only from then on, over a sliding
window of the last `window` steps (the pace changes: a sample's first epoch costs more than its
later ones, whose target normalisers are cached; a resized world steps at another rate):

    waiting ──(generation done)──► measuring ──(`window` steps)──► projecting, at every step:
        keep = the most epochs whose untrained samples, at the window's samples/s (plus the
        last, partial step and two deviations of the steps' sum), are trained by the
        deadline (the begun ones always, and at least one)

Two decisions follow. The LR horizon is the step the kept epochs end at, so the cosine reaches
its floor at the last step instead of being cut off halfway down; it moves to another number of
epochs when `keep` leaves a band around the one it was planned for (measured on the local job:
without the band a pace wavering by 0.3% moved it 45 steps back and forth within a second).
And the epochs from `keep` on are dropped from the ledger (`SampleLedger.shorten`: whole epochs,
so the record proves every prompt × epoch of the shortened plan trained exactly once), but only
once every epoch before them has begun: until then a faster pace may still fit them, and a drop
cannot be undone. If the pace falls behind the projection within the last kept epoch, the job's
deadline stops training where it is (`ended_by: time_budget`). Pure: the clock is injected, the
driver (`cluster.job.loop`) applies the decisions.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Plan:
    epochs: int  # the epochs that fit (`keep`)
    horizon_epochs: int  # the epochs the LR schedule is planned for
    horizon: int  # the step they end at
    samples_per_s: float
    drop: bool  # the epochs from `epochs` on should leave the plan now (every one before them has begun)


class EpochPlanner:
    def __init__(
        self,
        deadline: float = math.inf,
        window: int = 10,
        slack: float = 0.05,
        band: float = 0.05,
        clock=time.monotonic,
    ) -> None:
        """`deadline`: the clock's time by which training ends (inf: no budget, the planner only
        measures the LR horizon); `window`: the steps the pace is measured over (a checkpoint
        interval at least, so that checkpoints count at their share); `slack`: the fraction of
        the time left that a kept plan must leave unused (a pace a little slower than measured
        should still end the plan, not cut its last epoch); `band`: how far (a fraction of the
        time left) the projection must move before the LR horizon follows it to another number of
        epochs (a pace that wavers around an epoch's edge would otherwise move it back and forth)."""
        self.deadline, self.slack, self.band, self.clock = deadline, slack, band, clock
        self.points: deque[tuple[float, int, int]] = deque(maxlen=window + 1)  # (time, step, samples trained) per step
        self.step, self.trained = 0, 0

    @property
    def budgeted(self) -> bool:
        return self.deadline < math.inf

    def expired(self) -> bool:
        return self.clock() >= self.deadline

    def ready(self) -> bool:
        """The pace is measured: a whole window of steps since generation ended."""
        return len(self.points) == self.points.maxlen

    def remeasure(self) -> None:
        """The pace changes from here on (the trainer world was resized): measure it again."""
        self.points.clear()

    def on_step(self, step: int, samples: int, generating: bool) -> None:
        """After each optimizer step: its number, the samples it trained, whether any producer
        still has samples to generate."""
        if generating or step <= self.step:
            # generation resumed (lost samples regenerated), or the world went back to a
            # checkpoint: neither is the pace from here on
            self.points.clear()
        self.step, self.trained = step, self.trained + samples
        if not generating:
            self.points.append((self.clock(), self.step, self.trained))

    def step_seconds(self) -> tuple[float, float]:
        """The window's mean seconds per step and their spread: the median absolute deviation
        scaled to a standard deviation (1.4826 x MAD), which a checkpoint step does not inflate
        (periodic, and already in the mean: with the plain deviation one checkpoint in the local
        job's window of 40 steps made the margin half a minute and cost it two epochs)."""
        times = [(b[0] - a[0]) / max(b[1] - a[1], 1) for a, b in zip(self.points, list(self.points)[1:])]
        median = statistics.median(times)
        return sum(times) / len(times), 1.4826 * statistics.median(abs(t - median) for t in times)

    def plan(
        self, remaining_per_epoch: list[int], first_open_epoch: int, horizon_epochs: int | None = None
    ) -> Plan | None:
        """None until the pace is measured. `remaining_per_epoch[e]`: epoch e's samples not yet
        trained; `first_open_epoch`: the lowest epoch from which on none has begun;
        `horizon_epochs`: the epochs the LR horizon was last planned for (kept while the
        projection stays within the band around it)."""
        if not self.ready():
            return None
        (t0, step0, trained0), (now, step, trained) = self.points[0], self.points[-1]
        rate = (trained - trained0) / max(now - t0, 1e-9)
        per_step = (trained - trained0) / (step - step0)
        if rate <= 0:
            return None
        begun, usable = max(first_open_epoch, 1), (self.deadline - now) * (1 - self.slack)
        step_s, spread_s = self.step_seconds()

        def seconds_for(samples: int) -> float:
            # at the measured pace, plus the last step (partial: it waits for the last samples)
            # and two deviations of a sum of that many step times (a pace that wavers: CI missed
            # a 36 s budget by one step on a 5% slack)
            steps = samples / per_step
            return samples / rate + step_s + 2 * spread_s * math.sqrt(steps)

        def fitting(seconds: float) -> int:  # the most epochs trained within `seconds`
            n = begun
            while n < len(remaining_per_epoch) and seconds_for(sum(remaining_per_epoch[: n + 1])) <= seconds:
                n += 1
            return n

        keep = fitting(usable)
        drop = keep == begun and keep < len(remaining_per_epoch)
        held = keep if horizon_epochs is None else min(max(horizon_epochs, begun), len(remaining_per_epoch))
        if drop or not fitting(usable * (1 - self.band)) <= held <= fitting(usable * (1 + self.band)):
            held = keep
        return Plan(
            epochs=keep,
            horizon_epochs=held,
            horizon=step + math.ceil(sum(remaining_per_epoch[:held]) / per_step),
            samples_per_s=rate,
            drop=drop,
        )
