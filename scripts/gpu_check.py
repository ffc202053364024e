"""Every check this project can only do on a CUDA GPU, in one run, one table, non-zero on any
failure (run through `scripts/gpu_check.sh`, which makes the environment).

Coverage (`--list` prints it, with what this machine would run, without importing torch):

  check             what it proves                                                       GPUs
  ----------------  -------------------------------------------------------------------  ----
  dspark_serving    vLLM serves our checkpoint with `method: dspark`: greedy output         1
                    identical to the target alone (lossless), τ within 0.05 of the
                    reference decoder's on the same prompts (both fp32)
  served_recipe     the recipe users serve (dspark.recipe = serve.sh: dspark, every block   1
                    slot drafted, probabilistic drafting, block rejection) through the
                    job's served evaluation (cluster/inference/served_eval.py): greedy outputs
                    identical, token for token, to a target-only engine (fp32), τ > 1;
                    then sampled at T = 0.8 — the Markov head's probabilistic drafting
                    (over the reduced draft vocabulary through d2t, for a drafter that
                    has one) and block verification actually executing — the first 3
                    tokens of 3000 samples from each engine drawn from one distribution
                    (two-sample chi-square, p >= 1e-3), τ > 1
  connector_cuda    the hidden-state capture's CUDA path (cluster.inference.capture_model under CUDA  1
                    graphs + our connector, file backend) against transformers on the
                    GPU: cosine >= 0.999 per aux layer, as the CPU test asks
  connector_fp8_kv  the same with an fp8 KV cache (configs/kimi_k3.yaml's): the states      1
                    still stored in bf16, cosine >= 0.99
  trainer_nccl      the job's trainer on NCCL with ZeRO-2 on this GPU, fed by a replay       1
                    replica with the samples connector_cuda wrote: exactly once, a drafter
                    exported
  serving_gpu       benchmarks/serving.py's GPU variant (the OpenAI server with and          1
                    without the drafter under vllm bench serve): the server measured τ > 1
  replica_tp2       a TP-2 inference replica (vLLM's GPU executor over 2 GPUs) capturing     2
                    hidden states: cosine >= 0.999 per aux layer against transformers
  trainer_zero2_2r  the job's trainer as a 2-rank NCCL world under ZeRO-2 (2 GPUs), fed      2
                    by replay: exactly once over both ranks, a drafter exported

A check that needs more GPUs than the machine has is reported SKIP with the reason (not a
failure); `--only` picks checks.

    python scripts/gpu_check.py --drafter outputs/local/final [--work DIR] [--only NAME ...]
    python scripts/gpu_check.py --list

The drafter is a checkpoint of the local job (`scripts/run_local.sh` on any machine; carry
`outputs/local/final` to the GPU machine). Each check runs in its own process, so that one
engine's GPU memory is free before the next starts.

Not covered here: τ at temperature > 0 against the reference decoder (the two sample
differently; the reference decoder's distribution at T > 0 is tested on CPU,
tests/unit/test_speculative_lossless.py), and TP across nodes on GPUs (one machine).
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
# name -> GPUs it needs (the order is the run order: trainer_* replay what connector_cuda wrote)
CHECKS = {
    "dspark_serving": 1,
    "served_recipe": 1,
    "connector_cuda": 1,
    "connector_fp8_kv": 1,
    "trainer_nccl": 1,
    "serving_gpu": 1,
    "replica_tp2": 2,
    "trainer_zero2_2r": 2,
}
PROMPTS = [
    [{"role": "user", "content": c}]
    for c in (
        "Name three colours of the rainbow.",
        "What is 12 times 7? Explain step by step.",
        "Write a short poem about a lighthouse.",
        "Translate 'good morning, friends' into French and Spanish.",
    )
]


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
    proc = run(
        [
            PY,
            "benchmarks/serve_dspark_gpu.py",
            "--target",
            target,
            "--drafter",
            drafter,
            "--prompts",
            str(heldout_file(work)),
            "--limit",
            "16",
            "--max-new-tokens",
            "64",
            "--dtype",
            "float32",
            "--reference",
            "--json",
            str(out),
        ],
        900,
        log,
    )
    if not out.exists():
        return False, f"exit {proc.returncode}: {tail(log)}"
    r = json.loads(out.read_text())
    tau, ref = r["dspark"]["tau"], r["reference"]["tau"]
    ok = r["lossless"] and tau is not None and abs(tau - ref) <= 0.05
    return (
        ok,
        f"lossless={r['lossless']}, vLLM tau {tau:.3f} vs reference {ref:.3f}, {r['dspark']['tokens_per_s']:.0f} tok/s",
    )


def two_sample_chi_square(a: dict, b: dict, min_count: int = 10) -> tuple[float, int, float]:
    """Homogeneity of two samples (outcome -> count): Pearson's statistic over the outcomes seen
    at least `min_count` times in both together (the rest pooled), df = cells - 1, p-value."""
    import torch

    na, nb = sum(a.values()), sum(b.values())
    cells, rest = [], [0, 0]
    for key in set(a) | set(b):
        x, y = a.get(key, 0), b.get(key, 0)
        if x + y >= min_count:
            cells.append((x, y))
        else:
            rest[0], rest[1] = rest[0] + x, rest[1] + y
    if sum(rest):
        cells.append(tuple(rest))
    stat = 0.0
    for x, y in cells:
        ea, eb = (x + y) * na / (na + nb), (x + y) * nb / (na + nb)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    df = max(len(cells) - 1, 1)
    p = float(
        torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64))
    )
    return stat, df, p


def check_served_recipe(
    target: str, drafter: str, work: Path, samples: int = 3000, temperature: float = 0.8, compare_tokens: int = 3
) -> tuple[bool, str]:
    """The recipe serve.sh serves, through cluster/inference/served_eval.py (greedy, lossless against a
    target-only engine), then sampled: the first `compare_tokens` tokens of `samples` requests
    of one prompt from the speculative engine and from the target alone come from one
    distribution. fp32, so that greedy equality is not at the mercy of bf16 near-ties."""
    from vllm import LLM, SamplingParams

    from cluster.config import TargetConfig
    from cluster.inference import InferenceSettings, engine_kwargs
    from cluster.inference.served_eval import ServedEvalSettings, ServedEvaluator, _close, decode_stats
    from dspark.chat import render_prompt
    from dspark.recipe import speculative_config

    spec = speculative_config(json.loads((Path(drafter) / "config.json").read_text()), drafter)
    if (spec["method"], spec["draft_sample_method"], spec["rejection_sample_method"]) != (
        "dspark",
        "probabilistic",
        "block",
    ):
        return False, f"the recipe is not the one users are told to serve: {spec}"
    prompts = [json.loads(line) for line in heldout_file(work).read_text().splitlines()][:16]
    engine = InferenceSettings(
        TargetConfig(path=target, dtype="float32", max_model_len=1024, gpu_memory_utilization=0.4, enforce_eager=True),
        [],
        "gpu-check/eval",
        device="cuda",
        extract=False,
    )
    ev = ServedEvaluator(ServedEvalSettings(engine, drafter, "dspark", 64, check_lossless=True))
    greedy = ev.evaluate(prompts)
    tokenizer = ev.tokenizer
    del ev  # its engines are shut down by the lossless check
    differing = greedy["lossless_check"]["differing"]

    ids = render_prompt(tokenizer, prompts[0]["messages"], engine.chat)
    params = [SamplingParams(temperature=temperature, max_tokens=compare_tokens, seed=i) for i in range(samples)]
    counts, taus = [], []
    for cfg in (spec, None):
        kwargs = dict(speculative_config=cfg, per_request_spec_decode_metrics="detailed") if cfg else {}
        llm = LLM(**engine_kwargs(engine), **kwargs)
        try:
            outs = llm.generate([{"prompt_token_ids": ids}] * samples, params, use_tqdm=False)
        finally:
            _close(llm)
        c: dict = {}
        for o in outs:
            key = tuple(o.outputs[0].token_ids[:compare_tokens])
            c[key] = c.get(key, 0) + 1
        counts.append(c)
        if cfg:
            steps = [
                decode_stats(
                    o.outputs[0].spec_decode_metrics.per_step_accepted,
                    o.outputs[0].spec_decode_metrics.per_step_drafted,
                )
                for o in outs
            ]
            taus.append(sum(s.accepted + s.steps for s in steps) / max(sum(s.steps for s in steps), 1))
    stat, df, p = two_sample_chi_square(*counts)
    ok = greedy["lossless"] is True and (greedy["tau"] or 0) > 1 and p >= 1e-3 and taus[0] > 1
    return ok, (
        f"greedy: lossless={greedy['lossless']} over {greedy['lossless_check']['prompts']} prompts"
        f"{'' if not differing else f' (first difference {differing[0]})'}, τ {greedy['tau'] or 0:.3f}; "
        f"T={temperature}: τ {taus[0]:.3f}, first {compare_tokens} tokens of {samples} samples vs target alone: "
        f"chi2 {stat:.1f}, df {df}, p {p:.3g} ({len(counts[1])} distinct)"
    )


def check_connector_cuda(target: str, work: Path, kv_cache_dtype: str = "auto", tp: int = 1) -> tuple[bool, str]:
    """In this process: the engine's own worker process writes the files (with the default KV
    cache dtype on one GPU, the trainer checks replay them). `tp` 2: the replica spans two GPUs
    through vLLM's GPU executor for tensor parallelism (Ray, as the job's replicas use it: a
    local Ray is started here, the job's driver has one)."""
    import torch

    from cluster.config import SamplingConfig, TargetConfig
    from cluster.inference import InferenceActor, InferenceSettings
    from dspark.config import DSparkConfig
    from dspark.samples import read_sample
    from dspark.targets import hidden_states_for, load_target

    layer_ids = DSparkConfig.from_target(target).extract_layer_ids
    files = work / f"hs_files_{kv_cache_dtype}_tp{tp}"
    shutil.rmtree(files, ignore_errors=True)
    if tp > 1:
        import ray

        ray.init(address="local", num_gpus=torch.cuda.device_count(), include_dashboard=False, log_to_driver=False)
    target_cfg = TargetConfig(
        path=target,
        dtype="bfloat16",
        max_model_len=1024,
        gpu_memory_utilization=0.4,
        kv_cache_dtype=kv_cache_dtype,
        tensor_parallel_size=tp,
        enforce_eager=False,
    )  # the capture under CUDA graphs
    actor = InferenceActor(
        InferenceSettings(
            target_cfg,
            layer_ids,
            "gpu-check/g0",
            sampling=SamplingConfig(max_tokens=48),
            backend="file",
            file_dir=str(files),
            device="cuda",
        )
    )
    produced = actor.process([{"id": f"p{i}", "messages": m} for i, m in enumerate(PROMPTS)])
    del actor
    errors = [r.error for r in produced if r.error]
    if errors:
        return False, f"extraction failed: {errors[0]}"
    model, _ = load_target(target, torch.float32)
    model = model.cuda()
    worst = 1.0
    replay = work / "replay"
    replays = kv_cache_dtype == "auto" and tp == 1  # the states the trainer checks replay
    if replays:
        shutil.rmtree(replay, ignore_errors=True)  # no earlier run's samples for the trainer check
    for r in produced:
        s = read_sample(r.path, layer_ids)
        if s.hidden_states.dtype != torch.bfloat16:
            return False, f"{r.prompt_id}: hidden states stored as {s.hidden_states.dtype}, not the model's bf16"
        ref = hidden_states_for(model, s.token_ids.cuda(), layer_ids).float().cpu()
        for li in range(len(layer_ids)):
            cos = torch.nn.functional.cosine_similarity(
                s.hidden_states[:, li].float().flatten(), ref[:, li].flatten(), dim=0
            )
            worst = min(worst, float(cos))
    bound = 0.999 if kv_cache_dtype == "auto" else 0.99
    detail = (
        f"{len(produced)} conversations, {len(layer_ids)} layers, TP {tp}, KV cache {kv_cache_dtype}, "
        f"worst cosine {worst:.5f}"
    )
    if replays and worst >= bound:  # the trainer check replays these, and only states that passed
        replay.mkdir()
        for r in produced:
            shutil.copy(r.path, replay / f"{r.prompt_id}.safetensors")
        (replay / REPLAY_PASSED).write_text(detail + "\n")
    return worst >= bound, detail


