"""`TrainingJob`: the whole pipeline for one config, driven from the Ray job's entry script.

    StoreServices ─ Mooncake master + a store daemon per node (the samples' memory)
    SampleLedger ── every prompt × epoch of the job, whichever group generates or trains it
    ReplicaPool per group ──put──► store ◄──read── TrainerGang: one world, every group's ranks
    ProgressReporter (log, Ray metrics, wandb) · AutoscaleLoop ──ControlChannel──► training loop
    → final checkpoint → exactly-once proof (TrainingRecord) → calibration → export → held-out τ

One drafter per job: groups are how capacity is laid out (a set of inference nodes and a trainer
node, or both halves of one node) and balanced, not separate experiments.

`TrainingJob` builds the parts and hands each what it needs in its constructor; the parts own
their state: `JobInputs` (what was read and checked), `Committer` (what is trained since the last
checkpoint), `TrainerWorld` (the trainer's placement, restarts, resizes), `Supervisor` (replicas
and the store's master), `TrainingLoop` (the step count and its waits), `EventLog`. `run` is the
job on one screen; the end is in `results`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import asdict

from cluster.config import JobConfig, to_yaml
from cluster.control import ControlChannel, JobStopped
from cluster.data import LedgerClient, SampleLedger, TrainingRecord
from cluster.job.calibration import calibrate_head, reserved_prompts
from cluster.job.checkpointing import Committer
from cluster.job.evaluation import Evaluator
from cluster.job.events import EventLog
from cluster.job.history import RunHistory
from cluster.job.inputs import first_lr_horizon, read_inputs
from cluster.job.loop import TrainingLoop
from cluster.job.plan_revision import PlanRevision
from cluster.job.progress import ProgressReporter, TrainingStats
from cluster.job.recovery import TrainerWorld, check_resume_plan, restore_data_state
from cluster.job.results import RunFacts, TrainingEnd, finish, stopped
from cluster.job.settings import cpu_rank_env, producer_spec, trainer_settings
from cluster.job.supervision import Supervisor
from cluster.metrics import Metrics
from cluster.restart_budget import RestartBudget
from cluster.training import CheckpointDir, EpochPlanner, TrainerFailure

log = logging.getLogger("dspark.job")
# The replica pools', the progress reporter's and the autoscaler's calls on the ledger (it answers
# in milliseconds; the training loop's own calls wait LedgerClient's default).
WATCHER_LEDGER_TIMEOUT_S = 30.0


class TrainingJob:
    def __init__(
        self,
        cfg: JobConfig,
        conversations: list | None = None,
        started: float | None = None,
        box_plan: dict | None = None,
        control: ControlChannel | None = None,
    ) -> None:
        """`conversations`: the prompts as `cluster.preflight.check_inputs` read them (None: the
        job reads them); `started`: the job's start (time.monotonic; None: now), from which the
        time budget and the wall clock count; `box_plan`: the plan `cluster.box` chose;
        `control`: the channel a signal handler installed before the job was built sends to."""
        self.cfg, self.conversations, self.box_plan = cfg, conversations, box_plan
        self.started = time.monotonic() if started is None else started
        self.run_dir = cfg.run_dir
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(to_yaml(cfg))
        self.checkpoints = CheckpointDir(self.run_dir / "checkpoints")
        self.record = TrainingRecord(self.run_dir / "trained.jsonl")
        self.control = control or ControlChannel()
        self.stats = TrainingStats()
        self.events = EventLog()
        self.run_facts = RunFacts(cfg, self.run_dir, self.started, self.events.lines)
        self.stop_event = threading.Event()  # the progress reporter's and the autoscaler's threads
        self.metrics_stop = threading.Event()  # the gauges' refresh (cluster.metrics): until the job ends
        self.services = self.ledger = self.gang = self.reporter = self.autoscaler = self.wandb = None
        self.trained_until_s: float | None = None  # when training ended, from the job's start
        self.committer = self.world = self.loop = None
        self.pools: dict = {}
        self.placed: list = []
        if box_plan:
            self.events.add(
                f"plan for this box: {box_plan['prompts_per_category']} prompts per category, answers of "
                f"up to {box_plan['answer_tokens']} tokens, replica {box_plan['replica_threads']} / trainer "
                f"{box_plan['trainer_threads']} thread(s): {'; '.join(box_plan['reasons'])}"
            )

    def run(self) -> dict:
        """The job: read and check, start every part, train, then calibrate, commit, export and
        evaluate (a world that fails at the end trains again from its last checkpoint)."""
        self.prepare()
        try:
            self.start()
            ended_by = self.loop.run()
            self.trained_until_s = time.monotonic() - self.started
            if ended_by == "stop":
                return self.stopped(self.control.stop_sent.reason if self.control.stop_sent else "stop", "training")
            while True:
                try:
                    calibration = self.finalize()
                    break
                except TrainerFailure as e:  # bounded: trainer.max_restarts per trainer.restart_window_s
                    self.loop.restart(e)  # from the last checkpoint: what it had not committed is trained again
                    self.loop.run(begun=True)
            print(self.reporter.report(), flush=True)
            end = TrainingEnd(
                ended_by,
                self.stats.step,
                self.trained_until_s,
                self.gang.settings.total_steps,
                self.gang.layout(),
                {
                    name: {"replicas": self.final_replicas[name], "events": pool.events}
                    for name, pool in self.pools.items()
                },
                self.autoscaler.decisions() if self.autoscaler is not None else None,
            )
            return finish(
                self.run_facts,
                self.inputs,
                self.box_plan,
                end,
                calibration,
                self.ledger,
                self.record,
                self.gang,
                Evaluator(self.cfg, self.inputs, self.run_dir, self.placed, self.control.raise_if_stopped),
                self.reporter,
                self.history.path,
                self.wandb,
                self.control.raise_if_stopped,
            )
        except JobStopped as e:  # outside the loop's steps: `shutdown` releases what was placed
            return self.stopped(str(e), e.phase)
        finally:
            self.shutdown()

    def prepare(self) -> None:
        """What the job reads, checked before any actor starts (`JobInputs`), a resume checked
        against it, the LR horizon, the held-out prompts' file, wandb."""
        cfg = self.cfg
        self.inputs = inputs = read_inputs(cfg, self.conversations)
        self.resume = check_resume_plan(
            cfg, self.checkpoints, {c.id for c in inputs.train_prompts}, {c.id for c in inputs.heldout}
        )
        # the figures over time, for the end-of-job pictures; a resumed run goes on with its own
        self.history = RunHistory(self.run_dir / "history.jsonl", self.started)
        if self.resume is None:
            self.history.path.unlink(missing_ok=True)
        self.lr_horizon = first_lr_horizon(
            cfg,
            len(inputs.train_prompts),
            self.checkpoints.meta(self.resume).get("lr_horizon") if self.resume else None,
        )
        (self.run_dir / "heldout.jsonl").write_text(
            "".join(json.dumps(c.prompt_record()) + "\n" for c in inputs.heldout)
        )
        if cfg.logging.wandb_mode != "disabled":
            import wandb

            os.environ.setdefault("WANDB_CACHE_DIR", str(self.run_dir / "wandb-cache"))
            self.wandb = wandb.init(
                project=cfg.logging.wandb_project,
                name=cfg.run_name,
                mode=cfg.logging.wandb_mode,
                dir=str(self.run_dir),
                resume="allow",
                id=cfg.run_name.replace("/", "_"),
                config=json.loads(json.dumps(asdict(cfg), default=str)),
            )
        log.info(
            "target %s, aux layers %s, %d training prompts, %d held out, ~%d steps",
            inputs.target.path,
            inputs.aux_layer_ids,
            len(inputs.train_prompts),
            len(inputs.heldout),
            self.lr_horizon,
        )

    def start(self) -> None:
        """Placement, the store services, the ledger, the trainer world, every group's producers,
        the progress reporter and the autoscaler; a stop between two of them ends the start."""
        import ray

        from cluster.inference import ReplicaPool
        from cluster.scaling import describe, group_watermarks, groups_on_nodes, place_all, replica_spec
        from cluster.store import StoreServices
        from cluster.training import TrainerGang

        cfg, inputs, stop_check = self.cfg, self.inputs, self.control.raise_if_stopped
        stop_check("start-up (placement)")
        self.placed = place_all(cfg)
        log.info("placement:\n%s", describe(self.placed))
        stop_check("start-up (the store services)")
        watermarks = group_watermarks(cfg, groups_on_nodes(self.placed))
        self.services = StoreServices(cfg.transport, cfg.run_name, str(self.run_dir / "logs"))
        self.services.start()
        self.services.ensure_node_stores(self.placed)
        reuse = cfg.data.reuse_samples_across_epochs
        self.ledger = LedgerClient(
            ray.remote(num_cpus=0)(SampleLedger)
            .options(name=f"ledger-{cfg.run_name}")
            .remote(
                [{"id": c.id, "messages": c.prompt_messages} for c in inputs.train_prompts],
                epochs=cfg.data.epochs,
                key_prefix=cfg.run_name,
                watermarks=watermarks,
                shuffle_seed=cfg.trainer.seed,
                reuse_across_epochs=reuse if reuse is not None else cfg.sampling.temperature == 0,
                sample_bytes_estimate=inputs.max_sample_bytes,
                reserved=reserved_prompts(inputs.calibration_prompts, inputs.evaluated_prompts)
                if inputs.calibration_prompts
                else [],
            )
        )
        self.ledger.settle()  # its entries out of the cyclic collector's way (SampleLedger.settle)
        stop_check("start-up (the trainer world)")
        self.gang = TrainerGang(
            trainer_settings(cfg, inputs, self.services.store_config(), self.lr_horizon),
            cfg.run_name,
            cpu_rank_env(cfg),
        )
        self.supervisor = Supervisor(self.services, self.pools, self.ledger, self.gang, self.events)
        self.committer = Committer(self.gang, self.ledger, self.record, self.checkpoints)
        self.world = TrainerWorld(
            cfg,
            self.gang,
            self.services,
            self.ledger,
            self.record,
            self.checkpoints,
            self.committer,
            self.supervisor,
            self.events,
            inputs.vocab_texts,
            len(inputs.train_prompts),
            resume_from=None,
            stop_check=stop_check,
        )
        self.world.start([p for p in self.placed if p.spec.role == "trainer"])
        stop_check("start-up (the replicas)")
        # before any producer asks the ledger for prompts
        self.world.resume_from = restore_data_state(
            self.resume,
            self.checkpoints,
            self.ledger,
            self.record,
            self.gang,
            self.supervisor.master_generation,
            self.events,
        )
        watcher_ledger = self.ledger.with_timeout(WATCHER_LEDGER_TIMEOUT_S)
        for gi, g in enumerate(cfg.topology.groups):
            i = cfg.inference
            pool = ReplicaPool(
                g.name,
                producer_spec(cfg, inputs, gi, str(self.run_dir)),
                watcher_ledger,
                self.services,
                replica_spec(cfg, gi),
                cfg.run_name,
                cfg.autoscaler.placement_timeout_s,
                RestartBudget(i.max_replica_restarts, i.restart_window_s),
                i.generation_timeout_s,
                i.restart_backoff_s,
                i.start_timeout_s,
            )
            for p in self.placed:
                if p.spec.group == g.name and p.spec.role == "inference":
                    pool.start(p)
            self.pools[g.name] = pool
        self.stats.ranks, self.stats.layout = self.gang.size, self.gang.layout()
        self.reporter = ProgressReporter(
            Metrics(tags={"run": cfg.run_name}),
            watcher_ledger,
            self.pools,
            self.stats,
            self.services,
            self.wandb,
            self.history,
        )
        threading.Thread(
            target=self.reporter.loop,
            args=(self.stop_event, cfg.logging.progress_interval_s),
            daemon=True,
            name="progress",
        ).start()
        # the last reported gauges (the held-out τ at the end) stay exported until the job ends
        threading.Thread(
            target=self.reporter.metrics.keep_alive, args=(self.metrics_stop,), daemon=True, name="metrics"
        ).start()
        if cfg.autoscaler.enabled:
            from cluster.scaling import AutoscaleLoop

            self.autoscaler = AutoscaleLoop(cfg, self.pools, watcher_ledger, self.stats, self.control, watermarks)
            threading.Thread(
                target=self.autoscaler.run, args=(self.stop_event,), daemon=True, name="autoscaler"
            ).start()
        t = cfg.trainer
        # The pace is measured over a checkpoint interval at least: checkpoints are part of it.
        deadline = self.started + t.time_budget_s if t.time_budget_s else float("inf")
        planner = EpochPlanner(deadline, window=max(10, t.checkpoint_interval))
        revision = (  # the box plan's second look, once the replica has answered (a fresh start's)
            PlanRevision(cfg, self.box_plan, inputs.train_prompts, self.ledger, deadline, self.events)
            if self.box_plan and self.resume is None
            else None
        )
        self.loop = TrainingLoop(
            t,
            cfg.device == "cpu",
            self.ledger,
            self.gang,
            self.world,
            self.committer,
            self.record,
            self.supervisor,
            self.reporter,
            planner,
            self.stats,
            self.control,
            self.events,
            revision,
        )

    def finalize(self) -> dict:
        """The reporter and the autoscaler threads stop; the confidence head is calibrated on the
        calibration split (`cluster.job.calibration`); the final checkpoint commits the last
        samples; then the producers stop (after: they generate the calibration samples, and a
        world that fails here restarts from the last checkpoint, its released samples generated
        again)."""
        self.stop_event.set()
        calib = calibrate_head(
            self.ledger,
            self.gang,
            self.inputs.calibration_prompts,
            self.cfg.data.calibration_wait_s,
            self.control.raise_if_stopped,
        )
        self.committer.commit(self.stats.step)
        self.final_replicas = {name: len(pool) for name, pool in self.pools.items()}
        for pool in self.pools.values():
            pool.stop()
        return calib

    def stopped(self, reason: str, phase: str) -> dict:
        self.stop_event.set()  # the progress reporter and the autoscaler
        return stopped(
            self.run_facts,
            reason,
            phase,
            self.stats.step,
            self.trained_until_s,
            self.committer,
            self.checkpoints,
            self.record,
            self.ledger,
        )

    def shutdown(self) -> None:
        from cluster.scaling import release

        self.stop_event.set()
        self.metrics_stop.set()
        for pool in self.pools.values():
            pool.stop()
        trainer_placement = self.world.placement if self.world is not None else []
        if self.gang is not None:  # before the store daemons, which their clients would miss
            self.gang.stop()
        if self.services is not None:
            self.services.stop()
        release(self.placed + [p for p in trainer_placement if p not in self.placed])
        if self.wandb is not None:
            self.wandb.finish()
