"""Train a DSpark drafter for a target LLM on a Ray cluster: the job users submit.

    ray job submit --working-dir . -- python jobs/train_kimi_k3.py --config configs/kimi_k3.yaml [key=value ...]
    python jobs/train_kimi_k3.py --config configs/kimi_k3.yaml --plan --simulate 12x4   # dry run

Arguments may also come in $DSPARK_JOB_ARGS, a JSON list of strings, after those of the command
line: `ray job submit` runs its entrypoint through a shell, and arguments that travel in the
job's runtime environment reach the job verbatim, whatever `$`, `;` or quotes they hold
(scripts/run_local.sh passes the config and every override so).

Before it connects to Ray the job checks what it reads (the output directory, the target's
directory, every line of the prompt files, the evaluation sets), locks its run directory (one
job writes it at a time) and probes the Ray head it would join: each problem one line, exit 2.

`configs/local.yaml` runs the same pipeline on one CPU box. `--plan` places the topology,
prints which role lands on which node and GPU and the capacity plan (hidden-state bytes,
bandwidth and store memory per group, the drafter's parameters), then releases everything;
`--simulate NxG` does so on a simulated cluster of N nodes with G (fake) GPUs each.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.config import ConfigError, load_config  # noqa: E402

SIMULATED_NODES_TIMEOUT_S = 180
JOB_ARGS_ENV = "DSPARK_JOB_ARGS"
# Seconds a graceful stop needs at least (the step in progress, a checkpoint, result.json) on the
# local job; a cluster's checkpoint of a large drafter wants more (the manifest gives 1800).
MIN_STOP_WAIT_S = 60


def job_arguments(argv: list[str], environ=os.environ) -> list[str]:
    """The command line's arguments, then those of $DSPARK_JOB_ARGS (a JSON list of strings)."""
    raw = environ.get(JOB_ARGS_ENV)
    if not raw:
        return argv
    try:
        extra = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{JOB_ARGS_ENV}: not JSON ({e})") from None
    if not isinstance(extra, list) or not all(isinstance(a, str) for a in extra):
        raise ConfigError(f"{JOB_ARGS_ENV}: must be a JSON list of strings, got {raw[:200]}")
    return [*argv, *extra]


def warn_short_stop_wait() -> None:
    """Under `ray job submit`, Ray kills the driver RAY_JOB_STOP_WAIT_TIME_S after `ray job stop`'s
    SIGTERM (3 s unless the submission or the head sets it): too soon for the stop's checkpoint."""
    if "RAY_JOB_CONFIG_JSON_ENV_VAR" not in os.environ:  # not a submitted job: nobody times the stop
        return
    wait = float(os.environ.get("RAY_JOB_STOP_WAIT_TIME_S", 3))
    if wait < MIN_STOP_WAIT_S:
        logging.getLogger("dspark.job").warning(
            "RAY_JOB_STOP_WAIT_TIME_S=%g: `ray job stop` would kill this job before its stop checkpoint; submit with "
            "--runtime-env-json '{\"env_vars\": {\"RAY_JOB_STOP_WAIT_TIME_S\": \"%d\"}}' (scripts/run_local.sh does)",
            wait, 2 * MIN_STOP_WAIT_S)


def left_out(evaluation: dict, budget_key: str) -> str:
    """What an evaluation set's time budget left out, for the job's last lines."""
    left = evaluation.get("left_out_for_time") or []
    return f" ({len(left)} more left out by {budget_key}: {', '.join(left[:4])})" if left else ""


