"""Generation speed of the job's replica path against plain vLLM generation, same run, same CPU:

    python benchmarks/generation.py [--prompts 64] [--batches 16,64] [--max-tokens 160]

Every variant is one Ray actor (placed as the local job places a replica: `cpus_per_replica`
CPUs) running vLLM on the local target with the job's engine settings (`configs/local.yaml`:
dtype from the CPU, enforce_eager, max_model_len, KV cache), greedy, on the same training
prompts of the default set, handed over `batch` prompts per call as the ledger hands them to a
replica:

- `plain`: `LLM.generate` alone (no extraction), the ceiling;
- `job`: `InferenceActor.process` — regenerate with the capturing target
  (`cluster.inference.capture_model`) and put the aux and final states through our Mooncake connector into
  a real store — what the job's replica does;
and the environment knobs a replica can be given: `threads=N` (the engine's OpenMP/torch
threads; Ray gives an actor `OMP_NUM_THREADS=<its CPUs>`), `iomp` (Intel OpenMP preloaded, as
vLLM's CPU guide asks), `tcmalloc` (likewise its allocator), and `trainer=N`: while the variant
is timed, a trainer process steps beside it on N threads (the local job's drafter, first-epoch
steps of its shapes, its preloads and OpenMP settings: `cluster.box.machine_paces.probe_trainer`
in a loop), as the local job's rank does while its replica generates. Every variant is compared
with plain vLLM at the same knobs, a `trainer` variant also with itself alone. Prints the CPU
(model, cores, flags), then generated tokens/s per variant and its ratio to plain vLLM at the
same batch and knobs (`plain iomp` is the baseline of `job iomp`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def prompts(n: int) -> list[dict]:
    from cluster.config_load import load_config
    from cluster.data import load_prompts

    train, _ = load_prompts(load_config(ROOT / "configs" / "local.yaml"))
    return [{"id": c.id, "messages": c.prompt_messages} for c in train[:n]]


TRAINER_LOOP = """
import sys
sys.path.insert(0, {root!r})
from cluster.config_load import load_config
from cluster.box import probe_trainer
from dspark.targets import prepare_smollm2
cfg, target = load_config({config!r}), prepare_smollm2()
# before the replica's timed run
print(probe_trainer(cfg, target, 58, 128, [{threads}], repeats=1)[0][{threads}], flush=True)
while True:
    print(probe_trainer(cfg, target, 58, 128, [{threads}], repeats=1)[0][{threads}], flush=True)
