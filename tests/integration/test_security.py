"""What listens, and who may talk to it, while the job runs: every TCP listener that any process
of the test session opened (this process, the session's Ray and everything it started: the
job's actors, the Mooncake master and store daemon, the vLLM replica, the trainer ranks) is
either on loopback or refuses a client that lacks Ray's token.

No allow-list: not of ports, not of processes. A listener beyond loopback is probed as a client
without the token would: an HTTP request must get 401/403; a gRPC server must answer Ray's
methods with UNAUTHENTICATED (a method it serves, not just any name: Ray checks the token in
each method's handler); anything else (an answer, another protocol) fails the test."""

from __future__ import annotations

import functools
import http.client
import http.server
import importlib
import ipaddress
import os
import pkgutil
import socket
import threading
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from cluster.config_load import load_config
from tests.helpers import NO_CALIBRATION, QUICK_EVAL

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Listener:
    address: str
    port: int
    pid: int
    process: str = field(compare=False)  # its command line, shortened (Ray retitles its workers as they run)

    @property
    def loopback(self) -> bool:
        ip = ipaddress.ip_address(self.address)
        return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


def _listening_inodes() -> dict[str, tuple[str, int]]:
    """socket inode -> (address, port) of every listening TCP socket, from /proc (no `ss`)."""
    out = {}
    for proto in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{proto}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] != "0A":  # LISTEN
                continue
            hexaddr, hexport = cols[1].split(":")
            raw = bytes.fromhex(hexaddr)
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # each 32-bit word in host order
            out[cols[9]] = (str(ipaddress.ip_address(raw)), int(hexport, 16))
    return out


def descendants(root: int) -> set[int]:
    """`root` and every process below it."""
    children: dict[int, list[int]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(pid))
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        out.add(pid)
        todo.extend(children.get(pid, []))
    return out


def listeners(root: int) -> set[Listener]:
    """Every listening TCP socket held by `root` or a process below it."""
    inodes = _listening_inodes()
    out = set()
    for pid in descendants(root):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in inodes:
                out.add(Listener(*inodes[target[8:-1]], pid, cmd[:160]))
    return out


# ---- a client without the token --------------------------------------------------------------
def _network_address() -> str | None:
    """An address of this machine beyond loopback (where a wildcard listener is reached from
    elsewhere), or None on a machine without one."""
    import psutil

    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback:
                return a.address
    return None


def _target(listener: Listener) -> tuple[str, int]:
    host = listener.address
    if host in ("0.0.0.0", "::"):
        host = _network_address() or "127.0.0.1"
    elif ipaddress.ip_address(host).version == 6 and ipaddress.ip_address(host).ipv4_mapped is not None:
        host = str(ipaddress.ip_address(host).ipv4_mapped)
    return host, listener.port


@functools.lru_cache(maxsize=1)
def _ray_methods() -> tuple[str, ...]:
    """One read-only method (Get…, List…) of every gRPC service Ray defines, from its generated
    protocol modules: what a client would call. (Services of long polls and publishing only are
    left out: a poll would wait, and every Ray server also serves a service listed here.)"""
    import ray.core.generated as generated

    out = []
    for mod in pkgutil.iter_modules(generated.__path__):
        if not mod.name.endswith("_pb2"):
            continue
        try:
            module = importlib.import_module(f"ray.core.generated.{mod.name}")
        except Exception:  # noqa: BLE001 - a module this install cannot import defines nothing we reach
            continue
        for service in module.DESCRIPTOR.services_by_name.values():
            names = [m.name for m in service.methods]
            reads = [n for n in names if n.startswith(("Get", "List", "Num", "Check", "Health"))]
            if reads:
                out.append(f"/{service.full_name}/{reads[0]}")
    # The raylet's object manager serves a service Ray compiles for C++ only (no Python module).
    return (*out, "/ray.rpc.ObjectManagerService/Pull")


def _http_status(host: str, port: int) -> int | None:
    """The status of `GET /` without a token, or None where the listener does not speak HTTP/1."""
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}/"
    try:
        return urllib.request.urlopen(url, timeout=5).status
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, ValueError, http.client.HTTPException):
        return None


def _grpc_codes(host: str, port: int) -> dict[str, str]:
    """Ray's methods called without a token: method -> status code name."""
    import grpc

    out = {}
    with grpc.insecure_channel(f"[{host}]:{port}" if ":" in host else f"{host}:{port}") as channel:
        for method in _ray_methods():
            try:
                channel.unary_unary(method)(b"", timeout=5)
                out[method] = "OK"
            except grpc.RpcError as e:
                out[method] = e.code().name
            if out[method] in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):  # not a gRPC server (or gone): asking on is no use
                break
    return out


def refuses_without_token(listener: Listener) -> tuple[bool, str]:
    """(refused, what a client without the token got)."""
    host, port = _target(listener)
    try:
        socket.create_connection((host, port), timeout=5).close()
    except OSError as e:
        return True, f"no connection from {host} ({e})"  # gone, or not reachable there: nobody gets in
    status = _http_status(host, port)
    if status is not None:
        return status in (401, 403), f"HTTP {status} to GET / without a token"
    codes = _grpc_codes(host, port)
    seen = set(codes.values())
    if "UNAUTHENTICATED" in seen and seen <= {"UNAUTHENTICATED", "UNIMPLEMENTED"}:
        return True, f"gRPC: UNAUTHENTICATED on {sum(c == 'UNAUTHENTICATED' for c in codes.values())} of Ray's methods"
    answered = {m: c for m, c in codes.items() if c != "UNIMPLEMENTED"}
    return False, f"neither HTTP nor gRPC refused it: {answered or 'every Ray method UNIMPLEMENTED'}"


