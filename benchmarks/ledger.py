"""The sample ledger's cost per call as the data set grows (one process, no Ray), side by side
with the ledger before its indexes (tests/ledger_reference: the code as of 7b3a0cd, behind its
typed-rows adapter).

    python benchmarks/ledger.py [--sizes 10000 100000 1000000] [--rounds 200] [--cap-s 60]

One ledger holds every prompt × epoch of a job (3 epochs, answers reused across epochs: the
path where most samples sit stored), and every replica of every group and the training loop
call it, so a call must cost what it touches, not the size of the data set. Per size and
ledger: half of epoch 0 generated and stored first (the set-up, timed apart), then rounds of
two groups asking for 16 prompts each and reporting them, one step leased for 4 ranks in 2
groups, a commit every 10 steps (with the checkpoint state saved before it, as the job does)
and the counts the progress line reads. A ledger stops after `--cap-s` seconds of calls (the
rounds it managed are printed); one whose set-up alone passes the cap is not measured there.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.data import ProducedSample, SampleLedger  # noqa: E402
from cluster.store import SampleRef  # noqa: E402
from tests.ledger_reference.typed import TypedReferenceLedger as ReferenceLedger  # noqa: E402

GROUPS = ("g0", "g1")
CALLS = ("request_prompts", "report_produced", "lease_step", "checkpoint_state", "commit", "counts")


def stored(handed) -> list[ProducedSample]:
    """Their samples: 100 tokens, about 1 kB each (one float32 layer, 1 wide)."""
    return [ProducedSample(p.uid, SampleRef(p.key, 100, (0,), 1, "float32")) for p in handed]


def produce(ledger, group: str, n: int) -> None:
    ledger.report_produced(f"{group}-r0", stored(ledger.request_prompts(f"{group}-r0", n, group)))


def measure(cls, n: int, rounds: int, cap_s: float) -> dict:
    t0 = time.perf_counter()
    ledger = cls(
        [{"id": f"p{i}", "messages": []} for i in range(n)],
        epochs=3,
        reuse_across_epochs=True,
        watermarks={g: (1 << 40, 1 << 39) for g in GROUPS},
    )
    out = {"build_s": time.perf_counter() - t0}
    t0 = time.perf_counter()
    while ledger.counts().stored < n // 2:
        for g in GROUPS:
            produce(ledger, g, 4096)
        if time.perf_counter() - t0 > cap_s:
            return {**out, "setup_s": None}
    out["setup_s"] = time.perf_counter() - t0
    spent, calls = dict.fromkeys(CALLS, 0.0), dict.fromkeys(CALLS, 0)

    def timed(name, fn, *args):
        t = time.perf_counter()
        result = fn(*args)
        spent[name] += time.perf_counter() - t
        calls[name] += 1
        return result

    t0 = time.perf_counter()
    for step in range(1, rounds + 1):
        for g in GROUPS:
            handed = timed("request_prompts", ledger.request_prompts, f"{g}-r1", 16, g)
            timed("report_produced", ledger.report_produced, f"{g}-r1", stored(handed))
        timed("lease_step", ledger.lease_step, step, ["g0", "g0", "g1", "g1"], 400)
        if step % 10 == 0:
            timed("checkpoint_state", ledger.checkpoint_state, step)
            timed("commit", ledger.commit, step)
        timed("counts", ledger.counts)
        if time.perf_counter() - t0 > cap_s:
            break
    out["rounds"] = step
    out.update({k: 1e6 * spent[k] / calls[k] if calls[k] else None for k in CALLS})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--cap-s", type=float, default=60.0, help="seconds of calls per ledger and size")
    args = ap.parse_args()
    print("µs per call (3 epochs, reuse, half of epoch 0 stored); 'before' = tests/ledger_reference")
    print(
        f"{'prompts':>10} {'ledger':>7} {'build s':>8} {'set-up s':>9} {'rounds':>6} "
        + " ".join(f"{c:>17}" for c in CALLS)
    )
    for n in args.sizes:
        for name, cls in (("before", ReferenceLedger), ("after", SampleLedger)):
            m = measure(cls, n, args.rounds, args.cap_s)
            if m["setup_s"] is None:
                print(f"{n:>10,} {name:>7} {m['build_s']:>8.1f} {'> cap':>9}")
                continue
            cells = " ".join(f"{m[c]:>17,.0f}" if m[c] is not None else f"{'—':>17}" for c in CALLS)
            print(f"{n:>10,} {name:>7} {m['build_s']:>8.1f} {m['setup_s']:>9.1f} {m['rounds']:>6} {cells}", flush=True)


if __name__ == "__main__":
    main()
