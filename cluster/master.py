"""The Mooncake master's lifecycle: start `mooncake_master`, wait until it answers, restart it
when it dies, stop it with the job.

`MooncakeMaster` is a plain class; the job runs it as a Ray actor (one per job, or one per
group) so it lives on a known node and dies with the job. A restarted master has lost every
key: `generation` counts restarts so store users (and the ledger) can tell that stored
samples are gone and must be regenerated.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

from cluster.store import probe


def _die_with_parent() -> None:
    """Linux: the master dies with the process that started it (a killed job leaves no orphan)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def master_binary() -> str:
    import sys

    exe = Path(sys.executable).parent / "mooncake_master"
    found = str(exe) if exe.exists() else shutil.which("mooncake_master")
    if not found:
        raise FileNotFoundError("mooncake_master not found: install mooncake-transfer-engine(-non-cuda)")
    return found


class MooncakeMaster:
    """Also hosts the store's memory (`segment_bytes`) in this process: samples then outlive
    the death of any producer or trainer rank, and are lost only with the master itself (whose
    restart loses every key anyway)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, log_dir: str | None = None,
                 watch_interval_s: float = 0.5, extra_args: list[str] | None = None,
                 segment_bytes: int = 0, protocol: str = "tcp", rdma_devices: str = "") -> None:
        self.host = host
        self.port = port or free_port(host)
        self.metrics_port = free_port(host)
        self.log_dir = Path(log_dir) if log_dir else None
        self.extra_args = list(extra_args or [])
        self.generation = 0  # bumped at every (re)start: a new generation has no keys
        self.restarts = 0
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._stopping = False
        self.segment_bytes, self.protocol, self.rdma_devices = segment_bytes, protocol, rdma_devices
        self._holder = None
        self.start()
        self._watcher = threading.Thread(target=self._watch, args=(watch_interval_s,), daemon=True)
        self._watcher.start()

    @property
    def advertise_host(self) -> str:
        """The address clients use: the bind address, or this node's IP when bound to all."""
        if self.host not in ("0.0.0.0", ""):
            return self.host
        try:
            import ray

            return ray.util.get_node_ip_address()
        except Exception:  # noqa: BLE001 - outside Ray
            return socket.gethostbyname(socket.gethostname())

    @property
    def address(self) -> str:
        return f"{self.advertise_host}:{self.port}"

    def info(self) -> dict:
        return {"address": self.address, "generation": self.generation, "restarts": self.restarts,
                "metrics": f"http://{self.host}:{self.metrics_port}/metrics", "alive": self.alive()}

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self, timeout: float = 30.0) -> None:
        with self._lock:
            log = subprocess.DEVNULL
            if self.log_dir:
                self.log_dir.mkdir(parents=True, exist_ok=True)
                log = open(self.log_dir / f"mooncake_master.{self.generation + 1}.log", "ab")
            self._proc = subprocess.Popen(
                [master_binary(), f"--rpc_address={self.host}", f"--rpc_port={self.port}",
                 f"--metrics_host={self.host}", f"--metrics_port={self.metrics_port}", *self.extra_args],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent,
            )
            deadline = time.monotonic() + timeout
            while not probe(self.address, 0.5):
                if self._proc.poll() is not None:
                    raise RuntimeError(f"mooncake_master exited with {self._proc.returncode} at start")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"mooncake_master did not answer on {self.address} within {timeout}s")
                time.sleep(0.1)
            self.generation += 1
            self._host_segment()

    def _host_segment(self) -> None:
        if not self.segment_bytes:
            return
        from cluster.store import HiddenStateStore, StoreConfig

        if self._holder is not None:
            self._holder.close()
        self._holder = HiddenStateStore(StoreConfig(
            master=self.address, local_hostname=self.advertise_host, protocol=self.protocol, rdma_devices=self.rdma_devices,
            segment_bytes=self.segment_bytes, buffer_bytes=16 << 20)).connect()

    def _watch(self, interval: float) -> None:
        while not self._stopping:
            time.sleep(interval)
            if not self._stopping and not self.alive():
                try:
                    self.restarts += 1
                    self.start()
                except (RuntimeError, TimeoutError):
                    time.sleep(1.0)  # the port may still be in TIME_WAIT; try again next round

    def kill(self) -> None:
        """Kill the process as a crash would (the watcher restarts it)."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()

    def stop(self) -> None:
        self._stopping = True
        if self._holder is not None:
            self._holder.close()
            self._holder = None
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()

    def __del__(self) -> None:  # the job ending (actor teardown) takes the master with it
        try:
            self.stop()
        except Exception:
            pass
