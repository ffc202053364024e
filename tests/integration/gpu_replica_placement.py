"""A GPU replica's placement on two Ray nodes of fake GPUs, up to what vLLM is handed: two raylets
on this machine (`ray.cluster_utils.Cluster`, each with `num_gpus=2`, the second at its own
loopback address), the replica's placement group made as the job makes it (`replica_spec`,
`place`), its engine actor started as the job starts it (`producer_spec`, `start_engine_actors`)
but as `EngineProbe`: `InferenceActor` whose engine start is replaced by a record of what it
would hand vLLM. In that actor the probe then does what vLLM's Ray executor (V2, vLLM's default)
does with `VLLM_RAY_BUNDLE_INDICES` (`vllm/v1/executor/ray_executor_v2.py`, `_init_executor`):
rank i runs with 1 GPU and 0 CPUs on bundle `indices[i]` of the actor's placement group (here a
task, not vLLM's worker actor), and reports its node and GPU. The actor reports the store address
the connector's client (rank 0's, on the actor's node) would give its peers over RDMA
(`StoreConfig.resolve_local_hostname`: its node's IP, the second node's being another).

Cases: TP 2 on one node; TP 4 over two nodes with the job's bundles where Ray puts them (the
placement and the actor's options only: each engine actor is a process that imports torch, ~15 s
on a busy 2-core box); TP 4 over two nodes with the job's bundles pinned to alternate nodes
(custom resources), the layout that needs the bundles sorted by node. Run as a script (a Ray
cluster of its own, apart from the test session's): prints one JSON line per case.
`python -m tests.integration.gpu_replica_placement`."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
SECOND_IP = "127.0.0.2"  # the second node's address: a peer on another node has another IP


def vllm_rank():
    """What one of vLLM's Ray workers learns where it starts: its node and GPU."""
    import ray

    ctx = ray.get_runtime_context()
    return {"node": ctx.get_node_id(), "gpus": [str(g) for g in ctx.get_accelerator_ids().get("GPU", [])]}


def probe_class():
    """`EngineProbe`: `InferenceActor` whose engine start records the engine's arguments (and
    whose capture class, which needs the checkpoint, adds none), with `report`. Made on first use:
    the driver imports this module before the cluster package's heavier parts."""
    from cluster.inference import InferenceActor

    class Probe(InferenceActor):
        def __init__(self, settings, *args) -> None:
            import cluster.inference.replica as replica

            self.engine_kwargs = None

            def record(kwargs):
                self.engine_kwargs = kwargs
                return SimpleNamespace(get_tokenizer=lambda: None)

            # the capture class needs the checkpoint's config.json: what it adds is not placement
            replica.capture_engine_kwargs = lambda *a, **k: {}
            replica.start_engine = record
            super().__init__(settings, *args)

        def report(self) -> dict:
            import ray
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            from cluster.store import StoreConfig

            t0 = time.monotonic()
            ctx = ray.get_runtime_context()
            pg = ray.util.get_current_placement_group()  # what vLLM's executor takes as the replica's
            indices = [int(i) for i in os.environ.get("VLLM_RAY_BUNDLE_INDICES", "").split(",") if i]
            worker = ray.remote(vllm_rank)
            ranks = ray.get(
                [
                    worker.options(
                        num_cpus=0,
                        num_gpus=1,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b),
                    ).remote()
                    for b in indices
                ],
                timeout=60,
            )
            kw = self.engine_kwargs
            return {
                "node": ctx.get_node_id(),
                "gpus": [str(g) for g in ctx.get_accelerator_ids().get("GPU", [])],
                "pg": pg.id.hex() if pg else None,
                "bundle_indices": os.environ.get("VLLM_RAY_BUNDLE_INDICES"),
                "engine": {
                    "tensor_parallel_size": kw["tensor_parallel_size"],
                    "distributed_executor_backend": kw.get("distributed_executor_backend"),
                    "store_host": kw["kv_transfer_config"]["kv_connector_extra_config"]["store"]["local_hostname"],
                },
                "ranks": ranks,
                # the store client of the connector (rank 0's worker, on this node) gives its peers
                "store_host": StoreConfig(
                    **kw["kv_transfer_config"]["kv_connector_extra_config"]["store"]
                ).resolve_local_hostname(),
                "ranks_s": round(time.monotonic() - t0, 1),
            }

    Probe.__name__ = Probe.__qualname__ = "EngineProbe"
    return Probe


