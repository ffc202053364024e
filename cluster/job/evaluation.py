"""The end evaluation: the drafter judged on the held-out split (greedy, lossless checked), on
each `data.eval_sets` split, on the held-out split again sampled as the served recipe drafts and
verifies (`data.eval_temperature`), and on a long-context set by context length
(`data.long_context_prompts`). One `dspark.evaluate --plan` subprocess on CPU (the target and
the drafter loaded once); vLLM serving the target with the drafter on GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from cluster.config import ROOT, JobConfig
from cluster.data import repo_path
from cluster.hardware import read_cpu
from cluster.job.inputs import JobInputs
from cluster.job.settings import cpu_engine_env, inference_settings
from cluster.waiting import wait_until


@dataclass
class Evaluation:
    """What the end evaluation measured: the held-out split greedy (`heldout`), each
    `data.eval_sets` split greedy (`sets`), the held-out split sampled with the served recipe
    (`sampled`, None when `data.eval_temperature` is 0 or the backend cannot) and the long-context
    set by context length (`long_context`, None without `data.long_context_prompts`); `skipped`:
    what was not measured, and why."""

    heldout: dict
    sets: dict[str, dict]
    sampled: dict | None = None
    long_context: dict | None = None
    skipped: dict[str, str] = field(default_factory=dict)


def evaluation_plan(cfg: JobConfig, run_dir: Path) -> dict[str, dict]:
    """The sets `dspark.evaluate --plan` judges (its `EvalSet` fields), by their name here."""
    data = cfg.data
    greedy = {"temperature": 0.0, "limit": data.eval_limit, "max_new_tokens": data.eval_max_new_tokens}
    plan = {"heldout": {"prompts": str(run_dir / "heldout.jsonl"), "json": str(run_dir / "eval.json"), **greedy}}
    for name, src in data.eval_sets.items():
        plan[name] = {"prompts": str(repo_path(src)), "json": str(run_dir / f"eval-{name}.json"), **greedy}
    if data.eval_temperature > 0:
        # the first of the evaluated prompts (round-robin over categories, as the greedy run takes them)
        limits = [x for x in (data.eval_sampled_limit, data.eval_limit) if x]
        limit = min(limits) if limits else None
        plan["sampled"] = {
            **plan["heldout"],
            "json": str(run_dir / "eval-sampled.json"),
            "temperature": data.eval_temperature,
            "limit": limit,
            "recipe": True,
            "budget_s": data.eval_sampled_budget_s,
        }
    if data.long_context_prompts:
        plan["long_context"] = {
            "prompts": str(repo_path(data.long_context_prompts)),
            "json": str(run_dir / "eval-long_context.json"),
            "temperature": 0.0,
            "limit": None,
            "max_new_tokens": data.long_context_max_new_tokens,
            "per_length_bucket": data.long_context_per_bucket,
            "max_prompt_tokens": data.long_context_max_tokens,
            "budget_s": data.long_context_budget_s,
        }
    return plan


class Evaluator:
    """Judges a drafter directory at the job's end. `placed`: the job's placement groups (the
    served evaluation takes the first inference one, its replica stopped); `stop_check(phase)`
    raises JobStopped once a stop was sent (the evaluation, minutes long, ends on it)."""

    def __init__(self, cfg: JobConfig, inputs: JobInputs, run_dir: Path, placed: list, stop_check) -> None:
        self.cfg, self.inputs, self.run_dir, self.placed, self.stop_check = cfg, inputs, run_dir, placed, stop_check

    def evaluate(self, drafter: str) -> Evaluation:
        """The held-out evaluation and every other set of the plan, within `data.eval_timeout_s`
        each: vLLM serving the target with the drafter where the target runs (GPU: the driver
        never loads the target), the reference decoder on CPU (one subprocess for all the sets: the
        target and the drafter are loaded once). Per-request rows go to each set's eval*.json,
        figures to result.json."""
        cfg = self.cfg
        backend = cfg.data.eval_backend
        if backend == "auto":
            backend = "vllm" if cfg.device == "cuda" and cfg.inference.backend == "vllm" else "reference"
        plan = evaluation_plan(cfg, self.run_dir)
        skipped = {}
        if backend == "vllm":
            for name in [
                n for n in ("sampled", "long_context") if n in plan and not (n == "sampled" and cfg.device == "cuda")
            ]:
                del plan[name]
                skipped[name] = (
                    "vLLM's CPU build is unreliable at temperature > 0 (ENVIRONMENT.md)"
                    if name == "sampled"
                    else "the served evaluation runs within the replicas' target.max_model_len; judge long contexts "
                    "with dspark.evaluate --plan"
                )
            for _name, spec in plan.items():
                result = self.evaluate_served(drafter, Path(spec["prompts"]), spec["limit"], spec["temperature"])
                Path(spec["json"]).write_text(json.dumps(result, indent=2))
        else:
            # Every usable core: Ray starts a job's driver with OMP_NUM_THREADS=1, which this
            # subprocess would inherit (one thread made the local job's evaluation ~1.8x slower), and
            # the producers and the trainer are done. Usable, not present: under a CPU quota or an
            # affinity mask, more threads than that spin against each other. On CPU it runs the target
            # as a replica does, with its environment (the local job's evaluation took 65 s instead of
            # 74 s with the preloaded libraries on a 2-core AMD EPYC).
            env = {**os.environ, **(cpu_engine_env(cfg) or {})}
            plan_file = self.run_dir / "eval_plan.json"
            plan_file.write_text(json.dumps(list(plan.values()), indent=2))
            cmd = [
                sys.executable,
                "-m",
                "dspark.evaluate",
                "--target",
                self.inputs.target.path,
                "--drafter",
                drafter,
                "--plan",
                str(plan_file),
                "--threads",
                str(read_cpu().usable_cores),
            ]
            if cfg.target.trust_remote_code:  # the config's consent; the drafter's config.json gives none
                cmd.append("--trust-remote-code")
            self.run_stoppable(cmd, env, cfg.data.eval_timeout_s * len(plan))
        results = {}
        for name, spec in plan.items():
            results[name] = json.loads(Path(spec["json"]).read_text())
            results[name].pop("requests", None)
        return Evaluation(
            heldout=results.pop("heldout"),
            sampled=results.pop("sampled", None),
            long_context=results.pop("long_context", None),
            sets=results,
            skipped=skipped,
        )

    def run_stoppable(self, cmd: list[str], env: dict, timeout_s: float) -> None:
        """The evaluation subprocess, within `timeout_s`; ended (and JobStopped raised) as soon as a
        stop is sent, so `ray job stop` during the end is answered in seconds, not minutes."""
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
        try:
            wait_until(
                lambda: self.stop_check("the end (evaluation)") or proc.poll() is not None,
                timeout_s=timeout_s,
                interval_s=1.0,
                what=f"the evaluation ({' '.join(cmd[:3])} ...)",
            )
            if proc.returncode:
                raise subprocess.CalledProcessError(proc.returncode, cmd)
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    def evaluate_served(self, drafter: str, prompts_file: Path, limit: int | None, temperature: float) -> dict:
        """vLLM with the drafter, in the first inference placement group (its replica has stopped).
        On CPU vLLM runs only the backbone (`dflash`), exported beside the drafter."""
        import ray

        from cluster.inference import ServedEvalSettings, ServedEvaluator, engine_actor_options
        from dspark.prompts import read_conversations
        from dspark.tau_report import stratified

        cfg, target_path = self.cfg, self.inputs.target.path
        method = "dspark" if cfg.device == "cuda" else "dflash"
        if method == "dflash":
            from dspark.checkpoint import export_dflash_backbone, load_drafter

            drafter = str(export_dflash_backbone(load_drafter(drafter, target_path), self.run_dir / "final-dflash"))
        held = stratified(read_conversations(prompts_file)[0], lambda c: c.category, limit)
        prompts = [c.prompt_record() for c in held]
        settings = ServedEvalSettings(
            inference_settings(cfg, self.inputs, "eval"), drafter, method, cfg.data.eval_max_new_tokens, temperature
        )
        placed = next(p for p in self.placed if p.spec.role == "inference")
        actor = (
            ray.remote(ServedEvaluator)
            .options(
                name=f"{cfg.run_name}-eval",
                **engine_actor_options(placed, settings.engine.target.tensor_parallel_size, cpu_engine_env(cfg)),
            )
            .remote(settings)
        )
        try:
            return ray.get(actor.evaluate.remote(prompts), timeout=cfg.data.eval_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"the served evaluation ({method}, {len(prompts)} prompts) did not finish within "
                f"data.eval_timeout_s={cfg.data.eval_timeout_s}"
            ) from None
        finally:
            ray.kill(actor)
