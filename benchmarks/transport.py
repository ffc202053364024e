"""Hidden-state transport: Mooncake store vs Ray's object store, producer → consumer, same run.

    python benchmarks/transport.py [--samples 24] [--memcpy 0|1]

Producer and consumer are separate Ray actors (separate processes), as inference replicas and
trainer ranks are. Mooncake paths: the producer `put_sample`s (upsert) and sends only the
`SampleRef` through Ray; the consumer reads into its registered buffer (views, as the trainer
reads a step before packing it) and removes the keys, as the trainer does after a commit.
Three layouts of the store's memory (`transport.segment_host`, and what lies between nodes):
- node (the default): a `mooncake_client` daemon lends it; producer and consumer attach to the
  daemon over shared memory;
- two nodes: as between nodes of a cluster, the producer attached to one daemon (lending no
  memory) and the consumer to another: every sample crosses loopback TCP once, daemon to daemon;
- master: the master's actor lends it; producer and consumer are full clients, and every byte
  crosses loopback TCP twice (put, then read).
Ray path: the producer returns the sample's torch tensors as Ray objects and the consumer
`ray.get`s them. Two sample shapes: the local target's (2,048 tokens × 6 layers × hidden 576,
bf16) and a Kimi-K3-shaped one scaled down in tokens (512 tokens × 6 layers × hidden 7,168, bf16).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {"smollm2 (2048x6x576)": (2048, 6, 576), "kimi-k3-like (512x6x7168)": (512, 6, 7168)}


def make_sample(t, layers, h, seed):
    import torch

    from dspark.samples import Sample

    g = torch.Generator().manual_seed(seed)
    return Sample(
        torch.randint(0, 49152, (t,), generator=g),
        torch.ones(t, dtype=torch.bool),
        torch.randn(t, layers, h, generator=g).to(torch.bfloat16),
        list(range(2, 2 + layers)),
    )


class Producer:
    def __init__(self, store: dict, shape, n: int) -> None:
        from cluster.store import HiddenStateStore, StoreConfig

        self.samples = [make_sample(*shape, seed=i) for i in range(min(n, 4))]  # reuse buffers: measure transport
        self.store = HiddenStateStore(StoreConfig(**store, buffer_bytes=64 << 20)).connect()

    def put_mooncake(self, i: int):
        t0 = time.perf_counter()
        ref = self.store.put_sample(f"bench/{i}", self.samples[i % len(self.samples)])
        return ref, time.perf_counter() - t0

    def put_ray(self, i: int):
        s = self.samples[i % len(self.samples)]
        return {"hidden_states": s.hidden_states, "token_ids": s.token_ids, "loss_mask": s.loss_mask}


class Consumer:
    def __init__(self, store: dict) -> None:
        from cluster.store import HiddenStateStore, StoreConfig

        self.store = HiddenStateStore(StoreConfig(**store, buffer_bytes=64 << 20)).connect()

    def get_mooncake(self, refs):
        t0 = time.perf_counter()
        samples = self.store.get_samples(refs, copy=False)  # as the trainer reads a step
        for r in refs:
            self.store.remove(r.key)
        return sum(s.hidden_states.numel() * 2 for s in samples), time.perf_counter() - t0

    def get_ray(self, objs):
        import ray

        t0 = time.perf_counter()
        got = ray.get(objs)
        n = sum(int(d["hidden_states"].numel()) * 2 for d in got)
        return n, time.perf_counter() - t0


def pipelined(ray, n, put, get):
    """Windows of 4: the puts of window k+1 overlap the reads of window k."""
    t0 = time.perf_counter()
    pending = None
    for start in range(0, n, 4):
        batch = put(range(start, min(n, start + 4)))
        if pending is not None:
            ray.get(pending)
        pending = get(batch)
    ray.get(pending)
    return time.perf_counter() - t0


def run(shape, n, ray, name: str, producer_store: dict, consumer_store: dict, with_ray: bool):
    t, layers, h = shape
    nbytes = t * layers * h * 2
    rows = {}
    prod = ray.remote(num_cpus=0)(Producer).remote(producer_store, shape, n)
    cons = ray.remote(num_cpus=0)(Consumer).remote(consumer_store)
    ray.get([prod.put_mooncake.remote(-1), cons.get_mooncake.remote([])])  # warm up connections
    dt = pipelined(
        ray,
        n,
        lambda idx: [r for r, _ in ray.get([prod.put_mooncake.remote(i) for i in idx])],
        lambda refs: cons.get_mooncake.remote(refs),
    )
    rows[f"mooncake, {name}"] = (n * nbytes / dt / 1e9, n / dt)
    # Raw read bandwidth of one consumer (no pipelining): put 4, then time the reads
    refs = [r for r, _ in ray.get([prod.put_mooncake.remote(10_000 + i) for i in range(4)])]
    got, secs = ray.get(cons.get_mooncake.remote(refs))
    rows[f"  read only, {name}"] = (got / secs / 1e9, len(refs) / secs)
    if with_ray:
        dt = pipelined(
            ray, n, lambda idx: [prod.put_ray.remote(i) for i in idx], lambda objs: cons.get_ray.remote(objs)
        )
        rows["ray object store"] = (n * nbytes / dt / 1e9, n / dt)
    ray.kill(prod)
    ray.kill(cons)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=24)
    ap.add_argument("--memcpy", default=os.environ.get("MC_STORE_MEMCPY", "0"))
    args = ap.parse_args()
    os.environ["MC_STORE_MEMCPY"] = args.memcpy
    import ray

    from cluster.store import MooncakeMaster, NodeStore

    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        _temp_dir=f"/tmp/ray-bench-{os.getpid()}",
        runtime_env={"env_vars": {k: v for k, v in os.environ.items() if k.startswith("MC_")}},
    )
    knobs = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MC_"))
    print(
        f"{knobs} (store clients), {args.samples} samples per shape, producer and consumer processes; "
        "as in the job, the memory is in a third process"
    )
    print(f"{'shape':28} {'path':52} {'GB/s':>7} {'samples/s':>10}")
    for name, shape in SHAPES.items():
        rows = {}
        # One layout at a time, each with its own master, so puts land where the layout says.
        for layout in ("node", "two nodes", "master"):
            master = MooncakeMaster(segment_bytes=2 << 30 if layout == "master" else 0)
            daemons = []
            if layout == "node":
                daemons = [NodeStore(master.address, 2 << 30)]
                label = "node daemon, attached over shm"
            elif layout == "two nodes":  # the producer's daemon lends nothing: every sample crosses
                daemons = [NodeStore(master.address, 0), NodeStore(master.address, 2 << 30)]
                label = "two node daemons, one loopback TCP hop"
            else:
                label = "memory in the master, two loopback TCP hops"
            ends = [{"master": master.address, "node_client": d.address} for d in daemons] or [
                {"master": master.address}
            ]
            rows.update(run(shape, args.samples, ray, label, ends[0], ends[-1], with_ray=layout == "node"))
            for d in daemons:
                d.stop()
            master.stop()
        for path, (gbs, sps) in rows.items():
            print(f"{name:28} {path:52} {gbs:7.2f} {sps:10.1f}")
    ray.shutdown()


if __name__ == "__main__":
    main()
