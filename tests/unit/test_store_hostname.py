"""A store client's own address (Mooncake's `local_hostname`) is resolved in the process that
connects, never on the driver: over RDMA a peer's transfer engine connects back to it, so a replica
or trainer rank on another node than the driver's must give its own node's IP (issue 52, item 7)."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from cluster.config import TransportConfig
from cluster.store import HiddenStateStore, StoreConfig, StoreServices

DRIVER_IP, REPLICA_IP = "10.0.0.1", "10.0.0.2"


class FakeMooncake:
    """Records the arguments of `setup` (a full client's connection)."""

    setups: list[tuple] = []

    def setup(self, *args) -> int:
        FakeMooncake.setups.append(args)
        return 0


@pytest.fixture
def node_ip(monkeypatch):
    """`ray.util.get_node_ip_address` answers what `set` says: the node of the process calling it."""
    import mooncake.store
    import ray.util

    where = {"ip": DRIVER_IP}
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda *a, **k: where["ip"])
    monkeypatch.setattr(mooncake.store, "MooncakeDistributedStore", FakeMooncake)
    monkeypatch.setattr("cluster.store.client.probe", lambda *a, **k: True)
    FakeMooncake.setups = []
    return where


def driver_config(protocol: str) -> StoreConfig:
    """What the job's driver hands every store user (`StoreServices.store_config`), made on the
    driver's node, with `segment_host: master` (no node daemons: every user is a full client)."""
    services = StoreServices(TransportConfig(protocol=protocol, segment_host="master"), "run", "/tmp")
    services.master_address = f"{DRIVER_IP}:50051"
    return services.store_config()


def test_rdma_client_gives_its_own_nodes_ip_not_the_drivers(node_ip):
    cfg = driver_config("rdma")  # made where the driver runs (its node's IP: DRIVER_IP)
    assert cfg.local_hostname == ""  # the driver names no address for the clients
    # ... the config travels through Ray, and through vLLM's connector config as JSON
    shipped = json.loads(json.dumps(asdict(cfg)))
    node_ip["ip"] = REPLICA_IP  # the process that connects runs on the replica's node
    HiddenStateStore(shipped).connect(timeout=1.0)
    assert FakeMooncake.setups[-1][0] == REPLICA_IP
    assert FakeMooncake.setups[-1][4] == "rdma" and FakeMooncake.setups[-1][6] == f"{DRIVER_IP}:50051"


def test_tcp_client_gives_loopback_and_a_set_address_stands(node_ip):
    node_ip["ip"] = REPLICA_IP
    assert driver_config("tcp").resolve_local_hostname() == "127.0.0.1"  # TCP peers never call a client back
    assert StoreConfig(local_hostname="192.168.7.7", protocol="rdma").resolve_local_hostname() == "192.168.7.7"
    assert StoreConfig(protocol="rdma").resolve_local_hostname() == REPLICA_IP


def test_resolved_without_a_ray_connection():
    """vLLM's multiprocessing workers are no Ray processes: they get the routed address (loopback
    on a one-machine cluster, as in the suite) without connecting to Ray."""
    host = StoreConfig(protocol="rdma").resolve_local_hostname()
    assert host.count(".") == 3, host
