"""`--plan` for the production topology on a simulated 12-node cluster (12 × 4 fake GPUs):
4 groups × (8 inference GPUs on 2 nodes + 4 trainer GPUs on 1 node), each replica's bundles in
node order, every node used exactly once; and an impossible topology names what is missing."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def plan(nodes: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run([sys.executable, str(ROOT / "jobs" / "train_kimi_k3.py"), "--config",
                           str(ROOT / "configs" / "kimi_k3.yaml"), "--plan", "--simulate", nodes],
                          capture_output=True, text=True, timeout=300, env=env)


def test_production_placement_on_simulated_cluster():
    out = plan("12x4")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.startswith("g")]
    by_role = defaultdict(list)
    for role, node, device, bundle in rows:
        by_role[role].append((node, device, int(bundle)))
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


def test_impossible_topology_names_the_missing_resource():
    out = plan("10x4")
    assert out.returncode == 2
    assert "missing 2 node(s), 8 GPU(s)" in out.stderr, out.stderr[-2000:]
