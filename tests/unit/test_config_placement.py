from __future__ import annotations

from pathlib import Path

import pytest

from cluster.config import ConfigError
from cluster.config_load import load_config
from cluster.scaling import PlacementError, check_topology, role_specs, sort_bundles_by_node, trainer_specs

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_configs_load():
    local = load_config(ROOT / "configs" / "local.yaml")
    assert local.device == "cpu" and local.target.path == "smollm2" and len(local.topology.groups) == 1
    k3 = load_config(ROOT / "configs" / "kimi_k3.yaml")
    assert k3.drafter.num_layers == 5 and k3.drafter.block_size == 8 and k3.target.kv_cache_dtype == "fp8"
    assert k3.transport.protocol == "rdma" and len(k3.topology.groups) == 4
    two = load_config(ROOT / "configs" / "local_2groups.yaml")
    assert [g.name for g in two.topology.groups] == ["g0", "g1"] and all(
        g.trainer_ranks == 1 for g in two.topology.groups
    )
    one_node = load_config(ROOT / "configs" / "single_node_8gpu.yaml")
    assert one_node.target.tensor_parallel_size == 4 and one_node.topology.groups[0].trainer_ranks == 4


def test_kimi_k3_config_is_what_it_claims():
    """Aux layers spread over the target's depth, a drafter whose recipe drafts probabilistically
    (the full vocabulary), an autoscaler with room to act, a public verifier id, remote code on."""
    from cluster.config_checks import check_against_target
    from cluster.scaling import drafter_size, target_config
    from dspark.config import default_aux_layer_ids
    from dspark.recipe import speculative_config

    k3 = load_config(ROOT / "configs" / "kimi_k3.yaml")
    tcfg = target_config(k3)  # the plan copy of the target's config: /shared is not mounted here
    check_against_target(k3, tcfg)
    assert k3.target.aux_layer_ids == default_aux_layer_ids(tcfg.num_hidden_layers) and tcfg.num_hidden_layers == 93
    size = drafter_size(k3, tcfg)
    size.config.verifier_name_or_path = k3.target.name
    assert speculative_config(size.config.to_speculators_dict(), "d")["draft_sample_method"] == "probabilistic"
    assert k3.autoscaler.enabled and all(
        g.min_replicas < g.max_replicas and g.trainer_rank_bounds()[0] < g.trainer_rank_bounds()[1]
        for g in k3.topology.groups
    )
    assert k3.target.name == "moonshotai/Kimi-K3" and k3.target.trust_remote_code