def check_trainer_nccl(work: Path, ranks: int = 1) -> tuple[bool, str]:
    """The job on GPUs with a replay replica; `ranks` trainer ranks on as many GPUs of this node
    (one data-parallel NCCL world under ZeRO-2)."""
    replay = work / "replay"
    if not (replay / REPLAY_PASSED).exists():
        return False, "no replay samples from a connector_cuda check that passed in this --work directory"
    name = "gpu-check" if ranks == 1 else f"gpu-check-{ranks}r"
    log = work / f"trainer_nccl_{ranks}r.log"
    proc = run(
        [
            PY,
            "jobs/train_kimi_k3.py",
            "--config",
            "configs/local.yaml",
            f"run_name={name}",
            f"output_dir={work}",
            "device=cuda",
            f"topology.groups.0.gpus_per_node={ranks}",
            f"topology.groups.0.trainer_ranks_per_node={ranks}",
            "inference.backend=replay",
            f"inference.replay_dir={replay}",
            "trainer.zero_stage=2",
            "trainer.precision=bf16-mixed",
            "data.max_prompts=32",
            "data.epochs=1",
            "trainer.checkpoint_interval=4",
            "data.eval_limit=2",
            "data.eval_max_new_tokens=16",
            "logging.wandb_mode=disabled",
        ],
        900,
        log,
    )
    result = work / name / "result.json"
    if proc.returncode != 0 or not result.exists():
        return False, f"exit {proc.returncode}: {tail(log)}"
    r = json.loads(result.read_text())
    backend = "nccl" if "nccl" in log.read_text(errors="replace").lower() else "?"
    world = sum(r.get("world", {}).values())
    ok = (
        r["exactly_once"]["trained"] == 32
        and r["steps"] > 0
        and world == ranks
        and (Path(r["drafter"]) / "model.safetensors").exists()
    )
    return ok, (
        f"{r['steps']} steps, {r['exactly_once']['trained']} samples exactly once, ZeRO-2, {world} rank(s), "
        f"backend {backend}"
    )