def plan(cfg, simulate: str | None) -> int:
    import ray

    from cluster.scaling import capacity_plan
    from cluster.scaling import PlacementError, describe, place_all, release

    cluster = None
    if simulate:
        from ray.cluster_utils import Cluster

        n, g = (int(x) for x in simulate.lower().split("x"))
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0, "include_dashboard": False})
        for _ in range(n):  # started side by side (each is a raylet and its agents), then awaited together
            cluster.add_node(wait=False, num_cpus=64, num_gpus=g)
        ray.init(address=cluster.address, log_to_driver=False)
    else:
        from cluster.preflight import check_ray_head

        try:
            check_ray_head()
        except ConfigError as e:
            print(e, file=sys.stderr)
            return 2
        ray.init()
    try:
        if cluster is not None:
            try:
                cluster.wait_for_nodes(timeout=SIMULATED_NODES_TIMEOUT_S)
            except TimeoutError:  # Ray's own message does not say how many, nor how long
                joined = sum(1 for node in ray.nodes() if node["Alive"]) - 1  # less the head
                print(f"--simulate {simulate}: {joined} of {n} simulated nodes joined within "
                      f"{SIMULATED_NODES_TIMEOUT_S} s (each is a raylet started on this machine)", file=sys.stderr)
                return 2
        placed = place_all(cfg)
        print(describe(placed))
        release(placed)
        print()
        print(capacity_plan(cfg))
        return 0
    except PlacementError as e:
        print(f"cannot place: {e}", file=sys.stderr)
        return 2
    except (ConfigError, FileNotFoundError) as e:
        print(e, file=sys.stderr)
        return 2
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "configs" / "local.yaml"))
    ap.add_argument("--plan", action="store_true", help="place the topology, print it, exit")
    ap.add_argument("--simulate", default=None, metavar="NxG", help="with --plan: a simulated cluster")
    ap.add_argument("overrides", nargs="*", help="config overrides, key=value")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        args = ap.parse_intermixed_args(job_arguments(sys.argv[1:] if argv is None else argv))
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    if args.plan:
        return plan(cfg, args.simulate)
    from cluster.preflight import RunDirLock, check_inputs, check_ray_head

    try:
        conversations = check_inputs(cfg)
        lock = RunDirLock(cfg.run_dir).acquire()  # noqa: F841 - held until this process ends
        head = check_ray_head()
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2

    import ray

    from cluster.control import Stop
    from cluster.job import TrainingJob, plan_box
    from dspark.tau_report import fmt, format_length_table, format_table

    if head is None:
        # No head to join: ray.init starts one for this job alone. Ray's one-machine switch keeps
        # every listener of it on loopback (else Ray turns 127.0.0.1 into the machine's address),
        # as scripts/run_local.sh does for its head.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    warn_short_stop_wait()
    if os.environ.get(JOB_ARGS_ENV):  # `ray job list` shows only the entrypoint
        logging.getLogger("dspark.job").info("arguments (with $%s): %s", JOB_ARGS_ENV, args)
    started = time.monotonic()  # the time budget counts from here: the box's probe is part of it
    try:
        box = plan_box(cfg, conversations, started)  # box_plan: what this machine can train in the budget
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    ray.init(log_to_driver=True)
    job = TrainingJob(cfg, conversations, started=started, box_plan=box)

    def stop(signum, _frame):
        # The first signal (`ray job stop` sends SIGTERM) asks the job to stop after its step with
        # a checkpoint and result.json (or, during start-up, after the phase it is in); a second
        # one aborts at once.
        signal.signal(signum, signal.SIG_DFL if signum == signal.SIGTERM else signal.default_int_handler)
        job.control.send(Stop(f"{signal.Signals(signum).name} received"))

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    try:
        result = job.run()
    except ConfigError as e:  # found in the preparation, against the target: nothing was started
        print(e, file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - the cause in one line, after the traceback in the log
        logging.getLogger("dspark.job").exception("the job failed")
        print(f"\njob failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if result["status"] == "stopped":
        print(f"\nstopped at step {result['steps']} ({result['reason']}); {result['resume']}")
        print(f"results: {result['run_dir']}/result.json")
        return 0
    ev = result["evaluation"]
    print(f"\nheld-out tau = {fmt(ev['tau'])} over {ev['num_prompts']} prompts (greedy, block {cfg.drafter.block_size}); "
          f"lossless={ev['lossless']}; per-position acceptance "
          + " ".join(f"{a:.2f}" for a in ev["per_position_acceptance"]))
    print(format_table(ev))
    for name, other in result["evaluation_sets"].items():
        print(f"\n{name} tau = {fmt(other['tau'])} over {other['num_prompts']} prompts of {cfg.data.eval_sets[name]} "
              f"(never trained on); lossless={other['lossless']}")
        print(format_table(other))
    sampled = result.get("evaluation_sampled")
    if sampled:
        s = sampled["settings"]
        print(f"\nheld-out tau at temperature {s['temperature']} = {fmt(sampled['tau'])} over {sampled['num_prompts']} prompts "
              f"(the served recipe: {s['draft_sample_method']} drafting, {s['rejection_sample_method']} rejection)"
              + left_out(sampled, "data.eval_sampled_budget_s"))
        print(format_table(sampled))
    long_context = result.get("long_context")
    if long_context:
        print(f"\nlong-context tau = {fmt(long_context['tau'])} over {long_context['num_prompts']} prompts of "
              f"{cfg.data.long_context_prompts}{left_out(long_context, 'data.long_context_budget_s')}, by context length:")
        print(format_length_table(long_context["by_prompt_length"]))
    for name, why in result.get("evaluation_skipped", {}).items():
        print(f"\n{name}: not measured ({why})")
    proof = result["exactly_once"]
    epochs = result["epochs"]
    # what was trained, as passes over the prompts: "20 of 20 planned epochs" said nothing of a run
    # that the time budget ended 3.5% into its plan
    print(f"trained {proof['trained']} samples exactly once over groups {sorted(result['groups'])} "
          f"({proof['crossed']} by another group's rank): {epochs['trained']:.1f} epochs of {epochs['prompts']} prompts "
          f"({result['trained_fraction']:.0%} of the {epochs['kept']} epochs kept of {epochs['planned']} planned) "
          f"in {result['trained_until_s'] / 60:.1f} min, ended by {result['ended_by']}; record: {proof['record']}")
    if result.get("plan"):
        p = result["plan"]
        print(f"plan for this box: {p['prompts_per_category']} prompts per category, answers of up to {p['answer_tokens']} "
              f"tokens, expected {p['epochs']:.1f} epochs ({p['reasons'][0]})")
    print(f"drafter: {result['drafter']}  (vLLM: method=dspark)")
    quality = result["quality"]
    if not quality["worth_serving"]:
        print(f"NOT WORTH SERVING: {'; '.join(quality['reasons'])}\n  to change: {'; '.join(quality['advice'])}")
    cpu = result["machine"]["cpu"]
    print(f"wall clock {result['wall_clock_s'] / 60:.1f} min on {cpu['model']} ({cpu['cores']} cores, native bf16: "
          f"{cpu['native_bf16']}); target {result['machine']['target_dtype']}, trainer {result['machine']['trainer_precision']}")
    print(f"results: {result['run_dir']}/result.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