def placed_only(name, spec, ips: dict) -> dict:
    """The job's placement group and the engine actor's options, without starting the actor."""
    from cluster.inference.replica_pool import engine_actor_options
    from cluster.scaling import place, release

    placed = place(spec, 60)
    try:
        options = engine_actor_options(placed, len(spec.bundles), None)
        strategy = options["scheduling_strategy"]
        env = (options["runtime_env"] or {}).get("env_vars", {})
        return {
            "case": name,
            "bundle_nodes": placed.bundle_nodes,
            "order": placed.order,
            "ips": ips,
            "node": placed.bundle_nodes[strategy.placement_group_bundle_index],
            "num_gpus": options["num_gpus"],
            "bundle_indices": env.get("VLLM_RAY_BUNDLE_INDICES"),
        }
    finally:
        release([placed])


def run_case(name, cfg, spec, ips: dict) -> dict:
    import ray

    from cluster.inference import start_engine_actors
    from cluster.job.settings import producer_spec
    from cluster.scaling import place, release
    from dspark.chat import TOKENIZER_DEFAULT

    t0 = time.monotonic()
    placed = place(spec, 60)
    try:
        inputs = SimpleNamespace(
            target=SimpleNamespace(path="/shared/models/Kimi-K3", chat=TOKENIZER_DEFAULT),
            layer_ids=[2, 24, 46, 69, 91, 92],
        )
        job = producer_spec(cfg, inputs, 0, "")  # the job's settings and actor environment
        settings = replace(job.settings, store=replace(job.settings.store, protocol="rdma"))
        engine, helpers = start_engine_actors(probe_class(), settings, placed, job.env, f"probe-{name}", ("r0", "g0"))
        ray.get(engine.__ray_ready__.remote(), timeout=120)
        started = time.monotonic() - t0
        report = ray.get(engine.report.remote(), timeout=120)
        report["engine_s"] = round(started, 1)
        ray.kill(engine)
    finally:
        release([placed])
    return {
        "case": name,
        "bundle_nodes": placed.bundle_nodes,
        "order": placed.order,
        "helpers": len(helpers),
        "ips": ips,
        "seconds": round(time.monotonic() - t0, 1),
        **report,
    }


T0 = time.monotonic()


def main() -> list[dict]:
    import ray
    from ray.cluster_utils import Cluster

    from cluster.config_load import load_config
    from cluster.scaling import RoleSpec, replica_spec
    from cluster.store import free_port

    temp = f"/tmp/ray-gpu-place-{os.getpid()}"  # short socket paths (Ray's limit)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "num_gpus": 2,
            "resources": {"node_a": 2},
            "gcs_server_port": free_port(),
            "include_dashboard": False,
            "temp_dir": temp,
        },
    )
    cluster.add_node(num_cpus=2, num_gpus=2, resources={"node_b": 2}, node_ip_address=SECOND_IP)
    out = []
    print(f"cluster up {time.monotonic() - T0:.1f}s", file=sys.stderr, flush=True)
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes(timeout=60)
        ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        k3 = ROOT / "configs" / "kimi_k3.yaml"
        small = [
            f"topology.groups.0.{k}" for k in ("gpus_per_node=2", "trainer_ranks_per_node=2", "cpus_per_replica=1")
        ]
        one = load_config(k3, ["target.tensor_parallel_size=2", "target.nodes_per_replica=1", *small])
        two = load_config(k3, ["target.tensor_parallel_size=4", "target.nodes_per_replica=2", *small])
        out.append(run_case("tp2-one-node", one, replica_spec(one, 0), ips))
        out.append(placed_only("tp4-two-nodes", replica_spec(two, 0), ips))
        # bundles 0 and 2 on one node, 1 and 3 on the other: vLLM's ranks in index order would
        # alternate nodes
        job = replica_spec(two, 0)
        pinned = [{**b, "node_a" if i % 2 == 0 else "node_b": 1} for i, b in enumerate(job.bundles)]
        alternate = RoleSpec(job.group, job.role, 1, pinned, job.strategy, job.nodes, job.run)
        out.append(run_case("tp4-alternate-bundles", two, alternate, ips))
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    for result in main():
        print("RESULT " + json.dumps(result), flush=True)