def check_serving_gpu(target: str, drafter: str, work: Path) -> tuple[bool, str]:
    out, log = work / "serving", work / "serving_gpu.log"
    proc = run(
        [
            PY,
            "benchmarks/serving.py",
            "--target",
            target,
            "--drafter",
            drafter,
            "--device",
            "cuda",
            "--out",
            str(out),
            "--concurrency",
            "1",
            "4",
            "16",
            "--max-tokens",
            "64",
        ],
        900,
        log,
    )
    if proc.returncode != 0 or not (out / "serving.json").exists():
        return False, f"exit {proc.returncode}: {tail(log)}"
    r = json.loads((out / "serving.json").read_text())
    taus = [p["acceptance_length"] for p in r["with_drafter"]]
    ratios = ", ".join(f"{m['ratio']:.2f}x" for m in r["matched_interactivity"]) or "no matched point"
    return all(t and t > 1 for t in taus), f"server tau {', '.join(f'{t:.2f}' for t in taus if t)}; ratio {ratios}"


def count_gpus_without_torch() -> int:
    """GPUs `nvidia-smi -L` lists (0 where there is none or no driver): for --list, which must
    run anywhere without the GPU environment."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines()) if out.returncode == 0 else 0


def coverage_table() -> str:
    """The docstring's coverage table (one source)."""
    lines = __doc__.splitlines()
    start = next(i for i, x in enumerate(lines) if x.strip().startswith("check ") and "GPUs" in x)
    end = next(i for i in range(start + 2, len(lines)) if not lines[i].strip())
    return "\n".join(lines[start:end])


