"""dtypes chosen from the CPU's flags: bf16 only where the CPU computes in it natively."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.config import ConfigError, load_config, resolve_for_machine
from cluster.hardware import CpuInfo, read_cpu

ROOT = Path(__file__).resolve().parents[2]
XEON_NO_BF16 = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) CPU @ 2.60GHz\nflags\t\t: fpu sse2 avx2 avx512f avx512bw\n\n" \
               "processor\t: 1\nmodel name\t: Intel(R) Xeon(R) CPU @ 2.60GHz\nflags\t\t: fpu sse2 avx2 avx512f avx512bw\n"
EPYC_BF16 = "processor\t: 0\nmodel name\t: AMD EPYC 9654\nflags\t\t: fpu avx2 avx512f avx512_bf16\n"
GRAVITON = "processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd sve bf16 i8mm\n"


@pytest.mark.parametrize("text, model, native", [(XEON_NO_BF16, "Intel(R) Xeon(R) CPU @ 2.60GHz", False),
                                                 (EPYC_BF16, "AMD EPYC 9654", True), (GRAVITON, None, True)])
def test_read_cpu(tmp_path, text, model, native):
    f = tmp_path / "cpuinfo"
    f.write_text(text)
    cpu = read_cpu(f)
    assert cpu.native_bf16 is native
    if model:
        assert cpu.model == model
    assert ("avx512_bf16" in cpu.to_dict()["flags"]) is ("avx512_bf16" in text)


def test_unreadable_cpuinfo_means_no_native_bf16(tmp_path):
    assert read_cpu(tmp_path / "missing").native_bf16 is False


@pytest.mark.parametrize("native, device, dtype, precision", [
    (False, "cpu", "float32", "fp32"), (True, "cpu", "bfloat16", "bf16-mixed"), (False, "cuda", "bfloat16", "bf16-mixed")])
def test_auto_dtypes(native, device, dtype, precision):
    cfg = load_config(ROOT / "configs" / "local.yaml", [f"device={device}", "topology.groups.0.gpus_per_node=1"]
                      if device == "cuda" else [])
    cfg.target.dtype, cfg.trainer.precision = "auto", "auto"  # what local.yaml says before resolution
    cpu = CpuInfo("test", 2, frozenset({"avx512_bf16"} if native else {"avx2"}))
    resolve_for_machine(cfg, cpu)
    assert (cfg.target.dtype, cfg.trainer.precision) == (dtype, precision)


def test_explicit_dtypes_are_kept_and_checked():
    cfg = load_config(ROOT / "configs" / "local.yaml", ["target.dtype=bfloat16", "trainer.precision=fp32"])
    assert (cfg.target.dtype, cfg.trainer.precision) == ("bfloat16", "fp32")
    with pytest.raises(ConfigError, match="target.dtype"):
        load_config(ROOT / "configs" / "local.yaml", ["target.dtype=bf16"])
    auto = load_config(ROOT / "configs" / "local.yaml")  # resolved on this machine, never left "auto"
    assert auto.target.dtype in ("bfloat16", "float32") and auto.trainer.precision in ("bf16-mixed", "fp32")


def test_cpu_threads_from_the_machine():
    """Unset, a CPU replica's engine and an idle-producer trainer rank get the machine's cores;
    set, they keep what was asked; a GPU job leaves them alone."""
    eight = CpuInfo("test", 8, frozenset({"avx2"}))
    cfg = load_config(ROOT / "configs" / "local.yaml", ["inference.cpu_threads=null", "trainer.torch_threads_when_idle=null"])
    cfg.inference.cpu_threads = cfg.trainer.torch_threads_when_idle = None  # as read, before resolution
    resolve_for_machine(cfg, eight)
    assert (cfg.inference.cpu_threads, cfg.trainer.torch_threads_when_idle) == (8, 8)
    cfg.inference.cpu_threads, cfg.trainer.torch_threads_when_idle = 3, 1
    resolve_for_machine(cfg, eight)
    assert (cfg.inference.cpu_threads, cfg.trainer.torch_threads_when_idle) == (3, 1)
    gpu = load_config(ROOT / "configs" / "local.yaml", ["device=cuda", "topology.groups.0.gpus_per_node=1"])
    gpu.inference.cpu_threads = None
    resolve_for_machine(gpu, eight)
    assert gpu.inference.cpu_threads is None


def test_cpu_process_env(monkeypatch):
    """What a CPU process that runs torch gets: the libraries found, Intel OpenMP's spin cut to
    5 ms only where it is preloaded, its threads only when given."""
    import cluster.hardware as hw

    found = {"tcmalloc": "/usr/lib/libtcmalloc_minimal.so.4", "iomp": "/venv/lib/libiomp5.so"}
    monkeypatch.setattr(hw, "preload_libraries", lambda names: [found[n] for n in names if n in found])
    assert hw.cpu_process_env(("tcmalloc", "iomp"), 4) == {
        "LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4:/venv/lib/libiomp5.so", "KMP_BLOCKTIME": "5", "OMP_NUM_THREADS": "4"}
    assert hw.cpu_process_env(("tcmalloc",)) == {"LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4"}
    del found["iomp"]  # not installed: nothing about it
    assert hw.cpu_process_env(("iomp",)) == {}


@pytest.mark.parametrize("key", ["inference.preload", "trainer.preload"])
def test_unknown_preload_is_a_config_error(key):
    with pytest.raises(ConfigError, match=rf"`{key}`: \['jemalloc'\] not among"):
        load_config(ROOT / "configs" / "local.yaml", [f"{key}=[jemalloc]"])
