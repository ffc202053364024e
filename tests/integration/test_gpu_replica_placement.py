"""A GPU replica's path on CPU, up to what vLLM is handed (issue 52, item 8): two Ray nodes of two
fake GPUs each, the job's replica placement group, its engine actor started with the job's options
(`tests/integration/gpu_replica_placement.py`, in a process of its own: it needs a Ray cluster of
its own). vLLM's Ray executor gives rank i the bundle `VLLM_RAY_BUNDLE_INDICES[i]`: the value must
list the bundles node by node, rank 0's node first, where the engine actor runs (its connector's
store client is rank 0's), and the engine actor must leave the GPUs to the ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from cluster.scaling import sort_bundles_by_node

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cases() -> dict[str, dict]:
    run = subprocess.run(
        [sys.executable, "-m", "tests.integration.gpu_replica_placement"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        errors="replace",
    )
    lines = [json.loads(ln.removeprefix("RESULT ")) for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    assert run.returncode == 0 and len(lines) == 3, (run.stdout[-3000:], run.stderr[-3000:])
    return {c["case"]: c for c in lines}


def check_engine(case: dict, tp: int) -> None:
    """The engine actor on rank 0's node, with no GPU of its own; one rank per GPU bundle, in the
    order vLLM is told; the store address its connector gives its peers is its own node's."""
    order = case["order"]
    assert case["bundle_indices"] == ",".join(map(str, order))
    assert case["node"] == case["bundle_nodes"][order[0]] and case["gpus"] == []
    assert case["engine"] == {"tensor_parallel_size": tp, "distributed_executor_backend": "ray", "store_host": ""}
    assert [r["node"] for r in case["ranks"]] == [case["bundle_nodes"][b] for b in order]
    gpus = Counter((r["node"], tuple(r["gpus"])) for r in case["ranks"])
    assert all(len(r["gpus"]) == 1 for r in case["ranks"]) and max(gpus.values()) == 1  # one GPU each
    assert case["store_host"] == case["ips"][case["node"]]


def test_tp2_on_one_node(cases):
    case = cases["tp2-one-node"]
    assert len(set(case["bundle_nodes"])) == 1 and case["order"] == [0, 1] and case["bundle_indices"] == "0,1"
    check_engine(case, 2)


def test_tp4_over_two_nodes_where_ray_puts_the_bundles(cases):
    case = cases["tp4-two-nodes"]
    assert sorted(Counter(case["bundle_nodes"]).values()) == [2, 2]
    assert case["order"] == sort_bundles_by_node(case["bundle_nodes"])
    assert case["bundle_indices"] == ",".join(map(str, case["order"]))
    assert case["node"] == case["bundle_nodes"][case["order"][0]] and case["num_gpus"] == 0


def test_tp4_over_two_nodes_with_alternating_bundles_ranks_stay_node_by_node(cases):
    case = cases["tp4-alternate-bundles"]
    a, b = case["bundle_nodes"][0], case["bundle_nodes"][1]
    assert a != b and case["bundle_nodes"] == [a, b, a, b] and case["ips"][a] != case["ips"][b]
    assert case["order"] == [0, 2, 1, 3] and case["bundle_indices"] == "0,2,1,3"
    check_engine(case, 4)
    assert [r["node"] for r in case["ranks"]] == [a, a, b, b]  # ranks 0-1 share a node, 2-3 the other