def test_replica_kv_per_token_counts_the_hidden_state_group_on_every_rank():
    """A token's KV cache on each rank of a replica, by hand from the plan copies' figures. K3
    (configs/targets/kimi_k3.json, FP8 KV cache, TP 8): 24 MLA layers x (kv_lora_rank 512 +
    qk_rope_head_dim 64) x 1 B = 13,824 B (the latent is not split over ranks; the 69 KDA layers
    keep a state per sequence, not per token), plus the capture's own group: 5 aux layers + the
    last = 6 states x hidden 7168 x 2 B (bf16, whatever the KV dtype) = 86,016 B, whole on every
    rank. Qwen3-32B (bf16 KV cache, TP 4): 64 layers x 2 (K and V) x 8/4 KV heads x 128 x 2 B =
    65,536 B, plus 6 x 5120 x 2 B = 61,440 B."""
    from cluster.scaling import replica_kv_per_token, target_config

    k3 = load_config(ROOT / "configs" / "kimi_k3.yaml")
    kv = replica_kv_per_token(k3, target_config(k3), len(k3.target.aux_layer_ids) + 1, 7168)
    assert (kv.attention, kv.hidden_states) == (24 * (512 + 64) * 1, 6 * 7168 * 2) == (13_824, 86_016)
    assert kv.total == 99_840  # ~100 kB: 64 GB of a GPU hold ~641k tokens, 39 sequences of max_model_len 16,384
    assert "24 MLA layers x (512 + 64) x 1 B (fp8" in kv.attention_formula
    qwen = load_config(ROOT / "configs" / "single_node_8gpu.yaml")
    kv = replica_kv_per_token(qwen, target_config(qwen), 6, 5120)
    assert (kv.attention, kv.hidden_states) == (64 * 2 * (8 // 4) * 128 * 2, 6 * 5120 * 2) == (65_536, 61_440)
    # the capture is not split over ranks, the heads are: TP 8 halves attention only
    kv8 = replica_kv_per_token(
        load_config(ROOT / "configs" / "single_node_8gpu.yaml", ["target.tensor_parallel_size=8"]),
        target_config(qwen),
        6,
        5120,
    )
    assert (kv8.attention, kv8.hidden_states) == (32_768, 61_440)


@pytest.mark.parametrize(
    "override, key",
    [
        (["trainer.lrr=1"], "trainer.lrr"),
        (["trainer.lr=fast"], "trainer.lr"),
        (["drafter.mode=eagle"], "drafter.mode"),
        (["nonsense=1"], "nonsense"),
        (["transport.low_watermark=0.9"], "transport.low_watermark"),
        (["transport.segment_mb=8"], "transport.segment_mb"),
    ],
)
def test_bad_config_names_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(ROOT / "configs" / "local.yaml", override)


def test_cuda_tp_must_fit_the_nodes():
    # 12 GPUs over 2 nodes is 6 per node on 4-GPU nodes; 7 does not split over 2 nodes
    for tp in (12, 7):
        with pytest.raises(ConfigError, match="tensor_parallel_size"):
            load_config(ROOT / "configs" / "kimi_k3.yaml", [f"target.tensor_parallel_size={tp}"])
    with pytest.raises(ConfigError, match="trainer_ranks_per_node"):
        load_config(ROOT / "configs" / "single_node_8gpu.yaml", ["topology.groups.0.trainer_ranks_per_node=9"])


def test_single_node_split_counts_gpus_per_node():
    cfg = load_config(ROOT / "configs" / "single_node_8gpu.yaml")
    check_topology(cfg, fake_nodes(1, 8))  # a TP-4 replica and 4 trainer ranks share one 8-GPU node
    with pytest.raises(PlacementError, match="missing 1 node"):
        check_topology(cfg, fake_nodes(1, 6))  # 4 + 4 GPUs do not fit 6
    two = load_config(ROOT / "configs" / "single_node_8gpu.yaml", ["topology.groups.0.trainer_ranks_per_node=5"])
    with pytest.raises(PlacementError, match="missing 1 node"):
        check_topology(two, fake_nodes(1, 8))
    check_topology(two, fake_nodes(2, 8))


def test_replay_replicas_take_no_gpu():
    """A replay replica runs no model: on a GPU job it takes a CPU bundle, so one GPU holds the
    trainer (what scripts/gpu_check.sh runs); a vLLM replica of the same job needs its own GPU."""
    gpu_job = ["device=cuda", "topology.groups.0.gpus_per_node=1"]
    vllm = load_config(ROOT / "configs" / "local.yaml", gpu_job)
    with pytest.raises(PlacementError, match="missing 1 node"):
        check_topology(vllm, fake_nodes(1, 1))
    replay = load_config(
        ROOT / "configs" / "local.yaml", [*gpu_job, "inference.backend=replay", "inference.replay_dir=/samples"]
    )
    check_topology(replay, fake_nodes(1, 1))
    replica, trainer = role_specs(replay)
    assert replica.bundles == [{"CPU": 1.0}] and trainer.bundles == [{"GPU": 1.0, "CPU": 1.0}]


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
    local = load_config(
        ROOT / "configs" / "local.yaml", ["topology.groups.0.inference_replicas=3", "topology.groups.0.max_replicas=3"]
    )
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
    tr = [s for s in trainer_specs(k3, {"g1": 6}, generation=2) if s.group == "g1"]
    assert [len(s.bundles) for s in tr] == [4, 2]
    assert [s.name for s in tr] == ["k3/g1/trainer0.2", "k3/g1/trainer1.2"]  # never a live group's name
    assert [s.name for s in role_specs(k3) if s.role == "trainer" and s.group == "g1"] == ["k3/g1/trainer0"]
    # the world's rank order: group by group
    assert [s.group for s in trainer_specs(k3, {"g1": 6})] == ["g0", "g1", "g1", "g2", "g3"]


def test_bundles_sorted_by_node():
    # PACK placed bundles 0,1,4,5 on node A and 2,3,6,7 on node B
    assert sort_bundles_by_node(list("AABBAABB")) == [0, 1, 4, 5, 2, 3, 6, 7]
    assert sort_bundles_by_node(list("BAAB")) == [0, 3, 1, 2]


def test_cluster_request_lists_the_whole_job():
    from cluster.scaling import cluster_request

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

    from cluster.scaling import AutoscaleLoop

    asked = []
    monkeypatch.setattr(sdk, "request_resources", lambda bundles: asked.append(bundles))
    loop = AutoscaleLoop.__new__(AutoscaleLoop)
    loop.cfg = load_config(ROOT / "configs" / "kimi_k3.yaml")
    loop.pools = {f"g{i}": [object()] for i in range(4)}  # one replica each
    loop.stats = SimpleNamespace(layout={f"g{i}": 4 for i in range(4)})
    loop.request_resources("g1", "trainer 4->8 ranks needs GPUs", trainer_ranks=8)
    loop.request_resources("g1", "starving")
    gpus = [sum(b.get("GPU", 0) for b in a) for a in asked]
    assert gpus == [52, 56]  # 48 running + 4 trainer GPUs; 48 + one 8-GPU replica


def test_gpu_packing_is_exact_where_best_fit_is_not():
    from cluster.scaling.placement import _fits

    # Best-fit decreasing puts 4+3 on the first node and is left with 3,2,2,2 for the second: it
    # would say no. 4+2+2 and 3+3+2 fit.
    assert _fits([4, 3, 3, 2, 2, 2], [8, 8])
    assert not _fits([4, 3, 3, 2, 2, 3], [8, 8])  # 17 GPUs of shares on 16
    assert not _fits([5, 5, 5], [8, 8])  # 15 <= 16 GPUs, but no node holds two shares of 5
    assert _fits([4] * 12, [4] * 12) and not _fits([4] * 12, [4] * 11)
