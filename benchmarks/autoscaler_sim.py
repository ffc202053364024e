"""Autoscaler simulation (no Ray): a 12-node, 4-group cluster with Kimi-K3-like rates.

    python benchmarks/autoscaler_sim.py [--hours 6] [--seed 0]

Cluster: 12 GB300 nodes × 4 GPUs = 48 GPUs. An inference replica is TP-8 over two nodes
(8 GPUs); a trainer rank is one GPU (data parallel, resized only at checkpoints, every 10 min).
Start: the production split, 1 replica + 4 trainer ranks per group (all 48 GPUs).

Rates (stated, Kimi-K3-like, per TP-8 replica at batch ~256 on GB300 with FP8 KV):
  decode 6,000 generated tokens/s, prefill 40,000 prompt tokens/s;
  trainer (5-layer drafter, hidden 7,168, 512 anchors × block 8, target logits recomputed over a
  160K vocabulary): 12,000 sequence tokens/s per GPU.
Groups differ in their data (prompt, response tokens): (3000, 800), (1500, 1200), (600, 1500), (4000, 400).
At half time every response gets twice as long (a new data mix): inference per sample roughly
doubles while training per sample grows less, so the right split moves.
Adding a replica takes 6 min (loading 2.8T weights); removing one drains for 1 min.
Measurements carry ±5% noise. The autoscaler runs every 30 s with the production defaults.

Baseline: the best *static* split for the whole run, found by exact search (dynamic
programming over the GPU budget, i.e. exhaustive over all feasible splits).
Reported: sustained training throughput (samples/s, whole run), time to converge (to within 5%
of the phase optimum) at start and after the shift, scaling actions and direction reversals.
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.scaling import GroupState, ScalingPolicy  # noqa: E402

GPUS, PER_REPLICA = 48, 8
DECODE, PREFILL, TRAIN = 6000.0, 40000.0, 8000.0
MIX = [(3000, 800), (1500, 1200), (600, 1500), (4000, 400)]


def rates(prompt: int, response: int) -> tuple[float, float]:
    """(samples/s per replica, samples/s per trainer GPU)."""
    return 1.0 / (response / DECODE + prompt / PREFILL), TRAIN / (prompt + response)


def phase_rates(shifted: bool):
    return [rates(p, r * (2 if shifted else 1)) for p, r in MIX]


def best_static(weights: list[float], phase_list: list[list[tuple[float, float]]]) -> tuple[float, list[tuple[int, int]]]:
    """Exact best static split: DP over groups and GPU budget of phase-weighted throughput."""
    best = {0: (0.0, [])}  # gpus used -> (value, splits)
    for g in range(len(MIX)):
        nxt = {}
        for used, (val, splits) in best.items():
            for r in range(1, GPUS // PER_REPLICA + 1):
                for d in range(1, GPUS + 1):
                    cost = used + PER_REPLICA * r + d
                    if cost > GPUS:
                        break
                    v = val + sum(w * min(r * ph[g][0], d * ph[g][1]) for w, ph in zip(weights, phase_list))
                    if cost not in nxt or nxt[cost][0] < v:
                        nxt[cost] = (v, splits + [(r, d)])
        best = nxt
    return max(best.values(), key=lambda x: x[0])


def phase_optimum(ph) -> float:
    return best_static([1.0], [ph])[0]


@dataclass
class Group:
    replicas: int = 1
    ranks: int = 4
    starting: list = None  # ready times of replicas being added
    pending_ranks: int | None = None
    queue: float = 0.0
    produced: float = 0.0
    trained: float = 0.0
    busy_rep_s: float = 0.0
    compute_s: float = 0.0
    wait_s: float = 0.0
    actions: int = 0
    directions: list = None


def simulate(hours: float, seed: int, dt: float = 10.0, interval: float = 30.0):
    rng = random.Random(seed)
    total_s = hours * 3600
    groups = [Group(starting=[], directions=[]) for _ in MIX]
    policy = ScalingPolicy(scale_up_delay_s=120, scale_down_delay_s=300, cooldown_s=600, min_gain=0.05,
                           gpus_per_replica=PER_REPLICA)
    high = 4000.0  # samples: the store's high watermark
    t, next_decide, next_ckpt = 0.0, interval, 600.0
    series = []
    window = {i: [0.0, 0.0, 0.0, 0.0] for i in range(len(MIX))}  # produced, busy, trained, compute since last decision
    log = []
    while t < total_s:
        ph = phase_rates(t >= total_s / 2)
        for i, g in enumerate(groups):
            g.replicas += sum(1 for ready in g.starting if ready <= t)
            g.starting = [ready for ready in g.starting if ready > t]
            i_rate, t_rate = ph[i]
            paused = g.queue >= high
            prod = 0.0 if paused else g.replicas * i_rate * dt
            cap = g.ranks * t_rate * dt
            take = min(cap, g.queue + prod)
            g.queue += prod - take
            g.produced += prod
            g.trained += take
            busy = 0.0 if paused else g.replicas * dt
            compute = take / t_rate if t_rate else 0.0  # rank-seconds spent computing
            g.busy_rep_s += busy
            g.compute_s += compute
            g.wait_s += g.ranks * dt - compute
            w = window[i]
            w[0] += prod; w[1] += busy; w[2] += take; w[3] += compute
        series.append((t, sum(g.trained for g in groups)))
        if t >= next_ckpt:
            next_ckpt += 600.0
            for g in groups:
                if g.pending_ranks is not None:
                    g.ranks, g.pending_ranks = g.pending_ranks, None
        if t >= next_decide:
            next_decide += interval
            states = []
            for i, g in enumerate(groups):
                w = window[i]
                noise = lambda: 1 + rng.uniform(-0.05, 0.05)  # noqa: E731
                states.append(GroupState(  # report committed sizes: pending resizes count as done
                    f"g{i}", g.replicas + len(g.starting), g.pending_ranks or g.ranks, 1, 5, 1, 40,
                    per_replica_rate=(w[0] / w[1]) * noise() if w[1] else None,
                    per_rank_rate=(w[2] / w[3]) * noise() if w[3] else None,
                    data_wait_fraction=1 - w[3] / (g.ranks * interval) if g.ranks else 0.0,
                    queue_samples=int(g.queue), queue_bytes=int(g.queue), high_watermark_bytes=int(high),
                    producers_paused=g.queue >= high,
                ))
                window[i] = [0.0, 0.0, 0.0, 0.0]
            used = sum(PER_REPLICA * (g.replicas + len(g.starting)) + (g.pending_ranks or g.ranks) for g in groups)
            free = GPUS - used
            for d in policy.decide(states, free, t):
                i = int(d.group[1:])
                g = groups[i]
                if d.action == "add_replica" and free >= PER_REPLICA:
                    g.starting.append(t + 360.0)
                    free -= PER_REPLICA
                elif d.action == "remove_replica" and g.replicas > 1:
                    g.replicas -= 1
                    free += PER_REPLICA  # drains for a minute: the GPUs come back after it
                elif d.action == "resize_trainer" and d.target_ranks is not None:
                    grow = d.target_ranks - g.ranks
                    if grow <= free:
                        g.pending_ranks = d.target_ranks
                        free -= max(grow, 0)
                    else:
                        continue
                else:
                    continue
                g.actions += 1
                direction = "up" if d.action == "add_replica" or (d.action == "resize_trainer" and d.target_ranks > g.ranks) else "down"
                g.directions.append((direction, d.action, t >= total_s / 2))
                policy.applied(d.group, t, direction)
                log.append((t, d.group, d.action, d.reason))
        t += dt
    return groups, series, log


def converge_time(series, start, end, target, dt=10.0, window_s=600.0):
    """First time after `start` from which the trailing-window throughput stays within 5% of target."""
    pts = [(t, v) for t, v in series if start <= t < end]
    rates = []
    for (t0, v0), (t1, v1) in zip(pts, pts[1:]):
        rates.append((t1, (v1 - v0) / (t1 - t0)))
    k = int(window_s / dt)
    ok_from = None
    for j in range(len(rates)):
        lo = max(0, j - k)
        avg = sum(r for _, r in rates[lo : j + 1]) / (j + 1 - lo)
        if avg >= 0.95 * target:
            ok_from = ok_from if ok_from is not None else rates[j][0]
        else:
            ok_from = None
    return None if ok_from is None else ok_from - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hours", type=float, default=6.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    before, after = phase_rates(False), phase_rates(True)
    static_val, static_split = best_static([0.5, 0.5], [before, after])
    opt1, opt2 = phase_optimum(before), phase_optimum(after)
    groups, series, log = simulate(args.hours, args.seed)
    total = args.hours * 3600
    auto = series[-1][1] / total
    print("rates (samples/s): per replica / per trainer GPU, before -> after the shift")
    for i, ((a, b), (c, d)) in enumerate(zip(before, after)):
        print(f"  g{i} prompt {MIX[i][0]:5d} response {MIX[i][1]:5d}->{2 * MIX[i][1]:5d}: replica {a:5.2f} -> {c:5.2f}   rank {b:5.2f} -> {d:5.2f}")
    prod = sum(min(1 * r, 4 * t) for r, t in before) * 0.5 + sum(min(1 * r, 4 * t) for r, t in after) * 0.5
    print(f"\nproduction split (1 replica + 4 ranks per group), static: {prod:6.2f} samples/s")
    print(f"best static split (exact search): {static_val:6.2f} samples/s  {static_split}")
    print(f"autoscaled:                        {auto:6.2f} samples/s  = {auto / static_val:.1%} of the best static split")
    print(f"phase optima: {opt1:.2f} (first half), {opt2:.2f} (second half)")
    c1 = converge_time(series, 0, total / 2, opt1)
    c2 = converge_time(series, total / 2, total, opt2)
    fmt = lambda c: "not reached" if c is None else f"{c / 60:.0f} min"  # noqa: E731
    print(f"time to converge (within 5% of the phase optimum): start {fmt(c1)}, after the shift {fmt(c2)}")
    for i, g in enumerate(groups):
        flaps = 0
        for half in (False, True):  # reversals within a phase are flapping; across the shift, adaptation
            dirs = [d for d, _, h in g.directions if h == half]
            flaps += sum(1 for a, b in zip(dirs, dirs[1:]) if a != b)
        print(f"  g{i}: final {g.replicas} replicas + {g.ranks} ranks, {g.actions} actions, {flaps} reversals within a phase")
    print("\nfirst decisions:")
    for t, grp, action, reason in log[:12]:
        print(f"  t={t / 60:6.1f} min {grp} {action:15s} {reason}")


if __name__ == "__main__":
    main()
