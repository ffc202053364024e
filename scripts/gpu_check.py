"""Every check this project can only do on a CUDA GPU, in one run, one table, non-zero on any
failure (run through `scripts/gpu_check.sh`, which makes the environment):

  dspark_serving   vLLM serves our checkpoint with `method: dspark`: greedy output identical to
                   the target alone (lossless), τ within 0.05 of the reference decoder's on the
                   same prompts (both fp32)
  connector_cuda   the hidden-state capture's CUDA path (cluster.capture_model under CUDA
                   graphs + our connector, file backend) against transformers on the GPU:
                   cosine >= 0.999 per aux layer, as the CPU test asks
  connector_fp8_kv the same with an fp8 KV cache (configs/kimi_k3.yaml's): the states still
                   stored in bf16, cosine >= 0.99 (fp8 keys and values move the attention a little)
  trainer_nccl     the job's trainer on NCCL with ZeRO-2 on this GPU, fed by a replay replica
                   with the samples the connector check wrote: exactly once, a drafter exported
  serving_gpu      benchmarks/serving.py's GPU variant (the OpenAI server with and without the
                   drafter under vllm bench serve): the server measured τ > 1

    python scripts/gpu_check.py --drafter outputs/local/final [--work DIR] [--only NAME ...]

The drafter is a checkpoint of the local job (`scripts/run_local.sh` on any machine; carry
`outputs/local/final` to the GPU machine). Each check runs in its own process, so that one
engine's GPU memory is free before the next starts.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PY = sys.executable
REPLAY_PASSED = "PASSED"  # written by connector_cuda beside the samples it checked, when they passed
CHECKS = ("dspark_serving", "connector_cuda", "connector_fp8_kv", "trainer_nccl", "serving_gpu")
PROMPTS = [[{"role": "user", "content": c}] for c in (
    "Name three colours of the rainbow.", "What is 12 times 7? Explain step by step.",
    "Write a short poem about a lighthouse.", "Translate 'good morning, friends' into French and Spanish.")]


def run(cmd: list[str], timeout_s: float, log: Path) -> subprocess.CompletedProcess:
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s, cwd=ROOT)
    return proc


def tail(log: Path, n: int = 15) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:])


def heldout_file(work: Path) -> Path:
    """The held-out split of our prompt set, as the job writes it."""
    from dspark.prompts import read_conversations, split

    convs, _ = read_conversations(ROOT / "data" / "prompts" / "default.jsonl")
    _, held = split(convs, 0.1, 0)
    out = work / "heldout.jsonl"
    out.write_text("".join(json.dumps(c.prompt_record()) + "\n" for c in held))
    return out


def check_dspark_serving(target: str, drafter: str, work: Path) -> tuple[bool, str]:
    out, log = work / "dspark_serving.json", work / "dspark_serving.log"
    proc = run([PY, "benchmarks/serve_dspark_gpu.py", "--target", target, "--drafter", drafter, "--prompts",
                str(heldout_file(work)), "--limit", "16", "--max-new-tokens", "64", "--dtype", "float32", "--reference",
                "--json", str(out)], 900, log)
    if not out.exists():
        return False, f"exit {proc.returncode}: {tail(log)}"
    r = json.loads(out.read_text())
    tau, ref = r["dspark"]["tau"], r["reference"]["tau"]
    ok = r["lossless"] and tau is not None and abs(tau - ref) <= 0.05
    return ok, f"lossless={r['lossless']}, vLLM tau {tau:.3f} vs reference {ref:.3f}, {r['dspark']['tokens_per_s']:.0f} tok/s"


def check_connector_cuda(target: str, work: Path, kv_cache_dtype: str = "auto") -> tuple[bool, str]:
    """In this process: the engine's own worker process writes the files (with the default KV
    cache dtype, the trainer check replays them)."""
    import torch

    from cluster.inference import InferenceActor, InferenceSettings
    from dspark.config import DSparkConfig
    from dspark.samples import read_sample
    from dspark.targets import hidden_states_for, load_target

    layer_ids = DSparkConfig.from_target(target).extract_layer_ids
    files = work / f"hs_files_{kv_cache_dtype}"
    shutil.rmtree(files, ignore_errors=True)
    actor = InferenceActor(InferenceSettings(target_path=target, layer_ids=layer_ids, key_prefix="gpu-check/g0",
                                             backend="file", file_dir=str(files), device="cuda", dtype="bfloat16",
                                             max_model_len=1024, max_tokens=48, gpu_memory_utilization=0.4,
                                             kv_cache_dtype=kv_cache_dtype,
                                             enforce_eager=False))  # the capture under CUDA graphs
    produced = actor.process([{"id": f"p{i}", "messages": m} for i, m in enumerate(PROMPTS)])
    del actor
    errors = [r.error for r in produced if r.error]
    if errors:
        return False, f"extraction failed: {errors[0]}"
    model, _ = load_target(target, torch.float32)
    model = model.cuda()
    worst = 1.0
    replay = work / "replay"
    if kv_cache_dtype == "auto":
        shutil.rmtree(replay, ignore_errors=True)  # no earlier run's samples for the trainer check
    for r in produced:
        s = read_sample(r.ref["path"], layer_ids)
        if s.hidden_states.dtype != torch.bfloat16:
            return False, f"{r.prompt_id}: hidden states stored as {s.hidden_states.dtype}, not the model's bf16"
        ref = hidden_states_for(model, s.token_ids.cuda(), layer_ids).float().cpu()
        for li in range(len(layer_ids)):
            cos = torch.nn.functional.cosine_similarity(s.hidden_states[:, li].float().flatten(), ref[:, li].flatten(), dim=0)
            worst = min(worst, float(cos))
    bound = 0.999 if kv_cache_dtype == "auto" else 0.99
    detail = f"{len(produced)} conversations, {len(layer_ids)} layers, KV cache {kv_cache_dtype}, worst cosine {worst:.5f}"
    if kv_cache_dtype == "auto" and worst >= bound:  # the trainer check replays these, and only states that passed
        replay.mkdir()
        for r in produced:
            shutil.copy(r.ref["path"], replay / f"{r.prompt_id}.safetensors")
        (replay / REPLAY_PASSED).write_text(detail + "\n")
    return worst >= bound, detail


def check_trainer_nccl(work: Path) -> tuple[bool, str]:
    replay = work / "replay"
    if not (replay / REPLAY_PASSED).exists():
        return False, "no replay samples from a connector_cuda check that passed in this --work directory"
    log = work / "trainer_nccl.log"
    proc = run([PY, "jobs/train_kimi_k3.py", "--config", "configs/local.yaml", "run_name=gpu-check", f"output_dir={work}",
                "device=cuda", "topology.groups.0.gpus_per_node=1", "inference.backend=replay",
                f"inference.replay_dir={replay}", "trainer.zero_stage=2", "trainer.precision=bf16-mixed",
                "data.max_prompts=32", "data.epochs=1", "trainer.checkpoint_interval=4", "data.eval_limit=2",
                "data.eval_max_new_tokens=16", "logging.wandb_mode=disabled"], 900, log)
    result = work / "gpu-check" / "result.json"
    if proc.returncode != 0 or not result.exists():
        return False, f"exit {proc.returncode}: {tail(log)}"
    r = json.loads(result.read_text())
    backend = "nccl" if "nccl" in log.read_text(errors="replace").lower() else "?"
    ok = r["exactly_once"]["trained"] == 32 and r["steps"] > 0 and (Path(r["drafter"]) / "model.safetensors").exists()
    return ok, f"{r['steps']} steps, {r['exactly_once']['trained']} samples exactly once, ZeRO-2, backend {backend}"


def check_serving_gpu(target: str, drafter: str, work: Path) -> tuple[bool, str]:
    out, log = work / "serving", work / "serving_gpu.log"
    proc = run([PY, "benchmarks/serving.py", "--target", target, "--drafter", drafter, "--device", "cuda", "--out", str(out),
                "--concurrency", "1", "4", "16", "--max-tokens", "64"], 900, log)
    if proc.returncode != 0 or not (out / "serving.json").exists():
        return False, f"exit {proc.returncode}: {tail(log)}"
    r = json.loads((out / "serving.json").read_text())
    taus = [p["acceptance_length"] for p in r["with_drafter"]]
    ratios = ", ".join(f"{m['ratio']:.2f}x" for m in r["matched_interactivity"]) or "no matched point"
    return all(t and t > 1 for t in taus), f"server tau {', '.join(f'{t:.2f}' for t in taus if t)}; ratio {ratios}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default=str(ROOT / "outputs" / "local" / "final"))
    ap.add_argument("--work", default="/tmp/dspark-gpu-check")
    ap.add_argument("--only", nargs="+", choices=CHECKS, default=list(CHECKS))
    ap.add_argument("--one", choices=CHECKS, help=argparse.SUPPRESS)  # internal: run one check, print its JSON
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    from dspark.targets import prepare_smollm2

    target = str(prepare_smollm2())
    drafter = str(Path(args.drafter).resolve())
    if args.one:
        fn = {"dspark_serving": lambda: check_dspark_serving(target, drafter, work),
              "connector_cuda": lambda: check_connector_cuda(target, work),
              "connector_fp8_kv": lambda: check_connector_cuda(target, work, "fp8"),
              "trainer_nccl": lambda: check_trainer_nccl(work),
              "serving_gpu": lambda: check_serving_gpu(target, drafter, work)}[args.one]
        ok, detail = fn()
        print("GPU_CHECK_RESULT " + json.dumps({"ok": ok, "detail": detail}))
        return 0

    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: these checks need one", file=sys.stderr)
        return 2
    if any(c in args.only for c in ("dspark_serving", "serving_gpu")) and not (Path(drafter) / "config.json").exists():
        print(f"no drafter at {drafter}: run scripts/run_local.sh (any machine) and bring outputs/local/final, "
              "or pass --drafter", file=sys.stderr)
        return 2
    rows, t_all = [], time.perf_counter()
    for name in CHECKS:
        if name not in args.only:
            continue
        t0 = time.perf_counter()
        log = work / f"{name}.driver.log"
        try:
            run([PY, __file__, "--one", name, "--drafter", drafter, "--work", str(work)], 1200, log)
            line = next((x for x in log.read_text(errors="replace").splitlines() if x.startswith("GPU_CHECK_RESULT ")), None)
            res = json.loads(line.split(" ", 1)[1]) if line else {"ok": False, "detail": tail(log, 8)}
        except subprocess.TimeoutExpired:
            res = {"ok": False, "detail": "timed out after 1200 s"}
        rows.append((name, res["ok"], time.perf_counter() - t0, res["detail"]))
        print(f"[gpu_check] {name}: {'PASS' if res['ok'] else 'FAIL'} ({rows[-1][2]:.0f} s)", flush=True)
    print(f"\nGPU checks on {torch.cuda.get_device_name(0)} ({time.perf_counter() - t_all:.0f} s in all)")
    print(f"{'check':<16} {'result':<6} {'s':>5}  detail")
    for name, ok, secs, detail in rows:
        print(f"{name:<16} {'PASS' if ok else 'FAIL':<6} {secs:>5.0f}  {detail}")
    return 0 if all(ok for _, ok, _, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
