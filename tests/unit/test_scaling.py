from __future__ import annotations

import itertools
import random

from cluster.scaling import GroupState, ScalingPolicy, best_allocation


def brute_force(groups, gpus, per_replica):
    options = [[(r, d) for r in range(g.min_replicas, g.max_replicas + 1) for d in range(g.min_ranks, g.max_ranks + 1)]
               for g in groups]
    best = -1.0
    for combo in itertools.product(*options):
        if sum(per_replica * r + d for r, d in combo) <= gpus:
            best = max(best, sum(g.throughput(r, d) for g, (r, d) in zip(groups, combo)))
    return best


def test_allocation_is_optimal():
    rng = random.Random(0)
    for _ in range(30):
        groups = [GroupState(f"g{i}", 1, 1, 1, 3, 1, 5, per_replica_rate=rng.uniform(1, 6), per_rank_rate=rng.uniform(1, 12))
                  for i in range(3)]
        gpus = rng.randint(15, 30)  # at least every group's minimum (3 x (4 + 1))
        alloc = best_allocation(groups, gpus, 4)
        value = sum(g.throughput(*alloc[g.name]) for g in groups)
        assert abs(value - brute_force(groups, gpus, 4)) < 1e-6
        assert sum(4 * r + d for r, d in alloc.values()) <= gpus


def test_starving_trainer_adds_a_replica_after_the_delay():
    p = ScalingPolicy(scale_up_delay_s=20, scale_down_delay_s=20, cooldown_s=30, gpus_per_replica=1)
    g = GroupState("g0", 1, 1, 1, 3, 1, 1, data_wait_fraction=0.8, queue_samples=0)
    assert p.decide([g], 4, 0.0)[0].action == "none"
    assert p.decide([g], 4, 10.0)[0].action == "none"
    d = p.decide([g], 4, 21.0)[0]
    assert d.action == "add_replica" and "starving" in d.reason
    assert p.decide([g], 0, 21.0)[0].action == "wait_resources"


def test_flood_removes_a_replica_and_cooldown_blocks_reversal():
    p = ScalingPolicy(scale_up_delay_s=0, scale_down_delay_s=0, cooldown_s=30, gpus_per_replica=1)
    flooded = GroupState("g0", 2, 1, 1, 3, 1, 1, producers_paused=True, queue_bytes=100, high_watermark_bytes=50)
    starting = GroupState("g0", 2, 1, 1, 3, 1, 1, producers_paused=True, trainer_running=False)
    assert p.decide([starting], 0, 0.0)[0].action == "none"  # no verdict before the trainer runs
    assert p.decide([flooded], 0, 0.0)[0].action == "remove_replica"
    p.applied("g0", 0.0, "down")
    starving = GroupState("g0", 1, 1, 1, 3, 1, 1, data_wait_fraction=0.9)
    assert p.decide([starving], 4, 10.0)[0].action == "none"  # reversal within the cooldown
    assert p.decide([starving], 4, 40.0)[0].action == "add_replica"


def test_balanced_groups_do_not_flap_under_noise():
    p = ScalingPolicy(scale_up_delay_s=0, scale_down_delay_s=0, cooldown_s=0, min_gain=0.05, gpus_per_replica=8)
    rng = random.Random(1)
    actions = []
    for t in range(200):
        noise = lambda: 1 + rng.uniform(-0.05, 0.05)  # noqa: E731
        groups = [GroupState("g0", 2, 2, 1, 4, 1, 8, per_replica_rate=4.0 * noise(), per_rank_rate=4.0 * noise()),
                  GroupState("g1", 1, 2, 1, 4, 1, 8, per_replica_rate=6.0 * noise(), per_rank_rate=3.0 * noise())]
        actions += [d.action for d in p.decide(groups, 0, float(t)) if d.action != "none"]
    assert actions == []
