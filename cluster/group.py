"""`GroupRunner`: one group's actors and its training loop.

A group is a sample ledger, its inference replicas (each pulling prompts from the ledger and
pushing hidden states into the store) and its trainer ranks (leasing whole steps from the
ledger). The runner supervises them: a dead replica's prompts go back to pending and the
replica is recreated in its placement group; a restarted Mooncake master sends stored samples
back for regeneration and every store client reconnects; the job keeps going.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from pathlib import Path

from cluster.config import JobConfig
from cluster.placement import Placed

log = logging.getLogger("dspark.group")
VOCAB_SAMPLES = 64  # stored answers the draft vocabulary is counted on, at a fresh start


def latest_checkpoint(root: Path) -> Path | None:
    steps = sorted((p for p in root.glob("step-*") if p.is_dir() and (p / "meta.json").exists()),
                   key=lambda p: int(p.name.split("-")[1]))
    return steps[-1] if steps else None


class GroupRunner:
    def __init__(self, job, index: int, placements: list[Placed], prompts: list[dict]) -> None:
        import ray

        self.job, self.cfg = job, job.cfg
        cfg: JobConfig = job.cfg
        self.index = index
        self.gcfg = cfg.topology.groups[index]
        self.name = self.gcfg.name
        self.ray = ray
        self.replica_pgs = [p for p in placements if p.spec.role == "inference"]
        self.trainer_pgs = [p for p in placements if p.spec.role == "trainer"]
        self.prompts = prompts
        self.ckpt_root = cfg.run_dir / "checkpoints" / self.name
        self.ckpt_root.mkdir(parents=True, exist_ok=True)
        seg = cfg.transport.segment_mb << 20
        self.ledger = ray.remote(num_cpus=0)(job.ledger_class).options(name=f"ledger-{cfg.run_name}-{self.name}").remote(
            self.name, prompts, epochs=cfg.data.epochs, key_prefix=cfg.run_name,
            high_watermark_bytes=int(seg * cfg.transport.high_watermark),
            low_watermark_bytes=int(seg * cfg.transport.low_watermark),
            reuse_across_epochs=cfg.data.reuse_samples_across_epochs
            if cfg.data.reuse_samples_across_epochs is not None else cfg.sampling.temperature == 0,
            shuffle_seed=cfg.trainer.seed,
        )
        self.replicas: dict[str, tuple[object, object, Placed]] = {}  # id -> (actor, serve ref, placement)
        self.replica_seq = 0
        self.ranks: list = []
        self.step = 0
        self.stop_event = threading.Event()
        self.lock = threading.RLock()  # replicas change from the training loop and the autoscaler
        self.last_metrics: dict = {}
        self.resize_to: int | None = None  # trainer ranks the autoscaler asked for, applied at a checkpoint
        self.trainer_generation = 0
        self.master_generation = job.master_generation()
        self.data_wait_s = 0.0
        self.train_s = 0.0
        self.uncommitted_rows: list[dict] = []
        self.events: list[str] = []

    # ---- replicas ----------------------------------------------------------------------
    def start_replica(self, placed: Placed) -> str:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from cluster.inference import InferenceActor
        from cluster.replay import ReplayActor

        rid = f"{self.name}-r{self.replica_seq}"
        self.replica_seq += 1
        self.job.start_node_stores([placed])
        env = {}
        if self.cfg.inference.backend == "replay":
            cls, settings = ReplayActor, self.job.replay_settings()
        else:
            cls, settings = InferenceActor, self.job.inference_settings(self.name)
            if placed.spec.bundles[0].get("GPU"):
                env["VLLM_RAY_BUNDLE_INDICES"] = ",".join(map(str, placed.order))
        tp = settings.get("tensor_parallel_size", 1)
        actor = self.ray.remote(cls).options(
            num_cpus=placed.spec.bundles[0].get("CPU", 1), num_gpus=0 if tp > 1 else placed.spec.bundles[0].get("GPU", 0),
            max_concurrency=2, name=f"{self.job.cfg.run_name}-{rid}",
            scheduling_strategy=PlacementGroupSchedulingStrategy(placed.pg, placement_group_bundle_index=placed.order[0]),
            runtime_env={"env_vars": env} if env else None,
        ).remote(settings, rid)
        serve = actor.serve.remote(self.ledger, self.job.prompt_batch)
        self.replicas[rid] = (actor, serve, placed)
        return rid

    def supervise(self) -> None:
        """Replace dead replicas; react to a master restart."""
        gen = self.job.master_generation()
        if gen > self.master_generation:
            self.master_generation = gen
            lost = self.ray.get(self.ledger.master_restarted.remote(gen))
            self.events.append(f"master restarted (generation {gen}): {lost} stored samples back to pending")
            log.warning("[%s] %s", self.name, self.events[-1])
            self.ray.get([r.reconnect_store.remote() for r in self.ranks])
        with self.lock:
            for rid, (actor, serve, placed) in list(self.replicas.items()):
                done, _ = self.ray.wait([serve], timeout=0)
                if not done:
                    continue
                try:
                    self.ray.get(serve)
                    continue  # finished normally (stopped)
                except Exception as e:  # noqa: BLE001 - any failure of the replica
                    returned = self.ray.get(self.ledger.replica_died.remote(rid))
                    self.events.append(f"replica {rid} died ({type(e).__name__}); {returned} prompts back to pending")
                    log.warning("[%s] %s", self.name, self.events[-1])
                    del self.replicas[rid]
                    self.ray.kill(actor, no_restart=True)
                    if not self.stop_event.is_set():
                        self.start_replica(placed)

    def add_replica(self) -> str:
        """A new replica in a new placement group; PlacementError if the cluster has no room."""
        from cluster.placement import place, role_specs

        spec = next(s for s in role_specs(self.cfg, self.index) if s.role == "inference")
        spec.index = self.replica_seq
        placed = place(spec, self.cfg.autoscaler.placement_timeout_s)
        with self.lock:
            rid = self.start_replica(placed)
        self.events.append(f"added replica {rid}")
        return rid

    def remove_replica(self) -> str | None:
        """Drain the newest replica: its in-flight batch finishes and is reported, then it goes."""
        from ray.util.placement_group import remove_placement_group

        with self.lock:
            if len(self.replicas) <= 1:
                return None
            rid = list(self.replicas)[-1]
            actor, serve, placed = self.replicas.pop(rid)
        self.ray.get(actor.stop.remote())
        try:
            self.ray.get(serve, timeout=600)
        except Exception:  # noqa: BLE001 - died while draining: its prompts go back
            self.ray.get(self.ledger.replica_died.remote(rid))
        self.ray.kill(actor, no_restart=True)
        if placed not in self.replica_pgs:
            remove_placement_group(placed.pg)
        self.events.append(f"removed replica {rid}")
        return rid

    def signals(self, window: dict) -> dict:
        """Rates and queue state for the autoscaler, over the window since the last call."""
        stats = self.replica_stats()
        produced = sum(s.get("prompts", 0) for s in stats)
        busy = sum(s.get("seconds", 0.0) for s in stats)
        c = self.counts()
        trained = c.get("trained_samples", 0) + c["leased"]
        d_prod, d_busy = produced - window.get("produced", 0), busy - window.get("busy", 0.0)
        d_trained, d_train = trained - window.get("trained", 0), self.train_s - window.get("train_s", 0.0)
        d_wait, d_time = self.data_wait_s - window.get("wait_s", 0.0), time.monotonic() - window.get("t", time.monotonic())
        window.update(produced=produced, busy=busy, trained=trained, train_s=self.train_s, wait_s=self.data_wait_s,
                      t=time.monotonic())
        seg = self.cfg.transport.segment_mb << 20
        min_ranks, max_ranks = self.gcfg.trainer_rank_bounds()
        return {
            "name": self.name, "replicas": len(self.replicas), "ranks": len(self.ranks),
            "min_replicas": self.gcfg.min_replicas, "max_replicas": self.gcfg.max_replicas,
            "min_ranks": min_ranks, "max_ranks": max_ranks,
            "per_replica_rate": d_prod / d_busy if d_busy > 0 and d_prod > 0 else None,
            "per_rank_rate": d_trained / (d_train * len(self.ranks)) if d_train > 0 and d_trained > 0 else None,
            "data_wait_fraction": min(1.0, d_wait / d_time) if d_time > 0 else 0.0,
            "queue_samples": c["stored"], "queue_bytes": c["queued_bytes"],
            "high_watermark_bytes": int(seg * self.cfg.transport.high_watermark), "producers_paused": c["paused"],
            "trainer_running": self.train_s > 0,
        }

    def stop_replicas(self) -> None:
        """Drain and stop every replica; placement groups the autoscaler added go with them (the
        initial ones are released by the job)."""
        from ray.util.placement_group import remove_placement_group

        for actor, _, _ in self.replicas.values():
            try:
                self.ray.get(actor.stop.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - already gone
                pass
        for actor, serve, _ in self.replicas.values():
            try:
                self.ray.get(serve, timeout=120)
            except Exception:  # noqa: BLE001
                pass
            self.ray.kill(actor, no_restart=True)
        for _, _, placed in self.replicas.values():
            if placed not in self.replica_pgs:
                remove_placement_group(placed.pg)
        self.replicas.clear()

    # ---- trainer -----------------------------------------------------------------------
    def start_trainer(self) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from cluster.trainer import TrainerRank

        placed = [(p, b) for p in self.trainer_pgs for b in p.order]
        world = len(placed)
        self.job.start_node_stores(self.trainer_pgs)
        settings = self.job.trainer_settings(self.name, world)
        self.ranks = [
            self.ray.remote(TrainerRank).options(
                num_cpus=p.spec.bundles[b].get("CPU", 1), num_gpus=p.spec.bundles[b].get("GPU", 0),
                name=f"{self.job.cfg.run_name}-{self.name}-rank{r}" + (f".{self.trainer_generation}" if self.trainer_generation else ""),
                scheduling_strategy=PlacementGroupSchedulingStrategy(p.pg, placement_group_bundle_index=b),
            ).remote(r, world, settings)
            for r, (p, b) in enumerate(placed)
        ]
        self.ray.get([r.connect_store.remote() for r in self.ranks])

    def init_model(self, reload_from: Path | None = None) -> int:
        """Fresh start (vocab mapping from the first stored samples) or resume; returns step.
        `reload_from`: this run's own checkpoint, for new ranks (a resize); the live ledger stays."""
        resume = reload_from or (latest_checkpoint(self.ckpt_root) if self.cfg.trainer.resume != "never" else None)
        if self.cfg.trainer.resume == "always" and resume is None:
            raise RuntimeError(f"trainer.resume=always but no checkpoint under {self.ckpt_root}")
        if resume is not None:
            if reload_from is None:
                state = json.loads((resume / "ledger.json").read_text())
                stale = self.ray.get(self.ledger.load_state_dict.remote(state, self.master_generation))
                self.ray.get(self.ranks[0].remove_keys.remote(stale))
            model_init = self.ray.get(self.ranks[0].read_drafter.remote(str(resume / "drafter")))
            if reload_from is None:
                self.events.append(f"resumed from {resume}")
                log.info("[%s] resuming from %s", self.name, resume)
        else:
            model_init = {}
            if self.cfg.drafter.draft_vocab_size:
                # More answers cover more of what the drafter will predict (on the default
                # prompts, 64 instead of 16 draft-vocab ~94 % of held-out answer tokens instead
                # of 92 %); waiting costs little: epoch 0 can only be trained as it arrives.
                rows = self.wait_for_samples(min(VOCAB_SAMPLES, self.job.num_prompts))
                texts = [m["content"] for p in self.prompts for m in p["messages"]]
                model_init = self.ray.get(self.ranks[0].vocab_mapping.remote(rows, texts))
        addr, port = self.ray.get(self.ranks[0].rendezvous_address.remote())
        resized = resume is not None and json.loads((resume / "meta.json").read_text()).get("world_size") != len(self.ranks)
        out = self.ray.get([r.setup.remote(addr, port, model_init, str(resume / "trainer") if resume else None, resized)
                            for r in self.ranks])
        self.step = out[0]["step"]
        return self.step

    def wait_for_samples(self, n: int) -> list[dict]:
        while True:
            rows = self.ray.get(self.ledger.peek_stored.remote(n))
            counts = self.ray.get(self.ledger.counts.remote())
            # A full store (producers paused) or nothing left to generate: take what there is.
            if len(rows) >= n or (rows and (counts["paused"] or counts["to_generate"] == 0)):
                return rows
            self.supervise()
            time.sleep(0.5)

    def train(self) -> None:
        cfg = self.cfg
        world = len(self.ranks)
        interval = cfg.trainer.checkpoint_interval
        while not self.stop_event.is_set():
            self.supervise()
            if cfg.trainer.max_steps and self.step >= cfg.trainer.max_steps:
                break
            if self.resize_to is not None:
                self.resize_trainer(self.resize_to)
                world = len(self.ranks)
            t0 = time.perf_counter()
            lease = self.ray.get(self.ledger.lease_step.remote(self.step + 1, world, cfg.trainer.batch_tokens))
            if lease is None:
                if self.ray.get(self.ledger.drained.remote()):
                    break
                if self.uncommitted_rows and self.counts()["paused"]:
                    # Trained-but-uncommitted samples fill the store (it holds fewer than
                    # checkpoint_interval steps): only a commit makes room, so commit now.
                    self.events.append(f"step {self.step}: store full of uncommitted samples, checkpointing early")
                    log.info("[%s] %s", self.name, self.events[-1])
                    self.checkpoint()
                    continue
                time.sleep(0.2)
                self.data_wait_s += time.perf_counter() - t0
                continue
            missing = sum(self.ray.get([r.fetch.remote(self.step + 1, rows) for r, rows in zip(self.ranks, lease)]), [])
            if missing:
                self.ray.get(self.ledger.release_lease.remote(self.step + 1, missing))
                self.events.append(f"step {self.step + 1}: {len(missing)} samples gone from the store, regenerating")
                continue
            self.data_wait_s += time.perf_counter() - t0
            t1 = time.perf_counter()
            metrics = self.ray.get([r.train_step.remote(self.step + 1) for r in self.ranks])
            self.train_s += time.perf_counter() - t1
            self.step += 1
            self.uncommitted_rows += [row for rows in lease for row in rows]
            self.last_metrics = metrics[0]
            self.job.on_step(self.name, self.step, metrics)
            # The last step's samples stay uncommitted (and in the store) for the final calibration.
            if self.step % interval == 0 and not self.ray.get(self.ledger.drained.remote()):
                self.checkpoint()

    def resize_trainer(self, ranks: int) -> None:
        """Change the data-parallel size at a checkpoint boundary: commit, stop the ranks,
        place and start `ranks` new ones, reload the checkpoint. If the new size cannot be
        placed, the old size is placed again (its resources were just freed)."""
        from ray.util.placement_group import remove_placement_group

        from cluster.placement import PlacementError, place, role_specs

        self.resize_to = None
        old = len(self.ranks)
        if ranks == old:
            return
        ckpt = self.checkpoint()
        for r in self.ranks:
            self.ray.kill(r, no_restart=True)
        for p in self.trainer_pgs:
            remove_placement_group(p.pg)
        timeout = self.cfg.autoscaler.placement_timeout_s
        for size in (ranks, old):
            self.trainer_generation += 1
            specs = [s for s in role_specs(self.cfg, self.index, size, self.trainer_generation) if s.role == "trainer"]
            placed = []
            try:
                for spec in specs:
                    placed.append(place(spec, timeout))
                break
            except PlacementError as e:
                for p in placed:
                    remove_placement_group(p.pg)
                if size == old:
                    raise
                self.events.append(f"trainer resize {old}->{ranks} not placed ({e}); staying at {old}")
                log.warning("[%s] %s", self.name, self.events[-1])
        self.trainer_pgs = placed
        self.start_trainer()
        self.init_model(reload_from=ckpt)
        if len(self.ranks) != old:
            self.events.append(f"trainer resized {old}->{len(self.ranks)} ranks at step {self.step}")
            log.info("[%s] %s", self.name, self.events[-1])

    def finalize(self) -> dict:
        """Calibrate the confidence head on samples not yet removed, then the final checkpoint."""
        calib = {}
        if self.uncommitted_rows and self.cfg.drafter.enable_confidence_head and self.cfg.drafter.mode == "dspark":
            calib = self.ray.get(self.ranks[0].calibrate.remote(self.uncommitted_rows[-32:]))
        self.checkpoint()
        return calib

    def checkpoint(self) -> Path:
        step = self.step
        dest = self.ckpt_root / f"step-{step:06d}"
        tmp = self.ckpt_root / f".step-{step:06d}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        rngs = self.ray.get([r.anchor_rng.remote() for r in self.ranks])
        self.ray.get([r.save.remote(str(tmp), step, rngs) for r in self.ranks])
        state = self.ray.get(self.ledger.checkpoint_state.remote(step))
        meta = {"step": step, "group": self.name, "time": time.time(), "world_size": len(self.ranks)}
        self.ray.get(self.ranks[0].finalize_checkpoint.remote(str(tmp), str(dest), state, meta))
        keys = self.ray.get(self.ledger.commit.remote(step))
        self.ray.get(self.ranks[0].remove_keys.remote(keys))
        self.uncommitted_rows = []
        for old in sorted(self.ckpt_root.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))[:-2]:
            shutil.rmtree(old, ignore_errors=True)
        log.info("[%s] checkpoint at step %d (%d samples committed)", self.name, step, len(keys))
        return dest

    def counts(self) -> dict:
        return self.ray.get(self.ledger.counts.remote())

    def replica_stats(self) -> list[dict]:
        out = []
        with self.lock:
            actors = [a for a, _, _ in self.replicas.values()]
        for actor in actors:
            try:
                out.append(self.ray.get(actor.stats.remote(), timeout=5))
            except Exception:  # noqa: BLE001 - a replica being replaced
                pass
        return out
