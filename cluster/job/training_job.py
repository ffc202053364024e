"""`TrainingJob`: the whole pipeline for one config, driven from the Ray job's entry script.

    StoreServices ─ Mooncake master + a store daemon per node (the samples' memory)
    SampleLedger ── every prompt × epoch of the job, whichever group generates or trains it
    ReplicaPool per group ──put──► store ◄──read── TrainerGang: one world, every group's ranks
    ProgressReporter (log, Ray metrics, wandb) · AutoscaleLoop ──ControlChannel──► training loop
    → final checkpoint → exactly-once proof (TrainingRecord) → calibration → export → held-out τ

One drafter per job: groups are how capacity is laid out (a set of inference nodes and a trainer
node, or both halves of one node) and balanced, not separate experiments. The training loop
(`loop.train`) runs on the driver's main thread; the progress reporter and the autoscaler run
beside it and reach it only through the `ControlChannel`.

`TrainingJob` holds the job's state and its parts and runs the phases; what each phase does is
in its module: `settings` (what each part gets from the config), `loop` (the global step),
`checkpointing` (the commit point), `recovery` (resume, restarts, resize), `results` (the end).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import asdict
from pathlib import Path

from cluster.config import JobConfig, to_yaml
from cluster.control import ControlChannel, JobStopped
from cluster.data import LedgerClient, SampleLedger, TrainingRecord, calibration_split, check_eval_sets, load_prompts
from cluster.data.ledger_rows import LeasedSample
from cluster.job.calibration import calibrate_head, reserved_prompts
from cluster.job.checkpointing import checkpoint
from cluster.job.history import RunHistory
from cluster.job.loop import train
from cluster.job.progress import ProgressReporter, TrainingStats
from cluster.job.recovery import check_resume_plan, restart_trainer, restore_data_state
from cluster.job.results import finish, stopped
from cluster.job.settings import cpu_rank_env, producer_spec, trainer_settings
from cluster.metrics import Metrics
from cluster.training import CheckpointDir, EpochPlanner, TrainerFailure

log = logging.getLogger("dspark.job")
# The replica pools', the progress reporter's and the autoscaler's calls on the ledger (it answers
# in milliseconds; the training loop's own calls wait LedgerClient's default).
WATCHER_LEDGER_TIMEOUT_S = 30.0


class TrainingJob:
    def __init__(self, cfg: JobConfig, conversations: list | None = None, started: float | None = None,
                 box_plan: dict | None = None) -> None:
        """`conversations`: the prompts as `cluster.preflight.check_inputs` read them (None: the
        job reads them); `started`: the job's start (time.monotonic; None: now), from which the
        time budget and the wall clock count; `box_plan`: the plan `cluster.job.box` chose."""
        import ray

        self.cfg, self.ray, self.conversations, self.box_plan = cfg, ray, conversations, box_plan
        self.started = time.monotonic() if started is None else started  # result.json's wall clock
        self.run_dir = cfg.run_dir
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(to_yaml(cfg))
        self.metrics = Metrics(tags={"run": cfg.run_name})
        self.checkpoints = CheckpointDir(self.run_dir / "checkpoints")
        self.record = TrainingRecord(self.run_dir / "trained.jsonl")
        self.control = ControlChannel()
        self.stats = TrainingStats()
        self.stop_event = threading.Event()
        self.services = self.ledger = self.gang = self.reporter = self.autoscaler = None
        self.pools: dict = {}
        self.placed: list = []
        self.trainer_pgs: list = []
        self.resume_candidate: Path | None = None  # the checkpoint a resume would start from
        self.resume_from: Path | None = None
        self.uncommitted: list[LeasedSample] = []  # lease rows since the last commit (calibration reads the last ones)
        self.events: list[str] = []
        if box_plan:
            self.events.append(f"plan for this box: {box_plan['prompts_per_category']} prompts per category, answers of "
                               f"up to {box_plan['answer_tokens']} tokens, replica {box_plan['replica_threads']} / trainer "
                               f"{box_plan['trainer_threads']} thread(s): {'; '.join(box_plan['reasons'])}")
        self.ended_by = "data"  # data | max_steps | time_budget | stop
        self.trainer_generation = 0  # bumped per trainer placement after a resize: new placement group names
        self.trainer_restarts = 0
        self.nonfinite_streak = 0
        self.horizon_epochs: int | None = None  # the epochs the LR horizon was last measured for (cluster.training.budget)
        self.trained_until_s: float | None = None  # when training ended, from the job's start
        self.produced_seen, self.produced_at = 0, time.monotonic()  # for the stalled-store commit
        self.waiting_since: float | None = None  # the first of the current run of steps without data
        self.wandb = None
    def prepare(self) -> None:
        from cluster.inference import read_target
        from dspark.config import default_aux_layer_ids

        self.target = read_target(self.cfg)
        self.target_path, tcfg = self.target.path, self.target.config
        self.aux_layer_ids = list(self.cfg.target.aux_layer_ids or default_aux_layer_ids(tcfg.num_hidden_layers, self.cfg.target.num_aux_layers))
        self.layer_ids = [*self.aux_layer_ids, tcfg.num_hidden_layers]
        # The largest sample the target can produce: what the ledger assumes until it has measured
        # some (a first request that cannot overfill the store).
        self.max_sample_bytes = self.cfg.target.max_model_len * (
            len(self.layer_ids) * tcfg.hidden_size * (4 if self.cfg.target.dtype == "float32" else 2) + 5)
        self.train_prompts, self.heldout = load_prompts(self.cfg, self.conversations)
        check_eval_sets(self.cfg, self.train_prompts)
        head = self.cfg.drafter.enable_confidence_head and self.cfg.drafter.mode == "dspark"
        self.calibration_prompts, self.evaluated_prompts = calibration_split(
            self.heldout, self.cfg.data.eval_limit, self.cfg.data.calibration_prompts if head else 0)
        check_resume_plan(self)
        # the figures over time, for the end-of-job pictures; a resumed run goes on with its own
        self.history = RunHistory(self.run_dir / "history.jsonl", self.started)
        if self.resume_candidate is None:
            self.history.path.unlink(missing_ok=True)
        est_tokens = len(self.train_prompts) * self.cfg.data.epochs * (96 + 0.6 * self.cfg.sampling.max_tokens)
        world = sum(g.trainer_ranks for g in self.cfg.topology.groups)
        self.total_steps = self.cfg.trainer.max_steps or max(10, int(est_tokens / (self.cfg.trainer.batch_tokens * world)))
        t = self.cfg.trainer
        if self.resume_candidate is not None and not t.max_steps:
            # A resumed schedule goes on to the end of the plan it was trained under (not to a
            # fresh estimate for every epoch of the config) until the pace is measured again.
            self.total_steps = self.checkpoints.meta(self.resume_candidate).get("lr_horizon", self.total_steps)
        # The pace is measured over a checkpoint interval at least: checkpoints are part of it.
        self.planner = EpochPlanner(self.started + t.time_budget_s if t.time_budget_s else float("inf"),
                                    window=max(10, t.checkpoint_interval))
        (self.run_dir / "heldout.jsonl").write_text(
            "".join(json.dumps(c.prompt_record()) + "\n" for c in self.heldout))
        if self.cfg.logging.wandb_mode != "disabled":
            import wandb

            os.environ.setdefault("WANDB_CACHE_DIR", str(self.run_dir / "wandb-cache"))
            self.wandb = wandb.init(project=self.cfg.logging.wandb_project, name=self.cfg.run_name,
                                    mode=self.cfg.logging.wandb_mode, dir=str(self.run_dir), resume="allow",
                                    id=self.cfg.run_name.replace("/", "_"), config=json.loads(json.dumps(asdict(self.cfg), default=str)))

    def start(self) -> None:
        """Placement, the store services, the ledger, every group's producers, the trainer world."""
        from cluster.scaling import describe, group_watermarks, groups_on_nodes, place_all, replica_spec
        from cluster.inference import ReplicaPool
        from cluster.store import StoreServices
        from cluster.training import TrainerGang

        cfg, stop_check = self.cfg, self.control.raise_if_stopped
        stop_check("placement")
        self.placed = place_all(cfg)
        log.info("placement:\n%s", describe(self.placed))
        stop_check("the store services")
        self.watermarks = group_watermarks(cfg, groups_on_nodes(self.placed))
        self.services = StoreServices(cfg.transport, cfg.run_name, str(self.run_dir / "logs"))
        self.services.start()
        self.services.ensure_node_stores(self.placed)
        prompts = [{"id": c.id, "messages": c.prompt_messages} for c in self.train_prompts]
        reuse = cfg.data.reuse_samples_across_epochs
        self.ledger = LedgerClient(self.ray.remote(num_cpus=0)(SampleLedger).options(name=f"ledger-{cfg.run_name}").remote(
            prompts, epochs=cfg.data.epochs, key_prefix=cfg.run_name, watermarks=self.watermarks,
            reuse_across_epochs=reuse if reuse is not None else cfg.sampling.temperature == 0, shuffle_seed=cfg.trainer.seed,
            sample_bytes_estimate=self.max_sample_bytes,
            reserved=reserved_prompts(self.calibration_prompts, self.evaluated_prompts) if self.calibration_prompts else []))
        self.master_generation = self.services.master_info()["generation"]
        self.trainer_pgs = [p for p in self.placed if p.spec.role == "trainer"]
        stop_check("the trainer world")
        self.gang = TrainerGang(trainer_settings(self), cfg.run_name, cpu_rank_env(self))
        self.gang.start(self.trainer_pgs)
        stop_check("the replicas")
        self.resume_from = restore_data_state(self)  # before any producer asks the ledger for prompts
        watcher_ledger = self.ledger.with_timeout(WATCHER_LEDGER_TIMEOUT_S)
        for gi, g in enumerate(cfg.topology.groups):
            pool = ReplicaPool(g.name, producer_spec(self, gi), watcher_ledger, self.services, replica_spec(cfg, gi),
                               cfg.run_name, cfg.autoscaler.placement_timeout_s, cfg.inference.max_replica_restarts,
                               cfg.inference.generation_timeout_s, cfg.inference.restart_backoff_s,
                               cfg.inference.start_timeout_s)
            for p in self.placed:
                if p.spec.group == g.name and p.spec.role == "inference":
                    pool.start(p)
            self.pools[g.name] = pool
        self.stats.ranks, self.stats.layout = self.gang.size, self.gang.layout()
        self.reporter = ProgressReporter(self.metrics, watcher_ledger, self.pools, self.stats, self.services, self.wandb,
                                         self.history)
        threading.Thread(target=self.reporter.loop, args=(self.stop_event, cfg.logging.progress_interval_s),
                         daemon=True, name="progress").start()
        if cfg.autoscaler.enabled:
            from cluster.scaling import AutoscaleLoop

            self.autoscaler = AutoscaleLoop(cfg, self.pools, watcher_ledger, self.stats, self.control,
                                            self.watermarks)
            threading.Thread(target=self.autoscaler.run, args=(self.stop_event,), daemon=True, name="autoscaler").start()

    def check_resume_plan(self) -> None:
        """Refuse a resume whose checkpoint trained samples this config no longer plans
        (`recovery.check_resume_plan`)."""
        check_resume_plan(self)

    def finalize(self) -> dict:
        """The reporter and the autoscaler threads stop; the confidence head is calibrated on the
        calibration split (`cluster.job.calibration`); the final checkpoint commits the last
        samples; then the producers stop (after: they generate the calibration samples, and a
        world that fails here restarts from the last checkpoint, its released samples generated
        again)."""
        self.stop_event.set()
        calib = calibrate_head(self)
        checkpoint(self)
        self.final_replicas = {name: len(pool) for name, pool in self.pools.items()}
        for pool in self.pools.values():
            pool.stop()
        return calib

    def shutdown(self) -> None:
        from cluster.scaling import release

        self.stop_event.set()
        for pool in self.pools.values():
            pool.stop()
        if self.gang is not None:  # before the store daemons, which their clients would miss
            self.gang.stop()
        if self.services is not None:
            self.services.stop()
        release(self.placed + [p for p in self.trainer_pgs if p not in self.placed])
        if self.wandb is not None:
            self.wandb.finish()

    def run(self) -> dict:
        self.prepare()
        log.info("target %s, aux layers %s, %d training prompts, %d held out, ~%d steps",
                 self.target_path, self.aux_layer_ids, len(self.train_prompts), len(self.heldout), self.total_steps)
        try:
            self.start()
            train(self)
            self.trained_until_s = time.monotonic() - self.started
            if self.ended_by == "stop":
                return stopped(self, self.control.stop_sent.reason if self.control.stop_sent else "stop")
            while True:
                try:
                    calibration = self.finalize()
                    break
                except TrainerFailure as e:  # bounded: restarts count against trainer.max_restarts
                    restart_trainer(self, e)  # from the last checkpoint: what it had not committed is trained again
                    train(self, begun=True)
            print(self.reporter.report(), flush=True)
            return finish(self, calibration)
        except JobStopped as e:  # during start-up: `shutdown` releases what was placed
            return stopped(self, str(e))
        finally:
            self.shutdown()
