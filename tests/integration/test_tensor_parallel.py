"""A tensor-parallel replica with real parts: vLLM (CPU) with two worker processes (its
multiprocessing executor, one core set per rank) inside a Ray actor, the capturing target class
handed to the workers by name, the connector writing from rank 0 into a real Mooncake store.

On a random Llama whose heads split over two ranks (4 attention heads, 2 KV heads), the TP-2
replica stores the same rows as a TP-1 replica (the same tokens, every row's states at cosine
>= 0.999: the ranks' all-reduce sums in another order), and it runs through several times its
KV cache: the finished requests' blocks are freed although only rank 0 reports them saved."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from cluster.config import SamplingConfig
from cluster.hardware import cpu_process_env
from cluster.inference import InferenceActor, InferenceSettings
from cluster.store import HiddenStateStore, StoreConfig
from dspark.config import DSparkConfig
from tests.helpers import eager_target

pytestmark = pytest.mark.integration

PROMPTS = [
    {"id": f"p{i}", "messages": [{"role": "user", "content": f"Tell me something about the number {i}."}]}
    for i in range(40)
]
KV_BLOCKS = 4  # x 128-token blocks on CPU: 512 tokens of KV cache, while the prompts need ~2,400


@pytest.fixture(scope="module")
def random_llama(smol_target):
    from dspark.targets import prepare_random_llama

    return prepare_random_llama()


@pytest.fixture(scope="module")
def tp_runs(ray_cluster, random_llama, mooncake_master):
    ray = ray_cluster
    holder = HiddenStateStore(StoreConfig(master=mooncake_master.address, segment_bytes=128 << 20)).connect()
    layer_ids = DSparkConfig.from_target(random_llama).extract_layer_ids
    # fp32: in bf16 the two ranks' partial sums could round a near-tie to another greedy token
    tp1 = InferenceSettings(
        eager_target(random_llama, max_model_len=256, dtype="float32", kv_cache_blocks=KV_BLOCKS),
        layer_ids,
        "tp1/g0",
        sampling=SamplingConfig(max_tokens=24),
        store=StoreConfig(master=mooncake_master.address),
        cpu_threads=2,
    )
    tp2 = replace(tp1, key_prefix="tp2/g0", target=replace(tp1.target, tensor_parallel_size=2))
    # the job's CPU engine environment (preloaded tcmalloc and Intel OpenMP: 4x the TP-2 decode speed here)
    env = {"runtime_env": {"env_vars": cpu_process_env(("tcmalloc", "iomp"), 2)}}
    actors = {tp: ray.remote(num_cpus=1)(InferenceActor).options(**env).remote(s) for tp, s in ((1, tp1), (2, tp2))}
    out = {tp: ray.get(a.process.remote(PROMPTS), timeout=600) for tp, a in actors.items()}
    stats = {tp: ray.get(a.stats.remote(), timeout=60) for tp, a in actors.items()}
    for a in actors.values():
        ray.kill(a)
    yield out, stats, holder
    holder.close()


def test_tp2_replica_stores_the_rows_tp1_stores(tp_runs):
    out, _, holder = tp_runs
    worst = 1.0
    for one, two in zip(out[1], out[2]):
        assert one.error is None and two.error is None, (one.error, two.error)
        assert two.response_ids == one.response_ids, one.prompt_id
        a, b = (holder.get_samples([r.ref])[0] for r in (one, two))
        assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.loss_mask, b.loss_mask)
        cos = torch.nn.functional.cosine_similarity(
            a.hidden_states.float().flatten(1), b.hidden_states.float().flatten(1), dim=-1
        )
        worst = min(worst, cos.min().item())
    assert worst >= 0.999, worst


def test_tp2_replica_runs_through_several_times_its_kv_cache(tp_runs):
    out, stats, _ = tp_runs
    tokens = sum(r.prompt_tokens + len(r.response_ids) for r in out[2])
    assert stats[2]["kv_cache_tokens"] == KV_BLOCKS * 128
    assert tokens >= 4 * stats[2]["kv_cache_tokens"], (tokens, stats[2]["kv_cache_tokens"])
    assert all(r.ref is not None for r in out[2]) and stats[2]["failed"] == 0


@pytest.mark.slow
def test_a_replica_across_two_ray_nodes():
    """`nodes_per_replica: 2` on CPU: two raylets, the replica's placement group spread over both,
    vLLM's multi-node multiprocessing executor (engine actor + headless worker actor); the same
    tokens and rows as a TP-1 replica. In a process of its own: it needs a Ray cluster of its own."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, "-m", "tests.integration.two_node_replica"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
        errors="replace",
    )
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    assert run.returncode == 0 and lines, (run.stdout[-3000:], run.stderr[-3000:])
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["nodes"] == 2 and result["helpers"] == 1
    assert result["same_tokens"] and result["min_cos"] >= 0.999 and result["samples"] == 8, result
