"""Autoscaler simulation (no Ray): a 12-node, 4-group cluster training one drafter, with
Kimi-K3-like rates.

    python benchmarks/autoscaler_sim.py [--hours 6] [--seed 0]

Cluster: 12 GB300 nodes × 4 GPUs = 48 GPUs. An inference replica is TP-8 over two nodes
(8 GPUs); a trainer rank is one GPU. Every group's ranks belong to one data-parallel world (one
drafter), resized only at checkpoints (every 10 min), all groups together. Start: the
production split, 1 replica + 4 trainer ranks per group (all 48 GPUs).

What the job does, modelled: each group's replicas take prompts from the one ledger and store
answers in their own group's queue (producers pause at the high watermark); each rank trains
its own group's samples first, and a rank whose group has nothing ready borrows from a group
whose queue is above its low watermark (a *crossed* sample: its bytes cross the network).
Lockstep steps are modelled as per-tick capacity: what a rank cannot fill is lost.

Rates (stated, Kimi-K3-like, per TP-8 replica at batch ~256 on GB300 with FP8 KV):
  decode 6,000 generated tokens/s, prefill 40,000 prompt tokens/s;
  trainer (5-layer drafter, hidden 7,168, 512 anchors × block 8, target logits recomputed over a
  160K vocabulary): 8,000 sequence tokens/s per GPU.
The prompts are shared (one ledger), so all groups see the same data: 2,000 prompt tokens and
600 answer tokens per sample; at half time the answers grow 4× (a shift to reasoning traces), so
inference per sample more than triples while training per sample grows 1.7×: the right split
moves. The sets differ in hardware: g2's replica runs on an older node generation (0.75× the
decode and prefill rates), g3's on a faster one (1.3×). Adding a replica takes 6 min (loading
2.8T weights); removing one drains for 1 min. Measurements carry ±5% noise. The autoscaler
runs every 30 s with the production defaults.

Baseline: the best *static* split for the whole run, by exact search over every feasible
split (replicas per group, world size) of the pooled throughput min(Σ production, ranks × rate
per rank), phase-weighted; an upper bound for a static split in this model (it assumes
perfect borrowing). Reported: sustained training throughput (samples/s, whole run) against
it, time to converge (within 5% of the phase optimum) at start and after the shift, scaling
actions and direction reversals, and the fraction of samples trained by another group's rank.
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.scaling import GroupState, ScalingPolicy  # noqa: E402

GPUS, PER_REPLICA, GROUPS = 48, 8, 4
DECODE, PREFILL, TRAIN = 6000.0, 40000.0, 8000.0
SPEED = [1.0, 1.0, 0.75, 1.3]  # replica speed per group (node generation)
PROMPT, ANSWER = 2000, 600
MAX_REPLICAS, MAX_RANKS = 5, 16
# Queue watermarks per group as configs/kimi_k3.yaml sets them: 0.7 and 0.5 of one node's 64 GiB
# store segment; a sample's hidden states are 6 layers x 7168 x 2 bytes = 86,016 bytes per token.
SEGMENT, BYTES_PER_TOKEN = 64 * 2**30, 6 * 7168 * 2


def watermarks(shifted: bool) -> tuple[float, float]:
    """(high, low) in samples."""
    sample = (PROMPT + ANSWER * (4 if shifted else 1)) * BYTES_PER_TOKEN
    return 0.7 * SEGMENT / sample, 0.5 * SEGMENT / sample


def rates(shifted: bool) -> tuple[list[float], float]:
    """(samples/s per replica of each group, samples/s per trainer rank)."""
    answer = ANSWER * (4 if shifted else 1)
    per_replica = [s / (answer / DECODE + PROMPT / PREFILL) for s in SPEED]
    return per_replica, TRAIN / (PROMPT + answer)


def pooled(replicas: tuple[int, ...], ranks: int, phase) -> float:
    per_replica, per_rank = phase
    return min(sum(r * i for r, i in zip(replicas, per_replica)), ranks * per_rank)


def best_static(weights: list[float], phases) -> tuple[float, tuple]:
    """Exhaustive: every replica count per group and every world size within the GPU budget."""
    best = (-1.0, ())
    for reps in itertools.product(range(1, MAX_REPLICAS + 1), repeat=GROUPS):
        left = GPUS - PER_REPLICA * sum(reps)
        for ranks in range(GROUPS, min(left, GROUPS * MAX_RANKS) + 1):
            v = sum(w * pooled(reps, ranks, ph) for w, ph in zip(weights, phases))
            if v > best[0]:
                best = (v, (reps, ranks))
    return best


@dataclass
class Group:
    replicas: int = 1
    ranks: int = 4
    starting: list = field(default_factory=list)  # ready times of replicas being added
    pending_ranks: int | None = None
    queue: float = 0.0
    window: list = field(default_factory=lambda: [0.0, 0.0])  # produced, busy replica-seconds since the last decision
    actions: int = 0
    directions: list = field(default_factory=list)


def simulate(hours: float, seed: int, dt: float = 10.0, interval: float = 30.0):
    rng = random.Random(seed)
    total_s = hours * 3600
    groups = [Group() for _ in range(GROUPS)]
    policy = ScalingPolicy(
        scale_up_delay_s=120, scale_down_delay_s=300, cooldown_s=600, min_gain=0.05, gpus_per_replica=PER_REPLICA
    )
    t, next_decide, next_ckpt = 0.0, interval, 600.0
    trained_total = crossed = last_trained = 0.0
    series, log = [], []
    while t < total_s:
        per_replica, per_rank = rates(t >= total_s / 2)
        high, low = watermarks(t >= total_s / 2)
        spare = []  # (group, rank-seconds left after its own queue)
        for i, g in enumerate(groups):
            g.replicas += sum(1 for ready in g.starting if ready <= t)
            g.starting = [ready for ready in g.starting if ready > t]
            paused = g.queue >= high
            prod = 0.0 if paused else g.replicas * per_replica[i] * dt
            g.queue += prod
            g.window[0] += prod
            g.window[1] += 0.0 if paused else g.replicas * dt
            own = min(g.ranks * per_rank * dt, g.queue)
            g.queue -= own
            trained_total += own
            spare.append(g.ranks * dt - own / per_rank)
        for i, _g in enumerate(groups):  # ranks left idle borrow from deep queues
            for d in sorted(range(GROUPS), key=lambda k: -groups[k].queue):
                if spare[i] <= 0 or d == i or groups[d].queue <= low:
                    continue
                take = min(spare[i] * per_rank, groups[d].queue - low)
                groups[d].queue -= take
                spare[i] -= take / per_rank
                trained_total += take
                crossed += take
        ranks_now = sum(g.ranks for g in groups)
        series.append((t, trained_total))
        if t >= next_ckpt:
            next_ckpt += 600.0
            for g in groups:
                if g.pending_ranks is not None:
                    g.ranks, g.pending_ranks = g.pending_ranks, None
        if t >= next_decide:
            next_decide += interval
            noise = lambda: 1 + rng.uniform(-0.05, 0.05)  # noqa: E731
            trained_window, last_trained = trained_total - last_trained, trained_total
            compute = trained_window / per_rank  # rank-seconds spent computing
            rank_rate = per_rank * noise() if compute > 0 else None
            wait = max(0.0, 1 - compute / (ranks_now * interval))
            states = []
            for i, g in enumerate(groups):
                prod, busy = g.window
                g.window = [0.0, 0.0]
                states.append(
                    GroupState(  # report committed sizes: pending resizes count as done
                        f"g{i}",
                        g.replicas + len(g.starting),
                        g.pending_ranks or g.ranks,
                        1,
                        MAX_REPLICAS,
                        1,
                        MAX_RANKS,
                        per_replica_rate=(prod / busy) * noise() if busy else None,
                        per_rank_rate=rank_rate,
                        data_wait_fraction=wait,
                        queue_samples=int(g.queue),
                        queue_bytes=int(g.queue),
                        high_watermark_bytes=int(high),
                        producers_paused=g.queue >= high,
                    )
                )
            used = sum(PER_REPLICA * (g.replicas + len(g.starting)) + (g.pending_ranks or g.ranks) for g in groups)
            free = GPUS - used
            for d in policy.decide(states, free, t):
                i = int(d.group[1:])
                g = groups[i]
                now_ranks = g.pending_ranks or g.ranks
                if d.action == "add_replica" and free >= PER_REPLICA:
                    g.starting.append(t + 360.0)
                    free -= PER_REPLICA
                elif d.action == "remove_replica" and g.replicas > 1:
                    g.replicas -= 1
                    free += PER_REPLICA  # drains for a minute: the GPUs come back after it
                elif d.action == "resize_trainer" and d.target_ranks is not None and d.target_ranks - now_ranks <= free:
                    g.pending_ranks = d.target_ranks
                    free -= d.target_ranks - now_ranks
                else:
                    continue
                g.actions += 1
                up = d.action == "add_replica" or (d.action == "resize_trainer" and d.target_ranks > now_ranks)
                g.directions.append(("up" if up else "down", d.action, t >= total_s / 2))
                policy.applied(d.group, t, "up" if up else "down")
                log.append((t, d.group, d.action, d.reason))
        t += dt
    return groups, series, log, crossed / max(trained_total, 1e-9)


def converge_time(series, start, end, target, dt=10.0, window_s=600.0):
    """First time after `start` from which the trailing-window throughput stays within 5% of target."""
    pts = [(t, v) for t, v in series if start <= t < end]
    rates_ = [(t1, (v1 - v0) / (t1 - t0)) for (t0, v0), (t1, v1) in zip(pts, pts[1:])]
    k = int(window_s / dt)
    ok_from = None
    for j in range(len(rates_)):
        lo = max(0, j - k)
        avg = sum(r for _, r in rates_[lo : j + 1]) / (j + 1 - lo)
        if avg >= 0.95 * target:
            ok_from = ok_from if ok_from is not None else rates_[j][0]
        else:
            ok_from = None
    return None if ok_from is None else ok_from - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hours", type=float, default=6.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    before, after = rates(False), rates(True)
    static_val, static_split = best_static([0.5, 0.5], [before, after])
    opt1, split1 = best_static([1.0], [before])
    opt2, split2 = best_static([1.0], [after])
    groups, series, log, crossed = simulate(args.hours, args.seed)
    total = args.hours * 3600
    auto = series[-1][1] / total
    print("rates (samples/s), before -> after the shift: per replica of each group; per trainer rank")
    print(
        "  replicas: "
        + "  ".join(f"g{i} {a:.2f}->{b:.2f}" for i, (a, b) in enumerate(zip(before[0], after[0])))
        + f"   rank: {before[1]:.2f}->{after[1]:.2f}"
    )
    start = ((1,) * GROUPS, 4 * GROUPS)
    prod = 0.5 * pooled(*start, before) + 0.5 * pooled(*start, after)
    print(f"\nproduction split (1 replica + 4 ranks per group), static: {prod:6.2f} samples/s")
    print(
        f"best static split (exact search):  {static_val:6.2f} samples/s  "
        f"replicas {static_split[0]}, {static_split[1]} ranks"
    )
    print(
        f"autoscaled:                        {auto:6.2f} samples/s  = {auto / static_val:.1%} of the best static split"
    )
    print(f"phase optima: {opt1:.2f} {split1} (first half), {opt2:.2f} {split2} (second half)")
    c1 = converge_time(series, 0, total / 2, opt1)
    c2 = converge_time(series, total / 2, total, opt2)
    fmt = lambda c: "not reached" if c is None else f"{c / 60:.0f} min"  # noqa: E731
    print(f"time to converge (within 5% of the phase optimum): start {fmt(c1)}, after the shift {fmt(c2)}")
    print(f"samples trained by another group's rank (crossed): {crossed:.1%}")
    for i, g in enumerate(groups):
        flaps = 0
        for half in (False, True):  # reversals within a phase are flapping; across the shift, adaptation
            dirs = [d for d, _, h in g.directions if h == half]
            flaps += sum(1 for a, b in zip(dirs, dirs[1:]) if a != b)
        print(
            f"  g{i}: final {g.replicas} replicas + {g.ranks} ranks, {g.actions} actions, "
            f"{flaps} reversals within a phase"
        )
    print("\nfirst decisions:")
    for t, grp, action, reason in log[:12]:
        print(f"  t={t / 60:6.1f} min {grp} {action:15s} {reason}")


if __name__ == "__main__":
    main()
