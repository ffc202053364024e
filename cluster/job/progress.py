"""What a running job tells its user: the `[progress]` lines in the job log, the
`ray_dspark_*` series in the Ray dashboard (via `cluster.metrics`) and wandb.

`TrainingStats` is the training loop's own account (step, seconds computing and waiting, last
metrics); the loop writes it, the reporter thread only reads it. `ProgressReporter` reads that,
the ledger's counts and the replica pools' rates, and publishes them: one line for the trainer
world and one per group.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, field

from cluster.data import LedgerCounts
from cluster.job.history import RunHistory
from cluster.metrics import Metrics
from cluster.training import StepResult

log = logging.getLogger("dspark.progress")
TRAIN_METRICS = ("loss", "ce", "l1", "confidence_bce", "expected_tau", "greedy_tau", "lr")


@dataclass
class TrainingStats:
    step: int = 0
    train_s: float = 0.0  # seconds in train_step calls
    data_wait_s: float = 0.0  # seconds waiting for a step's data (assembly and reads)
    last: StepResult | None = None  # the last step's figures (of a rank that had data)
    ranks: int = 0
    layout: dict = field(default_factory=dict)  # trainer ranks per group
    skipped_steps: int = 0  # steps whose update was skipped (a non-finite loss)
    resize_seq_handled: int = 0  # the last resize request the loop has acted on (applied or refused)


def nan_if_none(x: float | None) -> float:
    return math.nan if x is None else x


def eta(stats: TrainingStats, counts: LedgerCounts, gen_rate: float) -> float:
    """Seconds until the slower of generation (what is left, at the current rate) and
    training (what is left, at the trainer's own pace, data waits excluded) is done."""
    done = counts.trained + counts.leased
    if not done or not stats.step:
        return float("nan")
    to_generate = counts.to_generate
    tokens_per_sample = counts.produced_tokens / max(counts.produced_samples, 1)
    gen_s = to_generate * tokens_per_sample / gen_rate if to_generate and gen_rate > 0 else 0.0
    train_s = (counts.total - done) / (done / stats.step) * (stats.train_s / stats.step)
    return max(gen_s, train_s)


class ProgressReporter:
    def __init__(
        self,
        metrics: Metrics,
        ledger,
        pools: dict,
        stats: TrainingStats,
        services,
        wandb_run=None,
        history: RunHistory | None = None,
    ) -> None:
        import ray

        self.ray, self.metrics, self.ledger, self.pools, self.stats = ray, metrics, ledger, pools, stats
        self.services, self.wandb, self.history = services, wandb_run, history

    def on_step(self, step: int, per_rank: list[StepResult]) -> None:
        """After every optimizer step: counters, the loss terms, wandb."""
        m = self.stats.last or per_rank[0]
        self.publish_train(m)
        self.metrics.count("train_steps", 1)
        self.metrics.count("trained_tokens", sum(x.tokens for x in per_rank))
        if self.wandb is not None:
            self.wandb.log(m.scalars(), step=step)
        if self.history is not None:
            self.history.step(step, m.scalars())

    def publish_train(self, m: StepResult | None) -> None:
        figures = m.scalars() if m is not None else {}
        for k in TRAIN_METRICS:
            if figures.get(k) is not None:
                self.metrics.gauge(f"train_{k}", figures[k])

    def publish_evaluation(self, evaluation: dict) -> None:
        """The held-out evaluation's τ, overall and per category (after the job's evaluation)."""
        for name in ("tau", "macro_tau"):
            if evaluation.get(name) is not None:
                self.metrics.gauge(f"heldout_{name}", evaluation[name])
        for category, figures in evaluation.get("per_category", {}).items():
            if figures.get("tau") is not None:
                self.metrics.gauge("heldout_category_tau", figures["tau"], category=category)

    def report(self) -> str:
        """Publish every gauge and return the progress lines."""
        try:  # only a metric: a dead daemon's samples are found missing by readers
            self.metrics.gauge("store_daemon_restarts", self.services.daemon_restarts())
            self.metrics.gauge("master_restarts", self.services.master_info()["restarts"])
        except Exception:  # noqa: BLE001 - a metric is not worth failing the report for
            pass
        c = self.ledger.counts()
        for state, n in c.per_state().items():
            self.metrics.gauge(f"samples_{state}", n)
        self.metrics.gauge("oldest_lease_s", c.oldest_lease_s)
        self.metrics.gauge("crossed_samples", c.crossed_samples)
        self.metrics.gauge("trainer_ranks", self.stats.ranks)
        s, m = self.stats, self.stats.last
        gen_total, lines, rates = 0.0, [], {}
        for name, pool in self.pools.items():
            g = c.group(name)
            rate = rates[name] = sum(x["tokens_per_s"] for x in pool.stats())
            gen_total += rate
            tags = {"group": name}
            self.metrics.gauge("queue_bytes", g.queued_bytes, **tags)
            self.metrics.gauge("queue_samples", g.stored, **tags)
            self.metrics.gauge("producers_paused", int(g.paused), **tags)
            self.metrics.gauge("inference_tokens_per_s", rate, **tags)
            self.metrics.gauge("inference_replicas", len(pool), **tags)
            self.metrics.gauge("samples_generated", g.produced_samples, **tags)
            lines.append(
                f"[progress]   {name}: in {rate:.0f} tok/s (replicas {len(pool)}) | generated {g.produced_samples} "
                f"| queue {g.stored} samples {g.queued_bytes / 2**20:.0f} MiB"
                f"{' (paused)' if g.paused else ''} | trained {g.trained_samples}, "
                f"{g.crossed_samples} of them by another group's ranks"
            )
        if self.history is not None:
            self.history.progress(s.step, rates, s.data_wait_s, s.train_s)
        left = eta(s, c, gen_total)
        failed = f", {c.failed} failed" if c.failed else ""
        skipped = f", {s.skipped_steps} skipped (non-finite)" if s.skipped_steps else ""
        head = (
            f"[progress] step {s.step} ({s.ranks} ranks{skipped}) "
            f"| trained {c.trained}+{c.leased} leased{failed} / {c.total} "
            f"| loss {nan_if_none(m and m.loss):.3f} tau~{nan_if_none(m and m.expected_tau):.2f} "
            f"| {s.train_s / max(s.step, 1):.1f}s/step, data wait {s.data_wait_s:.0f}s | ETA {left / 60:.1f} min"
        )
        return "\n".join([head, *lines])

    def loop(self, stop: threading.Event, interval_s: float) -> None:
        while not stop.wait(interval_s):
            try:
                print(self.report(), flush=True)
            except Exception as e:  # noqa: BLE001 - progress must never kill the job
                log.warning("progress report failed: %r", e)
