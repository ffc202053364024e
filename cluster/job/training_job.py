"""`TrainingJob`: the whole pipeline for one config, driven from the Ray job's entry script.

    StoreServices ─ Mooncake master + a store daemon per node (the samples' memory)
    SampleLedger ── every prompt × epoch of the job, whichever group generates or trains it
    ReplicaPool per group ──put──► store ◄──read── TrainerGang: one world, every group's ranks
    ProgressReporter (log, Ray metrics, wandb) · AutoscaleLoop ──ControlChannel──► training loop
    → final checkpoint → exactly-once proof (TrainingRecord) → calibration → export → held-out τ

One drafter per job: groups are how capacity is laid out (a set of inference nodes and a trainer
node, or both halves of one node) and balanced, not separate experiments. The training loop
(`train`) runs on the driver's main thread; the progress reporter and the autoscaler run beside
it and reach it only through the `ControlChannel`.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path

from cluster.training import EpochPlanner
from cluster.training import CheckpointDir
from cluster.config import ROOT, JobConfig, group_watermarks, to_yaml
from cluster.control import ControlChannel, ResizeTrainer
from cluster.hardware import cpu_process_env, read_cpu
from cluster.data import SampleLedger
from cluster.metrics import Metrics
from cluster.job.progress import ProgressReporter, TrainingStats
from cluster.data import TrainingRecord
from cluster.training import TrainerFailure
from dspark.recipe import write_recipe
from dspark.tau_report import UNCATEGORIZED

log = logging.getLogger("dspark.job")
VOCAB_SAMPLES = 64  # stored answers the draft vocabulary is counted on, at a fresh start
LEDGER_TIMEOUT_S = 60.0  # one call on the ledger actor (it answers in milliseconds)


def repo_path(src: str) -> Path:
    """A path of the config: absolute, or relative to the repository."""
    return Path(src) if Path(src).is_absolute() else ROOT / src


def load_prompts(cfg: JobConfig):
    """All prompt sources, de-duplicated by id, split into train / held-out."""
    from dspark.prompts import cap_per_category, read_conversations, split

    convs, seen = [], set()
    for src in cfg.data.prompts:
        got, report = read_conversations(repo_path(src))
        log.info("%s", report.summary())
        for c in got:
            if c.id in seen:
                raise ValueError(f"prompt id {c.id!r} appears twice across data.prompts")
            seen.add(c.id)
            convs.append(c)
    train, held = split(convs, cfg.data.heldout_fraction, cfg.data.split_seed)
    unknown = sorted(set(cfg.data.category_caps) - {c.category for c in train})
    if unknown:  # a misspelt category would cap nothing, silently
        from cluster.config import ConfigError

        raise ConfigError(f"config error at `data.category_caps`: no training prompt of data.prompts has "
                          f"category {', '.join(map(repr, unknown))} (they have "
                          f"{', '.join(sorted({str(c.category) for c in train}))})")
    if cfg.data.max_prompts_per_category or cfg.data.category_caps:
        train = cap_per_category(train, cfg.data.max_prompts_per_category, cfg.data.split_seed,
                                 cfg.data.category_caps)
    if cfg.data.max_prompts:
        train = train[: cfg.data.max_prompts]
    if not train:
        raise ValueError(f"no training prompts in data.prompts={list(cfg.data.prompts)} "
                         f"({len(convs)} read, {len(held)} held out): nothing to train on")
    return train, held


def check_eval_sets(cfg: JobConfig, train) -> None:
    """Every `data.eval_sets` file reads, has prompts, and shares none with the training prompts
    (a set trained on would measure memory, not generalisation)."""
    from cluster.config import ConfigError
    from dspark.prompts import read_conversations

    def key(c) -> str:
        return json.dumps(c.prompt_messages, sort_keys=True)

    trained = {key(c): c.id for c in train}
    for name, src in cfg.data.eval_sets.items():
        path = repo_path(src)
        if not path.exists():
            raise ConfigError(f"config error at `data.eval_sets.{name}`: {path} does not exist")
        convs, _ = read_conversations(path)
        if not convs:
            raise ConfigError(f"config error at `data.eval_sets.{name}`: no prompts in {path}")
        both = next((c for c in convs if key(c) in trained), None)
        if both is not None:
            raise ConfigError(f"config error at `data.eval_sets.{name}`: prompt {both.id} of {path} is also the "
                              f"training prompt {trained[key(both)]}")


class JobFailed(RuntimeError):
    pass


class TrainingJob:
    def __init__(self, cfg: JobConfig) -> None:
        import ray

        self.cfg, self.ray = cfg, ray
        self.started = time.monotonic()  # result.json's wall clock
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
        self.uncommitted: list[dict] = []  # lease rows since the last commit (calibration reads the last ones)
        self.events: list[str] = []
        self.ended_by = "data"  # data | max_steps | time_budget | stop
        self.trainer_generation = 0  # bumped per trainer placement after a resize: new placement group names
        self.trainer_restarts = 0
        self.nonfinite_streak = 0
        self.horizon_epochs: int | None = None  # the epochs the LR horizon was last measured for (cluster.training.budget)
        self.trained_until_s: float | None = None  # when training ended, from the job's start
        self.produced_seen, self.produced_at = 0, time.monotonic()  # for the stalled-store commit
        self.wandb = None

    # ---- set-up ----------------------------------------------------------------------------
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
        self.train_prompts, self.heldout = load_prompts(self.cfg)
        check_eval_sets(self.cfg, self.train_prompts)
        self.check_resume_plan()
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
        from cluster.scaling import describe, place_all, replica_spec
        from cluster.inference import ReplicaPool
        from cluster.store import StoreServices
        from cluster.training import TrainerGang

        cfg = self.cfg
        self.placed = place_all(cfg)
        log.info("placement:\n%s", describe(self.placed))
        self.services = StoreServices(cfg.transport, cfg.run_name, str(self.run_dir / "logs"))
        self.services.start()
        self.services.ensure_node_stores(self.placed)
        prompts = [{"id": c.id, "messages": c.prompt_messages} for c in self.train_prompts]
        reuse = cfg.data.reuse_samples_across_epochs
        self.ledger = self.ray.remote(num_cpus=0)(SampleLedger).options(name=f"ledger-{cfg.run_name}").remote(
            prompts, epochs=cfg.data.epochs, key_prefix=cfg.run_name, watermarks=group_watermarks(cfg),
            reuse_across_epochs=reuse if reuse is not None else cfg.sampling.temperature == 0, shuffle_seed=cfg.trainer.seed,
            sample_bytes_estimate=self.max_sample_bytes)
        self.master_generation = self.services.master_info()["generation"]
        self.trainer_pgs = [p for p in self.placed if p.spec.role == "trainer"]
        self.gang = TrainerGang(self.trainer_settings(), cfg.run_name, self.cpu_rank_env())
        self.gang.start(self.trainer_pgs)
        self.resume_from = self.restore_data_state()  # before any producer asks the ledger for prompts
        for gi, g in enumerate(cfg.topology.groups):
            pool = ReplicaPool(g.name, self.producer_spec(gi), self.ledger, self.services, replica_spec(cfg, gi),
                               cfg.run_name, cfg.autoscaler.placement_timeout_s, cfg.inference.max_replica_restarts,
                               cfg.inference.generation_timeout_s, cfg.inference.restart_backoff_s)
            for p in self.placed:
                if p.spec.group == g.name and p.spec.role == "inference":
                    pool.start(p)
            self.pools[g.name] = pool
        self.stats.ranks, self.stats.layout = self.gang.size, self.gang.layout()
        self.reporter = ProgressReporter(self.metrics, self.ledger, self.pools, self.stats, self.services, self.wandb)
        threading.Thread(target=self.reporter.loop, args=(self.stop_event, cfg.logging.progress_interval_s),
                         daemon=True, name="progress").start()
        if cfg.autoscaler.enabled:
            from cluster.scaling import AutoscaleLoop

            self.autoscaler = AutoscaleLoop(cfg, self.pools, self.ledger, self.stats, self.control)
            threading.Thread(target=self.autoscaler.run, args=(self.stop_event,), daemon=True, name="autoscaler").start()

    def producer_spec(self, group_index: int):
        from cluster.inference import InferenceActor
        from cluster.data import ReplayActor, ReplaySettings
        from cluster.inference import ProducerSpec
        from cluster.store import StoreConfig

        c, g = self.cfg, self.cfg.topology.groups[group_index]
        if c.inference.backend == "replay":
            i = c.inference
            rate = g.replay_samples_per_s if g.replay_samples_per_s is not None else i.replay_samples_per_s
            settings = ReplaySettings(i.replay_dir, StoreConfig(), rate, crash_on=list(i.replay_crash_on),
                                      hang_on=list(i.replay_hang_on), fault_dir=str(self.run_dir))
            return ProducerSpec(ReplayActor, settings, i.prompt_batch)
        return ProducerSpec(InferenceActor, self.inference_settings(g.name), c.inference.prompt_batch, self.cpu_engine_env())

    def cpu_engine_env(self) -> dict | None:
        """A CPU engine's process: its OpenMP threads and what vLLM's CPU guide preloads."""
        if self.cfg.device != "cpu":
            return None
        # (cpu_threads is set from the machine's cores when the config was read)
        return cpu_process_env(tuple(self.cfg.inference.preload), self.cfg.inference.cpu_threads) or None

    def cpu_rank_env(self) -> dict | None:
        """A CPU trainer rank's process: the preloaded libraries (its threads it sets itself)."""
        if self.cfg.device != "cpu":
            return None
        return cpu_process_env(tuple(self.cfg.trainer.preload)) or None

    def inference_settings(self, group: str):
        from cluster.inference import InferenceSettings
        from cluster.store import StoreConfig

        c, t = self.cfg, self.cfg.target
        return InferenceSettings(
            target_path=self.target_path, layer_ids=self.layer_ids, key_prefix=f"{c.run_name}/{group}",
            store=StoreConfig(), device=c.device, dtype=t.dtype, tensor_parallel_size=t.tensor_parallel_size,
            max_model_len=t.max_model_len, max_num_seqs=t.max_num_seqs, kv_cache_dtype=t.kv_cache_dtype,
            kv_cache_blocks=t.kv_cache_blocks, cpu_threads=c.inference.cpu_threads, enforce_eager=t.enforce_eager, gpu_memory_utilization=t.gpu_memory_utilization,
            cpu_kvcache_space_gb=t.cpu_kvcache_space_gb, temperature=c.sampling.temperature, top_p=c.sampling.top_p,
            max_tokens=c.sampling.max_tokens, trust_remote_code=t.trust_remote_code, chat=self.target.chat)

    def trainer_settings(self):
        from cluster.training import TrainerSettings

        return TrainerSettings(target_path=self.target_path, trust_remote_code=self.cfg.target.trust_remote_code,
                               chat=self.target.chat, drafter=self.cfg.drafter, trainer=self.cfg.trainer,
                               store=self.services.store_config(), device=self.cfg.device, total_steps=self.total_steps,
                               aux_layer_ids=self.aux_layer_ids, extensions_dir=os.environ.get("TORCH_EXTENSIONS_DIR"))

    # ---- the training loop -------------------------------------------------------------------
    def train(self) -> None:
        """One global step per iteration, until the data is trained (or max_steps, or a stop).
        A failed trainer world is restarted from the last checkpoint (bounded)."""
        t, s = self.cfg.trainer, self.stats
        s.step = self.begin()
        while True:
            try:
                self.supervise()
                if self.handle_requests():
                    break
                if t.max_steps and s.step >= t.max_steps:
                    self.ended_by = "max_steps"
                    break
                if self.planner.expired():
                    self.ended_by = "time_budget"
                    self.events.append(f"trainer.time_budget_s={t.time_budget_s:g} reached at step {s.step}")
                    break
                if self.global_step() == "drained":
                    break
            except TrainerFailure as e:
                self.restart_trainer(e)

    def global_step(self) -> str:
        """Assemble, read and train step `step + 1`: "stepped", "waited" (no data, or data that
        cannot be trained: given back), "skipped" (a non-finite loss) or "drained"."""
        t, s = self.cfg.trainer, self.stats
        t0 = time.perf_counter()
        lease = self.ledger_call("lease_step", s.step + 1, self.gang.rank_groups, t.batch_tokens)
        if lease is None:
            if self.ledger_call("drained"):
                return "drained"
            self.wait_for_data()
            s.data_wait_s += time.perf_counter() - t0
            return "waited"
        bad = self.gang.fetch(s.step + 1, lease)
        if bad:  # gone from the store (a daemon or the master died) or unusable: regenerate them
            self.ledger_call("release_lease", s.step + 1, bad)
            self.events.append(f"step {s.step + 1}: {len(bad)} samples could not be read, e.g. "
                               f"{next(iter(bad))}: {next(iter(bad.values()))}; regenerating")
            return "waited"
        s.data_wait_s += time.perf_counter() - t0
        generating = self.ledger_call("to_generate") > 0
        if self.cfg.device == "cpu":
            self.gang.set_threads(t.torch_threads if generating else t.torch_threads_when_idle)
        t1 = time.perf_counter()
        per_rank = self.gang.train_step(s.step + 1, lease)
        s.train_s += time.perf_counter() - t1
        if per_rank[0]["skipped"]:
            self.nonfinite_step(s.step + 1, per_rank)
            return "skipped"
        self.nonfinite_streak = 0
        s.step, s.last = s.step + 1, next((m for m in per_rank if "loss" in m), per_rank[0])
        for m, group in zip(per_rank, self.gang.rank_groups):
            self.record.add(s.step, m["rank"], group, m.pop("trained"))
        rows = [row for rank_rows in lease for row in rank_rows]
        self.uncommitted = self.release_before(s.step, rows) if t.release_samples == "after_step" else self.uncommitted + rows
        self.reporter.on_step(s.step, per_rank)
        # The last step's samples stay uncommitted (and in the store) for the final calibration.
        if s.step % t.checkpoint_interval == 0 and not self.ledger_call("drained"):
            self.checkpoint()
        self.follow_plan(len(rows), generating)
        return "stepped"

    def follow_plan(self, samples: int, generating: bool) -> None:
        """Once the pace is measured (`cluster.training.budget`): end the LR schedule where the epochs
        that fit in `trainer.time_budget_s` end, and drop the others when they would begin.
        Without a budget the horizon is measured once."""
        planner = self.planner
        planner.on_step(self.stats.step, samples, generating)
        if not planner.ready() or (self.horizon_epochs is not None and not planner.budgeted):
            return
        remaining = self.ledger_call("remaining_per_epoch")
        plan = planner.plan(remaining, self.ledger_call("first_open_epoch"), self.horizon_epochs)
        if plan is None:
            return
        if plan.drop:
            self.gang.on_rank0("remove_keys", self.ledger_call("shorten", plan.epochs))
            self.events.append(f"step {self.stats.step}: {plan.epochs} of {len(remaining)} epochs fit in trainer.time_budget_s="
                               f"{self.cfg.trainer.time_budget_s:g} at {plan.samples_per_s:.2f} samples/s; the others are dropped")
            log.info("%s", self.events[-1])
        if plan.horizon_epochs != self.horizon_epochs:
            horizon = min(plan.horizon, self.cfg.trainer.max_steps or plan.horizon)
            log.info("LR schedule: ends at step %d (was %d): %d of %d epochs fit at %.2f samples/s", horizon,
                     self.total_steps, plan.horizon_epochs, len(remaining), plan.samples_per_s)
            if horizon != self.total_steps:
                self.gang.set_lr_horizon(horizon)  # (first: if the world fails here, the next plan sets it again)
                self.total_steps = horizon
            self.horizon_epochs = plan.horizon_epochs

    def nonfinite_step(self, step: int, per_rank: list[dict]) -> None:
        """No rank updated: every sample of the step is leased again (those of the ranks whose
        loss was not finite are FAILED after max attempts of that)."""
        ranks = [m["rank"] for m in per_rank if m["nonfinite"]]
        bad = {uid: f"non-finite loss on rank {m['rank']}" for m in per_rank if m["nonfinite"] for uid in m["batch"]}
        self.ledger_call("release_lease", step, bad, "non-finite loss", False)
        self.nonfinite_streak += 1
        self.stats.skipped_steps += 1
        self.events.append(f"step {step}: non-finite loss on ranks {ranks}; update skipped on every rank")
        log.warning("%s", self.events[-1])
        if self.nonfinite_streak >= self.cfg.trainer.max_nonfinite_steps:
            raise RuntimeError(f"{self.nonfinite_streak} consecutive steps had a non-finite loss (the last at step {step}, "
                               f"ranks {ranks}): the drafter diverged; lower trainer.lr or check the data "
                               f"(trainer.max_nonfinite_steps={self.cfg.trainer.max_nonfinite_steps})")

    def restart_trainer(self, cause: Exception) -> None:
        """The world failed (a rank died, hung or raised): a new world from the last checkpoint.
        The ledger gives back what was leased after it (re-read, or regenerated if released),
        the training record drops the rows it did not commit. A restart that fails itself counts
        as the next one."""
        from cluster.scaling import place_all, release, trainer_specs

        layout = self.gang.layout()
        while True:
            if self.trainer_restarts >= self.cfg.trainer.max_restarts:
                raise RuntimeError(f"the trainer world failed {self.trainer_restarts + 1} times "
                                   f"(trainer.max_restarts={self.cfg.trainer.max_restarts}); last: {cause}")
            self.trainer_restarts += 1
            self.gang.stop()
            release(self.trainer_pgs)
            self.trainer_pgs = []
            try:
                self.services.check(force=True)  # a dead store daemon (what may have killed the ranks) first
                self.trainer_generation += 1
                self.trainer_pgs = place_all(self.cfg, trainer_specs(self.cfg, layout, self.trainer_generation))
                self.services.ensure_node_stores(self.trainer_pgs)
                self.gang.settings = replace(self.gang.settings, store=self.services.store_config())
                self.gang.start(self.trainer_pgs)
                ckpt = self.checkpoints.latest()
                returned = self.ledger_call("trainer_restarted", self.checkpoints.meta(ckpt)["step"] if ckpt else 0)
                self.record.rollback_to(self.checkpoints.meta(ckpt)["record_rows"] if ckpt else 0)
                self.uncommitted = []
                self.events.append(f"trainer world restarted from {ckpt.name if ckpt else 'scratch'} "
                                   f"({returned} leased samples given back): {cause}")
                log.warning("%s", self.events[-1])
                self.resume_from = ckpt
                self.stats.step = self.begin()
                return
            except TrainerFailure as e:
                cause = e

    def release_before(self, step: int, rows: list[dict]) -> list[dict]:
        """`trainer.release_samples=after_step`: the previous step's samples leave the store; the
        newest step's (`rows`) stay, for the final calibration, and are what is left in it."""
        keys = self.ledger_call("release", step - 1)
        if keys:
            self.gang.on_rank0("remove_keys", keys)
        return rows

    def ledger_call(self, method: str, *args):
        return self.ray.get(getattr(self.ledger, method).remote(*args), timeout=LEDGER_TIMEOUT_S)

    def supervise(self) -> None:
        """Replace dead replicas (bounded); after a master restart the stored samples are gone."""
        gen = self.services.check()
        if gen > self.master_generation:
            self.master_generation = gen
            lost = self.ledger_call("master_restarted", gen)
            self.events.append(f"master restarted (generation {gen}): {lost} stored samples back to pending")
            log.warning("%s", self.events[-1])
            self.gang.call("reconnect_store")
        for pool in self.pools.values():
            pool.supervise()

    def wait_for_data(self) -> None:
        """No rank got anything for the next step. If trained-but-uncommitted samples fill the
        store (it holds fewer than checkpoint_interval steps), only a commit makes room: commit
        when a group's producers are held back (its watermark), or when nothing has been stored
        for `trainer.stall_commit_s` while samples are in generation (their puts may be waiting
        for room that only a commit frees: Mooncake evicts nothing)."""
        counts = self.ledger_call("counts")
        produced = counts.get("produced_samples", 0)
        if produced != self.produced_seen:
            self.produced_seen, self.produced_at = produced, time.monotonic()
        stalled = counts["generating"] and time.monotonic() - self.produced_at > self.cfg.trainer.stall_commit_s
        if self.uncommitted and (counts["paused"] or stalled):
            why = "store full of uncommitted samples" if counts["paused"] else "nothing stored for a while"
            self.events.append(f"step {self.stats.step}: {why}, checkpointing early")
            log.info("%s", self.events[-1])
            self.checkpoint()
            self.produced_at = time.monotonic()
        else:
            time.sleep(0.2)

    def handle_requests(self) -> bool:
        """Apply what other threads asked for: a resize (at a checkpoint boundary), a stop."""
        resize, stop = self.control.take()
        if stop is not None:
            self.events.append(f"stopped at step {self.stats.step}: {stop.reason}")
            self.ended_by = "stop"
            return True
        if resize is not None:
            self.resize(resize)
        return False

    # ---- start, resume, checkpoint, resize ---------------------------------------------------
    def check_resume_plan(self) -> None:
        """Refuse, before any actor starts, a resume whose checkpoint trained samples this config
        no longer plans: changed prompt files, `data.max_prompts(_per_category)`, held-out split
        or fewer epochs. The ledger would drop them and train another set under the old record
        (or, with a changed split, may have trained on prompts now evaluated). A plan that only
        adds samples (more epochs, another prompt file) resumes. `trainer.resume=always` with no
        whole checkpoint is refused here too."""
        from cluster.config import ConfigError
        from cluster.data import trained_outside

        t = self.cfg.trainer
        ckpt = self.resume_candidate = self.checkpoints.latest() if t.resume != "never" else None
        if t.resume == "always" and ckpt is None:
            raise ConfigError(f"config error at `trainer.resume`: always, but no whole checkpoint under {self.checkpoints.root}")
        if ckpt is None:
            return
        outside = trained_outside(json.loads((ckpt / "ledger.json").read_text()),
                                  {c.id for c in self.train_prompts}, self.cfg.data.epochs)
        if not outside:
            return
        heldout = {c.id for c in self.heldout} & {u.rsplit("@", 1)[0] for u in outside}
        raise ConfigError(
            f"{ckpt} trained {len(outside)} samples this config does not plan to train (e.g. {', '.join(outside[:3])})"
            + (f"; {len(heldout)} of their prompts are now held out for evaluation" if heldout else "")
            + ": the prompt files, data.max_prompts, data.max_prompts_per_category, data.heldout_fraction, "
            "data.split_seed or data.epochs differ from the run that wrote it. Restore them to resume, or start "
            "afresh with trainer.resume=never (earlier checkpoints are moved aside).")

    def restore_data_state(self) -> Path | None:
        """The checkpoint to resume from, with the ledger and the training record already set back
        to it (samples it did not commit leave the store); or a fresh start (earlier checkpoints of
        this run name moved aside, no record)."""
        resume = self.resume_candidate  # found, and checked against the plan, by check_resume_plan
        if resume is None:
            moved = self.checkpoints.archive()  # a fresh run must not rotate into an old run's steps
            if moved:
                self.events.append(f"fresh start: earlier checkpoints moved to {moved}")
            self.record.reset()
            return None
        stale = self.ledger_call("load_state_dict", json.loads((resume / "ledger.json").read_text()), self.master_generation)
        self.gang.on_rank0("remove_keys", stale)
        self.record.rollback_to(self.checkpoints.meta(resume)["record_rows"])
        self.events.append(f"resumed from {resume}")
        log.info("resuming from %s", resume)
        return resume

    def begin(self) -> int:
        """The trainer world's drafter and engines: from the checkpoint, or fresh (the draft
        vocabulary counted on the first stored answers); the step it starts from."""
        if self.resume_from is None:
            return self.gang.setup(self.fresh_model_init(), None, False)
        model_init = self.gang.on_rank0("read_drafter", str(self.resume_from / "drafter"))
        return self.gang.setup(model_init, self.resume_from, self.checkpoints.meta(self.resume_from)["world_size"] != self.gang.size)

    def fresh_model_init(self) -> dict:
        if not self.cfg.drafter.draft_vocab_size:
            return {}
        # More answers cover more of what the drafter will predict (on the default prompts, 64
        # instead of 16 draft-vocab ~94 % of held-out answer tokens instead of 92 %); waiting
        # costs little: epoch 0 can only be trained as it arrives.
        want = min(VOCAB_SAMPLES, len(self.train_prompts))
        deadline = time.monotonic() + self.cfg.inference.first_samples_timeout_s
        while True:
            rows = self.ledger_call("peek_stored", want)
            counts = self.ledger_call("counts")
            # A full store (producers paused) or nothing left to generate: take what there is.
            if len(rows) >= want or (rows and (counts["paused"] or counts["to_generate"] == 0)):
                break
            if not rows and counts["to_generate"] == 0 and not counts["generating"]:
                failed = self.ledger_call("outcome")["failed"]
                example = next(iter(failed.items()), ("-", ["?"]))
                raise RuntimeError(f"no answer could be stored: {len(failed)} prompt x epochs FAILED, e.g. {example[0]}: "
                                   f"{example[1][-1] if example[1] else '?'}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(rows)} of the first {want} answers stored after "
                                   f"{self.cfg.inference.first_samples_timeout_s:.0f}s (inference.first_samples_timeout_s); "
                                   f"ledger: {({k: counts[k] for k in ('pending', 'generating', 'stored', 'failed')})}")
            self.supervise()
            time.sleep(0.5)
        texts = [m["content"] for c in self.train_prompts for m in c.prompt_messages]
        return self.gang.on_rank0("vocab_mapping", rows, texts)

    def checkpoint(self) -> Path:
        """Collective save; the record and the ledger commit with it; committed samples leave
        the store; older checkpoints rotate away (the last two stay). A model with a non-finite
        weight is never saved: the world restarts from the last good checkpoint instead."""
        step = self.stats.step
        if not all(self.gang.call("parameters_finite")):
            raise TrainerFailure(f"non-finite weights at step {step}: not saved")
        tmp, dest = self.checkpoints.paths(step)
        state = self.ledger_call("checkpoint_state", step)
        rows = self.record.commit(step)  # before the rename: a crash in between rolls these rows back
        self.gang.save_checkpoint(tmp, dest, step, state, {"step": step, "record_rows": rows, "lr_horizon": self.total_steps})
        keys = self.ledger_call("commit", step)
        self.gang.on_rank0("remove_keys", keys)
        self.uncommitted = []
        self.checkpoints.rotate()
        log.info("checkpoint at step %d (%d record rows; %d samples left the store)", step, rows, len(keys))
        return dest

    def resize(self, request: ResizeTrainer) -> None:
        """A new world with `request`'s ranks per group, at a checkpoint boundary: commit, stop
        the ranks, place and start the new ones, reload. If the new layout cannot be placed, the
        old one is placed again (its resources were just freed)."""
        from cluster.scaling import PlacementError, place, release, trainer_specs

        old = self.gang.layout()
        want = {**old, **request.ranks}
        if want == old:
            self.stats.resize_seq_handled = request.seq
            return
        ckpt = self.checkpoint()
        self.gang.stop()
        release(self.trainer_pgs)
        timeout = self.cfg.autoscaler.placement_timeout_s
        for layout in (want, old):
            self.trainer_generation += 1
            placed = []
            try:
                for spec in trainer_specs(self.cfg, layout, self.trainer_generation):
                    placed.append(place(spec, timeout))
                break
            except PlacementError as e:
                release(placed)
                if layout == old:
                    raise
                self.events.append(f"trainer resize {old}->{want} not placed ({e}); staying at {old}")
                log.warning("%s", self.events[-1])
        self.trainer_pgs = placed
        self.services.ensure_node_stores(placed)
        self.gang.settings = replace(self.gang.settings, store=self.services.store_config())
        self.gang.start(placed)
        resized = self.gang.size != sum(old.values())  # the old layout placed again keeps its optimizer state
        self.gang.setup(self.gang.on_rank0("read_drafter", str(ckpt / "drafter")), ckpt, resized)
        self.stats.ranks, self.stats.layout = self.gang.size, self.gang.layout()
        self.stats.resize_seq_handled = request.seq
        self.planner.remeasure()  # another world, another pace (and the resize's own minutes are not one step)
        if self.gang.layout() != old:
            self.events.append(f"trainer resized {old}->{self.gang.layout()} at step {self.stats.step}")
            log.info("%s", self.events[-1])

    # ---- the end ---------------------------------------------------------------------------
    def finalize(self) -> dict:
        """Producers stop (and with them the reporter and the autoscaler threads); the confidence
        head is calibrated on the last, uncommitted samples (never trained twice: calibration
        only reads); the final checkpoint commits them."""
        self.stop_event.set()
        self.final_replicas = {name: len(pool) for name, pool in self.pools.items()}
        for pool in self.pools.values():
            pool.stop()
        calib = {}
        if self.uncommitted and self.cfg.drafter.enable_confidence_head and self.cfg.drafter.mode == "dspark":
            calib = self.gang.calibrate(self.uncommitted[-32:])
        self.checkpoint()
        return calib

    def finish(self, calibration: dict) -> dict:
        outcome = self.ledger_call("outcome")
        proof = self.record.verify(outcome, complete=self.ended_by == "data")
        log.info("exactly-once: %s", proof)
        final = self.run_dir / "final"
        self.gang.export(str(final), calibration.get("temperatures"), self.cfg.target.name)
        counts = self.ledger_call("counts")
        results = {
            "run_dir": str(self.run_dir), "drafter": str(final), "steps": self.stats.step, "ended_by": self.ended_by,
            "trained_fraction": proof["trained"] / max(counts["total"], 1),
            "exactly_once": proof, "world": self.gang.layout(), "calibration": calibration, "events": self.events,
            # the plan the time budget kept (cluster.training.budget); what each epoch trained is in exactly_once
            "epochs": {"planned": self.cfg.data.epochs, "kept": counts["epochs"]}, "lr_horizon": self.total_steps,
            "trained_until_s": self.trained_until_s,
            "groups": {name: {"replicas": self.final_replicas[name], "generated": proof["generated_by_group"].get(name, 0),
                              "trained_by_its_ranks": proof["trained_by_group"].get(name, 0),
                              "events": pool.events} for name, pool in self.pools.items()},
        }
        failed = proof["failed"]
        results["failed_fraction"] = len(failed) / max(counts["total"], 1)
        if failed:
            errors = outcome["failed"][failed[0]]
            results["failed_examples"] = {u: outcome["failed"][u] for u in failed[:20]}
            log.warning("%d prompt x epochs failed, e.g. %s: %s", len(failed), failed[0], errors[-1] if errors else "?")
        results["evaluation"], results["evaluation_sets"] = self.evaluate(str(final))
        results["tau"] = results["evaluation"]["tau"]
        write_recipe(final, self.training_summary(proof["trained"], counts["epochs"]), results["evaluation"])
        # Final values once more, fresh for whoever looks after the job: Ray drops series that
        # nobody has set for a while, and training ended before the evaluation.
        self.reporter.report()
        self.reporter.publish_train(self.stats.last)
        for name, value in (("heldout_tau", results["tau"]), ("heldout_macro_tau", results["evaluation"]["macro_tau"])):
            if value is not None:
                self.metrics.gauge(name, value)
        for category, figures in results["evaluation"]["per_category"].items():
            if figures["tau"] is not None:
                self.metrics.gauge("heldout_category_tau", figures["tau"], category=category)
        results["machine"] = {"cpu": read_cpu().to_dict(), "device": self.cfg.device, "target_dtype": self.cfg.target.dtype,
                              "trainer_precision": self.cfg.trainer.precision}
        results["wall_clock_s"] = time.monotonic() - self.started  # the job, from its config to this file
        (self.run_dir / "result.json").write_text(json.dumps(results, indent=2, default=str))
        if results["failed_fraction"] > self.cfg.data.max_failed_fraction:
            u = failed[0]
            raise JobFailed(f"{len(failed)} of {counts['total']} prompt x epochs failed ({results['failed_fraction']:.1%} > "
                            f"data.max_failed_fraction={self.cfg.data.max_failed_fraction}), e.g. {u}: "
                            f"{outcome['failed'][u][-1] if outcome['failed'][u] else '?'}; the drafter and result.json "
                            f"are written ({self.run_dir})")
        return results

    def training_summary(self, trained: int, epochs: int) -> dict:
        """What the model card says about the data the drafter learned from."""
        categories = Counter(c.category or UNCATEGORIZED for c in self.train_prompts)
        sampling = self.cfg.sampling
        return {"target": self.cfg.target.name or self.target_path, "prompt_files": list(self.cfg.data.prompts),
                "train_prompts": len(self.train_prompts), "heldout_prompts": len(self.heldout), "categories": dict(categories),
                "epochs": epochs, "trained_samples": trained, "steps": self.stats.step,
                "sampling": f"temperature {sampling.temperature}, up to {sampling.max_tokens} tokens"}

    def evaluate(self, drafter: str) -> tuple[dict, dict[str, dict]]:
        """The held-out evaluation and that of every `data.eval_sets` split, each within
        `data.eval_timeout_s`: vLLM serving the target with the drafter where the target runs
        (GPU: the driver never loads the target), the reference decoder on CPU (one subprocess
        for all the sets: the target and the drafter are loaded once). Per-request rows go to
        eval.json (eval-<set>.json), figures to result.json."""
        backend = self.cfg.data.eval_backend
        if backend == "auto":
            backend = "vllm" if self.cfg.device == "cuda" and self.cfg.inference.backend == "vllm" else "reference"
        sets = {None: (self.run_dir / "heldout.jsonl", self.run_dir / "eval.json")}
        for name, src in self.cfg.data.eval_sets.items():
            sets[name] = (repo_path(src), self.run_dir / f"eval-{name}.json")
        if backend == "vllm":
            for prompts, out in sets.values():
                out.write_text(json.dumps(self.evaluate_served(drafter, prompts), indent=2))
        else:
            # Every core: Ray starts a job's driver with OMP_NUM_THREADS=1, which this subprocess
            # would inherit (one thread made the local job's evaluation ~1.8x slower), and the
            # producers and the trainer are done. On CPU it runs the target as a replica does,
            # with its environment (the local job's evaluation took 65 s instead of 74 s with the
            # preloaded libraries on a 2-core AMD EPYC).
            env = {**os.environ, **(self.cpu_engine_env() or {})}
            cmd = [sys.executable, "-m", "dspark.evaluate", "--target", self.target_path, "--drafter", drafter,
                   "--max-new-tokens", str(self.cfg.data.eval_max_new_tokens), "--threads", str(read_cpu().cores)]
            for prompts, out in sets.values():
                cmd += ["--prompts", str(prompts), "--json", str(out)]
            if self.cfg.data.eval_limit:
                cmd += ["--limit", str(self.cfg.data.eval_limit)]
            subprocess.run(cmd, check=True, cwd=ROOT, env=env, timeout=self.cfg.data.eval_timeout_s * len(sets))
        results = {}
        for name, (_, out) in sets.items():
            results[name] = json.loads(out.read_text())
            results[name].pop("requests", None)
        heldout = results.pop(None)
        return heldout, results

    def evaluate_served(self, drafter: str, prompts_file: Path) -> dict:
        """vLLM with the drafter, in the first inference placement group (its replica has stopped).
        On CPU vLLM runs only the backbone (`dflash`), exported beside the drafter."""
        from cluster.inference import engine_actor_options
        from cluster.inference import ServedEvalSettings, ServedEvaluator
        from dspark.prompts import read_conversations
        from dspark.tau_report import stratified

        method = "dspark" if self.cfg.device == "cuda" else "dflash"
        if method == "dflash":
            from dspark.checkpoint import export_dflash_backbone, load_drafter

            drafter = str(export_dflash_backbone(load_drafter(drafter, self.target_path), self.run_dir / "final-dflash"))
        held = stratified(read_conversations(prompts_file)[0], lambda c: c.category, self.cfg.data.eval_limit)
        prompts = [c.prompt_record() for c in held]
        settings = ServedEvalSettings(self.inference_settings("eval"), drafter, method, self.cfg.data.eval_max_new_tokens)
        placed = next(p for p in self.placed if p.spec.role == "inference")
        actor = self.ray.remote(ServedEvaluator).options(
            name=f"{self.cfg.run_name}-eval", **engine_actor_options(placed, settings.engine.tensor_parallel_size,
                                                                       self.cpu_engine_env()),
        ).remote(settings)
        try:
            return self.ray.get(actor.evaluate.remote(prompts), timeout=self.cfg.data.eval_timeout_s)
        except self.ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"the served evaluation ({method}, {len(prompts)} prompts) did not finish within "
                               f"data.eval_timeout_s={self.cfg.data.eval_timeout_s}") from None
        finally:
            self.ray.kill(actor)

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
            self.train()
            self.trained_until_s = time.monotonic() - self.started
            calibration = self.finalize()
            print(self.reporter.report(), flush=True)
            return self.finish(calibration)
        finally:
            self.shutdown()
