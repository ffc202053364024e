"""Helpers of the soak harness (benchmarks/soak.py): the simulated clock, the seeded chaos
schedule (what it injected, kept as its own record for the test to check against), the ledger
behind a simulated clock in a Ray actor, and the measurements' summaries."""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field

from cluster.data import SampleLedger

# Faults drawn at a rate per simulated hour (scaled by --chaos-scale); poison prompts and samples
# are a count chosen at the start, the stop and resubmit a fraction of the run.
RATES_PER_HOUR = {"replica_death": 1.0, "rank_death": 0.25, "hang": 0.25, "master_restart": 0.05, "full_store": 0.25}
KINDS = (*RATES_PER_HOUR, "poison_prompt", "poison_sample", "resubmit")


class SimClock:
    """The ledger's clock (`SampleLedger(clock=...)`): simulated seconds, moved by the harness."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class SimLedger(SampleLedger):
    """The ledger as the job's Ray actor runs it, on a simulated clock the driver moves with one
    extra call per tick (`set_time`, not timed: the job's actor reads its own monotonic clock)."""

    def __init__(self, *args, **kwargs) -> None:
        self._sim = SimClock()
        super().__init__(*args, clock=self._sim, **kwargs)

    def set_time(self, t: float) -> None:
        self._sim.t = t

    def ledger_events(self) -> list[dict]:
        return self.events


@dataclass
class Chaos:
    """The seeded fault schedule. Each tick `draw(dt_s, frac)` returns the faults to inject now:
    Poisson draws at `rates` per simulated hour while the run is before `until` (a fraction of its
    samples: a fault near the very end would have nothing left to hit), plus each kind in
    `forced` once at its own fraction of the run if it has not happened by then. `injected`
    is the schedule's own record: kind -> count, filled by the harness when a fault is applied."""

    seed: int
    scale: float = 1.0
    forced: tuple[str, ...] = ()
    until: float = 0.85
    rates: dict = field(default_factory=lambda: dict(RATES_PER_HOUR))
    injected: Counter = field(default_factory=Counter)
    log: list = field(default_factory=list)  # (simulated s, step, kind, detail)

    def __post_init__(self) -> None:
        self.rng = random.Random(f"chaos/{self.seed}")
        # (the producers' faults early: with answers reused across epochs only epoch 0 is generated)
        at = {"hang": 0.03, "full_store": 0.06, "replica_death": 0.12, "rank_death": 0.4, "master_restart": 0.5}
        self.force_at = {k: at[k] for k in self.rates if k in self.forced}

    def draw(self, dt_s: float, frac: float) -> list[str]:
        if frac >= self.until:
            return []
        due = []
        for kind, per_hour in self.rates.items():
            lam = per_hour * self.scale * dt_s / 3600
            n = 0 if lam <= 0 else _poisson(self.rng, lam)
            due += [kind] * n
        for kind, at in list(self.force_at.items()):
            if frac >= at:
                del self.force_at[kind]
                if not self.injected[kind] and kind not in due:
                    due.append(kind)
        return due

    def record(self, now: float, step: int, kind: str, detail: str) -> None:
        self.injected[kind] += 1
        self.log.append((round(now), step, kind, detail))


def _poisson(rng: random.Random, lam: float) -> int:
    n, p, limit = 0, rng.random(), math.exp(-lam)
    while p > limit:
        n += 1
        p *= rng.random()
    return n


def percentiles(xs: list[float]) -> tuple[float, float, float]:
    """p50, p99, max (nearest rank); zeros for none."""
    if not xs:
        return 0.0, 0.0, 0.0
    s = sorted(xs)
    return s[len(s) // 2], s[min(len(s) - 1, math.ceil(0.99 * len(s)) - 1)], s[-1]


def decile_table(
    steps: list[tuple[int, float]], ckpts: list[dict], produce: list[tuple[int, float]], total: int
) -> list[dict]:
    """Per decile of the run by samples trained: the control path's cost per step (ms), the
    producers' cost per call, the checkpoints' time, bytes and cost per changed row."""
    rows = []
    for d in range(10):

        def inside(done: int, d=d) -> bool:
            return min(int(10 * done / total), 9) == d

        st = [c for done, c in steps if inside(done)]
        pr = [c for done, c in produce if inside(done)]
        ck = [c for c in ckpts if inside(c["done"])]
        changed = sum(c["changed"] for c in ck)
        rows.append(
            {
                "decile": d,
                "steps": len(st),
                "step_ms": [1e3 * x for x in percentiles(st)],
                "produce_ms": [1e3 * x for x in percentiles(pr)],
                "ckpts": len(ck),
                "ckpt_ms": [1e3 * x for x in percentiles([c["s"] for c in ck])],
                "ckpt_state_ms": 1e3 * max((c["state_s"] for c in ck), default=0.0),
                "ckpt_write_ms": 1e3 * max((c["write_s"] for c in ck), default=0.0),
                "ckpt_record_ms": 1e3 * max((c["record_s"] for c in ck), default=0.0),
                "ckpt_mb": max((c["bytes"] for c in ck), default=0) / 1e6,
                "ckpt_us_per_changed": 1e6 * sum(c["s"] for c in ck) / changed if changed else 0.0,
            }
        )
    return rows


def format_table(rows: list[dict]) -> str:
    head = (
        f"{'decile':>6} {'steps':>6} {'step ms p50/p99/max':>22} {'produce ms p99/max':>19} {'ckpts':>5} "
        f"{'ckpt ms p50/max':>16} {'state/write/record ms (max)':>27} {'ckpt MB':>8} {'ckpt us/changed':>15}"
    )
    out = [head]
    for r in rows:
        s, p, c = r["step_ms"], r["produce_ms"], r["ckpt_ms"]
        out.append(
            f"{r['decile']:>6} {r['steps']:>6} {s[0]:>7.2f}/{s[1]:>6.2f}/{s[2]:>7.2f} {p[1]:>9.2f}/{p[2]:>8.2f} "
            f"{r['ckpts']:>5} {c[0]:>8.1f}/{c[2]:>7.1f} {r['ckpt_state_ms']:>10.1f}/{r['ckpt_write_ms']:>6.1f}/"
            f"{r['ckpt_record_ms']:>8.1f} {r['ckpt_mb']:>8.2f} {r['ckpt_us_per_changed']:>15.1f}"
        )
    return "\n".join(out)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        return f"{names[0]} ({len(names)} logical cores)" if names else "unknown"
    except OSError:
        return "unknown"
