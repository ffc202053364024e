"""dtypes chosen from the CPU's flags: bf16 only where the CPU computes in it natively."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.config import ConfigError, resolve_for_machine
from cluster.config_load import load_config
from cluster.hardware import CpuInfo, cpu_quota, read_cpu

ROOT = Path(__file__).resolve().parents[2]
XEON_NO_BF16 = (
    "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) CPU @ 2.60GHz\nflags\t\t: fpu sse2 avx2 avx512f avx512bw\n\n"
    "processor\t: 1\nmodel name\t: Intel(R) Xeon(R) CPU @ 2.60GHz\nflags\t\t: fpu sse2 avx2 avx512f avx512bw\n"
)
EPYC_BF16 = "processor\t: 0\nmodel name\t: AMD EPYC 9654\nflags\t\t: fpu avx2 avx512f avx512_bf16\n"
GRAVITON = "processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd sve bf16 i8mm\n"


@pytest.mark.parametrize(
    "text, model, native",
    [
        (XEON_NO_BF16, "Intel(R) Xeon(R) CPU @ 2.60GHz", False),
        (EPYC_BF16, "AMD EPYC 9654", True),
        (GRAVITON, None, True),
    ],
)
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


@pytest.mark.parametrize(
    "native, device, dtype, precision",
    [
        (False, "cpu", "float32", "fp32"),
        (True, "cpu", "bfloat16", "bf16-mixed"),
        (False, "cuda", "bfloat16", "bf16-mixed"),
    ],
)
def test_auto_dtypes(native, device, dtype, precision):
    cfg = load_config(
        ROOT / "configs" / "local.yaml",
        [f"device={device}", "topology.groups.0.gpus_per_node=1"] if device == "cuda" else [],
    )
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
    """Unset, a CPU replica's engine and an idle-producer trainer rank get the cores the job may
    use (all 8; 3 under a quota of 2.6 cores); set, they keep what was asked; a GPU job leaves
    them alone."""
    eight = CpuInfo("test", 8, frozenset({"avx2"}))
    cfg = load_config(
        ROOT / "configs" / "local.yaml", ["inference.cpu_threads=null", "trainer.torch_threads_when_idle=null"]
    )
    cfg.inference.cpu_threads = cfg.trainer.torch_threads_when_idle = None  # as read, before resolution
    resolve_for_machine(cfg, eight)
    assert (cfg.inference.cpu_threads, cfg.trainer.torch_threads_when_idle) == (8, 8)
    cfg.inference.cpu_threads = cfg.trainer.torch_threads_when_idle = None
    resolve_for_machine(cfg, CpuInfo("test", 8, frozenset({"avx2"}), None, 2.6))
    assert (cfg.inference.cpu_threads, cfg.trainer.torch_threads_when_idle) == (3, 3)
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
        "LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4:/venv/lib/libiomp5.so",
        "KMP_BLOCKTIME": "5",
        "OMP_NUM_THREADS": "4",
    }
    assert hw.cpu_process_env(("tcmalloc",)) == {"LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4"}
    del found["iomp"]  # not installed: nothing about it
    assert hw.cpu_process_env(("iomp",)) == {}


@pytest.mark.parametrize("key", ["inference.preload", "trainer.preload"])
def test_unknown_preload_is_a_config_error(key):
    with pytest.raises(ConfigError, match=rf"`{key}`: \['jemalloc'\] not among"):
        load_config(ROOT / "configs" / "local.yaml", [f"{key}=[jemalloc]"])


def test_a_cgroup_quota_is_read_in_cores_the_tightest_level_wins(tmp_path):
    # cgroup v1: the cpu controller's hierarchy, a quota on the job's cgroup and a looser one above
    v1 = tmp_path / "v1"
    job = v1 / "cpu" / "slow" / "job"
    job.mkdir(parents=True)
    (v1 / "cpu" / "slow" / "cpu.cfs_quota_us").write_text("150000\n")
    (v1 / "cpu" / "slow" / "cpu.cfs_period_us").write_text("100000\n")
    (job / "cpu.cfs_quota_us").write_text("66000\n")
    (job / "cpu.cfs_period_us").write_text("100000\n")
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")  # the root: no quota
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    cgroup = tmp_path / "cgroup-v1"
    cgroup.write_text("4:memory:/elsewhere\n1:cpu:/slow/job\n0::/\n")
    assert cpu_quota(cgroup, v1) == pytest.approx(0.66)
    # cgroup v2 (cpu.max: "max" is none)
    v2 = tmp_path / "v2"
    (v2 / "user" / "run").mkdir(parents=True)
    (v2 / "user" / "cpu.max").write_text("max 100000\n")
    (v2 / "user" / "run" / "cpu.max").write_text("200000 100000\n")
    cgroup.write_text("0::/user/run\n")
    assert cpu_quota(cgroup, v2) == pytest.approx(2.0)
    (v2 / "user" / "run" / "cpu.max").write_text("max 100000\n")
    assert cpu_quota(cgroup, v2) is None
    assert cpu_quota(tmp_path / "absent", v2) is None


@pytest.mark.parametrize(
    "affinity, quota, usable", [(None, None, 8), (2, None, 2), (8, 0.66, 1), (2, 1.5, 2), (1, 3.0, 1)]
)
def test_usable_cores_are_the_affinity_within_the_quota(affinity, quota, usable):
    assert CpuInfo("x", 8, frozenset(), affinity, quota).usable_cores == usable


def test_busy_cores_from_two_readings_of_proc_stat(tmp_path, monkeypatch):
    import time

    from cluster.hardware import busy_cores

    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal
    stat.write_text("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 ...\n")

    def half_a_second_later(_seconds):  # 400 jiffies pass: 150 busy, 250 idle or waiting
        stat.write_text("cpu  200 0 100 1000 100 0 0 0 0 0\ncpu0 ...\n")

    monkeypatch.setattr(time, "sleep", half_a_second_later)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert busy_cores(0.5, stat) == pytest.approx(150 / 400 * 2)
    assert busy_cores(0.5, tmp_path / "absent") is None