# ---- the tests -------------------------------------------------------------------------------
def test_the_probe_tells_a_refusal_from_an_answer(ray_cluster, mooncake_master):
    """The probe itself, on real servers: Ray's GCS and raylet (both its ports) refuse without the token; a plain
    HTTP server and Mooncake's metrics endpoint answer; a raw TCP listener is no refusal."""
    ray = ray_cluster
    gcs_host, gcs_port = ray.get_runtime_context().gcs_address.rsplit(":", 1)
    node = next(n for n in ray.nodes() if n["NodeID"] == ray.get_runtime_context().get_node_id())
    for name, host, port in (
        ("gcs_server", gcs_host, int(gcs_port)),
        ("raylet", node["NodeManagerAddress"], node["NodeManagerPort"]),
        ("raylet's object manager", node["NodeManagerAddress"], node["ObjectManagerPort"]),
    ):
        refused, why = refuses_without_token(Listener(host, port, 0, name))
        assert refused and why.startswith("gRPC: UNAUTHENTICATED"), (name, why)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    raw = socket.socket()
    raw.bind(("127.0.0.1", 0))
    raw.listen()
    try:
        open_http = refuses_without_token(Listener("127.0.0.1", server.server_address[1], 0, "http.server"))
        assert open_http == (False, "HTTP 200 to GET / without a token"), open_http
        metrics = mooncake_master.info()["metrics"].rsplit(":", 1)[1].split("/")[0]
        assert not refuses_without_token(Listener("127.0.0.1", int(metrics), 0, "mooncake_master"))[0]
        assert not refuses_without_token(Listener("127.0.0.1", raw.getsockname()[1], 0, "raw"))[0]
    finally:
        server.shutdown()
        raw.close()


class ListenerWatch:
    """The listeners of this process and its descendants, read every `interval_s` in a thread
    while a job runs; each new one beyond loopback probed at once (while it is there). Used by
    the slow test below and by the default run's end-to-end job (tests/integration/test_job.py)."""

    PARTS = ("mooncake_master", "mooncake_client", "TrainerRank", "InferenceActor", "gcs_server", "raylet")

    def __init__(self, interval_s: float = 0.5) -> None:
        self.interval_s = interval_s
        self.seen: dict[Listener, tuple[bool, str]] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="listener-watch")

    def _watch(self) -> None:
        while not self._done.is_set():
            for listener in listeners(os.getpid()) - set(self.seen):
                self.seen[listener] = (True, "loopback") if listener.loopback else refuses_without_token(listener)
            self._done.wait(self.interval_s)

    def __enter__(self) -> ListenerWatch:
        assert os.environ.get("RAY_AUTH_MODE") == "token"
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join(timeout=60)

    def assert_safe(self) -> None:
        """It saw the job's processes while they ran (not only what was left at the end), and
        every listener beyond loopback refused a client without the token."""
        processes = " ".join(x.process for x in self.seen)
        for part in self.PARTS:
            assert part in processes, f"no listener of {part} seen: {sorted({x.process[:60] for x in self.seen})}"
        beyond = sorted(
            f"{x.address}:{x.port} {x.process[:60]}: {why}" for x, (_, why) in self.seen.items() if not x.loopback
        )
        kinds = Counter(x.process.split()[0].rsplit("/", 1)[-1] for x in self.seen)
        print(f"{len(self.seen)} listeners seen ({dict(kinds)}), {len(beyond)} beyond loopback: {beyond}")
        exposed = {x: why for x, (ok, why) in self.seen.items() if not ok}
        assert not exposed, "listeners beyond loopback that do not refuse a client without the token:\n" + "\n".join(
            f"  {x.address}:{x.port} pid {x.pid} {x.process[:100]}: {why}"
            for x, why in sorted(exposed.items(), key=str)
        )


@pytest.mark.slow  # the default run watches the end-to-end job's listeners (one rank) instead
def test_every_listener_of_the_job_is_loopback_or_refuses_without_the_token(ray_cluster, smol_target, tmp_path):
    """The local job (vLLM replica, two trainer ranks, store master and daemon), small."""
    from cluster.job import TrainingJob

    cfg = load_config(
        ROOT / "configs" / "local.yaml",
        [
            "run_name=listeners",
            f"output_dir={tmp_path}",
            "data.max_prompts=8",
            "data.epochs=1",
            "sampling.max_tokens=16",
            "topology.groups.0.trainer_ranks_per_node=2",
            "trainer.batch_tokens=256",
            "trainer.checkpoint_interval=2",
            "drafter.draft_vocab_size=null",
            "drafter.num_anchors=4",
            "drafter.markov_rank=16",
            "transport.segment_mb=256",
            "data.eval_limit=1",
            "data.eval_max_new_tokens=8",
            "logging.wandb_mode=disabled",
            "logging.progress_interval_s=5",
            NO_CALIBRATION,
            *QUICK_EVAL,
        ],
    )
    with ListenerWatch() as watch:
        result = TrainingJob(cfg).run()
    assert result["exactly_once"]["failed"] == []
    # A trainer rank listens as a Ray worker and for its gloo peers (the world has two ranks).
    per_rank = Counter(x.pid for x in watch.seen if "TrainerRank" in x.process)
    assert max(per_rank.values()) >= 2, per_rank
    watch.assert_safe()
