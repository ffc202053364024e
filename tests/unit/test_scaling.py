from __future__ import annotations

import itertools
import random

from cluster.scaling import GroupState, ScalingPolicy, best_allocation, pooled_throughput


def brute_force(groups, gpus, per_replica, rank_rate):
    """Every (replicas, ranks) per group within the bounds and the budget: the pooled objective
    min(sum of replicas x rate, all ranks x rate per rank), computed directly."""
    options = [
        [(r, d) for r in range(g.min_replicas, g.max_replicas + 1) for d in range(g.min_ranks, g.max_ranks + 1)]
        for g in groups
    ]
    best = -1.0
    for combo in itertools.product(*options):
        if sum(per_replica * r + d for r, d in combo) <= gpus:
            produced = sum(r * g.per_replica_rate for g, (r, _) in zip(groups, combo))
            best = max(best, min(produced, rank_rate * sum(d for _, d in combo)))
    return best


def test_allocation_is_optimal():
    rng = random.Random(0)
    for _ in range(30):
        t = rng.uniform(1, 12)  # the shared world's rate per rank: every group reports it
        groups = [
            GroupState(
                f"g{i}",
                rng.randint(1, 3),
                rng.randint(1, 5),
                1,
                3,
                1,
                5,
                per_replica_rate=rng.uniform(1, 6),
                per_rank_rate=t,
            )
            for i in range(3)
        ]
        gpus = rng.randint(15, 30)  # at least every group's minimum (3 x (4 + 1))
        alloc = best_allocation(groups, gpus, 4)
        assert abs(pooled_throughput(groups, alloc) - brute_force(groups, gpus, 4, t)) < 1e-6
        assert sum(4 * r + d for r, d in alloc.values()) <= gpus
        assert all(
            g.min_replicas <= alloc[g.name][0] <= g.max_replicas and g.min_ranks <= alloc[g.name][1] <= g.max_ranks
            for g in groups
        )


def test_ranks_follow_production_only_when_the_world_changes_size():
    # g1 produces three times what g0 does; the world needs 8 ranks but has 4.
    groups = [
        GroupState("g0", 1, 2, 1, 1, 1, 8, per_replica_rate=2.0, per_rank_rate=1.0),
        GroupState("g1", 1, 2, 1, 1, 1, 8, per_replica_rate=6.0, per_rank_rate=1.0),
    ]
    alloc = best_allocation(groups, 2 * 4 + 8, 4)
    assert alloc == {"g0": (1, 2), "g1": (1, 6)}  # 8 ranks, spread 1:3 like the production
    # Enough ranks already (4 = 2 + 6 / 2... here the need is 4): a skewed spread is left alone,
    # since moving ranks between groups changes nothing but a world restart.
    slow = [
        GroupState(g.name, 1, 2, 1, 1, 1, 8, per_replica_rate=g.per_replica_rate / 2, per_rank_rate=1.0) for g in groups
    ]
    assert best_allocation(slow, 2 * 4 + 8, 4) == {"g0": (1, 2), "g1": (1, 2)}


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
    # Production 2 x 5 + 1 x 5 = 15 samples/s = 4 ranks x 3.75: no move can gain anything, and
    # +-5% noise on every rate (the world's per-rank rate is one, reported by every group) must
    # not look like a gain either.
    p = ScalingPolicy(scale_up_delay_s=0, scale_down_delay_s=0, cooldown_s=0, min_gain=0.05, gpus_per_replica=8)
    rng = random.Random(1)
    actions = []
    for t in range(200):
        noise = lambda: 1 + rng.uniform(-0.05, 0.05)  # noqa: E731
        rank_rate = 3.75 * noise()
        groups = [
            GroupState("g0", 2, 2, 1, 4, 1, 8, per_replica_rate=5.0 * noise(), per_rank_rate=rank_rate),
            GroupState("g1", 1, 2, 1, 4, 1, 8, per_replica_rate=5.0 * noise(), per_rank_rate=rank_rate),
        ]
        actions += [d.action for d in p.decide(groups, 0, float(t)) if d.action != "none"]
    assert actions == []


def test_the_world_resizes_in_one_round_and_only_by_the_difference():
    # 2 replicas make 4 samples/s for a world of 8 ranks that could train 16: the plan trades 4 of
    # the 16 GPUs for a third replica (6 samples/s) and keeps the 3 ranks that production needs.
    # Every group whose ranks change gets its resize in the same round, before the replica.
    p = ScalingPolicy(scale_up_delay_s=0, scale_down_delay_s=0, cooldown_s=0, min_gain=0.05, gpus_per_replica=4)
    groups = [
        GroupState("g0", 1, 4, 1, 3, 1, 8, per_replica_rate=2.0, per_rank_rate=2.0),
        GroupState("g1", 1, 4, 1, 3, 1, 8, per_replica_rate=2.0, per_rank_rate=2.0),
    ]
    decisions = p.decide(groups, 0.0, 0.0)  # (free GPUs as a float, as Ray reports them)
    resizes = {d.group: d.target_ranks for d in decisions if d.action == "resize_trainer"}
    assert set(resizes) == {"g0", "g1"} and sum(resizes.values()) == 3, decisions
    assert not any(d.action == "add_replica" for d in decisions)  # the shrink goes first: it frees the GPUs
    for g in groups:  # once it is done, the replica follows
        p.applied(g.name, 1.0, "down")
        g.ranks = resizes[g.name]
    assert [d.action for d in p.decide(groups, 4.0, 2.0)].count("add_replica") == 1


def test_spread_moves_only_the_difference():
    from cluster.scaling import spread_ranks

    groups = [
        GroupState("g0", 1, 3, 1, 3, 1, 8, per_replica_rate=1.0),
        GroupState("g1", 1, 1, 1, 3, 1, 8, per_replica_rate=3.0),
    ]
    assert spread_ranks(groups, [1, 1], 5) == [3, 2]  # the new rank goes to g1, g0 keeps its 3
    assert spread_ranks(groups, [1, 1], 3) == [2, 1]  # the removed one comes from g0 (most ranks per sample)
    assert spread_ranks(groups, [1, 1], 4) == [3, 1]  # same size: nothing moves
