"""Hidden-state extraction throughput on the local target, three ways in one run:

    python benchmarks/extraction.py [--conversations 64] [--repeats 2]

- vLLM prefill alone (no extraction; the floor any extraction path pays),
- extraction through our MooncakeHiddenStatesConnector into a real mooncake_master's store,
- extraction through the file backend (vLLM's on-disk safetensors format).
Each runs in its own Ray actor with the same engine settings, on the same conversations
(prompt + a previously generated answer, max_tokens=1: the prefill-dominated workload of
turning existing conversations into training samples). Prints prompt tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def conversations(n: int) -> list[dict]:
    from dspark.prompts import read_conversations

    convs, _ = read_conversations(ROOT / "data" / "prompts" / "default.jsonl")
    answers = {}
    cached = ROOT / "outputs" / "bench_drafter_quality" / "responses.jsonl"
    if cached.exists():
        answers = {r["id"]: r["response"] for r in map(json.loads, cached.read_text().splitlines())}
    out = []
    for c in convs[:n]:
        answer = answers.get(c.id, "Here is a detailed answer. " * 12)
        out.append(
            {
                "id": c.id,
                "messages": c.prompt_messages
                + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Thanks."}],
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("MC_STORE_MEMCPY", "0")
    from dataclasses import replace

    import ray

    from cluster.config import SamplingConfig, TargetConfig
    from cluster.inference import InferenceActor, InferenceSettings
    from cluster.store import HiddenStateStore, MooncakeMaster, StoreConfig
    from dspark.config import DSparkConfig
    from dspark.targets import prepare_smollm2

    target = prepare_smollm2()
    layer_ids = DSparkConfig.from_target(target).extract_layer_ids
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        _temp_dir=f"/tmp/ray-bench-{os.getpid()}",
    )
    master = MooncakeMaster()
    holder = HiddenStateStore(StoreConfig(master=master.address, segment_bytes=4 << 30)).connect()
    files = Path(tempfile.mkdtemp(prefix="dspark-hs-"))
    convs = conversations(args.conversations)
    base = InferenceSettings(
        TargetConfig(path=str(target), max_model_len=2048, enforce_eager=True),
        layer_ids,
        "bench/g0",
        sampling=SamplingConfig(max_tokens=1),
        store=StoreConfig(master=master.address),
    )
    variants = {
        "vLLM prefill alone": replace(base, extract=False),
        "Mooncake connector": base,
        "file connector": replace(base, backend="file", file_dir=str(files)),
    }
    Actor = ray.remote(num_cpus=2)(InferenceActor)
    rows = []
    for name, settings in variants.items():
        actor = Actor.remote(settings)
        ray.get(actor.process.remote(convs[:4]))  # warm-up
        best = 0.0
        for rep in range(args.repeats):
            batch = [{**c, "key": f"bench/g0/{rep}/{c['id']}"} for c in convs]
            t0 = time.perf_counter()
            out = ray.get(actor.process.remote(batch))
            dt = time.perf_counter() - t0
            assert all(o.error is None for o in out), [o.error for o in out if o.error][:3]
            tokens = sum(o.prompt_tokens for o in out)
            best = max(best, tokens / dt)
            if name == "Mooncake connector":
                for o in out:
                    holder.remove(o.ref.key)
        rows.append((name, tokens, best))
        ray.kill(actor)
    print(
        f"\nextraction of {len(convs)} conversations ({rows[0][1]} prompt tokens), layers {layer_ids}, "
        f"best of {args.repeats}"
    )
    print(f"{'path':22} {'tokens/s':>9} {'vs prefill':>11}")
    for name, _, rate in rows:
        print(f"{name:22} {rate:9.0f} {rate / rows[0][2]:10.2f}x")
    holder.close()
    master.stop()
    shutil.rmtree(files, ignore_errors=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
