"""The pictures every job leaves under `<run_dir>/plots/`, drawn from its history
(`cluster.job.history`) and its evaluation:

- `training.png`: loss and τ~ against step and against wall clock;
- `acceptance.png`: acceptance per draft position: each evaluation set's (how often the k-th
  draft was accepted) and, for comparison of shapes only, training's expected acceptance c* of
  each slot over the last steps (not conditioned on the slots before it, so higher);
- `tau_per_category.png`: τ per category for each evaluation set;
- `generation.png`: generation tok/s per group and the trainer's data wait against wall clock.

`plot_run` returns, per picture, the file and the series it drew, so a test compares them with
the history and the evaluation instead of trusting the pixels."""

from __future__ import annotations

import logging
import re
from pathlib import Path

log = logging.getLogger("dspark.plots")
POSITION = re.compile(r"^accept_pos(\d+)$")
LAST_STEPS = 20  # the training acceptance is the mean of the last steps' (one step is noisy)


def _series(rows: list[dict], kind: str, x: str, y: str) -> tuple[list[float], list[float]]:
    pts = [(r[x], r[y]) for r in rows if r["kind"] == kind and r.get(y) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def training_acceptance(rows: list[dict]) -> list[float]:
    """Mean acceptance per draft position over the last `LAST_STEPS` steps that report it."""
    steps = [r for r in rows if r["kind"] == "step" and any(POSITION.match(k) for k in r)][-LAST_STEPS:]
    if not steps:
        return []
    positions = sorted({int(m.group(1)) for r in steps for k in r if (m := POSITION.match(k))})
    return [sum(r.get(f"accept_pos{p}", 0.0) for r in steps) / len(steps) for p in positions]


def plot_data(rows: list[dict], evaluations: dict[str, dict]) -> dict[str, dict]:
    """What each picture draws: name -> panel -> series name -> (x, y)."""
    progress = [r for r in rows if r["kind"] == "progress"]
    groups = sorted({g for r in progress for g in r["tokens_per_s"]})
    trained = training_acceptance(rows)

    def positions(acceptance: list[float]) -> tuple[list[int], list[float]]:
        return list(range(1, len(acceptance) + 1)), list(acceptance)

    def category_taus(evaluation: dict) -> tuple[list[str], list[float]]:
        measured = sorted(c for c, f in evaluation.get("per_category", {}).items() if f.get("tau") is not None)
        return measured, [evaluation["per_category"][c]["tau"] for c in measured]

    return {
        "training": {
            "loss by step": {"loss": _series(rows, "step", "step", "loss")},
            "tau~ by step": {"tau~": _series(rows, "step", "step", "expected_tau")},
            "loss by wall clock (s)": {"loss": _series(rows, "step", "t", "loss")},
            "tau~ by wall clock (s)": {"tau~": _series(rows, "step", "t", "expected_tau")},
        },
        "acceptance": {
            "acceptance per draft position": {
                "training: c* per slot, last steps": positions(trained),
                **{
                    f"eval {name}": positions(e.get("per_position_acceptance") or []) for name, e in evaluations.items()
                },
            },
        },
        "tau_per_category": {f"tau per category: {name}": {"tau": category_taus(e)} for name, e in evaluations.items()},
        "generation": {
            "generation tok/s by wall clock (s)": {
                g: (
                    [r["t"] for r in progress if g in r["tokens_per_s"]],
                    [r["tokens_per_s"][g] for r in progress if g in r["tokens_per_s"]],
                )
                for g in groups
            },
            "trainer data wait (s) by wall clock (s)": {
                "data wait": _series(rows, "progress", "t", "data_wait_s"),
                "training": _series(rows, "progress", "t", "train_s"),
            },
        },
    }


def plot_run(out_dir: Path, rows: list[dict], evaluations: dict[str, dict]) -> dict[str, dict]:
    """Draw every picture into `out_dir`; returns name -> {"path", "data"} (nothing without
    matplotlib, which `.[dev]` installs: a job without it says so and goes on)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display on a cluster node
        import matplotlib.pyplot as plt
    except ImportError as e:
        log.warning("no pictures: %s", e)
        return {}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    drawn = {}
    for name, panels in plot_data(rows, evaluations).items():
        if not panels:
            continue
        fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
        for ax, (title, series) in zip(axes[0], panels.items()):
            for label, (x, y) in series.items():
                if name == "tau_per_category":
                    ax.bar(x, y)
                    ax.tick_params(axis="x", labelrotation=45)
                else:
                    ax.plot(x, y, marker="." if len(x) < 50 else None, label=label)
            ax.set_title(title)
            if name != "tau_per_category" and len(series) > 1:
                ax.legend(fontsize="small")
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        drawn[name] = {"path": str(path), "data": panels}
    return drawn
