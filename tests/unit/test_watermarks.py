"""Producers' pause and resume marks per group: groups whose replicas share a node split its
store segment by need (their most replicas), instead of each taking the whole."""

from __future__ import annotations

from cluster.config_load import load_config
from cluster.scaling import group_watermarks, groups_on_nodes


def two_groups(*overrides: str):
    return load_config("configs/local_2groups.yaml", ["transport.segment_mb=1000", *overrides])


def test_groups_sharing_a_node_split_its_segment_by_need():
    cfg = two_groups("topology.groups.0.max_replicas=1", "topology.groups.1.max_replicas=3")
    seg = 1000 << 20
    alone = group_watermarks(cfg, {"n0": {"g0"}, "n1": {"g1"}})
    assert alone == {g: (int(seg * 0.7), int(seg * 0.5)) for g in ("g0", "g1")}
    shared = group_watermarks(cfg, {"n0": {"g0", "g1"}})
    assert shared["g0"] == (int(seg * 0.25 * 0.7), int(seg * 0.25 * 0.5))
    assert shared["g1"] == (int(seg * 0.75 * 0.7), int(seg * 0.75 * 0.5))
    assert sum(high for high, _ in shared.values()) <= seg * cfg.transport.high_watermark
    # a group on two nodes, one of them shared: its smallest share holds
    spread = group_watermarks(cfg, {"n0": {"g0", "g1"}, "n1": {"g0"}})
    assert spread["g0"] == shared["g0"]


def test_the_master_lending_its_memory_is_shared_by_every_group():
    cfg = two_groups(
        "transport.segment_host=master", "topology.groups.0.max_replicas=2", "topology.groups.1.max_replicas=2"
    )
    marks = group_watermarks(cfg, {"n0": {"g0"}, "n1": {"g1"}})
    assert marks["g0"] == marks["g1"] == (int((1000 << 20) * 0.5 * 0.7), int((1000 << 20) * 0.5 * 0.5))


def test_which_groups_share_a_node_comes_from_the_placed_replicas():
    from types import SimpleNamespace as NS

    placed = [
        NS(spec=NS(role="inference", group="g0"), bundle_nodes=["a"]),
        NS(spec=NS(role="inference", group="g1"), bundle_nodes=["a", "b"]),
        NS(spec=NS(role="trainer", group="g1"), bundle_nodes=["c"]),
    ]
    assert groups_on_nodes(placed) == {"a": {"g0", "g1"}, "b": {"g1"}}
