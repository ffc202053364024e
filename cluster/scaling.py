"""The inference/training balancing policy, pure Python (the `Autoscaler` actor and the
simulation benchmark both drive it).

Inference replicas are cheap to add or remove (the target is frozen: no weight sync), so the
split can follow measured rates. Per group we estimate
  i_g = samples/s one replica produces while busy,
  t_g = samples/s one trainer rank consumes while not waiting for data,
and choose replicas R_g and trainer ranks D_g (GPU budget Σ gpus_per_replica·R_g + D_g ≤ G,
min/max per group) maximising Σ_g min(R_g·i_g, D_g·t_g), exactly (dynamic programming). A move is proposed only when the predicted gain
exceeds `min_gain`, has been wanted continuously for the scale-up (or scale-down) delay, and
the group's cooldown has passed: measurement noise then cannot make it flap. Before the first
measurements exist, the classic rules apply: a starving trainer (data-wait fraction above the
threshold, queue near empty) adds a replica; a queue above the high watermark with idle
producers removes one.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GroupState:
    name: str
    replicas: int
    ranks: int
    min_replicas: int = 1
    max_replicas: int = 8
    min_ranks: int = 1
    max_ranks: int = 8
    # measurements (None until there are any)
    per_replica_rate: float | None = None  # samples/s per busy replica
    per_rank_rate: float | None = None  # samples/s per rank while computing
    data_wait_fraction: float = 0.0
    queue_samples: int = 0
    queue_bytes: int = 0
    high_watermark_bytes: int = 1 << 62
    producers_paused: bool = False
    # A full queue before the trainer's first step says nothing about balance (it is still
    # starting: loading, counting the draft vocabulary): no replica is removed for it.
    trainer_running: bool = True

    def throughput(self, replicas: int | None = None, ranks: int | None = None) -> float:
        r = self.replicas if replicas is None else replicas
        d = self.ranks if ranks is None else ranks
        if self.per_replica_rate is None or self.per_rank_rate is None:
            return 0.0
        return min(r * self.per_replica_rate, d * self.per_rank_rate)


@dataclass
class Decision:
    group: str
    action: str  # add_replica | remove_replica | resize_trainer | none | wait_resources
    reason: str
    target_ranks: int | None = None
    inputs: dict = field(default_factory=dict)


def best_allocation(groups: list[GroupState], gpus: int, gpus_per_replica: int) -> dict[str, tuple[int, int]]:
    """The (replicas, ranks) per group maximising total throughput within the GPU budget.

    Exact: dynamic programming over groups and GPUs used (the objective is a sum of per-group
    terms, each a min of the two sides, so greedy marginal gains get stuck: one more replica
    is worthless until the group also gets a rank, and vice versa). Among equal optima the
    allocation closest to the current one wins, so ties never cause moves.
    """
    best: dict[int, tuple[float, list[tuple[int, int]]]] = {0: (0.0, [])}
    for g in groups:
        nxt: dict[int, tuple[float, list[tuple[int, int]]]] = {}
        for used, (val, picks) in best.items():
            for r in range(g.min_replicas, g.max_replicas + 1):
                for d in range(g.min_ranks, g.max_ranks + 1):
                    cost = used + gpus_per_replica * r + d
                    if cost > gpus:
                        break
                    moves = abs(r - g.replicas) + abs(d - g.ranks)
                    v = val + g.throughput(r, d) - 1e-9 * moves
                    if cost not in nxt or v > nxt[cost][0]:
                        nxt[cost] = (v, picks + [(r, d)])
        best = nxt
    if not best:
        return {g.name: (g.replicas, g.ranks) for g in groups}
    _, picks = max(best.values(), key=lambda x: x[0])
    return {g.name: p for g, p in zip(groups, picks)}


class ScalingPolicy:
    def __init__(self, scale_up_delay_s: float = 30.0, scale_down_delay_s: float = 60.0, cooldown_s: float = 60.0,
                 starving_wait_fraction: float = 0.3, min_gain: float = 0.03, gpus_per_replica: int = 8) -> None:
        self.up_delay, self.down_delay, self.cooldown = scale_up_delay_s, scale_down_delay_s, cooldown_s
        self.starving, self.min_gain, self.gpus_per_replica = starving_wait_fraction, min_gain, gpus_per_replica
        self.wanted_since: dict[tuple[str, str], float] = {}
        self.last_action: dict[str, tuple[float, str]] = {}  # group -> (time, "up"|"down")
        self.plan: dict[str, tuple[int, int]] | None = None

    def _persisted(self, key: tuple[str, str], now: float, delay: float, active: bool) -> bool:
        if not active:
            self.wanted_since.pop(key, None)
            return False
        since = self.wanted_since.setdefault(key, now)
        return now - since >= delay

    def decide(self, groups: list[GroupState], free_gpus: int, now: float) -> list[Decision]:
        total = free_gpus + sum(self.gpus_per_replica * g.replicas + g.ranks for g in groups)
        measured = all(g.per_replica_rate and g.per_rank_rate for g in groups)
        target = {}
        value = lambda plan: sum(g.throughput(*plan[g.name]) for g in groups)  # noqa: E731
        if measured:
            # Commit to a plan and only switch when another is clearly better: re-planning from
            # noisy rates at every tick would chase near-equal optima back and forth.
            fresh = best_allocation(groups, total, self.gpus_per_replica)
            feasible = self.plan is not None and set(self.plan) == {g.name for g in groups} and sum(
                self.gpus_per_replica * r + d for r, d in self.plan.values()) <= total
            if not feasible or value(fresh) > value(self.plan) * (1 + self.min_gain):
                self.plan = fresh
            target = self.plan
        current = sum(g.throughput() for g in groups)
        planned = value(target) if target else 0.0
        worth = measured and planned > current * (1 + self.min_gain)
        out = []
        for g in groups:
            inputs = {"replicas": g.replicas, "ranks": g.ranks, "per_replica_rate": g.per_replica_rate,
                      "per_rank_rate": g.per_rank_rate, "data_wait_fraction": round(g.data_wait_fraction, 3),
                      "queue_samples": g.queue_samples, "queue_bytes": g.queue_bytes, "paused": g.producers_paused,
                      "free_gpus": free_gpus, "throughput_now": round(current, 4), "throughput_target": round(planned, 4)}
            last_t, last_dir = self.last_action.get(g.name, (-1e18, ""))
            # The direct signals always count; the measured plan adds moves that pay and vetoes
            # moves against it (e.g. no replica added to a group the plan wants smaller).
            starving = g.data_wait_fraction > self.starving and g.queue_samples <= 1
            flooded = (g.producers_paused or g.queue_bytes > g.high_watermark_bytes) and g.data_wait_fraction < 0.05 \
                and g.trainer_running
            reason_up = f"trainer starving: waits {g.data_wait_fraction:.0%} of the time, queue {g.queue_samples}"
            reason_down = "queue above the high watermark with producers idle"
            want_r, want_d = target.get(g.name, (g.replicas, g.ranks))
            up, down = starving and want_r >= g.replicas, flooded and want_r <= g.replicas
            if target and worth and want_r != g.replicas:
                up, down = want_r > g.replicas, want_r < g.replicas
                reason_up = reason_down = (f"balance: {g.replicas}->{want_r} replicas, {g.ranks}->{want_d} ranks "
                                           f"(+{planned / max(current, 1e-12) - 1:.0%} throughput)")
            go_up = self._persisted((g.name, "up"), now, self.up_delay, up)
            go_down = self._persisted((g.name, "down"), now, self.down_delay, down)
            resize = bool(target) and worth and want_d != g.ranks and self._persisted((g.name, "resize"), now, self.up_delay, True)
            if resize and want_d > g.ranks and up:  # grow replicas first, ranks after
                resize = False
            # Shrinks come first: they free the GPUs that the grows (here or elsewhere) wait for.
            if resize and want_d < g.ranks:
                action = Decision(g.name, "resize_trainer", f"balance: trainer {g.ranks}->{want_d} ranks at the next checkpoint",
                                  target_ranks=want_d, inputs=inputs)
            elif go_down and g.replicas > g.min_replicas:
                action = Decision(g.name, "remove_replica", reason_down, inputs=inputs)
            elif go_up and g.replicas < g.max_replicas:
                if free_gpus < self.gpus_per_replica:
                    action = Decision(g.name, "wait_resources",
                                      f"{reason_up}; needs {self.gpus_per_replica} free GPUs, the cluster has {free_gpus}", inputs=inputs)
                else:
                    action = Decision(g.name, "add_replica", reason_up, inputs=inputs)
            elif resize and want_d > g.ranks:
                if free_gpus < want_d - g.ranks:
                    action = Decision(g.name, "wait_resources", f"trainer {g.ranks}->{want_d} ranks needs GPUs; {free_gpus} free",
                                      target_ranks=want_d, inputs=inputs)
                else:
                    action = Decision(g.name, "resize_trainer", f"balance: trainer {g.ranks}->{want_d} ranks at the next checkpoint",
                                      target_ranks=want_d, inputs=inputs)
            else:
                action = Decision(g.name, "none", "balanced" if measured else "measuring", inputs=inputs)
            grows = action.action == "add_replica" or (action.action == "resize_trainer" and want_d > g.ranks)
            direction = "up" if grows else "down"
            # The cooldown only blocks reversals: continuing in the same direction is not flapping.
            if action.action in ("add_replica", "remove_replica", "resize_trainer") and direction != last_dir \
                    and now - last_t < self.cooldown:
                action = Decision(g.name, "none", f"cooldown ({direction} right after {last_dir})", inputs=inputs)
            if action.action in ("add_replica", "remove_replica", "resize_trainer"):
                free_gpus -= self.gpus_per_replica if action.action == "add_replica" else max(0, (want_d or 0) - g.ranks) if grows else 0
            out.append(action)
        return out

    def applied(self, group: str, now: float, direction: str) -> None:
        self.last_action[group] = (now, direction)
        for key in [k for k in self.wanted_since if k[0] == group]:
            del self.wanted_since[key]
