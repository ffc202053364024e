"""The job's end: the exactly-once proof, the export, the held-out evaluation, result.json."""

from __future__ import annotations

import json
import logging
import re
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from cluster.data import quarantined
from cluster.hardware import read_cpu
from cluster.job.checkpointing import checkpoint
from cluster.job.evaluation import evaluate
from cluster.job.history import read_history
from cluster.job.plots import plot_run
from cluster.job.quality import assess
from dspark.recipe import write_recipe
from dspark.tau_report import UNCATEGORIZED

log = logging.getLogger("dspark.job")


class JobFailed(RuntimeError):
    pass


def stopped(job, reason: str) -> dict:
    """A stop (`ray job stop`, SIGTERM to the driver): what was trained since the last checkpoint
    is committed in one more, and result.json says so and how to resume. No calibration, export
    or evaluation: they take minutes that Ray's stop wait (`RAY_JOB_STOP_WAIT_TIME_S`) may not
    give, and the resumed job does them at its end. The producers are stopped afterwards, by the
    job's shutdown: draining them could take the stop wait, and what they generate now is
    generated again on resume (the checkpoint's ledger holds it as pending)."""
    job.stop_event.set()  # the progress reporter and the autoscaler
    if job.uncommitted:  # steps since the last checkpoint
        checkpoint(job)
    latest = job.checkpoints.latest()
    proof = job.record.verify(job.ledger.outcome(), complete=False) if job.ledger is not None else None
    resume = (f"submit the same command again with run_name={job.cfg.run_name} output_dir={job.cfg.output_dir}: "
              + (f"it resumes from {latest} (trainer.resume=auto)" if latest else "it starts over (nothing was trained)"))
    results = {"status": "stopped", "reason": reason, "run_dir": str(job.run_dir), "steps": job.stats.step,
               "checkpoint": str(latest) if latest else None, "resume": resume, "exactly_once": proof,
               "events": job.events, "trained_until_s": job.trained_until_s,
               "wall_clock_s": time.monotonic() - job.started}
    (job.run_dir / "result.json").write_text(json.dumps(results, indent=2, default=str))
    log.warning("stopped (%s) at step %d; %s", reason, job.stats.step, resume)
    return results



def pictures(job, final: Path, results: dict) -> dict[str, str]:
    """The run's pictures (`cluster.job.plots`) from its history and evaluations; with wandb on,
    the same pictures, the evaluation's τ and the drafter (an artifact) go to the run too."""
    evaluations = {"held-out": results["evaluation"], **results["evaluation_sets"]}
    drawn = plot_run(job.run_dir / "plots", read_history(job.history.path), evaluations)
    if job.wandb is not None:
        try:
            import wandb

            job.wandb.log({f"plots/{name}": wandb.Image(d["path"]) for name, d in drawn.items()})
            job.wandb.summary.update({f"eval/{name}/tau": e.get("tau") for name, e in evaluations.items()})
            artifact = wandb.Artifact(re.sub(r"[^A-Za-z0-9_.-]", "_", f"drafter-{job.cfg.run_name}"), type="model")
            artifact.add_dir(str(final))
            job.wandb.log_artifact(artifact)
        except Exception as e:  # noqa: BLE001 - wandb is a mirror of result.json, not worth the job
            log.warning("wandb: the pictures, evaluation or drafter were not logged: %r", e)
    return {name: d["path"] for name, d in drawn.items()}


