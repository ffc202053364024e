"""`StoreServices`: the job's shared Mooncake services — the master, one store daemon per node
that runs replicas or trainer ranks, and the `StoreConfig` every store user receives.

The driver owns them (not the actors that use them), so that a replaced replica or trainer rank
does not take a node's samples with it. Thread-safe: replicas are added from the autoscaler
thread while the training loop replaces dead ones.
"""

from __future__ import annotations

import logging
import threading

from cluster.config import TransportConfig
from cluster.store import StoreConfig

log = logging.getLogger("dspark.services")


class StoreServices:
    def __init__(self, transport: TransportConfig, run_name: str, log_dir: str) -> None:
        import ray

        self.ray, self.t, self.run_name, self.log_dir = ray, transport, run_name, log_dir
        self.master = None
        self.master_address = ""
        self.node_stores: dict[str, tuple[object, str]] = {}  # node id -> (NodeStore actor, address)
        self._lock = threading.Lock()

    def start(self, timeout_s: float = 120.0) -> None:
        from cluster.master import MooncakeMaster

        t = self.t
        self.master = self.ray.remote(num_cpus=0)(MooncakeMaster).options(
            name=f"mooncake-master-{self.run_name}", max_concurrency=4,
        ).remote(t.master_host, t.master_port, self.log_dir,
                 segment_bytes=t.segment_mb << 20 if t.segment_host == "master" else 0,
                 protocol=t.protocol, rdma_devices=t.rdma_devices)
        self.master_address = self.ray.get(self.master.info.remote(), timeout=timeout_s)["address"]
        log.info("mooncake master at %s", self.master_address)

    def ensure_node_stores(self, placements, timeout_s: float = 120.0) -> None:
        """`segment_host: node`: a store daemon on every node these placements landed on that has
        none yet."""
        if self.t.segment_host != "node":
            return
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from cluster.node_store import NodeStore

        t = self.t
        with self._lock:
            for node in sorted({n for p in placements for n in p.bundle_nodes} - set(self.node_stores)):
                actor = self.ray.remote(num_cpus=0)(NodeStore).options(
                    name=f"mooncake-store-{self.run_name}-{node[:12]}", max_concurrency=2,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                ).remote(self.master_address, t.segment_mb << 20,
                         host="127.0.0.1" if t.master_host.startswith("127.") else "0.0.0.0",
                         protocol=t.protocol, rdma_devices=t.rdma_devices, log_dir=self.log_dir)
                address = self.ray.get(actor.info.remote(), timeout=timeout_s)["address"]
                self.node_stores[node] = (actor, address)
                log.info("store daemon for node %s at %s (%d MiB)", node[:12], address, t.segment_mb)

    def store_config(self) -> StoreConfig:
        """What every store user (replica, connector, trainer rank) is given: the master, the
        node daemons by Ray node id (each user attaches to its own node's), the transport."""
        t = self.t
        with self._lock:
            clients = {node: address for node, (_, address) in self.node_stores.items()}
        host = self.ray.util.get_node_ip_address() if t.protocol == "rdma" else "127.0.0.1"
        return StoreConfig(master=self.master_address, local_hostname=host, protocol=t.protocol,
                           rdma_devices=t.rdma_devices, buffer_bytes=t.buffer_mb << 20, node_clients=clients)

    def master_info(self, timeout_s: float = 30.0) -> dict:
        """The master's address, generation (bumped at every restart: a new generation has no
        keys) and restart count."""
        return self.ray.get(self.master.info.remote(), timeout=timeout_s)

    def daemon_restarts(self, timeout_s: float = 10.0) -> int:
        with self._lock:
            actors = [a for a, _ in self.node_stores.values()]
        return sum(d["restarts"] for d in self.ray.get([a.info.remote() for a in actors], timeout=timeout_s))

    def stop(self) -> None:
        for actor, _ in self.node_stores.values():
            try:
                self.ray.get(actor.stop.remote(), timeout=30)
                self.ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.node_stores.clear()
        if self.master is not None:
            try:
                self.ray.get(self.master.stop.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - already gone
                pass

