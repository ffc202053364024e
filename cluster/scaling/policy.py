"""The inference/training balancing policy, pure Python (the `Autoscaler` actor and the
simulation benchmark both drive it).

Inference replicas are cheap to add or remove (the target is frozen: no weight sync), so the
split can follow measured rates. Every group's trainer ranks belong to one data-parallel world
that trains one drafter, and a rank whose own group has nothing ready borrows from a group whose
queue is deep, so training capacity is pooled while production is per group. We estimate
  i_g = samples/s one replica of group g produces while busy,
  t   = samples/s one trainer rank of the world consumes while not waiting for data,
and choose replicas R_g and trainer ranks D_g (GPU budget Σ gpus_per_replica·R_g + Σ D_g ≤ G,
min/max per group) maximising the pooled throughput min(Σ_g R_g·i_g, t·Σ_g D_g), exactly
(a knapsack over replicas, then the rank count that the production needs). The world's ranks
are spread over the groups in proportion to what each produces, so most samples are trained
where they were stored (the bytes stay inside the group's nodes); a redistribution alone is
never worth a resize. A move is proposed only when the predicted gain exceeds `min_gain`, has
been wanted continuously for the scale-up (or scale-down) delay, and the group's cooldown has
passed: measurement noise then cannot make it flap. Before the first measurements exist, the
classic rules apply: a starving trainer (data-wait fraction above the threshold, the group's
queue near empty) adds a replica; a queue above the high watermark with idle producers removes
one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace


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

    @property
    def production(self) -> float:
        return self.replicas * (self.per_replica_rate or 0.0)


def rank_rate(groups: list[GroupState]) -> float | None:
    """Samples/s per rank of the shared world (every group reports the world's figure)."""
    rates = [g.per_rank_rate for g in groups if g.per_rank_rate]
    return sum(rates) / len(rates) if rates else None


def pooled_throughput(groups: list[GroupState], plan: dict[str, tuple[int, int]] | None = None) -> float:
    """Samples/s the job trains with `plan` (replicas, ranks) per group (default: as they are):
    what the groups produce, up to what the world's ranks can train."""
    t = rank_rate(groups)
    if t is None or any(g.per_replica_rate is None for g in groups):
        return 0.0
    plan = plan or {g.name: (g.replicas, g.ranks) for g in groups}
    produced = sum(plan[g.name][0] * g.per_replica_rate for g in groups)
    return min(produced, t * sum(plan[g.name][1] for g in groups))


@dataclass
class Decision:
    group: str
    action: str  # add_replica | remove_replica | resize_trainer | none | wait_resources
    reason: str
    target_ranks: int | None = None
    inputs: dict = field(default_factory=dict)


def best_allocation(groups: list[GroupState], gpus: int, gpus_per_replica: int) -> dict[str, tuple[int, int]]:
    """The (replicas, ranks) per group maximising pooled throughput within the GPU budget.

    Exact: for every total replica count, the most productive way to place those replicas
    (dynamic programming over groups; among equals the one closest to the current split); then
    as many world ranks as that production needs, within the rank bounds and the GPUs left
    (more would idle; when fewer cannot reach the optimum, the current count is kept); the
    best total wins. Ranks are spread over groups in proportion to their production.
    """
    t = rank_rate(groups)
    if t is None or any(g.per_replica_rate is None for g in groups):
        return {g.name: (g.replicas, g.ranks) for g in groups}
    # replicas used -> (production, -moves, picks)
    best: dict[int, tuple[float, int, list[int]]] = {0: (0.0, 0, [])}
    for g in groups:
        nxt: dict[int, tuple[float, int, list[int]]] = {}
        for used, (prod, neg_moves, picks) in best.items():
            for r in range(g.min_replicas, g.max_replicas + 1):
                cand = (prod + r * g.per_replica_rate, neg_moves - abs(r - g.replicas), picks + [r])
                if used + r not in nxt or cand[:2] > nxt[used + r][:2]:
                    nxt[used + r] = cand
        best = nxt
    lo, hi_ranks = sum(g.min_ranks for g in groups), sum(g.max_ranks for g in groups)
    now_ranks = sum(g.ranks for g in groups)
    choice, choice_key = None, None
    for n, (prod, neg_moves, picks) in best.items():
        hi = min(hi_ranks, gpus - gpus_per_replica * n)
        if hi < lo:
            continue
        need = min(max(lo, math.ceil(prod / t - 1e-9)), hi)
        ranks = need if now_ranks < need or now_ranks > hi else now_ranks  # equal value: fewer moves
        value = min(prod, t * ranks)
        key = (round(value, 9), neg_moves - abs(ranks - now_ranks))
        if choice_key is None or key > choice_key:
            choice, choice_key = (picks, ranks), key
    if choice is None:
        return {g.name: (g.replicas, g.ranks) for g in groups}
    picks, ranks = choice
    spread = spread_ranks(groups, picks, ranks)
    return {g.name: (r, d) for g, r, d in zip(groups, picks, spread)}


def spread_ranks(groups: list[GroupState], replicas: list[int], total: int) -> list[int]:
    """`total` ranks over the groups, changed one rank at a time from how they are now (each
    change restarts the world, so none is made for locality alone): a rank added goes to the
    group whose production has the fewest ranks per sample, a rank removed comes from the one
    with the most, within each group's bounds."""
    share = [max(r * (g.per_replica_rate or 0.0), 1e-12) for g, r in zip(groups, replicas)]
    out = [min(max(g.ranks, g.min_ranks), g.max_ranks) for g in groups]
    while sum(out) < total:
        open_ = [i for i, g in enumerate(groups) if out[i] < g.max_ranks]
        if not open_:
            break
        out[max(open_, key=lambda k: (share[k] / (out[k] + 1), -k))] += 1
    while sum(out) > total:
        open_ = [i for i, g in enumerate(groups) if out[i] > g.min_ranks]
        if not open_:
            break
        out[min(open_, key=lambda k: (share[k] / out[k], k))] -= 1
    return out


class ScalingPolicy:
    def __init__(
        self,
        scale_up_delay_s: float = 30.0,
        scale_down_delay_s: float = 60.0,
        cooldown_s: float = 60.0,
        starving_wait_fraction: float = 0.3,
        min_gain: float = 0.03,
        gpus_per_replica: int = 8,
        smoothing: float = 0.3,
    ) -> None:
        self.up_delay, self.down_delay, self.cooldown = scale_up_delay_s, scale_down_delay_s, cooldown_s
        self.starving, self.min_gain, self.gpus_per_replica = starving_wait_fraction, min_gain, gpus_per_replica
        # Rates are exponentially smoothed before planning (weight of the newest measurement):
        # each is a short window's, and the pooled objective is a min of sums of them, so raw
        # noise alone would often look like a gain of a few percent.
        self.smoothing = smoothing
        self.ema: dict[tuple[str, str], float] = {}
        self.wanted_since: dict[tuple[str, str], float] = {}
        self.last_action: dict[str, tuple[float, str]] = {}  # group -> (time, "up"|"down")
        self.plan: dict[str, tuple[int, int]] | None = None

    def _persisted(self, key: tuple[str, str], now: float, delay: float, active: bool) -> bool:
        if not active:
            self.wanted_since.pop(key, None)
            return False
        since = self.wanted_since.setdefault(key, now)
        return now - since >= delay

    def _smoothed(self, g: GroupState) -> GroupState:
        rates = {}
        for key in ("per_replica_rate", "per_rank_rate"):
            x = getattr(g, key)
            if x is not None:
                old = self.ema.get((g.name, key))
                self.ema[(g.name, key)] = x if old is None else old + self.smoothing * (x - old)
            rates[key] = self.ema.get((g.name, key))
        return replace(g, **rates)

    def decide(self, groups: list[GroupState], free_gpus: float, now: float) -> list[Decision]:
        groups = [self._smoothed(g) for g in groups]
        free_gpus = int(free_gpus)  # Ray reports resources as floats; budgets are whole GPUs
        total = free_gpus + sum(self.gpus_per_replica * g.replicas + g.ranks for g in groups)
        measured = all(g.per_replica_rate and g.per_rank_rate for g in groups)
        target = {}
        value = lambda plan: pooled_throughput(groups, plan)  # noqa: E731
        if measured:
            # Commit to a plan and only switch when another is clearly better: re-planning from
            # noisy rates at every tick would chase near-equal optima back and forth.
            fresh = best_allocation(groups, total, self.gpus_per_replica)
            feasible = (
                self.plan is not None
                and set(self.plan) == {g.name for g in groups}
                and sum(self.gpus_per_replica * r + d for r, d in self.plan.values()) <= total
            )
            if not feasible or value(fresh) > value(self.plan) * (1 + self.min_gain):
                self.plan = fresh
            target = self.plan
        current = pooled_throughput(groups)
        planned = value(target) if target else 0.0
        worth = measured and planned > current * (1 + self.min_gain)
        out = []
        for g in groups:
            inputs = {
                "replicas": g.replicas,
                "ranks": g.ranks,
                "per_replica_rate": g.per_replica_rate,
                "per_rank_rate": g.per_rank_rate,
                "data_wait_fraction": round(g.data_wait_fraction, 3),
                "queue_samples": g.queue_samples,
                "queue_bytes": g.queue_bytes,
                "paused": g.producers_paused,
                "free_gpus": free_gpus,
                "throughput_now": round(current, 4),
                "throughput_target": round(planned, 4),
            }
            # The direct signals always count; the measured plan adds moves that pay and vetoes
            # moves against it (e.g. no replica added to a group the plan wants smaller).
            starving = g.data_wait_fraction > self.starving and g.queue_samples <= 1
            flooded = (
                (g.producers_paused or g.queue_bytes > g.high_watermark_bytes)
                and g.data_wait_fraction < 0.05
                and g.trainer_running
            )
            reason_up = f"trainer starving: waits {g.data_wait_fraction:.0%} of the time, queue {g.queue_samples}"
            reason_down = "queue above the high watermark with producers idle"
            want_r, want_d = target.get(g.name, (g.replicas, g.ranks))
            up, down = starving and want_r >= g.replicas, flooded and want_r <= g.replicas
            if target and worth and want_r != g.replicas:
                up, down = want_r > g.replicas, want_r < g.replicas
                reason_up = reason_down = (
                    f"balance: {g.replicas}->{want_r} replicas, {g.ranks}->{want_d} ranks "
                    f"(+{planned / max(current, 1e-12) - 1:.0%} throughput)"
                )
            go_up = self._persisted((g.name, "up"), now, self.up_delay, up)
            go_down = self._persisted((g.name, "down"), now, self.down_delay, down)
            if go_down and g.replicas > g.min_replicas:
                action = Decision(g.name, "remove_replica", reason_down, inputs=inputs)
            elif go_up and g.replicas < g.max_replicas:
                if free_gpus < self.gpus_per_replica:
                    action = Decision(
                        g.name,
                        "wait_resources",
                        f"{reason_up}; needs {self.gpus_per_replica} free GPUs, the cluster has {free_gpus}",
                        inputs=inputs,
                    )
                else:
                    action = Decision(g.name, "add_replica", reason_up, inputs=inputs)
            else:
                action = Decision(g.name, "none", "balanced" if measured else "measuring", inputs=inputs)
            action = self._cooldown(action, now)
            if action.action == "add_replica":
                free_gpus -= self.gpus_per_replica
            out.append(action)
        return self._world_resize(groups, target if worth else {}, out, free_gpus, now)

    def _cooldown(self, action: Decision, now: float) -> Decision:
        """The cooldown only blocks reversals: continuing in the same direction is not flapping."""
        if action.action not in ("add_replica", "remove_replica", "resize_trainer"):
            return action
        last_t, last_dir = self.last_action.get(action.group, (-1e18, ""))
        grows = action.action == "add_replica" or (
            action.action == "resize_trainer" and action.target_ranks > action.inputs["ranks"]
        )
        direction = "up" if grows else "down"
        if direction != last_dir and now - last_t < self.cooldown:
            return Decision(
                action.group, "none", f"cooldown ({direction} right after {last_dir})", inputs=action.inputs
            )
        return action

    def _world_resize(
        self, groups: list[GroupState], target: dict, out: list[Decision], free_gpus: int, now: float
    ) -> list[Decision]:
        """The trainer world changes size as one decision (one restart at the next checkpoint):
        a resize_trainer for every group whose ranks change, all in the same round. A shrink goes
        first (it frees the GPUs that the plan's new replicas wait for); a growth waits until no
        replica is being added or removed in the round (replicas first, ranks after)."""
        changes = {g.name: target[g.name][1] for g in groups if target and target[g.name][1] != g.ranks}
        if not self._persisted(("*", "resize"), now, self.up_delay, bool(changes)):
            return out
        now_ranks = {g.name: g.ranks for g in groups}
        grow = sum(changes.values()) > sum(now_ranks[k] for k in changes)
        if grow and any(d.action in ("add_replica", "remove_replica") for d in out):
            return out
        resized = []
        for d in out:
            if d.group not in changes:
                resized.append(d)
                continue
            want, inputs = changes[d.group], d.inputs
            reason = f"balance: trainer {now_ranks[d.group]}->{want} ranks at the next checkpoint"
            if grow and free_gpus < sum(changes.values()) - sum(now_ranks[k] for k in changes):
                resized.append(
                    Decision(
                        d.group,
                        "wait_resources",
                        f"{reason}; needs GPUs, {free_gpus} free",
                        target_ranks=want,
                        inputs=inputs,
                    )
                )
            else:
                resized.append(
                    self._cooldown(Decision(d.group, "resize_trainer", reason, target_ranks=want, inputs=inputs), now)
                )
        if any(d.action == "none" and d.group in changes for d in resized):  # one group in its cooldown holds the world
            return out
        return resized

    def applied(self, group: str, now: float, direction: str) -> None:
        self.last_action[group] = (now, direction)
        for key in [k for k in self.wanted_since if k[0] == group]:
            del self.wanted_since[key]
