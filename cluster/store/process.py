"""`SupervisedProcess`: a Mooncake binary run as a child of a Ray actor — started, probed until
it answers on its port, restarted when it dies (with backoff, at most `MAX_RESTARTS` within
any `RESTART_WINDOW_S`: `RestartBudget`), stopped with its owner. When the watcher gives up, or
dies itself, `info()` says why (`failure`), and the job's `StoreServices.check` stops the job
with it: a dead master or daemon never goes unnoticed.

The job runs two kinds: the master (`cluster.store.master`) and, per node, the store daemon that lends
the node's memory (`cluster.store.node_store`). Both lose their state when they die, so `generation`
counts starts: users compare it to tell that the keys they knew of are gone.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

from cluster.restart_budget import RestartBudget
from cluster.store.client import probe
from cluster.waiting import wait_until

# A process that exits this often is in a crash loop (a port taken, a full disk, a bad flag):
# restarting it more would hide the cause; a daemon dying now and then over days is restarted.
MAX_RESTARTS, RESTART_WINDOW_S = 5, 600.0
MAX_BACKOFF_S = 30.0


def _die_with_parent() -> None:
    """Linux: the child dies with the process that started it (a killed job leaves no orphan)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def free_port(host: str = "127.0.0.1", avoid: tuple[int, ...] = (), tries: int = 32) -> int:
    """A port nothing listens on now, not one of `avoid`: ports chosen but not bound yet (the
    kernel hands the same free port to successive binds of port 0: a master's metrics port once
    came out equal to its RPC port, chosen a moment before in the driver, and the master exited
    at every start because its second listener could not bind)."""
    for _ in range(tries):
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in avoid:
            return port
    raise RuntimeError(f"no free port on {host!r} outside {sorted(avoid)} in {tries} tries")


def mooncake_binary(name: str) -> str:
    """`mooncake_master` / `mooncake_client`: next to the interpreter (venv), on PATH, or in the
    wheel's package folder (where the non-CUDA wheel ships the client)."""
    candidates = [Path(sys.executable).parent / name]
    try:
        import mooncake

        candidates.append(Path(mooncake.__file__).parent / name)
    except ImportError:
        pass
    for c in candidates:
        if c.exists():
            return str(c)
    found = shutil.which(name)
    if not found:
        raise FileNotFoundError(f"{name} not found: install mooncake-transfer-engine(-non-cuda)")
    return found


class SupervisedProcess:
    name = "process"  # for logs and errors

    def __init__(self, host: str, port: int, log_dir: str | None, watch_interval_s: float) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.log_dir = Path(log_dir) if log_dir else None
        self.generation = 0  # bumped at every (re)start: a new generation has no keys
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._stopping = threading.Event()  # set by stop(): ends the watcher at once, not after its interval
        self._watch_interval_s = watch_interval_s
        self.restart_budget = RestartBudget(MAX_RESTARTS, RESTART_WINDOW_S)
        self.failure: str | None = None  # why the watcher gave up (or died): the process is not looked after
        self.last_start_error: str | None = None
        self._watcher: threading.Thread | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict:
        return dict(os.environ)

    def after_start(self) -> None:
        """Runs once the process answers (under the start lock)."""

    def launch(self) -> None:
        """First start, then supervision; subclasses call it at the end of their __init__."""
        self.start()
        self._watcher = threading.Thread(target=self._watch, daemon=True, name=f"watch-{self.name}")
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

    @property
    def restarts(self) -> int:
        """Restarts taken so far (the budget counts each one it granted)."""
        return self.restart_budget.total

    def info(self) -> dict:
        failure = self.failure
        if (
            failure is None
            and self._watcher is not None
            and not self._watcher.is_alive()
            and not self._stopping.is_set()
        ):
            failure = f"{self.name}'s watcher ended without a cause"  # (it catches everything: a bug)
        return {
            "address": self.address,
            "generation": self.generation,
            "restarts": self.restarts,
            "alive": self.alive(),
            "failure": failure,
        }

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self, timeout: float = 30.0) -> None:
        with self._lock:
            log = subprocess.DEVNULL
            if self.log_dir:
                self.log_dir.mkdir(parents=True, exist_ok=True)
                log = open(self.log_dir / f"{self.name}.{self.generation + 1}.log", "ab")
            self._proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )

            def answering() -> bool:
                if probe(self.address, 0.5):
                    return True
                if self._proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self._proc.returncode} at start")
                return False

            wait_until(
                answering,
                timeout_s=timeout,
                interval_s=0.1,
                what=f"{self.name} on {self.address}",
                on_timeout=lambda: TimeoutError(f"{self.name} did not answer on {self.address} within {timeout}s"),
            )
            self.generation += 1
            self.after_start()

    def _watch(self) -> None:
        try:
            while not self._stopping.wait(self._watch_interval_s) and self.watch_once():
                pass
        except Exception as e:  # noqa: BLE001 - the watcher's own death is reported, never silent
            self.failure = f"{self.name}'s watcher died: {type(e).__name__}: {e}"

    def watch_once(self) -> bool:
        """Restart the process if it died: False once the restart budget is spent (`failure` says
        why). A failed start (the port still held, a log that cannot be opened on a full disk)
        counts as a restart: the budget bounds those too."""
        if self.alive() or self._stopping.is_set():
            return True
        code = self._proc.returncode if self._proc is not None else None
        if not self.restart_budget.spend():
            self.failure = (
                f"{self.name} on {self.address} exited {self.restart_budget.recent() + 1} times within "
                f"{self.restart_budget.window_s:g} s (last exit code {code}"
                + (f"; last start error: {self.last_start_error}" if self.last_start_error else "")
                + f"; its logs: {self.log_dir}): not restarted again"
            )
            return False
        # backoff: the k-th restart within the window waits 2^(k-1) s (at most MAX_BACKOFF_S)
        if self._stopping.wait(min(2.0 ** (self.restart_budget.recent() - 1) - 1.0, MAX_BACKOFF_S)):
            return True
        try:
            self.start()
        except Exception as e:  # noqa: BLE001 - counted; the next round tries again within the budget
            self.last_start_error = f"{type(e).__name__}: {e}"
        return True

    def kill(self) -> None:
        """Kill the process as a crash would (the watcher restarts it)."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()

    def stop(self) -> None:
        self._stopping.set()
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()

    def __del__(self) -> None:  # the owner ending (actor teardown) takes the process with it
        try:
            self.stop()
        except Exception:
            pass
