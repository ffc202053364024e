"""The autoscaler: `Autoscaler`, the Ray actor that decides, and `AutoscaleLoop`, the driver
thread that feeds it and applies its decisions.

Every interval the loop sends the actor each group's signals (its replicas' rate and queue
depth; the trainer world's rate per rank and data-wait fraction; producers paused) and the free
capacity; the actor answers with decisions from `ScalingPolicy`, logs each with its inputs and
exports the state as metrics (replicas and trainer ranks per group, last decision and its
reason). The loop applies them: replicas are added to or drained from a group's `ReplicaPool`
at once; trainer resizes go to the training loop through the `ControlChannel` (the world is
restarted there, at a checkpoint, all groups together); when the cluster has no room it asks
Ray's cluster autoscaler for the resources. It reports back what it did (`applied`).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict

from cluster.config import AutoscalerConfig
from cluster.metrics import Metrics
from cluster.scaling.policy import Decision, GroupState, ScalingPolicy

log = logging.getLogger("dspark.autoscaler")
ACTIONS = {"none": 0, "measuring": 0, "add_replica": 1, "remove_replica": -1, "resize_trainer": 2, "wait_resources": 3}


class Autoscaler:
    def __init__(self, cfg: AutoscalerConfig, run_name: str, units_per_replica: float, metrics_backend=None) -> None:
        self.policy = ScalingPolicy(
            cfg.scale_up_delay_s,
            cfg.scale_down_delay_s,
            cfg.cooldown_s,
            cfg.starving_wait_fraction,
            cfg.min_gain,
            units_per_replica,
        )
        self.metrics = Metrics(tags={"run": run_name}, backend=metrics_backend)
        self.history: list[dict] = []

    def decide(self, states: list[GroupState], free_units: float, now: float | None = None) -> list[Decision]:
        now = time.monotonic() if now is None else now
        decisions = self.policy.decide(states, free_units, now)
        for s, d in zip(states, decisions):
            self.metrics.gauge("autoscaler_replicas", s.replicas, group=s.name)
            self.metrics.gauge("autoscaler_trainer_ranks", s.ranks, group=s.name)
            self.metrics.gauge("autoscaler_last_decision", ACTIONS.get(d.action, 0), group=s.name)
            if d.action != "none":
                self.history.append({"time": now, **asdict(d)})
                log.info("[%s] %s: %s | inputs %s", d.group, d.action, d.reason, d.inputs)
        return decisions

    def applied(self, group: str, action: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.policy.applied(group, now, "up" if action in ("add_replica", "grow_trainer") else "down")
        self.metrics.count("autoscaler_actions", 1, group=group, action=action)
        self.history.append({"time": now, "group": group, "action": f"applied:{action}"})

    def decisions(self) -> list[dict]:
        return list(self.history)


class AutoscaleLoop:
    """Driver side of the autoscaler (a thread beside the training loop)."""

    def __init__(self, cfg, pools: dict, ledger, stats, control, watermarks: dict[str, tuple[int, int]]) -> None:
        import ray

        self.ray, self.cfg, self.pools, self.ledger, self.stats, self.control = ray, cfg, pools, ledger, stats, control
        self.watermarks = watermarks  # the ledger's (cluster.scaling.capacity.group_watermarks)
        a = cfg.autoscaler
        gpu = any(g.gpus_per_node for g in cfg.topology.groups)
        self.unit = "GPU" if gpu else "CPU"
        per_replica = cfg.target.tensor_parallel_size if gpu else cfg.topology.groups[0].cpus_per_replica
        self.actor = (
            ray.remote(num_cpus=0)(Autoscaler)
            .options(name=f"autoscaler-{cfg.run_name}")
            .remote(a, cfg.run_name, per_replica)
        )
        self.window: dict = {}
        self.resize_seq = 0  # the last resize request sent to the training loop

    def signals(self) -> list[GroupState]:
        """Per group: its replicas' rate per busy replica and its queue; the world's rate per
        rank and data-wait fraction (the same for every group: they share one trainer), all
        over the window since the last call."""
        c = self.ledger.counts()
        s, w, now = self.stats, self.window, time.monotonic()
        trained = c.trained_samples + c.leased
        d_trained, d_train = trained - w.get("trained", 0), s.train_s - w.get("train_s", 0.0)
        d_wait, d_time = s.data_wait_s - w.get("wait_s", 0.0), now - w.get("t", now)
        w.update(trained=trained, train_s=s.train_s, wait_s=s.data_wait_s, t=now)
        per_rank = d_trained / (d_train * s.ranks) if d_train > 0 and d_trained > 0 and s.ranks else None
        out = []
        marks = self.watermarks
        for g in self.cfg.topology.groups:
            replicas = self.pools[g.name].stats()
            produced = sum(x.get("prompts", 0) for x in replicas)
            busy = sum(x.get("seconds", 0.0) for x in replicas)
            d_prod, d_busy = produced - w.get(("produced", g.name), 0), busy - w.get(("busy", g.name), 0.0)
            w[("produced", g.name)], w[("busy", g.name)] = produced, busy
            mine = c.group(g.name)
            lo, hi = g.trainer_rank_bounds()
            out.append(
                GroupState(
                    g.name,
                    len(self.pools[g.name]),
                    s.layout.get(g.name, 0),
                    g.min_replicas,
                    g.max_replicas,
                    lo,
                    hi,
                    per_replica_rate=d_prod / d_busy if d_busy > 0 and d_prod > 0 else None,
                    per_rank_rate=per_rank,
                    data_wait_fraction=min(1.0, d_wait / d_time) if d_time > 0 else 0.0,
                    queue_samples=mine.stored,
                    queue_bytes=mine.queued_bytes,
                    high_watermark_bytes=marks[g.name][0],
                    producers_paused=mine.paused,
                    trainer_running=s.train_s > 0,
                )
            )
        return out

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(self.cfg.autoscaler.interval_s):
            try:
                self.round()
            except Exception as e:  # noqa: BLE001 - scaling must never kill training
                log.warning("autoscaler round failed: %r", e)

    def round(self) -> None:
        from cluster.control import ResizeTrainer
        from cluster.scaling.placement import PlacementError

        if self.stats.resize_seq_handled < self.resize_seq:
            return  # a world resize is under way: every rate the actor would see is stale
        signals = self.signals()
        free = self.ray.available_resources().get(self.unit, 0.0)
        applied, resize = [], {}
        for d in self.ray.get(self.actor.decide.remote(signals, free), timeout=30):
            pool = self.pools[d.group]
            if d.action in ("add_replica", "remove_replica"):
                try:
                    rid = pool.add() if d.action == "add_replica" else pool.remove()
                except PlacementError as e:
                    self.request_resources(d.group, str(e))
                    continue
                if rid is not None:  # (None: the pool is at its floor, or stopping)
                    done = "added" if d.action == "add_replica" else "removed"
                    print(f"[autoscaler] {d.group}: {done} replica {rid} ({d.reason})", flush=True)
                    applied.append((d.group, d.action))
            elif d.action == "wait_resources":
                self.request_resources(d.group, d.reason, d.target_ranks)
            elif d.action == "resize_trainer":
                now = self.stats.layout.get(d.group, 0)
                resize[d.group] = d.target_ranks
                print(
                    f"[autoscaler] {d.group}: trainer {now}->{d.target_ranks} ranks at the next checkpoint "
                    f"({d.reason})",
                    flush=True,
                )
                applied.append((d.group, "grow_trainer" if d.target_ranks > now else "shrink_trainer"))
        if resize:  # the round's groups in one request: one world restart
            self.resize_seq += 1
            self.control.send(ResizeTrainer(resize, "autoscaler", self.resize_seq))
        for group, action in applied:
            self.ray.get(self.actor.applied.remote(group, action), timeout=30)

    def request_resources(self, group: str, reason: str, trainer_ranks: int | None = None) -> None:
        """Ask Ray's cluster autoscaler for room for `group` with one more replica, or with
        `trainer_ranks` trainer ranks; the other groups as they are."""
        from ray.autoscaler.sdk import request_resources

        from cluster.scaling.placement import cluster_request

        shapes = {g.name: (len(self.pools[g.name]), self.stats.layout.get(g.name, 0)) for g in self.cfg.topology.groups}
        r, d = shapes[group]
        shapes[group] = (r, trainer_ranks) if trainer_ranks else (r + 1, d)
        request_resources(bundles=cluster_request(self.cfg, list(shapes.values())))
        print(f"[autoscaler] {group}: waiting for resources ({reason}); asked Ray's cluster autoscaler", flush=True)

    def decisions(self) -> list[dict]:
        return self.ray.get(self.actor.decisions.remote(), timeout=30)
