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
import faulthandler
import json
import logging
import os
import re
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.config_load import explicit_keys, load_config  # noqa: E402
from cluster.errors import ConfigError  # noqa: E402

SIMULATED_NODES_TIMEOUT_S = 180
JOB_ARGS_ENV = "DSPARK_JOB_ARGS"
# The project's own default: the box plan may change its values, never those of a file or an override
# the user gives (`cluster.config_load.explicit_keys`)
EMBEDDED_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "local.yaml"
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
            '--runtime-env-json \'{"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "%d"}}\' (scripts/run_local.sh does)',
            wait,
            2 * MIN_STOP_WAIT_S,
        )


def simulated_cluster(text: str | None) -> tuple[int, int] | None:
    """`--simulate NxG`: N nodes of G (fake) GPUs each; a ConfigError naming the flag otherwise."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not m or int(m[1]) < 1:
        raise ConfigError(f"--simulate {text!r}: expected NxG, N nodes (at least 1) of G GPUs each, e.g. 12x4")
    return int(m[1]), int(m[2])


def plan(cfg, simulate: tuple[int, int] | None) -> int:
    import ray

    from cluster.scaling import PlacementError, capacity_plan, describe, place_all, release

    cluster = None
    if simulate:
        from ray.cluster_utils import Cluster

        n, g = simulate
        cluster = Cluster(
            initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0, "include_dashboard": False}
        )
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
                print(
                    f"--simulate {n}x{g}: {joined} of {n} simulated nodes joined within "
                    f"{SIMULATED_NODES_TIMEOUT_S} s (each is a raylet started on this machine)",
                    file=sys.stderr,
                )
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
    ap.add_argument("--config", default=str(EMBEDDED_CONFIG))
    ap.add_argument("--plan", action="store_true", help="place the topology, print it, exit")
    ap.add_argument("--simulate", default=None, metavar="NxG", help="with --plan: a simulated cluster")
    ap.add_argument("overrides", nargs="*", help="config overrides, key=value")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        args = ap.parse_intermixed_args(job_arguments(sys.argv[1:] if argv is None else argv))
        cfg = load_config(args.config, args.overrides)
        simulate = simulated_cluster(args.simulate)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    if args.plan:
        return plan(cfg, simulate)
    from cluster.preflight import RunDirLock, check_inputs, check_ray_head, join_ray, keep_ray_on_loopback

    try:
        conversations = check_inputs(cfg)
        lock = RunDirLock(cfg.run_dir).acquire()  # noqa: F841 - held until this process ends
        head = check_ray_head()
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2

    # A Ray of its own, or a head on loopback: every listener stays there. Before `import ray`:
    # Ray reads its one-machine switch when it is imported.
    keep_ray_on_loopback(head)
    # Ray's core worker installs its C++ crash handler (absl's) on SIGTERM too when `ray.init`
    # connects: it overrides the stop handler below, prints a stack and ends the driver, so
    # `ray job stop` left no checkpoint and no result.json (tests/integration/test_job_stop.py).
    # Ray's switch, read once at `import ray`, keeps it out of this process; taken out of the
    # environment again so that the processes of a Ray the driver starts keep theirs. Python's
    # faulthandler still prints every thread's stack on a real crash (SIGSEGV, SIGABRT, ...).
    no_crash_handler = "RAY_DISABLE_FAILURE_SIGNAL_HANDLER" not in os.environ
    if no_crash_handler:
        os.environ["RAY_DISABLE_FAILURE_SIGNAL_HANDLER"] = "1"
    faulthandler.enable()
    import ray

    if no_crash_handler:
        del os.environ["RAY_DISABLE_FAILURE_SIGNAL_HANDLER"]

    from cluster.box import plan_box
    from cluster.control import ControlChannel, JobStopped, Stop
    from cluster.job import TrainingJob, summary

    control = ControlChannel()

    def stop(signum, _frame):
        # The first signal (`ray job stop` sends SIGTERM) asks the job to stop after its step with
        # a checkpoint and result.json (or, during start-up, after the phase it is in); a second
        # one aborts at once. Installed before the box's probe and Ray: a stop then ends the
        # start-up at its first phase, with result.json.
        signal.signal(signum, signal.SIG_DFL if signum == signal.SIGTERM else signal.default_int_handler)
        control.send(Stop(f"{signal.Signals(signum).name} received"))

    def answer_stops() -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, stop)

    answer_stops()
    warn_short_stop_wait()
    if os.environ.get(JOB_ARGS_ENV):  # `ray job list` shows only the entrypoint
        logging.getLogger("dspark.job").info("arguments (with $%s): %s", JOB_ARGS_ENV, args)
    started = time.monotonic()  # the time budget counts from here: the box's probe is part of it
    try:
        # box_plan: what this machine can train in the budget; never what the user set
        explicit = explicit_keys(args.config, args.overrides, EMBEDDED_CONFIG)
        box = plan_box(cfg, conversations, started, explicit=explicit)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    job = TrainingJob(cfg, conversations, started=started, box_plan=box, control=control)
    try:
        join_ray(lambda: ray.init(log_to_driver=True), head, lambda: control.stop_sent)
    except ConfigError as e:  # Ray's own wait is still running in its thread: no clean exit
        print(e, file=sys.stderr, flush=True)
        os._exit(2)
    except JobStopped as e:
        print(summary(job.stopped(str(e), e.phase), cfg), flush=True)
        os._exit(0)
    if control.stop_sent is None:  # the handlers are ours again, whatever `ray.init` installed
        answer_stops()
    try:
        result = job.run()
    except ConfigError as e:  # found in the preparation, against the target: nothing was started
        print(e, file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - the cause in one line, after the traceback in the log
        logging.getLogger("dspark.job").exception("the job failed")
        print(f"\njob failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(summary(result, cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
