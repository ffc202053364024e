"""The job's end: the exactly-once proof, the export, the held-out evaluation, result.json."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from cluster.config import ROOT
from cluster.data import quarantined, repo_path
from cluster.hardware import read_cpu
from cluster.job.checkpointing import checkpoint
from cluster.job.history import read_history
from cluster.job.plots import plot_run
from cluster.job.quality import assess
from cluster.job.settings import cpu_engine_env, inference_settings
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
        "epochs": {"planned": job.cfg.data.epochs, "kept": counts.epochs}, "lr_horizon": job.total_steps,
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
    results["evaluation"], results["evaluation_sets"] = evaluate(job, str(final))
    results["tau"] = results["evaluation"]["tau"]
    results["plots"] = pictures(job, final, results)
    quality = assess(proof["trained"], len(job.train_prompts), results["tau"], job.ended_by, job.cfg.trainer.time_budget_s)
    results["quality"] = asdict(quality)
    if not quality.worth_serving:
        log.warning("this drafter is not worth serving: %s; %s", "; ".join(quality.reasons), "; ".join(quality.advice))
    write_recipe(final, {**training_summary(job, proof["trained"], counts.epochs), "quality": results["quality"]},
                 results["evaluation"])
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


def evaluate(job, drafter: str) -> tuple[dict, dict[str, dict]]:
    """The held-out evaluation and that of every `data.eval_sets` split, each within
    `data.eval_timeout_s`: vLLM serving the target with the drafter where the target runs
    (GPU: the driver never loads the target), the reference decoder on CPU (one subprocess
    for all the sets: the target and the drafter are loaded once). Per-request rows go to
    eval.json (eval-<set>.json), figures to result.json."""
    backend = job.cfg.data.eval_backend
    if backend == "auto":
        backend = "vllm" if job.cfg.device == "cuda" and job.cfg.inference.backend == "vllm" else "reference"
    sets = {None: (job.run_dir / "heldout.jsonl", job.run_dir / "eval.json")}
    for name, src in job.cfg.data.eval_sets.items():
        sets[name] = (repo_path(src), job.run_dir / f"eval-{name}.json")
    if backend == "vllm":
        for prompts, out in sets.values():
            out.write_text(json.dumps(evaluate_served(job, drafter, prompts), indent=2))
    else:
        # Every core: Ray starts a job's driver with OMP_NUM_THREADS=1, which this subprocess
        # would inherit (one thread made the local job's evaluation ~1.8x slower), and the
        # producers and the trainer are done. On CPU it runs the target as a replica does,
        # with its environment (the local job's evaluation took 65 s instead of 74 s with the
        # preloaded libraries on a 2-core AMD EPYC).
        env = {**os.environ, **(cpu_engine_env(job) or {})}
        cmd = [sys.executable, "-m", "dspark.evaluate", "--target", job.target_path, "--drafter", drafter,
               "--max-new-tokens", str(job.cfg.data.eval_max_new_tokens), "--threads", str(read_cpu().cores)]
        for prompts, out in sets.values():
            cmd += ["--prompts", str(prompts), "--json", str(out)]
        if job.cfg.data.eval_limit:
            cmd += ["--limit", str(job.cfg.data.eval_limit)]
        if job.cfg.target.trust_remote_code:  # the config's consent; the drafter's config.json gives none
            cmd.append("--trust-remote-code")
        subprocess.run(cmd, check=True, cwd=ROOT, env=env, timeout=job.cfg.data.eval_timeout_s * len(sets))
    results = {}
    for name, (_, out) in sets.items():
        results[name] = json.loads(out.read_text())
        results[name].pop("requests", None)
    heldout = results.pop(None)
    return heldout, results


def evaluate_served(job, drafter: str, prompts_file: Path) -> dict:
    """vLLM with the drafter, in the first inference placement group (its replica has stopped).
    On CPU vLLM runs only the backbone (`dflash`), exported beside the drafter."""
    from cluster.inference import engine_actor_options
    from cluster.inference import ServedEvalSettings, ServedEvaluator
    from dspark.prompts import read_conversations
    from dspark.tau_report import stratified

    method = "dspark" if job.cfg.device == "cuda" else "dflash"
    if method == "dflash":
        from dspark.checkpoint import export_dflash_backbone, load_drafter

        drafter = str(export_dflash_backbone(load_drafter(drafter, job.target_path), job.run_dir / "final-dflash"))
    held = stratified(read_conversations(prompts_file)[0], lambda c: c.category, job.cfg.data.eval_limit)
    prompts = [c.prompt_record() for c in held]
    settings = ServedEvalSettings(inference_settings(job, "eval"), drafter, method, job.cfg.data.eval_max_new_tokens)
    placed = next(p for p in job.placed if p.spec.role == "inference")
    actor = job.ray.remote(ServedEvaluator).options(
        name=f"{job.cfg.run_name}-eval", **engine_actor_options(placed, settings.engine.target.tensor_parallel_size,
                                                                   cpu_engine_env(job)),
    ).remote(settings)
    try:
        return job.ray.get(actor.evaluate.remote(prompts), timeout=job.cfg.data.eval_timeout_s)
    except job.ray.exceptions.GetTimeoutError:
        raise TimeoutError(f"the served evaluation ({method}, {len(prompts)} prompts) did not finish within "
                           f"data.eval_timeout_s={job.cfg.data.eval_timeout_s}") from None
    finally:
        job.ray.kill(actor)
