"""What listens, and who may talk to it, on a local run: the test session's Ray (token
authentication, as every run), a supervised Mooncake master and store daemon, a store client.

Every TCP listener is on loopback, except those no switch can keep there, and each of those is
either Ray's (which refuses a client without the token) or the store daemon's transfer-engine
ports (Mooncake has no authentication for them: what protects the data is the samples' MAC,
tests/unit/test_sample_format.py)."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def listeners() -> list[tuple[str, int, int, str]]:
    """(address, port, pid, process name) of every listening TCP socket, from /proc (no `ss`)."""
    inodes = {}
    for proto in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{proto}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] != "0A":  # LISTEN
                continue
            hexaddr, hexport = cols[1].split(":")
            raw = bytes.fromhex(hexaddr)
            # /proc prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            inodes[cols[9]] = (str(ipaddress.ip_address(raw)), int(hexport, 16))
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in inodes:
                addr, port = inodes[target[8:-1]]
                out.append((addr, port, int(pid), f"{name} {cmd[:120]}"))
    return out


def is_loopback(addr: str) -> bool:
    ip = ipaddress.ip_address(addr)
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


def descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False


def is_ray(what: str) -> bool:
    name, _, cmd = what.partition(" ")
    return name in ("gcs_server", "raylet") or name.startswith("ray::") or "site-packages/ray/" in cmd


def test_local_listeners_are_loopback_or_authenticated(ray_cluster, tmp_path):
    from cluster.store import MooncakeMaster
    from cluster.store import NodeStore
    from cluster.store import HiddenStateStore, StoreConfig

    ray = ray_cluster
    assert os.environ.get("RAY_AUTH_MODE") == "token"
    # This process listens only as a Ray driver (its core worker's server) before the store starts.
    as_driver = {(a, p) for a, p, pid, _ in listeners() if pid == os.getpid()}
    master = MooncakeMaster(log_dir=str(tmp_path))
    daemon = NodeStore(master.address, 64 << 20, log_dir=str(tmp_path))
    store = HiddenStateStore(StoreConfig(master=master.address, node_client=daemon.address)).connect()
    try:
        ours = [x for x in listeners() if descends_from(x[2], os.getpid())]  # this session's processes
        mooncake = [x for x in ours if x[2] in (master.pid(), daemon.pid())]
        exposed = [x for x in ours if not is_loopback(x[0])]
        # The master's RPC and metrics and the daemon's RPC are on loopback; the daemon's transfer
        # engine (handshake, data) cannot be: at most those two ports.
        assert {x[2] for x in mooncake if is_loopback(x[0])} == {master.pid(), daemon.pid()}, mooncake
        engine = [x for x in exposed if x[2] == daemon.pid()]
        assert len(engine) <= 2, engine
        # Everything else exposed is Ray's (it binds every interface whatever it is told): its
        # daemons and workers, and this driver's core worker (the store client added nothing) ...
        mine = {(x[0], x[1]) for x in exposed if x[2] == os.getpid()}
        assert mine <= as_driver, mine - as_driver
        rest = [x for x in exposed if x not in engine and x[2] != os.getpid()]
        assert all(is_ray(x[3]) for x in rest), [x for x in rest if not is_ray(x[3])]
        assert any(is_ray(x[3]) for x in exposed)
        # ... and Ray refuses a client without the token.
        gcs = ray.get_runtime_context().gcs_address
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_TOKEN")}
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="not-the-token")
        probe = subprocess.run([sys.executable, "-c", f"import ray; ray.init(address='{gcs}'); print('connected')"],
                               capture_output=True, text=True, timeout=120, env=env)
        assert probe.returncode != 0 and "connected" not in probe.stdout, probe.stdout[-500:]
    finally:
        store.close()
        daemon.stop()
        master.stop()
