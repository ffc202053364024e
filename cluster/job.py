"""`TrainingJob`: the whole pipeline for one config, driven from the Ray job's entry script.

    Mooncake master + a store daemon per node ─┬─ group g0: ledger · replicas · trainer ranks
                                                ├─ group g1: ...
    progress line · Ray metrics · wandb ────────┘
    → final checkpoint per group → exactly-once check → calibration → export → held-out τ

Groups train independently (one thread each on the driver); each exports its own drafter.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from dataclasses import asdict
from pathlib import Path

from cluster.config import LOCAL_TARGET, ROOT, JobConfig, to_yaml
from cluster.ledger import SampleLedger
from cluster.metrics import Metrics

log = logging.getLogger("dspark.job")


def resolve_target(cfg: JobConfig) -> str:
    if cfg.target.path == LOCAL_TARGET:
        from dspark.targets import prepare_smollm2

        return str(prepare_smollm2())
    path = Path(cfg.target.path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"target.path={cfg.target.path}: no HF checkpoint (config.json) there")
    return str(path)


def load_prompts(cfg: JobConfig):
    """All prompt sources, de-duplicated by id, split into train / held-out."""
    from dspark.prompts import read_conversations, split

    convs, seen = [], set()
    for src in cfg.data.prompts:
        path = Path(src) if Path(src).is_absolute() else ROOT / src
        got, report = read_conversations(path)
        log.info("%s", report.summary())
        for c in got:
            if c.id in seen:
                raise ValueError(f"prompt id {c.id!r} appears twice across data.prompts")
            seen.add(c.id)
            convs.append(c)
    train, held = split(convs, cfg.data.heldout_fraction, cfg.data.split_seed)
    if cfg.data.max_prompts:
        train = train[: cfg.data.max_prompts]
    return train, held


class TrainingJob:
    ledger_class = SampleLedger
    prompt_batch = 16  # prompts per replica request: big enough to batch, small enough to spread

    def __init__(self, cfg: JobConfig) -> None:
        import ray

        self.cfg, self.ray = cfg, ray
        self.run_dir = cfg.run_dir
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(to_yaml(cfg))
        self.metrics = Metrics(tags={"run": cfg.run_name})
        self.groups = []
        self.master = None
        self.node_stores: dict[str, tuple] = {}  # node id -> (NodeStore actor, address)
        self.wandb = None
        self._lock = threading.Lock()

    # ---- shared services --------------------------------------------------------------
    def start_master(self) -> None:
        from cluster.master import MooncakeMaster

        t = self.cfg.transport
        self.master = self.ray.remote(num_cpus=0)(MooncakeMaster).options(
            name=f"mooncake-master-{self.cfg.run_name}", max_concurrency=4,
        ).remote(t.master_host, t.master_port, str(self.run_dir / "logs"),
                 segment_bytes=t.segment_mb << 20 if t.segment_host == "master" else 0,
                 protocol=t.protocol, rdma_devices=t.rdma_devices)
        self.master_info = self.ray.get(self.master.info.remote())
        log.info("mooncake master at %s", self.master_info["address"])

    def start_node_stores(self, placements) -> None:
        """`segment_host: node`: a store daemon on every node these placements landed on that has
        none yet. Started by the driver (not by the actors that use it) so that it outlives
        them: a replaced replica or trainer rank must not take the node's samples with it."""
        if self.cfg.transport.segment_host != "node":
            return
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from cluster.node_store import NodeStore

        t = self.cfg.transport
        with self._lock:
            for node in sorted({n for p in placements for n in p.bundle_nodes} - set(self.node_stores)):
                actor = self.ray.remote(num_cpus=0)(NodeStore).options(
                    name=f"mooncake-store-{self.cfg.run_name}-{node[:12]}", max_concurrency=2,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                ).remote(self.master_info["address"], t.segment_mb << 20,
                         host="127.0.0.1" if t.master_host.startswith("127.") else "0.0.0.0",
                         protocol=t.protocol, rdma_devices=t.rdma_devices, log_dir=str(self.run_dir / "logs"))
                address = self.ray.get(actor.info.remote())["address"]
                self.node_stores[node] = (actor, address)
                log.info("store daemon for node %s at %s (%d MiB)", node[:12], address, t.segment_mb)

    def stop_node_stores(self) -> None:
        for actor, _ in self.node_stores.values():
            try:
                self.ray.get(actor.stop.remote(), timeout=30)
                self.ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.node_stores.clear()

    def master_generation(self) -> int:
        info = self.ray.get(self.master.info.remote())
        self.metrics.gauge("master_restarts", info["restarts"])
        return info["generation"]

    def store_config(self, segment_bytes: int = 0) -> dict:
        t = self.cfg.transport
        host = self.ray.util.get_node_ip_address() if t.protocol == "rdma" else "127.0.0.1"
        return {"master": self.master_info["address"], "protocol": t.protocol, "rdma_devices": t.rdma_devices,
                "segment_bytes": segment_bytes, "buffer_bytes": t.buffer_mb << 20, "local_hostname": host,
                "node_clients": {node: address for node, (_, address) in self.node_stores.items()}}

    def inference_settings(self, group: str) -> dict:
        from cluster.inference import InferenceSettings

        c, t = self.cfg, self.cfg.target
        return asdict(InferenceSettings(
            target_path=self.target_path, layer_ids=self.layer_ids, key_prefix=f"{c.run_name}/{group}",
            store=self.store_config(0), device=c.device, dtype=t.dtype, tensor_parallel_size=t.tensor_parallel_size,
            max_model_len=t.max_model_len, max_num_seqs=t.max_num_seqs, kv_cache_dtype=t.kv_cache_dtype,
            enforce_eager=t.enforce_eager, gpu_memory_utilization=t.gpu_memory_utilization,
            cpu_kvcache_space_gb=t.cpu_kvcache_space_gb, temperature=c.sampling.temperature, top_p=c.sampling.top_p,
            max_tokens=c.sampling.max_tokens,
        ))

    def replay_settings(self) -> dict:
        from cluster.replay import ReplaySettings

        i = self.cfg.inference
        return asdict(ReplaySettings(sample_dir=i.replay_dir, store=self.store_config(0), samples_per_s=i.replay_samples_per_s))

    def trainer_settings(self, group: str, world: int) -> dict:
        from cluster.trainer import TrainerSettings

        return asdict(TrainerSettings(
            target_path=self.target_path, drafter=asdict(self.cfg.drafter), trainer=asdict(self.cfg.trainer),
            store=self.store_config(0), device=self.cfg.device, total_steps=self.total_steps,
            aux_layer_ids=self.aux_layer_ids, torch_threads=self.cfg.trainer.torch_threads,
            extensions_dir=os.environ.get("TORCH_EXTENSIONS_DIR"),
        ))

    # ---- progress ----------------------------------------------------------------------
    def _publish_train(self, group: str, m: dict) -> None:
        for k in ("loss", "ce", "l1", "confidence_bce", "expected_tau", "greedy_tau", "lr"):
            if m.get(k) is not None:
                self.metrics.gauge(f"train_{k}", m[k], group=group)

    def on_step(self, group: str, step: int, metrics: list[dict]) -> None:
        m = metrics[0]
        tags = {"group": group}
        self._publish_train(group, m)
        self.metrics.count("train_steps", 1, **tags)
        self.metrics.count("trained_tokens", sum(x.get("tokens", 0) for x in metrics), **tags)
        if self.wandb is not None:
            with self._lock:
                self.wandb.log({f"{group}/{k}": v for k, v in m.items() if isinstance(v, (int, float))}, step=step)

    def progress(self) -> str:
        if self.node_stores:  # only a metric: a dead daemon's samples are found missing by readers
            try:
                daemons = self.ray.get([a.info.remote() for a, _ in self.node_stores.values()], timeout=10)
                self.metrics.gauge("store_daemon_restarts", sum(d["restarts"] for d in daemons))
            except Exception:  # noqa: BLE001 - a metric is not worth failing the report for
                pass
        lines = []
        for g in self.groups:
            c = g.counts()
            tags = {"group": g.name}
            for k in ("pending", "generating", "stored", "leased", "trained", "failed"):
                self.metrics.gauge(f"samples_{k}", c[k], **tags)
            self.metrics.gauge("queue_bytes", c["queued_bytes"], **tags)
            self.metrics.gauge("oldest_lease_s", c["oldest_lease_s"], **tags)
            self.metrics.gauge("producers_paused", int(c["paused"]), **tags)
            stats = g.replica_stats()
            gen_rate = sum(s["tokens_per_s"] for s in stats)
            self.metrics.gauge("inference_tokens_per_s", gen_rate, **tags)
            self.metrics.gauge("inference_replicas", len(g.replicas), **tags)
            eta = self._eta(g, c, gen_rate)
            m = g.last_metrics
            lines.append(
                f"[progress] {g.name} step {g.step} | trained {c['trained']}+{c['leased']} leased / {c['total']} "
                f"| in {gen_rate:.0f} tok/s (replicas {len(g.replicas)}) | queue {c['stored']} samples "
                f"{c['queued_bytes'] / 2**20:.0f} MiB{' (paused)' if c['paused'] else ''} | loss {m.get('loss', float('nan')):.3f} "
                f"tau~{m.get('expected_tau', float('nan')):.2f} | {g.train_s / max(g.step, 1):.1f}s/step, data wait {g.data_wait_s:.0f}s "
                f"| ETA {eta / 60:.1f} min"
            )
        return "\n".join(lines)

    @staticmethod
    def _eta(g, c: dict, gen_rate: float) -> float:
        """Seconds until the slower of generation (what is left, at the current rate) and
        training (what is left, at the trainer's own pace, data waits excluded) is done."""
        done = c["trained"] + c["leased"]
        if not done or not g.step:
            return float("nan")
        to_generate = c["to_generate"]
        tokens_per_sample = c.get("produced_tokens", 0) / max(c.get("produced_samples", 0), 1)
        gen_s = to_generate * tokens_per_sample / gen_rate if to_generate and gen_rate > 0 else 0.0
        train_s = (c["total"] - done) / (done / g.step) * (g.train_s / g.step)
        return max(gen_s, train_s)

    def _autoscale_loop(self, stop: threading.Event) -> None:
        """Feed the Autoscaler actor each group's signals and apply what it decides."""
        from cluster.autoscaler import Autoscaler
        from cluster.placement import PlacementError

        a = self.cfg.autoscaler
        gpu = any(g.gpus_per_node for g in self.cfg.topology.groups)
        g0 = self.cfg.topology.groups[0]
        unit = "GPU" if gpu else "CPU"
        per_replica = g0.gpus_per_node * self.cfg.target.nodes_per_replica if gpu else g0.cpus_per_replica
        self.autoscaler = self.ray.remote(num_cpus=0)(Autoscaler).options(name=f"autoscaler-{self.cfg.run_name}").remote(
            asdict(a), self.cfg.run_name, per_replica)
        windows = {g.name: {} for g in self.groups}
        while not stop.wait(a.interval_s):
            try:
                signals = [g.signals(windows[g.name]) for g in self.groups]
                free = self.ray.available_resources().get(unit, 0.0)
                for d in self.ray.get(self.autoscaler.decide.remote(signals, free)):
                    g = next(x for x in self.groups if x.name == d["group"])
                    if g.resize_to is not None:  # a trainer resize is under way: its rates are stale
                        continue
                    if d["action"] == "add_replica":
                        try:
                            rid = g.add_replica()
                        except PlacementError as e:
                            self._request_resources(g, str(e))
                            continue
                        print(f"[autoscaler] {g.name}: added replica {rid} ({d['reason']})", flush=True)
                    elif d["action"] == "remove_replica":
                        rid = g.remove_replica()
                        if rid is None:
                            continue
                        print(f"[autoscaler] {g.name}: removed replica {rid} ({d['reason']})", flush=True)
                    elif d["action"] == "wait_resources":
                        self._request_resources(g, d["reason"], d.get("target_ranks"))
                        continue
                    elif d["action"] == "resize_trainer":
                        g.resize_to = d["target_ranks"]  # the training loop applies it at a checkpoint
                        print(f"[autoscaler] {g.name}: trainer {len(g.ranks)}->{d['target_ranks']} ranks ({d['reason']})",
                              flush=True)
                        d["action"] = "grow_trainer" if d["target_ranks"] > len(g.ranks) else "shrink_trainer"
                    else:
                        continue
                    self.ray.get(self.autoscaler.applied.remote(g.name, d["action"]))
            except Exception as e:  # noqa: BLE001 - scaling must never kill training
                log.warning("autoscaler round failed: %r", e)

    def _request_resources(self, g, reason: str, trainer_ranks: int | None = None) -> None:
        """Ask Ray's cluster autoscaler for room for `g` with one more replica, or with
        `trainer_ranks` trainer ranks; the other groups as they are."""
        from ray.autoscaler.sdk import request_resources

        from cluster.placement import cluster_request

        shapes = [(len(x.replicas), len(x.ranks)) for x in self.groups]
        shapes[g.index] = (len(g.replicas), trainer_ranks) if trainer_ranks else (len(g.replicas) + 1, len(g.ranks))
        request_resources(bundles=cluster_request(self.cfg, shapes))
        print(f"[autoscaler] {g.name}: waiting for resources ({reason}); asked Ray's cluster autoscaler", flush=True)

    def _progress_loop(self, stop: threading.Event) -> None:
        while not stop.wait(self.cfg.logging.progress_interval_s):
            try:
                print(self.progress(), flush=True)
            except Exception as e:  # noqa: BLE001 - progress must never kill the job
                log.warning("progress report failed: %r", e)

    # ---- the run -----------------------------------------------------------------------
    def prepare(self) -> None:
        from dspark.config import default_aux_layer_ids

        from transformers import AutoConfig

        self.target_path = resolve_target(self.cfg)
        tcfg = AutoConfig.from_pretrained(self.target_path)
        tcfg = getattr(tcfg, "text_config", None) or tcfg
        self.aux_layer_ids = list(self.cfg.target.aux_layer_ids or default_aux_layer_ids(tcfg.num_hidden_layers, self.cfg.target.num_aux_layers))
        self.layer_ids = [*self.aux_layer_ids, tcfg.num_hidden_layers]
        self.train_prompts, self.heldout = load_prompts(self.cfg)
        self.num_prompts = len(self.train_prompts)
        est_tokens = self.num_prompts * self.cfg.data.epochs * (96 + 0.6 * self.cfg.sampling.max_tokens)
        world = max(g.trainer_nodes * g.trainer_ranks_per_node for g in self.cfg.topology.groups)
        self.total_steps = self.cfg.trainer.max_steps or max(10, int(est_tokens / (self.cfg.trainer.batch_tokens * world)))
        (self.run_dir / "heldout.jsonl").write_text(
            "".join(json.dumps({"id": c.id, "messages": c.prompt_messages}) + "\n" for c in self.heldout)
        )
        if self.cfg.logging.wandb_mode != "disabled":
            import wandb

            os.environ.setdefault("WANDB_CACHE_DIR", str(self.run_dir / "wandb-cache"))
            self.wandb = wandb.init(project=self.cfg.logging.wandb_project, name=self.cfg.run_name,
                                    mode=self.cfg.logging.wandb_mode, dir=str(self.run_dir), resume="allow",
                                    id=self.cfg.run_name.replace("/", "_"), config=json.loads(json.dumps(asdict(self.cfg), default=str)))

    def run(self) -> dict:
        from cluster.group import GroupRunner
        from cluster.placement import describe, place_all, release

        self.prepare()
        log.info("target %s, aux layers %s, %d training prompts, %d held out, ~%d steps",
                 self.target_path, self.aux_layer_ids, self.num_prompts, len(self.heldout), self.total_steps)
        placed = place_all(self.cfg)
        log.info("placement:\n%s", describe(placed))
        stop = threading.Event()
        reporter = threading.Thread(target=self._progress_loop, args=(stop,), daemon=True)
        try:
            self.start_master()
            prompts = [{"id": c.id, "messages": c.prompt_messages} for c in self.train_prompts]
            for gi, g in enumerate(self.cfg.topology.groups):
                mine = [p for p in placed if p.spec.group == g.name]
                runner = GroupRunner(self, gi, mine, prompts)
                runner.start_trainer()
                for p in runner.replica_pgs:
                    runner.start_replica(p)
                self.groups.append(runner)
            reporter.start()
            if self.cfg.autoscaler.enabled:
                threading.Thread(target=self._autoscale_loop, args=(stop,), daemon=True, name="autoscaler").start()
            threads = [threading.Thread(target=self._run_group, args=(g,), name=g.name) for g in self.groups]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            failed = [g.name for g in self.groups if getattr(g, "error", None)]
            if failed:
                raise RuntimeError(f"groups {failed} failed: " + "; ".join(str(g.error) for g in self.groups if g.error))
            stop.set()  # training is over: no more progress lines or scaling during evaluation
            print(self.progress(), flush=True)
            return self.finish()
        finally:
            stop.set()
            for g in self.groups:
                g.stop_event.set()
                g.stop_replicas()
                for r in g.ranks:  # before the store daemons, which their clients would miss
                    self.ray.kill(r, no_restart=True)
            self.stop_node_stores()
            if self.master is not None:
                try:
                    self.ray.get(self.master.stop.remote(), timeout=30)
                except Exception:  # noqa: BLE001
                    pass
            release(placed + [p for g in self.groups for p in g.trainer_pgs if p not in placed])
            if self.wandb is not None:
                self.wandb.finish()

    def _run_group(self, g) -> None:
        g.error = None
        try:
            g.init_model()
            g.train()
            g.stop_replicas()
            g.calibration = g.finalize()
        except Exception as e:  # noqa: BLE001 - reported by run()
            log.exception("group %s failed", g.name)
            g.error = e

    def finish(self) -> dict:
        results = {"run_dir": str(self.run_dir), "groups": {}}
        for g in self.groups:
            report = self.ray.get(g.ledger.verify_exactly_once.remote())
            log.info("[%s] exactly-once: %s", g.name, report)
            calib = g.calibration
            final = self.run_dir / ("final" if len(self.groups) == 1 else f"final-{g.name}")
            self.ray.get(g.ranks[0].export.remote(str(final), calib.get("temperatures")))
            results["groups"][g.name] = {"exactly_once": report, "steps": g.step, "final": str(final),
                                         "calibration": calib, "events": g.events}
        primary = results["groups"][self.groups[0].name]["final"]
        results["evaluation"] = self.evaluate(primary)
        results["tau"] = results["evaluation"]["tau"]
        # Final values once more, fresh for whoever looks after the job: Ray drops series that
        # nobody has set for a while, and training ended before the evaluation.
        self.progress()
        for g in self.groups:
            self._publish_train(g.name, g.last_metrics)
        self.metrics.gauge("heldout_tau", results["tau"])
        (self.run_dir / "result.json").write_text(json.dumps(results, indent=2, default=str))
        return results

    def evaluate(self, drafter: str) -> dict:
        out = self.run_dir / "eval.json"
        cmd = [sys.executable, "-m", "dspark.evaluate", "--target", self.target_path, "--drafter", drafter,
               "--prompts", str(self.run_dir / "heldout.jsonl"), "--max-new-tokens", str(self.cfg.data.eval_max_new_tokens),
               "--json", str(out)]
        if self.cfg.data.eval_limit:
            cmd += ["--limit", str(self.cfg.data.eval_limit)]
        subprocess.run(cmd, check=True, cwd=ROOT)
        res = json.loads(out.read_text())
        res.pop("requests", None)
        return res
