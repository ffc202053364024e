"""The scaling room: how capacity is laid out and moved.

Owns the scaling policy (`policy`, pure: what each group should have), the autoscaler that
applies it (`autoscaler`), placement of replicas and trainer ranks on Ray nodes (`placement`)
and the capacity plan of a config before anything starts (`capacity`). What one CPU box
trains in its time budget is the box room's (`cluster.box`).
"""

from cluster.scaling.autoscaler import AutoscaleLoop
from cluster.scaling.capacity import (
    drafter_size,
    group_watermarks,
    groups_on_nodes,
    replica_kv_per_token,
    target_config,
)
from cluster.scaling.capacity import plan as capacity_plan
from cluster.scaling.placement import (
    Placed,
    PlacementError,
    RoleSpec,
    check_topology,
    cluster_request,
    describe,
    place,
    place_all,
    release,
    replica_spec,
    role_specs,
    sort_bundles_by_node,
    trainer_specs,
)
from cluster.scaling.policy import Decision, GroupState, ScalingPolicy, best_allocation, pooled_throughput, spread_ranks

__all__ = [
    "AutoscaleLoop",
    "Decision",
    "GroupState",
    "Placed",
    "PlacementError",
    "RoleSpec",
    "ScalingPolicy",
    "best_allocation",
    "capacity_plan",
    "check_topology",
    "cluster_request",
    "describe",
    "drafter_size",
    "group_watermarks",
    "groups_on_nodes",
    "place",
    "place_all",
    "pooled_throughput",
    "release",
    "replica_kv_per_token",
    "replica_spec",
    "role_specs",
    "sort_bundles_by_node",
    "spread_ranks",
    "target_config",
    "trainer_specs",
]
