"""`Autoscaler`: the Ray actor that decides how each group splits inference and training.

Every interval the job's driver sends it each group's signals (rates, queue depth, trainer
data-wait fraction, producers paused) and the free capacity; it answers with decisions from
`ScalingPolicy`, logs each with its inputs and exports the state as metrics (replicas and
trainer ranks per group, last decision and its reason). The driver owns the groups' actors,
so it applies the decisions and reports back what it did (`applied`), or that the cluster had
no room (then it has asked Ray's cluster autoscaler for the resources and waits).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict

from cluster.metrics import Metrics
from cluster.scaling import GroupState, ScalingPolicy

log = logging.getLogger("dspark.autoscaler")
ACTIONS = {"none": 0, "measuring": 0, "add_replica": 1, "remove_replica": -1, "resize_trainer": 2, "wait_resources": 3}


class Autoscaler:
    def __init__(self, cfg: dict, run_name: str, units_per_replica: float, metrics_backend=None) -> None:
        self.policy = ScalingPolicy(cfg["scale_up_delay_s"], cfg["scale_down_delay_s"], cfg["cooldown_s"],
                                    cfg["starving_wait_fraction"], cfg["min_gain"], units_per_replica)
        self.metrics = Metrics(tags={"run": run_name}, backend=metrics_backend)
        self.history: list[dict] = []

    def decide(self, signals: list[dict], free_units: float, now: float | None = None) -> list[dict]:
        now = time.monotonic() if now is None else now
        states = [GroupState(**s) for s in signals]
        decisions = self.policy.decide(states, free_units, now)
        out = []
        for s, d in zip(states, decisions):
            self.metrics.gauge("autoscaler_replicas", s.replicas, group=s.name)
            self.metrics.gauge("autoscaler_trainer_ranks", s.ranks, group=s.name)
            self.metrics.gauge("autoscaler_last_decision", ACTIONS.get(d.action, 0), group=s.name)
            row = {"time": now, **asdict(d)}
            if d.action != "none":
                self.history.append(row)
                log.info("[%s] %s: %s | inputs %s", d.group, d.action, d.reason, d.inputs)
            out.append(row)
        return out

    def applied(self, group: str, action: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.policy.applied(group, now, "up" if action in ("add_replica", "grow_trainer") else "down")
        self.metrics.count("autoscaler_actions", 1, group=group, action=action)
        self.history.append({"time": now, "group": group, "action": f"applied:{action}"})

    def decisions(self) -> list[dict]:
        return list(self.history)
