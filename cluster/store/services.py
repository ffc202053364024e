"""`StoreServices`: the job's shared Mooncake services — the master, one store daemon per node
that runs replicas or trainer ranks, and the `StoreConfig` every store user receives.

The driver owns them (not the actors that use them), so that a replaced replica or trainer rank
does not take a node's samples with it. Each runs as a Ray actor that supervises its process
(a dead process is restarted by the actor). A dead *actor* is replaced here (`check`, at most
`transport.max_service_restarts` times in a job), on the same node and at the same address, so
that store users find it where they left it: the master on the driver's node at the port chosen
at the first start; a daemon on its node at its first port. A replaced master has no keys (its
generation counts on, so the training loop sends stored samples back for regeneration; the
daemons re-register with it by themselves); a replaced daemon has lost what it held (readers
find those samples missing, and they are regenerated). Thread-safe: replicas are added from the
autoscaler thread while the training loop checks and replaces.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time

from cluster.config import TransportConfig
from cluster.errors import cause_of
from cluster.store.client import StoreConfig
from cluster.store.process import free_port

log = logging.getLogger("dspark.services")
CHECK_INTERVAL_S = 2.0  # how often `check` asks the actors whether they are alive


class ServiceFailure(RuntimeError):
    pass


def unwatched(info: dict, what: str) -> None:
    """A service whose process watcher gave up (a crash loop) or died: ServiceFailure naming why
    (`SupervisedProcess.failure`), so that the job stops with it instead of running on a store
    nobody looks after."""
    if info.get("failure"):
        raise ServiceFailure(f"{what} at {info.get('address')}: {info['failure']}")


class StoreServices:
    def __init__(self, transport: TransportConfig, run_name: str, log_dir: str) -> None:
        import ray

        self.ray, self.t, self.run_name, self.log_dir = ray, transport, run_name, log_dir
        self.master = None
        self.master_address = ""
        self.master_generations = 0  # of the master actors replaced so far: the generation counts on
        self.node_stores: dict[str, tuple[object, str]] = {}  # node id -> (NodeStore actor, address)
        self.replaced = 0
        self.events: list[str] = []
        self.sample_key = secrets.token_hex(32)  # this job's: samples signed under another key are refused
        self._generation = 0
        self._checked = 0.0
        self._lock = threading.Lock()

    # ---- starting ---------------------------------------------------------------------------
    def start(self, timeout_s: float = 120.0) -> None:
        t = self.t
        port = t.master_port or free_port(t.master_host if t.master_host != "0.0.0.0" else "")
        self.master = self._start_master(port, timeout_s)
        log.info("mooncake master at %s", self.master_address)

    def _start_master(self, port: int, timeout_s: float):
        """On the driver's node (where `port` was chosen), so that a replacement gets the same
        address."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from cluster.store.master import MooncakeMaster

        t = self.t
        actor = (
            self.ray.remote(num_cpus=0)(MooncakeMaster)
            .options(
                name=f"mooncake-master-{self.run_name}-{self.replaced}",
                max_concurrency=4,
                scheduling_strategy=NodeAffinitySchedulingStrategy(
                    self.ray.get_runtime_context().get_node_id(), soft=False
                ),
            )
            .remote(
                t.master_host,
                port,
                self.log_dir,
                segment_bytes=t.segment_mb << 20 if t.segment_host == "master" else 0,
                protocol=t.protocol,
                rdma_devices=t.rdma_devices,
            )
        )
        info = self.ray.get(actor.info.remote(), timeout=timeout_s)
        self.master_address, self._generation = info["address"], self.master_generations + info["generation"]
        return actor

    def _start_daemon(self, node: str, port: int, timeout_s: float) -> tuple[object, str]:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from cluster.store.node_store import NodeStore

        t = self.t
        actor = (
            self.ray.remote(num_cpus=0)(NodeStore)
            .options(
                name=f"mooncake-store-{self.run_name}-{node[:12]}-{self.replaced}",
                max_concurrency=2,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
            )
            .remote(
                self.master_address,
                t.segment_mb << 20,
                host="127.0.0.1" if t.master_host.startswith("127.") else "0.0.0.0",
                port=port,
                protocol=t.protocol,
                rdma_devices=t.rdma_devices,
                log_dir=self.log_dir,
            )
        )
        return actor, self.ray.get(actor.info.remote(), timeout=timeout_s)["address"]

    def ensure_node_stores(self, placements, timeout_s: float = 120.0) -> None:
        """`segment_host: node`: a store daemon on every node these placements landed on that has
        none yet."""
        if self.t.segment_host != "node":
            return
        with self._lock:
            for node in sorted({n for p in placements for n in p.bundle_nodes} - set(self.node_stores)):
                self.node_stores[node] = self._start_daemon(node, 0, timeout_s)
                log.info(
                    "store daemon for node %s at %s (%d MiB)", node[:12], self.node_stores[node][1], self.t.segment_mb
                )

    def store_config(self) -> StoreConfig:
        """What every store user (replica, connector, trainer rank) is given: the master, the
        node daemons by Ray node id (each user attaches to its own node's), the transport. No
        `local_hostname`: each client resolves its own node's address where it connects
        (`StoreConfig.resolve_local_hostname`); this node's would be wrong for every client on
        another (over RDMA with `segment_host: master`, where replicas and ranks are full clients)."""
        t = self.t
        with self._lock:
            clients = {node: address for node, (_, address) in self.node_stores.items()}
        return StoreConfig(
            master=self.master_address,
            protocol=t.protocol,
            rdma_devices=t.rdma_devices,
            buffer_bytes=t.buffer_mb << 20,
            node_clients=clients,
            sample_key=self.sample_key,
        )

    # ---- supervision ------------------------------------------------------------------------
    def check(self, force: bool = False) -> int:
        """Replace a dead master or daemon actor (at most `transport.max_service_restarts` in a
        job, then ServiceFailure); returns the master's generation, which grows with every
        restart of its process or actor (a new generation has no keys). Asks the actors at most
        every CHECK_INTERVAL_S (unless `force`); between, the last answer."""
        if not force and time.monotonic() - self._checked < CHECK_INTERVAL_S:
            return self._generation
        with self._lock:
            self._checked = time.monotonic()
            try:
                info = self.ray.get(self.master.info.remote(), timeout=30)
                unwatched(info, "the Mooncake master")
                self._generation = self.master_generations + info["generation"]
            except self.ray.exceptions.RayActorError as e:
                self._replace("the Mooncake master's actor", e)
                self.ray.kill(self.master)
                self.master_generations = self._generation
                port = int(self.master_address.rsplit(":", 1)[1])
                self.master = self._retry(lambda: self._start_master(port, 120.0))
            for node, (actor, address) in list(self.node_stores.items()):
                try:
                    unwatched(self.ray.get(actor.info.remote(), timeout=30), f"the store daemon of node {node[:12]}")
                except self.ray.exceptions.RayActorError as e:
                    self._replace(f"the store daemon's actor of node {node[:12]}", e)
                    self.ray.kill(actor)
                    port = int(address.rsplit(":", 1)[1])
                    self.node_stores[node] = self._retry(
                        lambda node=node, port=port: self._start_daemon(node, port, 120.0)
                    )
        return self._generation

    def _replace(self, what: str, error: Exception) -> None:
        cause = cause_of(error, 300)
        if self.replaced >= self.t.max_service_restarts:
            raise ServiceFailure(
                f"{what} died; {self.replaced} store service actors were replaced already "
                f"(transport.max_service_restarts={self.t.max_service_restarts}): {cause}"
            )
        self.replaced += 1
        self.events.append(f"{what} died ({cause}); replaced at the same address")
        log.warning("%s", self.events[-1])

    @staticmethod
    def _retry(start, attempts: int = 5, wait_s: float = 2.0):
        """The old process's port may not be free yet (the kernel holds it a moment)."""
        for i in range(attempts):
            try:
                return start()
            except Exception:  # noqa: BLE001 - the last attempt's error is raised
                if i == attempts - 1:
                    raise
                time.sleep(wait_s)

    def master_info(self, timeout_s: float = 30.0) -> dict:
        """The master's address, generation and process restart count."""
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