def finish(job, calibration: dict) -> dict:
    outcome = job.ledger.outcome()
    proof = job.record.verify(outcome, complete=job.ended_by == "data")
    log.info("exactly-once: %s", proof)
    final = job.run_dir / "final"
    job.gang.export(str(final), calibration.get("temperatures"), job.cfg.target.name)
    counts = job.ledger.counts()
    results = {
        "status": "completed", "run_dir": str(job.run_dir), "drafter": str(final), "steps": job.stats.step, "ended_by": job.ended_by,
        "trained_fraction": proof["trained"] / max(counts.total, 1),
        "exactly_once": proof, "world": job.gang.layout(), "calibration": calibration, "events": job.events,
        # the plan the time budget kept (cluster.training.budget); what each epoch trained is in exactly_once
        "epochs": {"planned": job.cfg.data.epochs, "kept": counts.epochs, "prompts": len(job.train_prompts),
                   "trained": round(proof["trained"] / max(len(job.train_prompts), 1), 3)},
        "lr_horizon": job.total_steps,
        # what cluster.job.box chose for this machine (box_plan.enabled), with the paces it probed
        "plan": job.box_plan,
        "trained_until_s": job.trained_until_s,
        "groups": {name: {"replicas": job.final_replicas[name], "generated": proof["generated_by_group"].get(name, 0),
                          "trained_by_its_ranks": proof["trained_by_group"].get(name, 0),
                          "events": pool.events} for name, pool in job.pools.items()},
        # what the autoscaler decided and applied, in order (cluster.scaling.autoscaler)
        "autoscaler": job.autoscaler.decisions() if job.autoscaler is not None else None,
    }
    failed = proof["failed"]
    results["failed_fraction"] = len(failed) / max(counts.total, 1)
    if failed:
        errors = outcome["failed"][failed[0]]
        results["failed_examples"] = {u: outcome["failed"][u] for u in failed[:20]}
        log.warning("%d prompt x epochs failed, e.g. %s: %s", len(failed), failed[0], errors[-1] if errors else "?")
    results["quarantined"] = quarantined(outcome["failed"])
    measured = evaluate(job, str(final))
    results["evaluation"], results["evaluation_sets"] = measured.heldout, measured.sets
    # τ sampled with the served recipe, and by context length; `evaluation_skipped`: what was not measured, why
    results["evaluation_sampled"], results["long_context"] = measured.sampled, measured.long_context
    results["evaluation_skipped"] = measured.skipped
    results["tau"] = results["evaluation"]["tau"]
    results["plots"] = pictures(job, final, results)
    quality = assess(proof["trained"], len(job.train_prompts), results["tau"], job.ended_by, job.cfg.trainer.time_budget_s)
    results["quality"] = asdict(quality)
    if not quality.worth_serving:
        log.warning("this drafter is not worth serving: %s; %s", "; ".join(quality.reasons), "; ".join(quality.advice))
    write_recipe(final, {**training_summary(job, proof["trained"], counts.epochs), "quality": results["quality"]},
                 results["evaluation"], measured.sampled, measured.long_context)
    # Final values once more, fresh for whoever looks after the job: Ray drops series that
    # nobody has set for a while, and training ended before the evaluation.
    job.reporter.report()
    job.reporter.publish_train(job.stats.last)
    job.reporter.publish_evaluation(results["evaluation"])
    results["machine"] = {"cpu": read_cpu().to_dict(), "device": job.cfg.device, "target_dtype": job.cfg.target.dtype,
                          "trainer_precision": job.cfg.trainer.precision}
    results["wall_clock_s"] = time.monotonic() - job.started  # the job, from its config to this file
    (job.run_dir / "result.json").write_text(json.dumps(results, indent=2, default=str))
    if results["failed_fraction"] > job.cfg.data.max_failed_fraction:
        u = failed[0]
        raise JobFailed(f"{len(failed)} of {counts.total} prompt x epochs failed ({results['failed_fraction']:.1%} > "
                        f"data.max_failed_fraction={job.cfg.data.max_failed_fraction}), e.g. {u}: "
                        f"{outcome['failed'][u][-1] if outcome['failed'][u] else '?'}; the drafter and result.json "
                        f"are written ({job.run_dir})")
    return results


def training_summary(job, trained: int, epochs: int) -> dict:
    """What the model card says about the data the drafter learned from."""
    categories = Counter(c.category or UNCATEGORIZED for c in job.train_prompts)
    sampling = job.cfg.sampling
    return {"target": job.cfg.target.name or job.target_path, "prompt_files": list(job.cfg.data.prompts),
            "train_prompts": len(job.train_prompts), "heldout_prompts": len(job.heldout), "categories": dict(categories),
            "epochs": epochs, "trained_samples": trained, "steps": job.stats.step,
            "sampling": f"temperature {sampling.temperature}, up to {sampling.max_tokens} tokens"}
