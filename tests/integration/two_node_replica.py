"""A CPU replica whose two tensor-parallel ranks run on two Ray nodes, as `nodes_per_replica: 2`
lays out a GB300 replica: two raylets on this machine (`ray.cluster_utils.Cluster`, each node
with its own resources), the replica's placement group spread over both, vLLM's multi-node
multiprocessing executor (the engine actor on the first node, a headless worker actor on the
second), against a TP-1 replica on the same prompts.

Run as a script (a Ray cluster of its own, apart from the test session's): prints one JSON line
with what the test checks. `python -m tests.integration.two_node_replica`."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [
    {"id": f"p{i}", "messages": [{"role": "user", "content": f"Tell me something about the number {i}."}]}
    for i in range(8)
]


def main() -> dict:
    import ray
    import torch
    from ray.cluster_utils import Cluster

    from cluster.config import SamplingConfig
    from cluster.config_load import load_config
    from cluster.hardware import cpu_process_env
    from cluster.inference import InferenceActor, InferenceSettings, start_engine_actors
    from cluster.scaling import place, replica_spec
    from cluster.store import HiddenStateStore, MooncakeMaster, StoreConfig
    from dspark.config import DSparkConfig
    from dspark.targets import prepare_random_llama
    from tests.helpers import eager_target

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("MC_STORE_MEMCPY", "0")
    target = str(prepare_random_llama())
    from cluster.store import free_port

    # short socket paths (Ray's limit), in a folder of its own
    temp = f"/tmp/ray-two-node-{os.getpid()}"
    # Ray's default GCS port (6379) may be the local job's head's: a port of its own. (Its
    # nodes take the machine's address: ray.init turns a loopback address into it anyway.)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "gcs_server_port": free_port(), "include_dashboard": False, "temp_dir": temp},
    )
    cluster.add_node(num_cpus=2)
    master = MooncakeMaster(log_dir=str(Path(os.environ.get("TMPDIR", "/tmp")) / f"two-node-mooncake-{os.getpid()}"))
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes(timeout=60)
        cfg = load_config(
            ROOT / "configs" / "local.yaml",
            ["target.path=random-llama", "target.tensor_parallel_size=2", "target.nodes_per_replica=2"],
        )
        placed = place(replica_spec(cfg, 0), 60)
        # the memory the samples are stored in (the job's node store daemons lend it there)
        holder = HiddenStateStore(StoreConfig(master=master.address, segment_bytes=64 << 20)).connect()
        layer_ids = DSparkConfig.from_target(target).extract_layer_ids
        store = StoreConfig(master=master.address)
        tp1 = InferenceSettings(
            eager_target(target, max_model_len=256, dtype="float32"),
            layer_ids,
            "one/g0",
            sampling=SamplingConfig(max_tokens=24),
            store=store,
            cpu_threads=1,
        )
        env = cpu_process_env(("tcmalloc", "iomp"), 1)
        t0 = time.monotonic()
        spanning, helpers = start_engine_actors(
            InferenceActor,
            replace(tp1, key_prefix="two/g0", target=replace(tp1.target, tensor_parallel_size=2)),
            placed,
            env,
            "two-node-r0",
            ("r0", "g0"),
        )
        two = ray.get(spanning.process.remote(PROMPTS), timeout=600)
        started_and_ran_s = time.monotonic() - t0
        one_actor = ray.remote(num_cpus=1)(InferenceActor).options(runtime_env={"env_vars": env}).remote(tp1)
        one = ray.get(one_actor.process.remote(PROMPTS), timeout=600)
        worst, same_tokens = 1.0, True
        for a, b in zip(one, two):
            if a.error or b.error:
                raise RuntimeError(f"replica failed: {a.error or b.error}")
            same_tokens &= a.response_ids == b.response_ids
            x, y = (holder.get_samples([r.ref])[0] for r in (a, b))
            cos = torch.nn.functional.cosine_similarity(
                x.hidden_states.float().flatten(1), y.hidden_states.float().flatten(1), dim=-1
            )
            worst = min(worst, cos.min().item())
        holder.close()
        return {
            "nodes": len(set(placed.bundle_nodes)),
            "helpers": len(helpers),
            "same_tokens": same_tokens,
            "min_cos": worst,
            "samples": len(two),
            "seconds": round(started_and_ran_s, 1),
        }
    finally:
        ray.shutdown()
        master.stop()
        cluster.shutdown()


if __name__ == "__main__":
    print("RESULT " + json.dumps(main()), flush=True)
    sys.exit(0)