"""


def start_trainer(threads: int, cfg, nice: int, deadline_s: float = 300.0):
    """A process stepping the local job's drafter on `threads` threads, as a trainer rank beside
    the replica does; returns it once it steps, and its first step's seconds (within `deadline_s`:
    the drafter's set-up and one first-epoch step take ~10 s on a 2-core Xeon). `nice`: the
    replica actor's niceness, which the process takes: Ray starts its workers niced (the job's
    replica and trainer rank alike), and a trainer at niceness 0 beside a niced replica took half
    its pace (139 tok/s against 283 alone at 2 threads on a 2-core Xeon) where the job's replica
    kept all of it."""
    import select
    import subprocess

    from cluster.hardware import cpu_process_env

    env = {**os.environ, **cpu_process_env(tuple(cfg.trainer.preload), threads)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            TRAINER_LOOP.format(root=str(ROOT), threads=threads, config=str(ROOT / "configs" / "local.yaml")),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        preexec_fn=lambda: os.setpriority(os.PRIO_PROCESS, 0, nice),
    )
    ready, _, _ = select.select([proc.stdout], [], [], deadline_s)
    first = proc.stdout.readline() if ready else ""  # its first timed step: it is stepping
    if not first:
        proc.kill()
        raise RuntimeError(
            f"the trainer beside the replica did not step within {deadline_s:g} s "
            f"(exit code {proc.poll()}; run TRAINER_LOOP alone to see its error)"
        )
    return proc, float(first)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument(
        "--variants",
        default="plain,job,plain iomp tcmalloc,job iomp tcmalloc,"
        "plain threads=2 iomp tcmalloc,job threads=2 iomp tcmalloc",
    )
    args = ap.parse_args()
    os.environ.setdefault("MC_STORE_MEMCPY", "0")
    import ray

    from cluster.config import resolve_for_machine
    from cluster.config_load import load_config
    from cluster.hardware import preload_libraries, read_cpu
    from cluster.inference import InferenceActor, InferenceSettings
    from cluster.store import HiddenStateStore, MooncakeMaster, StoreConfig
    from dspark.config import DSparkConfig
    from dspark.targets import prepare_smollm2

    class Probe(InferenceActor):
        def threads(self) -> dict:
            import torch

            return {
                "torch": torch.get_num_threads(),
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
                "LD_PRELOAD": os.environ.get("LD_PRELOAD", ""),
                "nice": os.getpriority(os.PRIO_PROCESS, 0),
            }

    cfg = resolve_for_machine(load_config(ROOT / "configs" / "local.yaml"))
    cpu = read_cpu()
    print(
        f"CPU: {cpu.model}, {cpu.cores} cores, native bf16: {cpu.native_bf16}; flags: "
        f"{' '.join(sorted(f for f in cpu.flags if f.startswith(('avx', 'amx'))))}"
    )
    t = cfg.target
    target = prepare_smollm2()
    layer_ids = DSparkConfig.from_target(target).extract_layer_ids
    ray.init(
        address="local",
        num_cpus=cpu.cores,
        include_dashboard=False,
        log_to_driver=False,
        _temp_dir=f"/tmp/ray-bench-{os.getpid()}",
    )
    master = MooncakeMaster()
    holder = HiddenStateStore(StoreConfig(master=master.address, segment_bytes=4 << 30)).connect()
    work = prompts(args.prompts)
    base = InferenceSettings(
        replace(t, path=str(target)),
        layer_ids,
        "bench/g0",
        sampling=replace(cfg.sampling, max_tokens=args.max_tokens),
        store=StoreConfig(master=master.address),
    )
    replica_cpus = cfg.topology.groups[0].cpus_per_replica
    rows = []
    for batch in map(int, args.batches.split(",")):
        for variant in args.variants.split(","):
            words = variant.split()
            settings = replace(base, extract=words[0] == "job")
            env = {}
            trainer_threads = None
            for w in words[1:]:
                if w.startswith("trainer="):
                    trainer_threads = int(w.split("=")[1])
                elif w.startswith("threads="):
                    env["OMP_NUM_THREADS"] = w.split("=")[1]
                elif w in ("iomp", "tcmalloc"):
                    found = preload_libraries((w,))
                    if not found:
                        print(f"skipping {variant}: no {w} library found")
                        break
                    env["LD_PRELOAD"] = ":".join(filter(None, [env.get("LD_PRELOAD"), *found]))
            else:
                actor = (
                    ray.remote(num_cpus=replica_cpus)(Probe)
                    .options(runtime_env={"env_vars": env} if env else None)
                    .remote(settings)
                )
                threads = ray.get(actor.threads.remote())
                ray.get(actor.process.remote([{**p, "key": f"bench/warm/{p['id']}"} for p in work[:2]]))
                beside = start_trainer(trainer_threads, cfg, threads["nice"]) if trainer_threads else None
                generated, t0 = 0, time.perf_counter()
                for i in range(0, len(work), batch):
                    chunk = [{**p, "key": f"bench/{batch}/{variant}/{p['id']}"} for p in work[i : i + batch]]
                    out = ray.get(actor.process.remote(chunk))
                    assert all(o.error is None for o in out), [o.error for o in out if o.error][:3]
                    generated += sum(len(o.response_ids) for o in out)
                    for o in out:
                        if o.ref:
                            holder.remove(o.ref.key)
                dt = time.perf_counter() - t0
                trainer = ""
                if beside is not None:
                    proc, alone_s = beside
                    proc.kill()
                    steps = sorted(float(x) for x in proc.stdout.read().split())  # its steps while timed
                    proc.wait()
                    if steps:
                        trainer = (
                            f"; trainer beside: {steps[len(steps) // 2]:.2f} s a step (median of {len(steps)}), "
                            f"{alone_s:.2f} s before"
                        )
                ray.kill(actor)
                rows.append((batch, variant, generated / dt, threads))
                print(
                    f"  batch {batch:3d} {variant:30s} {generated / dt:7.1f} tok/s  ({generated} tokens, {dt:.1f} s; "
                    f"threads {threads['torch']}, OMP_NUM_THREADS={threads['OMP_NUM_THREADS']}, nice {threads['nice']}"
                    f"{trainer})",
                    flush=True,
                )
    print(
        f"\ngeneration, {len(work)} prompts of configs/local.yaml's training set, greedy, up to {args.max_tokens} "
        f"tokens, {t.dtype}, replica actor with {replica_cpus} CPU(s)"
    )
    print(f"{'batch':>5} {'variant':40} {'tok/s':>7} {'vs plain':>9} {'vs alone':>9}")

    def knobs(variant: str) -> list[str]:
        return sorted(w for w in variant.split()[1:] if not w.startswith("trainer="))

    def rate_of(batch: int, kind: str, like: str) -> float | None:  # `kind` alone, the knobs of `like`
        return next(
            (
                r
                for b, v, r, _ in rows
                if b == batch and v.split()[0] == kind and "trainer=" not in v and knobs(v) == knobs(like)
            ),
            None,
        )

    for batch, variant, rate, _ in rows:
        # Every variant against plain vLLM alone at the same knobs (threads, preloads): what the
        # replica keeps of the engine's own pace; a variant with a trainer beside it also against
        # itself alone, where that ran (what the trainer alone takes).
        plain, alone = rate_of(batch, "plain", variant), rate_of(batch, variant.split()[0], variant)
        ratio = lambda base, rate=rate: f"{rate / base:8.2f}x" if base else f"{'-':>9}"  # noqa: E731
        print(
            f"{batch:5d} {variant:40} {rate:7.1f} {ratio(plain)} {ratio(alone) if 'trainer=' in variant else ' ' * 9}"
        )
    holder.close()
    master.stop()
    ray.shutdown()


if __name__ == "__main__":
    main()
