"""DSpark against its own DFlash ablation: the local job twice, same data, steps and minutes.

    python benchmarks/drafter_quality.py [--config configs/local.yaml] [key=value ...]

Runs `scripts/run_local.sh` (the README's main-job command: a local Ray head, vLLM CPU
regenerating the answers, Mooncake, the DeepSpeed trainer) once with `drafter.mode=dspark` and
once with `drafter.mode=dflash` (the same backbone without the Markov and confidence heads),
every other setting equal, a fresh run each (`trainer.resume=never`). With a time budget (the
local default's `trainer.time_budget_s`) both train for the same minutes, each as many epochs as
its own pace fits. Prints, per mode, the
held-out τ and the τ of every `data.eval_sets` split (macro over categories too), the job's
wall clock and steps, and DSpark's ratio over DFlash; writes `outputs/drafter_quality.json`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(mode: str, config: str, overrides: list[str], log: Path) -> dict:
    name = f"quality-{mode}"
    cmd = [
        str(ROOT / "scripts" / "run_local.sh"),
        "--config",
        config,
        f"run_name={name}",
        f"drafter.mode={mode}",
        "trainer.resume=never",
        *overrides,
    ]
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=3 * 3600)
    if proc.returncode:
        raise SystemExit(f"{mode} run failed (exit {proc.returncode}); its log: {log}")
    result = json.loads((ROOT / "outputs" / name / "result.json").read_text())
    result["submit_s"] = time.time() - t0
    return result


def figures(result: dict) -> dict:
    sets = {"heldout": result["evaluation"], **result.get("evaluation_sets", {})}
    return {
        name: {
            "tau": ev["tau"],
            "macro_tau": ev["macro_tau"],
            "lossless": ev["lossless"],
            "per_position_acceptance": ev["per_position_acceptance"],
        }
        for name, ev in sets.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/local.yaml")
    ap.add_argument("--reuse", default="", help="modes whose earlier run (outputs/quality-<mode>) is read, not rerun")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    rows = {}
    for mode in ("dspark", "dflash"):
        if mode in args.reuse.split(","):
            r = json.loads((ROOT / "outputs" / f"quality-{mode}" / "result.json").read_text())
        else:
            r = run(mode, args.config, args.overrides, ROOT / "outputs" / f"drafter_quality-{mode}.log")
        rows[mode] = {
            "wall_clock_s": r["wall_clock_s"],
            "steps": r["steps"],
            "cpu": r["machine"]["cpu"]["model"],
            "epochs": r.get("epochs", {}).get("kept"),
            "splits": figures(r),
        }
    (ROOT / "outputs" / "drafter_quality.json").write_text(json.dumps(rows, indent=2))
    splits = list(rows["dspark"]["splits"])
    print(
        f"\n=== DSpark vs its DFlash ablation: {args.config} {' '.join(args.overrides)} on {rows['dspark']['cpu']} ==="
    )
    print(
        f"{'mode':8} {'wall min':>8} {'steps':>6} {'epochs':>6} "
        + " ".join(f"{s + ' tau':>12} {s + ' macro':>12}" for s in splits)
    )
    for mode, r in rows.items():
        print(
            f"{mode:8} {r['wall_clock_s'] / 60:8.1f} {r['steps']:6d} {r['epochs'] or '-':>6} "
            + " ".join(f"{r['splits'][s]['tau']:12.3f} {r['splits'][s]['macro_tau']:12.3f}" for s in splits)
        )
    print(
        "dspark / dflash: "
        + ", ".join(
            f"{s} {rows['dspark']['splits'][s]['tau'] / rows['dflash']['splits'][s]['tau']:.3f}x" for s in splits
        )
    )
    if not all(sp["lossless"] for r in rows.values() for sp in r["splits"].values()):
        sys.exit("a lossless check failed")


if __name__ == "__main__":
    main()
