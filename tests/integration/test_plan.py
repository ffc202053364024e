"""`--plan` for the production topology on a simulated 12-node cluster (12 × 4 fake GPUs):
4 groups × (8 inference GPUs on 2 nodes + 4 trainer GPUs on 1 node), each replica's bundles in
node order, every node used exactly once, one trainer world of 16 ranks, and the capacity plan;
the single-node split on one simulated 8-GPU node, with its capacity plan; an impossible topology
names what is missing; both GPU configs name the public checkpoint they train for. The 12-node
plan and the impossible topology's exit are `slow`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def plan(nodes: str, config: str = "kimi_k3.yaml") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run(
        [
            sys.executable,
            str(ROOT / "jobs" / "train_kimi_k3.py"),
            "--config",
            str(ROOT / "configs" / config),
            "--plan",
            "--simulate",
            nodes,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def dspark_parameters(hidden, layers, heads, kv_heads, head_dim, mlp, vocab, draft_vocab, aux, markov_rank):
    """The drafter's parameter count in closed form (DESIGN.md section 1), to check the plan's
    count of the model built on the meta device. Per layer: q/o (hidden x heads·head_dim), k/v
    (hidden x kv_heads·head_dim; the context goes through the same projections), q/k norms, a
    gated MLP, two norms. Then the context projection (aux·hidden -> hidden) and its norm, the
    final norm, the Markov head (target vocab x r embedding, r -> draft vocab), the confidence head
    (hidden + r weights and a bias). Frozen: the target's embedding, LM head and final norm, and a
    draft head only when the draft vocabulary is reduced."""
    attn = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 2 * head_dim
    layer = attn + 3 * hidden * mlp + 2 * hidden
    trainable = (
        layers * layer
        + aux * hidden * hidden
        + 2 * hidden
        + vocab * markov_rank
        + markov_rank * draft_vocab
        + hidden
        + markov_rank
        + 1
    )
    frozen = 2 * vocab * hidden + hidden + (draft_vocab * hidden if draft_vocab < vocab else 0)
    return trainable, frozen


def placement_rows(out: str) -> dict[str, list[tuple[str, str, int]]]:
    by_role = defaultdict(list)
    for line in out.splitlines():
        if line.startswith("g") and "/" in line.split()[0]:
            role, node, device, bundle = line.split()
            by_role[role].append((node, device, int(bundle)))
    return by_role


# `slow`: twelve simulated nodes are twelve raylets started on the test machine (about a minute
# of the default run's 15-minute budget on 2 cores). The default run keeps the two plans below;
# the production topology's roles are also checked without Ray in
# tests/unit/test_config_placement.py::test_roles_for_production_topology.
@pytest.mark.slow
def test_production_placement_on_simulated_cluster():
    out = plan("12x4")
    assert out.returncode == 0, out.stderr[-3000:]
    by_role = placement_rows(out.stdout)
    assert sorted(by_role) == [f"g{g}/{r}0" for g in range(4) for r in ("inference", "trainer")]
    nodes_used = defaultdict(set)
    for role, placed in by_role.items():
        nodes = [n for n, _, _ in placed]
        if "inference" in role:
            assert len(placed) == 8 and len(set(nodes)) == 2
            # rank order keeps each node's four GPUs consecutive
            assert nodes[:4] == [nodes[0]] * 4 and nodes[4:] == [nodes[4]] * 4
            assert [d for _, d, _ in placed] == ["GPU0", "GPU1", "GPU2", "GPU3"] * 2
        else:
            assert len(placed) == 4 and len(set(nodes)) == 1
        for n in nodes:
            nodes_used[n].add(role)
    assert len(nodes_used) == 12 and all(len(r) == 1 for r in nodes_used.values())
    # The capacity plan, in figures to check by hand: 6 states x 7168 x 2 B per token; 16 ranks in
    # one world; a group's replica puts 17,000 tok/s x 86,016 B = 1.46 GB/s into the store.
    text = out.stdout
    assert "6 x 7168 x 2 B (bfloat16) = 86,016 B per token" in text
    # a token in a replica's KV cache on each GPU: 24 x (512 + 64) x 1 B of FP8 MLA + the capture's 86,016 B
    assert "replica KV cache per token on each rank: 99,840 B" in text
    trainable, frozen = dspark_parameters(
        hidden=7168,
        layers=5,
        heads=56,
        kv_heads=56,
        head_dim=128,
        mlp=18432,
        vocab=163840,
        draft_vocab=163840,
        aux=5,
        markov_rank=256,
    )
    assert f"{trainable:,} trainable parameters" in text and f"{frozen:,} frozen" in text, text[:3000]
    assert "ZeRO-2 over 16 ranks" in text
    assert text.count("= 17,000 tok/s = 1.46 GB/s into the store") == 4
    assert "one step: 16 ranks x 32,768 tokens = 524,288 tokens = 45.1 GB of hidden states read" in text
    assert text.count("what it may hold is 4.3 steps of data") == 4  # 44.8 GiB / (4 x 32,768 x 86,016 B)


def test_single_node_split_on_one_simulated_node():
    out = plan("1x8", "single_node_8gpu.yaml")
    assert out.returncode == 0, out.stderr[-3000:]
    by_role = placement_rows(out.stdout)
    assert sorted(by_role) == ["g0/inference0", "g0/trainer0"]
    (rep_node,) = {n for n, _, _ in by_role["g0/inference0"]}
    (trainer_node,) = {n for n, _, _ in by_role["g0/trainer0"]}
    assert rep_node == trainer_node and len(by_role["g0/inference0"]) == 4 and len(by_role["g0/trainer0"]) == 4
    assert "network: none (the replica and the ranks share one node's store daemon)" in out.stdout
    assert "1 node(s) x 512 GiB lent" in out.stdout
    # The capacity plan for Qwen3-32B (configs/targets/qwen3_32b.json), in figures to check by hand:
    # 6 states x 5120 x 2 B per token; a 3-layer drafter with the target's 64/8 heads and 25,600-wide
    # MLP; 358.4 GiB (0.7 x 512 GiB) / 61,440 B = 6,263,494 tokens before the producers pause.
    text = out.stdout
    assert "6 x 5120 x 2 B (bfloat16) = 61,440 B per token" in text
    # 64 layers x 2 x 8/4 KV heads x 128 x 2 B = 65,536 B of attention + the capture's 61,440 B, on each rank
    assert "replica KV cache per token on each rank: 126,976 B" in text
    trainable, frozen = dspark_parameters(
        hidden=5120,
        layers=3,
        heads=64,
        kv_heads=8,
        head_dim=128,
        mlp=25600,
        vocab=151936,
        draft_vocab=151936,
        aux=5,
        markov_rank=256,
    )
    assert f"{trainable:,} trainable parameters" in text and f"{frozen:,} frozen" in text, text[:3000]
    assert "ZeRO-2 over 4 ranks" in text
    assert "= 6,263,494 tokens" in text


@pytest.mark.parametrize(
    "config, name", [("kimi_k3.yaml", "moonshotai/Kimi-K3"), ("single_node_8gpu.yaml", "Qwen/Qwen3-32B")]
)
def test_gpu_configs_name_the_checkpoint_they_plan_for(config, name):
    """The exported drafter names `target.name` as its verifier (never the local path), and --plan
    plans with `target.plan_config`, a copy of that checkpoint's config.json: a config must name
    the checkpoint, and its plan copy must be the same checkpoint's."""
    from cluster.config_load import load_config

    cfg = load_config(ROOT / "configs" / config)
    assert cfg.target.name == name and cfg.target.name != cfg.target.path
    plan_copy = json.loads((ROOT / cfg.target.plan_config).read_text())
    assert f"{name}'s config.json" in plan_copy["_comment"], plan_copy["_comment"]


@pytest.mark.slow  # 16 s; the message itself: tests/unit/test_config_placement.py (the suite's 15 minutes)
def test_impossible_topology_names_the_missing_resource():
    out = plan("3x4")  # 12 nodes wanted
    assert out.returncode == 2
    assert "missing 9 node(s) of 4 GPUs, 36 GPU(s)" in out.stderr, out.stderr[-2000:]