def plan(only: list[str], gpus: int) -> list[tuple[str, str | None]]:
    """(check, None to run it, else why it is skipped) in run order."""
    return [
        (name, None if CHECKS[name] <= gpus else f"needs {CHECKS[name]} GPUs, this machine has {gpus}")
        for name in CHECKS
        if name in only
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default=str(ROOT / "outputs" / "local" / "final"))
    ap.add_argument("--work", default="/tmp/dspark-gpu-check")
    ap.add_argument("--only", nargs="+", choices=CHECKS, default=list(CHECKS))
    ap.add_argument("--list", action="store_true", help="print the coverage table and what this machine would run")
    ap.add_argument("--one", choices=CHECKS, help=argparse.SUPPRESS)  # internal: run one check, print its JSON
    args = ap.parse_args()
    if args.list:
        gpus = count_gpus_without_torch()
        print(coverage_table())
        print(f"\nthis machine: {gpus} GPU(s) (nvidia-smi)")
        for name, skip in plan(args.only, gpus):
            print(f"  {name:<17} {'run' if skip is None else 'SKIP: ' + skip}")
        return 0
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    from dspark.targets import prepare_smollm2

    target = str(prepare_smollm2())
    drafter = str(Path(args.drafter).resolve())
    if args.one:
        fn = {
            "dspark_serving": lambda: check_dspark_serving(target, drafter, work),
            "served_recipe": lambda: check_served_recipe(target, drafter, work),
            "connector_cuda": lambda: check_connector_cuda(target, work),
            "connector_fp8_kv": lambda: check_connector_cuda(target, work, "fp8"),
            "trainer_nccl": lambda: check_trainer_nccl(work),
            "serving_gpu": lambda: check_serving_gpu(target, drafter, work),
            "replica_tp2": lambda: check_connector_cuda(target, work, tp=2),
            "trainer_zero2_2r": lambda: check_trainer_nccl(work, ranks=2),
        }[args.one]
        ok, detail = fn()
        print("GPU_CHECK_RESULT " + json.dumps({"ok": ok, "detail": detail}))
        return 0

    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: these checks need one", file=sys.stderr)
        return 2
    needs_drafter = ("dspark_serving", "served_recipe", "serving_gpu")
    if any(c in args.only for c in needs_drafter) and not (Path(drafter) / "config.json").exists():
        print(
            f"no drafter at {drafter}: run scripts/run_local.sh (any machine) and bring outputs/local/final, "
            "or pass --drafter",
            file=sys.stderr,
        )
        return 2
    rows, t_all = [], time.perf_counter()
    for name, skip in plan(args.only, torch.cuda.device_count()):
        if skip is not None:
            rows.append((name, None, 0.0, skip))
            print(f"[gpu_check] {name}: SKIP ({skip})", flush=True)
            continue
        t0 = time.perf_counter()
        log = work / f"{name}.driver.log"
        try:
            run([PY, __file__, "--one", name, "--drafter", drafter, "--work", str(work)], 1200, log)
            line = next(
                (x for x in log.read_text(errors="replace").splitlines() if x.startswith("GPU_CHECK_RESULT ")), None
            )
            res = json.loads(line.split(" ", 1)[1]) if line else {"ok": False, "detail": tail(log, 8)}
        except subprocess.TimeoutExpired:
            res = {"ok": False, "detail": "timed out after 1200 s"}
        rows.append((name, res["ok"], time.perf_counter() - t0, res["detail"]))
        print(f"[gpu_check] {name}: {'PASS' if res['ok'] else 'FAIL'} ({rows[-1][2]:.0f} s)", flush=True)
    label = {True: "PASS", False: "FAIL", None: "SKIP"}
    print(
        f"\nGPU checks on {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)} "
        f"({time.perf_counter() - t_all:.0f} s in all)"
    )
    print(f"{'check':<17} {'result':<6} {'s':>5}  detail")
    for name, ok, secs, detail in rows:
        print(f"{name:<17} {label[ok]:<6} {secs:>5.0f}  {detail}")
    return 0 if all(ok is not False for _, ok, _, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
