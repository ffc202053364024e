"""The job's end: the exactly-once proof, the export, the held-out evaluation, result.json.

`finish` writes what a completed run leaves; `stopped` what a stop leaves (a checkpoint of what
was trained since the last one, and how to resume). Each takes what it reads: the config, the
run's facts (`RunFacts`), where training ended (`TrainingEnd`) and the parts it asks.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from cluster.config import JobConfig
from cluster.data import poison_samples, quarantined
from cluster.hardware import read_cpu
from cluster.job.history import read_history
from cluster.job.inputs import JobInputs
from cluster.job.plots import plot_run
from cluster.job.quality import assess
from dspark.recipe import write_recipe
from dspark.tau_report import UNCATEGORIZED

log = logging.getLogger("dspark.job")


class JobFailed(RuntimeError):
    pass


@dataclass(frozen=True)
class RunFacts:
    """What a run is, whatever its end: its config, directory, start (time.monotonic) and events."""

    cfg: JobConfig
    run_dir: Path
    started: float
    events: list[str]

    def write(self, results: dict) -> None:
        (self.run_dir / "result.json").write_text(json.dumps(results, indent=2, default=str))


@dataclass(frozen=True)
class TrainingEnd:
    """Where the training phase left the run."""

    ended_by: str  # data | max_steps | time_budget | stop
    steps: int
    trained_until_s: float | None  # when training ended, from the job's start
    lr_horizon: int
    world: dict[str, int]  # trainer ranks per group
    groups: dict[str, dict]  # per group: the replicas it ended with, the pool's events
    autoscaler: list | None  # what the autoscaler decided and applied, in order (None: it was off)


def stopped(
    run: RunFacts,
    reason: str,
    phase: str,
    step: int,
    trained_until_s: float | None,
    committer,
    checkpoints,
    record,
    ledger,
) -> dict:
    """A stop (`ray job stop`, SIGTERM to the driver) in any `phase`: what was trained since the
    last checkpoint is committed in one more (`committer`, None when the stop came before the
    trainer), and result.json says so and how to resume. No calibration, export or evaluation:
    they take minutes that Ray's stop wait (`RAY_JOB_STOP_WAIT_TIME_S`) may not give, and the
    resumed job does them at its end. The producers are stopped afterwards, by the job's
    shutdown: draining them could take the stop wait, and what they generate now is generated
    again on resume (the checkpoint's ledger holds it as pending). result.json is written
    whatever fails here (a world that cannot save: the checkpoint before stands)."""
    problems = []
    if committer is not None and committer.uncommitted:  # steps since the last checkpoint
        try:
            committer.commit(step)
        except Exception as e:  # noqa: BLE001 - the stop's record matters more; the last checkpoint stands
            problems.append(
                f"the stop's checkpoint at step {step} failed ({type(e).__name__}: {e}); "
                f"the last one stands and its steps since are trained again on resume"
            )
    latest = checkpoints.latest()
    try:
        proof = record.verify(ledger.outcome(), complete=False) if ledger is not None else None
    except Exception as e:  # noqa: BLE001 - a dead ledger actor: said, not raised
        proof = None
        problems.append(f"the exactly-once proof could not be read: {type(e).__name__}: {e}")
    cfg = run.cfg
    resume = f"submit the same command again with run_name={cfg.run_name} output_dir={cfg.output_dir}: " + (
        f"it resumes from {latest} (trainer.resume=auto)" if latest else "it starts over (nothing was trained)"
    )
    results = {
        "status": "stopped",
        "reason": reason,
        "phase": phase,
        "run_dir": str(run.run_dir),
        "steps": step,
        "checkpoint": str(latest) if latest else None,
        "resume": resume,
        "exactly_once": proof,
        "events": run.events + problems,
        "trained_until_s": trained_until_s,
        "wall_clock_s": time.monotonic() - run.started,
    }
    run.write(results)
    log.warning("stopped (%s) at step %d; %s", reason, step, resume)
    return results


def pictures(run: RunFacts, history: Path, wandb_run, final: Path, results: dict) -> dict[str, str]:
    """The run's pictures (`cluster.job.plots`) from its history and evaluations; with wandb on,
    the same pictures, the evaluation's τ and the drafter (an artifact) go to the run too."""
    evaluations = {"held-out": results["evaluation"], **results["evaluation_sets"]}
    drawn = plot_run(run.run_dir / "plots", read_history(history), evaluations)
    if wandb_run is not None:
        try:
            import wandb

            wandb_run.log({f"plots/{name}": wandb.Image(d["path"]) for name, d in drawn.items()})
            wandb_run.summary.update({f"eval/{name}/tau": e.get("tau") for name, e in evaluations.items()})
            artifact = wandb.Artifact(re.sub(r"[^A-Za-z0-9_.-]", "_", f"drafter-{run.cfg.run_name}"), type="model")
            artifact.add_dir(str(final))
            wandb_run.log_artifact(artifact)
        except Exception as e:  # noqa: BLE001 - wandb is a mirror of result.json, not worth the job
            log.warning("wandb: the pictures, evaluation or drafter were not logged: %r", e)
    return {name: d["path"] for name, d in drawn.items()}


def finish(
    run: RunFacts,
    inputs: JobInputs,
    box_plan: dict | None,
    end: TrainingEnd,
    calibration: dict,
    ledger,
    record,
    gang,
    evaluator,
    reporter,
    history: Path,
    wandb_run,
    stop_check,
) -> dict:
    """The proof from the record, the export (rank 0), the evaluation, the pictures, the recipe
    and result.json; `JobFailed` (after writing them) when more prompt x epochs failed than
    `data.max_failed_fraction` allows. `stop_check(phase)` raises JobStopped once a stop was sent
    (between the export and the evaluation, and during the evaluation)."""
    cfg = run.cfg
    outcome = ledger.outcome()
    proof = record.verify(outcome, complete=end.ended_by == "data")
    log.info("exactly-once: %s", proof)
    final = run.run_dir / "final"
    stop_check("the end (export)")
    gang.export(str(final), calibration.get("temperatures"), cfg.target.name)
    counts = ledger.counts()
    prompts = counts.total // max(counts.epochs, 1)  # the ledger's: less any the box plan's second look left out
    results = {
        "status": "completed",
        "run_dir": str(run.run_dir),
        "drafter": str(final),
        "steps": end.steps,
        "ended_by": end.ended_by,
        "trained_fraction": proof["trained"] / max(counts.total, 1),
        "exactly_once": proof,
        "world": end.world,
        "calibration": calibration,
        "events": run.events,
        # the plan the time budget kept (cluster.training.budget); what each epoch trained is in exactly_once
        "epochs": {
            "planned": cfg.data.epochs,
            "kept": counts.epochs,
            "prompts": prompts,
            "trained": round(proof["trained"] / max(prompts, 1), 3),
        },
        "lr_horizon": end.lr_horizon,
        # what cluster.box chose for this machine (box_plan.enabled), with the paces it probed
        "plan": box_plan,
        "trained_until_s": end.trained_until_s,
        "groups": {
            name: {
                "replicas": g["replicas"],
                "generated": proof["generated_by_group"].get(name, 0),
                "trained_by_its_ranks": proof["trained_by_group"].get(name, 0),
                "events": g["events"],
            }
            for name, g in end.groups.items()
        },
        "autoscaler": end.autoscaler,
    }
    failed = proof["failed"]
    results["failed_fraction"] = len(failed) / max(counts.total, 1)
    if failed:
        errors = outcome["failed"][failed[0]]
        results["failed_examples"] = {u: outcome["failed"][u] for u in failed[:20]}
        log.warning("%d prompt x epochs failed, e.g. %s: %s", len(failed), failed[0], errors[-1] if errors else "?")
    results["quarantined"] = quarantined(outcome["failed"])
    # samples the trainer world failed on alone (cluster.job.poison), their prompts quarantined
    results["poison_samples"] = poison_samples(outcome["failed"])
    measured = evaluator.evaluate(str(final))
    results["evaluation"], results["evaluation_sets"] = measured.heldout, measured.sets
    # τ sampled with the served recipe, and by context length; `evaluation_skipped`: what was not measured, why
    results["evaluation_sampled"], results["long_context"] = measured.sampled, measured.long_context
    results["evaluation_skipped"] = measured.skipped
    results["tau"] = results["evaluation"]["tau"]
    results["plots"] = pictures(run, history, wandb_run, final, results)
    quality = assess(proof["trained"], prompts, results["tau"], end.ended_by, cfg.trainer.time_budget_s)
    results["quality"] = asdict(quality)
    if not quality.worth_serving:
        log.warning("this drafter is not worth serving: %s; %s", "; ".join(quality.reasons), "; ".join(quality.advice))
    write_recipe(
        final,
        {**training_summary(cfg, inputs, proof["trained"], counts.epochs, end.steps), "quality": results["quality"]},
        results["evaluation"],
        measured.sampled,
        measured.long_context,
    )
    # Final values once more, fresh for whoever looks after the job: Ray drops series that
    # nobody has set for a while, and training ended before the evaluation.
    reporter.report()
    reporter.publish_train(reporter.stats.last)
    reporter.publish_evaluation(results["evaluation"])
    results["machine"] = {
        "cpu": read_cpu().to_dict(),
        "device": cfg.device,
        "target_dtype": cfg.target.dtype,
        "trainer_precision": cfg.trainer.precision,
    }
    results["wall_clock_s"] = time.monotonic() - run.started  # the job, from its config to this file
    run.write(results)
    if results["failed_fraction"] > cfg.data.max_failed_fraction:
        u = failed[0]
        raise JobFailed(
            f"{len(failed)} of {counts.total} prompt x epochs failed ({results['failed_fraction']:.1%} > "
            f"data.max_failed_fraction={cfg.data.max_failed_fraction}), e.g. {u}: "
            f"{outcome['failed'][u][-1] if outcome['failed'][u] else '?'}; the drafter and result.json "
            f"are written ({run.run_dir})"
        )
    return results


def training_summary(cfg: JobConfig, inputs: JobInputs, trained: int, epochs: int, steps: int) -> dict:
    """What the model card says about the data the drafter learned from."""
    categories = Counter(c.category or UNCATEGORIZED for c in inputs.train_prompts)
    sampling = cfg.sampling
    return {
        "target": cfg.target.name or inputs.target.path,
        "prompt_files": list(cfg.data.prompts),
        "train_prompts": len(inputs.train_prompts),
        "heldout_prompts": len(inputs.heldout),
        "categories": dict(categories),
        "epochs": epochs,
        "trained_samples": trained,
        "steps": steps,
        "sampling": f"temperature {sampling.temperature}, up to {sampling.max_tokens} tokens",
    }
