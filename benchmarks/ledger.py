"""The sample ledger's cost per call as the data set grows (one process, no Ray).

    python benchmarks/ledger.py [--sizes 10000 100000 1000000] [--rounds 200]

One ledger holds every prompt × epoch of a job (2 epochs here), and every replica of every
group and the training loop call it, so a call must cost what is in flight, not the size of
the data set. Per size: building the ledger, then rounds of two groups asking for 16 prompts and
reporting them, a step leased for 4 ranks in 2 groups, a commit every 10 steps and the counts
the progress line reads. The smallest size is the baseline: a ledger that scanned its entries
would grow 100× from 10K to 1M prompts.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.data import SampleLedger  # noqa: E402


def measure(n: int, rounds: int) -> dict:
    t0 = time.perf_counter()
    groups = ("g0", "g1")
    ledger = SampleLedger([{"id": f"p{i}", "messages": []} for i in range(n)], epochs=2,
                          watermarks={g: (1 << 40, 1 << 39) for g in groups})
    out = {"build_s": time.perf_counter() - t0}
    spent = dict.fromkeys(("request_prompts", "report_produced", "lease_step", "commit", "counts"), 0.0)

    def timed(name, fn, *args):
        t = time.perf_counter()
        result = fn(*args)
        spent[name] += time.perf_counter() - t
        return result

    for step in range(1, rounds + 1):
        for g in groups:
            handed = timed("request_prompts", ledger.request_prompts, f"{g}-r0", 16, g)
            timed("report_produced", ledger.report_produced, f"{g}-r0",
                  [{"uid": p["uid"], "ref": {"key": p["key"]}, "tokens": 100, "nbytes": 1000} for p in handed])
        timed("lease_step", ledger.lease_step, step, ["g0", "g0", "g1", "g1"], 400)
        if step % 10 == 0:
            timed("commit", ledger.commit, step)
        timed("counts", ledger.counts)
    calls = {"request_prompts": 2 * rounds, "report_produced": 2 * rounds, "lease_step": rounds,
             "commit": rounds // 10, "counts": rounds}
    out.update({k: 1000 * v / calls[k] for k, v in spent.items()})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args()
    cols = ("request_prompts", "report_produced", "lease_step", "commit", "counts")
    print(f"{'prompts':>10} {'build s':>8} " + " ".join(f"{c + ' ms':>18}" for c in cols))
    for n in args.sizes:
        m = measure(n, args.rounds)
        print(f"{n:>10,} {m['build_s']:>8.1f} " + " ".join(f"{m[c]:>18.2f}" for c in cols))


if __name__ == "__main__":
    main()
