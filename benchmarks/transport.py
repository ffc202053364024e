"""Hidden-state transport: Mooncake store vs Ray's object store, producer → consumer, same run.

    python benchmarks/transport.py [--samples 24] [--memcpy 0|1]

Producer and consumer are separate Ray actors (separate processes), as inference replicas and
trainer ranks are. Mooncake path: the producer `put_sample`s (upsert) and sends only the
`SampleRef` through Ray; the consumer reads into its registered buffer and removes the key,
as the trainer does after a commit. Ray path: the producer returns the sample's torch tensors
as Ray objects and the consumer `ray.get`s them. Two sample shapes: the local target's
(2,048 tokens × 6 layers × hidden 576, bf16) and a Kimi-K3-shaped one scaled down in tokens
(512 tokens × 6 layers × hidden 7,168, bf16).
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
    return Sample(torch.randint(0, 49152, (t,), generator=g), torch.ones(t, dtype=torch.bool),
                  torch.randn(t, layers, h, generator=g).to(torch.bfloat16), list(range(2, 2 + layers)))


class Producer:
    def __init__(self, master: str | None, shape, n: int) -> None:
        from cluster.store import HiddenStateStore, StoreConfig

        self.samples = [make_sample(*shape, seed=i) for i in range(min(n, 4))]  # reuse buffers: measure transport
        self.store = HiddenStateStore(StoreConfig(master=master, buffer_bytes=512 << 20)).connect() if master else None

    def put_mooncake(self, i: int):
        t0 = time.perf_counter()
        ref = self.store.put_sample(f"bench/{i}", self.samples[i % len(self.samples)])
        return ref, time.perf_counter() - t0

    def put_ray(self, i: int):
        s = self.samples[i % len(self.samples)]
        return {"hidden_states": s.hidden_states, "token_ids": s.token_ids, "loss_mask": s.loss_mask}


class Consumer:
    def __init__(self, master: str | None) -> None:
        from cluster.store import HiddenStateStore, StoreConfig

        self.store = HiddenStateStore(StoreConfig(master=master)).connect() if master else None

    def get_mooncake(self, refs):
        t0 = time.perf_counter()
        samples = self.store.get_samples(refs)
        for r in refs:
            self.store.remove(r.key)
        return sum(s.hidden_states.numel() * 2 for s in samples), time.perf_counter() - t0

    def get_ray(self, objs):
        import ray

        t0 = time.perf_counter()
        got = ray.get(objs)
        n = sum(int(d["hidden_states"].numel()) * 2 for d in got)
        return n, time.perf_counter() - t0


def run(shape_name, shape, n, ray, master):
    P = ray.remote(num_cpus=0)(Producer)
    C = ray.remote(num_cpus=0)(Consumer)
    t, layers, h = shape
    nbytes = t * layers * h * 2
    prod, cons = P.remote(master.address, shape, n), C.remote(master.address)
    ray.get([prod.put_mooncake.remote(-1), cons.get_mooncake.remote([])])  # warm up connections
    rows = {}
    # Mooncake: pipelined in windows of 4 (puts of window k+1 overlap gets of window k)
    t0 = time.perf_counter()
    pending = None
    for start in range(0, n, 4):
        puts = ray.get([prod.put_mooncake.remote(i) for i in range(start, min(n, start + 4))])
        if pending is not None:
            ray.get(pending)
        pending = cons.get_mooncake.remote([r for r, _ in puts])
    ray.get(pending)
    dt = time.perf_counter() - t0
    rows["mooncake"] = (n * nbytes / dt / 1e9, n / dt)
    # Ray object store, same pipelining
    t0 = time.perf_counter()
    pending = None
    for start in range(0, n, 4):
        objs = [prod.put_ray.remote(i) for i in range(start, min(n, start + 4))]
        if pending is not None:
            ray.get(pending)
        pending = cons.get_ray.remote(objs)
    ray.get(pending)
    dt = time.perf_counter() - t0
    rows["ray object store"] = (n * nbytes / dt / 1e9, n / dt)
    # Raw read bandwidth of one consumer (no pipelining): put all, then time the gets
    refs = [r for r, _ in ray.get([prod.put_mooncake.remote(10_000 + i) for i in range(4)])]
    got, secs = ray.get(cons.get_mooncake.remote(refs))
    rows["mooncake read only"] = (got / secs / 1e9, len(refs) / secs)
    ray.kill(prod)
    ray.kill(cons)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=24)
    ap.add_argument("--memcpy", default=os.environ.get("MC_STORE_MEMCPY", "0"))
    args = ap.parse_args()
    os.environ["MC_STORE_MEMCPY"] = args.memcpy
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    from cluster.master import MooncakeMaster

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             _temp_dir=f"/tmp/ray-bench-{os.getpid()}",
             runtime_env={"env_vars": {k: v for k, v in os.environ.items() if k.startswith("MC_")}})
    master = MooncakeMaster(segment_bytes=2 << 30)  # as in the job: a third process hosts the store memory
    knobs = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MC_"))
    print(f"{knobs}, {args.samples} samples per shape, loopback TCP, producer and consumer "
          "processes, store memory in the master's process")
    print(f"{'shape':28} {'path':22} {'GB/s':>7} {'samples/s':>10}")
    for name, shape in SHAPES.items():
        for path, (gbs, sps) in run(name, shape, args.samples, ray, master).items():
            print(f"{name:28} {path:22} {gbs:7.2f} {sps:10.1f}")
    master.stop()
    ray.shutdown()


if __name__ == "__main__":
    main()
