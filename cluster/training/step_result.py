"""`StepResult`: what one trainer rank reports of a global step, typed as it crosses Ray."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cluster.data import LeasedSample


@dataclass
class StepResult:
    """One rank's part of step `step`. `figures` are the objective's own (`dspark.losses`: the
    loss and its terms, τ~, acceptance per position), empty for a rank that had nothing to
    train; they are an open set (wandb logs them all), the ones the loop and the progress
    line read have properties."""

    step: int
    rank: int
    skipped: bool  # no rank updated: some rank's loss was not finite
    nonfinite: bool  # this rank's loss was the non-finite one
    tokens: int  # tokens trained (0 when skipped)
    step_s: float
    lr: float | None
    batch: list[str] = field(default_factory=list)  # the uids this rank held, trained or not
    trained: list[LeasedSample] = field(default_factory=list)  # its lease rows it trained, for the exactly-once record
    figures: dict[str, float] = field(default_factory=dict)

    @property
    def loss(self) -> float | None:
        return self.figures.get("loss")

    @property
    def expected_tau(self) -> float | None:
        return self.figures.get("expected_tau")

    def scalars(self) -> dict[str, float]:
        """Every number of the step by name: the figures, the learning rate, tokens, seconds."""
        extra = {"tokens": self.tokens, "step_s": self.step_s, **({"lr": self.lr} if self.lr is not None else {})}
        return {**self.figures, **extra}
