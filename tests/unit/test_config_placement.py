from __future__ import annotations

from pathlib import Path

import pytest

from cluster.config import ConfigError, load_config
from cluster.placement import PlacementError, check_topology, role_specs, sort_bundles_by_node

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_configs_load():
    local = load_config(ROOT / "configs" / "local.yaml")
    assert local.device == "cpu" and local.target.path == "smollm2" and len(local.topology.groups) == 1
    k3 = load_config(ROOT / "configs" / "kimi_k3.yaml")
    assert k3.drafter.num_layers == 5 and k3.drafter.block_size == 8 and k3.target.kv_cache_dtype == "fp8"
    assert k3.transport.protocol == "rdma" and len(k3.topology.groups) == 4


@pytest.mark.parametrize("override, key", [
    (["trainer.lrr=1"], "trainer.lrr"),
    (["trainer.lr=fast"], "trainer.lr"),
    (["drafter.mode=eagle"], "drafter.mode"),
    (["nonsense=1"], "nonsense"),
    (["transport.low_watermark=0.9"], "transport.low_watermark"),
    (["transport.segment_mb=8"], "transport.segment_mb"),
])
def test_bad_config_names_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(ROOT / "configs" / "local.yaml", override)


def test_cuda_tp_must_match_gpus():
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        load_config(ROOT / "configs" / "kimi_k3.yaml", ["target.tensor_parallel_size=4"])


def fake_nodes(n, gpus, cpus=64):
    return [{"Alive": True, "Resources": {"GPU": gpus, "CPU": cpus}} for _ in range(n)]


def test_topology_check_names_missing_resource():
    k3 = load_config(ROOT / "configs" / "kimi_k3.yaml")
    check_topology(k3, fake_nodes(12, 4))
    with pytest.raises(PlacementError, match="missing 2 node"):
        check_topology(k3, fake_nodes(10, 4) + fake_nodes(4, 2))
    with pytest.raises(PlacementError, match="largest node has 2"):
        check_topology(k3, fake_nodes(24, 2))
    with pytest.raises(PlacementError, match="GPU"):
        check_topology(k3, fake_nodes(8, 4))
    local = load_config(ROOT / "configs" / "local.yaml", ["topology.groups.0.inference_replicas=3",
                                                          "topology.groups.0.max_replicas=3"])
    with pytest.raises(PlacementError, match="CPU"):
        check_topology(local, [{"Alive": True, "Resources": {"CPU": 2}}])


def test_roles_for_production_topology():
    specs = role_specs(load_config(ROOT / "configs" / "kimi_k3.yaml"))
    inf = [s for s in specs if s.role == "inference"]
    tr = [s for s in specs if s.role == "trainer"]
    assert len(inf) == 4 and all(len(s.bundles) == 8 and s.nodes == 2 for s in inf)
    assert len(tr) == 4 and all(len(s.bundles) == 4 and s.strategy == "STRICT_PACK" for s in tr)


def test_resized_trainer_fills_whole_nodes_first():
    k3 = load_config(ROOT / "configs" / "kimi_k3.yaml", ["run_name=k3"])
    tr = [s for s in role_specs(k3, 1, trainer_ranks=6, generation=2) if s.role == "trainer"]
    assert [len(s.bundles) for s in tr] == [4, 2] and all(s.group == "g1" for s in tr)
    assert [s.name for s in tr] == ["k3/g1/trainer0.2", "k3/g1/trainer1.2"]  # never a live group's name
    assert [s.name for s in role_specs(k3, 1) if s.role == "trainer"] == ["k3/g1/trainer0"]


def test_bundles_sorted_by_node():
    # PACK placed bundles 0,1,4,5 on node A and 2,3,6,7 on node B
    assert sort_bundles_by_node(list("AABBAABB")) == [0, 1, 4, 5, 2, 3, 6, 7]
    assert sort_bundles_by_node(list("BAAB")) == [0, 3, 1, 2]


def test_cluster_request_lists_the_whole_job():
    from cluster.placement import cluster_request

    k3 = load_config(ROOT / "configs" / "kimi_k3.yaml")
    now = [(1, 4)] * 4  # 4 groups x (one TP-8 replica over two 4-GPU nodes, one 4-GPU trainer node)
    assert sum(b.get("GPU", 0) for b in cluster_request(k3, now)) == 48
    more = cluster_request(k3, [(2, 4)] + now[1:])  # one more replica in g0: 8 GPUs more, all of it listed
    assert sum(b.get("GPU", 0) for b in more) == 56 and len(more) == 56
    grown = cluster_request(k3, [(1, 8)] + now[1:])  # g0's trainer on two nodes
    assert sum(b.get("GPU", 0) for b in grown) == 52
    local = load_config(ROOT / "configs" / "local.yaml")
    assert cluster_request(local, [(1, 1)]) == [{"CPU": 1.0}, {"CPU": 1.0}]


def test_resource_request_for_a_trainer_wait_asks_trainer_bundles(monkeypatch):
    from types import SimpleNamespace

    import ray.autoscaler.sdk as sdk

    from cluster.job import TrainingJob

    asked = []
    monkeypatch.setattr(sdk, "request_resources", lambda bundles: asked.append(bundles))
    job = TrainingJob.__new__(TrainingJob)
    job.cfg = load_config(ROOT / "configs" / "kimi_k3.yaml")
    job.groups = [SimpleNamespace(index=i, name=f"g{i}", replicas={"r0": None}, ranks=[0] * 4) for i in range(4)]
    job._request_resources(job.groups[1], "trainer 4->8 ranks needs GPUs", trainer_ranks=8)
    job._request_resources(job.groups[1], "starving")
    gpus = [sum(b.get("GPU", 0) for b in a) for a in asked]
    assert gpus == [52, 56]  # 48 running + 4 trainer GPUs; 48 + one 8-GPU replica
