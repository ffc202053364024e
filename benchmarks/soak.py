"""A run of days in minutes: the job's control path under a seeded chaos schedule.

    python benchmarks/soak.py [--prompts 10000] [--groups 100] [--ray] [--cap-s 600] [--chaos-scale 1]

What runs is the project's own code, called as the job calls it: one `SampleLedger` (in this
process, or with `--ray` in a Ray actor behind `LedgerClient`, as `TrainingJob` builds it), the
`TrainingRecord` (add per step, commit with each checkpoint, `rollback_to` on a restart), and
the checkpoint as `Committer.commit` takes it (the ledger's `checkpoint_delta`, or its
`checkpoint_state` for a base, written by `write_ledger_state` as a link of the checkpoints'
`LedgerChain`, the files' digests and the record's rows in `meta.json`, then `commit` and
`abandoned_keys`); recovery as the job recovers (`replica_died`, `hung_replicas` found by the
supervisor's check, `trainer_restarted` with the record rolled back, `master_restarted` with the
step's `release_lease`, and a stop and resubmit: a new ledger `load_state_dict`-ed from the last
checkpoint's state, `load_ledger_state`).

What is simulated: time (the ledger's `clock` is a `SimClock`, one tick per trainer step of
`--step-s` simulated seconds); the producers (replay-like: each replica takes `--replica-batch`
prompts, "generates" them for about `--gen-s` and reports a `SampleRef` per prompt whose bytes
make a group reach its watermark when answers run long); the trainer ranks (they lease and
train instantly); and the faults (benchmarks/soak_chaos.py: rates per simulated hour, seeded).
What is not: models, the store's bytes (keys are never read; removal is not simulated), Ray's
restarts and backoffs (a replacement replica or world is there at the next tick), the autoscaler
and resizes, the time budget's `shorten`, reserved prompts, `release_samples=after_step`.

Printed: per decile of the run (by samples trained) the control path's cost per step (the
supervisor's `hung_replicas` and `counts`, `lease_step`, `to_generate`, `record.add`), the
producers' cost per call, each checkpoint's time (state / write / record) and the bytes it wrote, and its
cost per changed row (samples produced + trained since the one before); the restarts by cause;
the faults injected; the exactly-once proof (`TrainingRecord.verify` against `outcome()`); the
issue's goals marked PASS/FAIL (measurements, not assertions). `run_soak(argv)` returns it all.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.soak_chaos import KINDS, Chaos, SimClock, SimLedger, cpu_model, decile_table, format_table, percentiles  # noqa: E402
from cluster.data import ExactlyOnceViolation, LedgerClient, ProducedSample, SampleLedger, TrainingRecord, quarantined  # noqa: E402
from cluster.data.ledger_checkpoint import LedgerChain, load_ledger_state, write_ledger_state, written_digests  # noqa: E402
from cluster.data.ledger_entry import poison_samples  # noqa: E402
from cluster.job.poison import PoisonSearch, lease_test  # noqa: E402
from cluster.store import SampleRef  # noqa: E402

LAYERS, HIDDEN = (0, 1, 2), 64  # a sample's shape: ~390 bytes a token, ~110 kB an answer
EPOCHS = 3


class Stalled(RuntimeError):
    pass


def ledger_digests(tmp: Path) -> dict[str, dict]:
    """What rank 0's `cluster.training.checkpoints.file_digests` records of the ledger's files
    (not imported here: the training room brings torch, whose objects would be in every garbage
    collection this process measures): the chain's files as they were written, the rest hashed."""
    known = written_digests(tmp)
    return {
        f.name: known.get(f.name) or {"bytes": f.stat().st_size, "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
        for f in sorted(tmp.iterdir())
    }


def tokens_of(prompt_id: str) -> int:
    return 64 + zlib.crc32(prompt_id.encode()) % 449  # 64..512, the same answer length every epoch


@dataclass
class Replica:
    rid: str
    group: str
    tasks: list = field(default_factory=list)
    done_at: float = 0.0
    hung: bool = False


class Soak:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a, self.rng = a, random.Random(f"soak/{a.seed}")
        # what the costs are measured in: wall time, or this process's CPU time (on a machine
        # shared with other work, whose load would otherwise be in every figure)
        self.timer = time.process_time if a.clock == "cpu" else time.perf_counter
        self.prompts = [{"id": f"p{i}", "messages": []} for i in range(a.prompts)]
        self.total = a.prompts * EPOCHS
        self.groups = [f"g{i:03d}" for i in range(a.groups)]
        self.rank_groups = [g for g in self.groups for _ in range(a.ranks)]
        self.clock, self.actor = SimClock(), None
        self.dir = Path(a.out or tempfile.mkdtemp(prefix="soak-"))
        self.record = TrainingRecord(self.dir / "trained.jsonl")
        self.record.reset()
        self.chaos = Chaos(a.seed, a.chaos_scale, forced=tuple(KINDS if a.every_fault else ()))
        picks = self.rng.sample(range(a.prompts), a.poison_prompts + a.poison_samples)
        self.poison_prompts = {f"p{i}" for i in picks[: a.poison_prompts]}
        self.poison_samples = {f"p{i}@0": 0 for i in picks[a.poison_prompts :]}  # uid -> ranks it killed
        # the job's poison-sample search (`cluster.job.poison`), as the training loop drives it; each
        # search's end: {"verdict", "uid", "samples" of the step it began with, "failures" of its tests}
        self.search, self.searches = PoisonSearch(), []
        for name, kind in [(p, "poison_prompt") for p in sorted(self.poison_prompts)] + [
            (u, "poison_sample") for u in sorted(self.poison_samples)
        ]:
            self.chaos.record(0, 0, kind, name)
        self.resubmit_at = sorted(a.resubmit_at)
        self.restarts, self.hangs, self.full_watch = Counter(), Counter(), {}
        self.big_reported: Counter = Counter()  # long answers a full-store group reported
        self.big_batches: dict[str, int] = {}  # a group's batches still to report with long answers (a full store)
        self.step = self.committed_rows = self.changed = 0
        self.ckpts: list[Path] = []
        self.chain = LedgerChain()  # the Committer's
        self.master_gen = self.incarnation = self.serial = 0
        self.waiting: list[str] = []  # drawn faults with nothing to hit yet
        self.in_step: list[str] = []  # faults that strike the next step (between its lease and its read)
        self.events: list[dict] = []  # the in-process ledgers' events, across resubmits
        self.step_costs, self.produce_costs, self.ckpt_costs = [], [], []
        self.recovery = {}  # call -> seconds, per call
        self.calls, self.step_cost = {}, 0.0  # the step's calls: name -> seconds per call; this step's sum
        sample = SampleRef("k", 288, LAYERS, HIDDEN).nbytes
        self.ledger = self.new_ledger(
            watermarks={g: (a.watermark_samples * sample, a.watermark_samples * sample // 2) for g in self.groups},
            sample_bytes_estimate=SampleRef("k", 512, LAYERS, HIDDEN).nbytes,
        )
        self.replicas: dict[str, Replica] = {}
        for g in self.groups:
            for _ in range(a.replicas):
                self.add_replica(g)

    # ---- the ledger, as the job builds it ----------------------------------------------------
    def new_ledger(self, **kw):
        self.kw = {**getattr(self, "kw", {}), **kw}
        kw = dict(
            epochs=EPOCHS,
            key_prefix="soak",
            max_attempts=3,
            shuffle_seed=self.a.seed,
            reuse_across_epochs=not self.a.regenerate,
            **self.kw,
        )
        if not self.a.ray:
            ledger = SampleLedger(self.prompts, clock=self.clock, **kw)
        else:
            import ray

            self.actor = ray.remote(num_cpus=0)(SimLedger).remote(self.prompts, **kw)
            ledger = LedgerClient(self.actor)
        ledger.settle()  # as the job does with its ledger actor
        return ledger

    def sync_clock(self) -> None:
        if self.actor is not None:
            import ray

            ray.get(self.actor.set_time.remote(self.clock.t))

    def ledger_events(self) -> list[dict]:
        return self.ledger.events if self.actor is None else []

    def timed(self, name: str, fn, *args):
        """A call of the step's control path: its time goes to the step and to the call's own list."""
        t = self.timer()
        out = fn(*args)
        dt = self.timer() - t
        self.step_cost += dt
        self.calls.setdefault(name, []).append(dt)
        return out

    def timed_recovery(self, name: str, fn, *args):
        t = self.timer()
        out = fn(*args)
        self.recovery.setdefault(name, []).append(self.timer() - t)
        return out

    @property
    def done(self) -> int:
        return self.committed_rows + len(self.record.pending)

    # ---- producers -----------------------------------------------------------------------------
    def add_replica(self, group: str) -> None:
        self.serial += 1
        rid = f"{group}-j{self.incarnation}-r{self.serial}"
        self.replicas[rid] = Replica(rid, group)

    def replica_dies(self, rep: Replica, cause: str, detail: str) -> None:
        self.timed_recovery("replica_died", self.ledger.replica_died, rep.rid, detail)
        self.restarts[f"replica: {cause}"] += 1
        del self.replicas[rep.rid]
        self.add_replica(rep.group)

    def produce(self) -> None:
        now, a = self.clock.t, self.a
        for rep in list(self.replicas.values()):
            if rep.tasks and not rep.hung and rep.done_at <= now:
                poison = [t.id for t in rep.tasks if t.id in self.poison_prompts]
                if poison:  # it kills every replica that generates it
                    self.replica_dies(rep, "poison_prompt", f"poison prompt {poison[0]} crashed the engine")
                    continue
                big = self.big_batches.get(rep.group, 0)
                wide = HIDDEN * (64 if big else 1)  # 64×: one batch of 8 passes a 200-sample watermark
                results = [ProducedSample(t.uid, SampleRef(t.key, tokens_of(t.id), LAYERS, wide)) for t in rep.tasks]
                t0 = self.timer()
                self.ledger.report_produced(rep.rid, results)
                self.produce_costs.append((self.done, self.timer() - t0))
                if big:
                    self.big_reported[rep.group] += len(results)
                if big and self.full_watch.get(rep.group) is False:
                    # seen here too: the group's ranks may lease it back under its low watermark
                    # within this tick, before the supervisor's look (not counted in any cost)
                    self.full_watch[rep.group] = self.ledger.counts().groups[rep.group].paused
                self.changed += len(results)
                rep.tasks = []
                if big:
                    self.big_batches[rep.group] = big - 1
            if not rep.tasks and not rep.hung:
                t0 = self.timer()
                rep.tasks = self.ledger.request_prompts(rep.rid, a.replica_batch, rep.group)
                self.produce_costs.append((self.done, self.timer() - t0))
                rep.done_at = now + a.gen_s * self.rng.uniform(0.5, 1.5)

    # ---- faults ----------------------------------------------------------------------------------
    def inject(self, kind: str) -> bool:
        """Apply one drawn fault; False: nothing it could hit now (it waits for the next tick)."""
        live = [r for r in self.replicas.values() if not r.hung]
        busy = [r for r in live if r.tasks]
        if kind in ("replica_death", "hang", "full_store") and not busy:
            return False
        if kind == "replica_death":
            rep = self.rng.choice(busy)
            self.chaos.record(self.clock.t, self.step, kind, rep.rid)
            self.replica_dies(rep, kind, "killed by the chaos schedule")
        elif kind == "hang":
            rep = self.rng.choice(busy)
            rep.hung = True
            self.hangs["injected"] += 1
            self.chaos.record(self.clock.t, self.step, kind, rep.rid)
        elif kind == "full_store":  # a group whose replicas are generating: their next batches run long
            # a group not hit before: each fault's pause is then its own to be seen
            fresh = sorted({r.group for r in busy} - set(self.full_watch))
            if not fresh:
                return False
            g = self.rng.choice(fresh)
            # the group's, not its replicas': a replica that dies or is replaced (a resubmit)
            # leaves the fault to the one that takes its place
            self.big_batches[g] = 2 * sum(r.group == g for r in live)
            self.full_watch[g] = False
            self.chaos.record(self.clock.t, self.step, kind, g)
        else:  # master_restart, rank_death: in the step (between its lease and its read)
            self.in_step.append(kind)
        return True

    def supervise(self):
        """The supervisor's check and the progress line: hung replicas die, pauses are seen."""
        self.step_cost = 0.0
        hung = self.timed("hung_replicas", self.ledger.hung_replicas, self.a.hang_timeout_s)
        counts = self.timed("counts", self.ledger.counts)
        for rid, age in hung.items():
            rep = self.replicas[rid]
            self.hangs["found"] += 1
            self.replica_dies(rep, "hang" if rep.hung else "slow (not injected)", f"hung: generating for {age:.0f}s")
        for g, gc in counts.groups.items():
            if gc.paused and g in self.full_watch:
                self.full_watch[g] = True
        return counts

    # ---- the trainer ---------------------------------------------------------------------------
    def trainer_restart(self, cause: str) -> None:
        ck_step, rows = self.last_checkpoint()
        self.timed_recovery("trainer_restarted", self.ledger.trainer_restarted, ck_step)
        self.timed_recovery("record.rollback_to", self.record.rollback_to, rows)
        self.step, self.restarts[f"trainer: {cause}"] = ck_step, self.restarts[f"trainer: {cause}"] + 1

    def last_checkpoint(self) -> tuple[int, int]:
        if not self.ckpts:
            return 0, 0
        meta = json.loads((self.ckpts[-1] / "meta.json").read_text())
        return meta["step"], meta["record_rows"]

    def train_step(self, counts) -> str:
        step, ledger = self.step + 1, self.ledger
        lease = None
        if self.search.active():  # only its suspects until it ends, as the loop leases (`TrainingLoop.lease`)
            lease, verdict = lease_test(self.search, ledger, step, self.rank_groups, self.a.batch_tokens)
            self.search_ended(verdict)
        if lease is None:
            lease = self.timed("lease_step", ledger.lease_step, step, self.rank_groups, self.a.batch_tokens)
        uids = [s.uid for rows in lease or () for s in rows]
        if "master_restart" in self.in_step:  # the store's keys are gone; this step cannot be read
            self.in_step.remove("master_restart")
            self.master_gen += 1
            self.chaos.record(self.clock.t, step, "master_restart", f"generation {self.master_gen}")
            self.timed_recovery("master_restarted", ledger.master_restarted, self.master_gen)
            if uids:
                self.timed_recovery("release_lease", ledger.release_lease, step, uids)
            self.restarts["store: master_restart"] += 1
            return "waited"
        if "rank_death" in self.in_step:  # (not told to a search: the job would count it as a failed test)
            self.in_step.remove("rank_death")
            self.chaos.record(self.clock.t, step, "rank_death", f"step {step}")
            self.trainer_restart("rank_death")
            return "waited"
        if lease is None:
            if self.timed("drained", ledger.drained):
                return "drained"
            if self.record.pending and counts.paused:  # the loop's early checkpoint: only a commit makes room
                self.checkpoint("early: store full")
            return "waited"
        killers = [u for u in self.poison_samples if any(x.rsplit("@", 1)[0] == u.rsplit("@", 1)[0] for x in uids)]
        if killers:  # a rank dies on it: the search begins, or this was one of its tests (`TrainingLoop.restart`)
            self.poison_samples[killers[0]] += 1
            cause = f"a trainer rank died during step {step}: killed by {killers[0]}"
            if self.search.active():
                self.search_ended(self.search.failed(step, uids, cause))
            else:
                self.search.start(step, uids, cause)
                self.searching_from = (len(uids), self.search.bound())
            self.trainer_restart("poison_sample")
            return "waited"
        if self.search.active():
            self.search_ended(self.search.passed(step, uids))
        self.timed("to_generate", ledger.to_generate)
        self.timed(
            "record.add", lambda: [self.record.add(step, r, self.rank_groups[r], rows) for r, rows in enumerate(lease)]
        )
        # changed entries: each leased one (and, reused, the next epoch's that inherits its sample)
        nxt = 0 if self.a.regenerate else sum(not u.endswith(f"@{EPOCHS - 1}") for u in uids)
        self.step, self.changed = step, self.changed + len(uids) + nxt
        self.step_costs.append((self.done, self.step_cost))
        if step % self.a.checkpoint_every == 0 and not ledger.drained():
            self.checkpoint("interval")
        return "stepped"

    def search_ended(self, verdict) -> None:
        """A poison-sample search's verdict (None: it goes on): a poison sample is quarantined."""
        if verdict is None:
            return
        if verdict.uid is not None:
            self.timed_recovery("quarantine_sample", self.ledger.quarantine_sample, verdict.uid, verdict.cause)
        n, bound = self.searching_from
        failures = self.search.failures
        self.searches.append(
            {"verdict": verdict.kind, "uid": verdict.uid, "samples": n, "bound": bound, "failures": failures}
        )

    def checkpoint(self, why: str) -> None:
        """`Committer.commit`: the ledger's state inside the checkpoint, the record's rows with it,
        then the ledger commits; the last two checkpoints stay."""
        step, t0 = self.step, self.timer()
        state = None if self.chain.wants_base() else self.ledger.checkpoint_delta(step)
        delta = state is not None
        state = self.chain.link(state if delta else self.ledger.checkpoint_state(step), delta)
        t1 = self.timer()
        tmp, dest = self.dir / "ckpt" / f"tmp-{step}", self.dir / "ckpt" / f"step-{step:07d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        write_ledger_state(tmp, state)
        files = ledger_digests(tmp)
        t2 = self.timer()
        rows = self.record.commit(step)
        t3 = self.timer()
        (tmp / "meta.json").write_text(json.dumps({"step": step, "record_rows": rows, "files": files}))
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
        self.chain.published(dest)
        self.ledger.commit(step)
        self.ledger.abandoned_keys()
        t4 = self.timer()
        self.ckpt_costs.append(
            {
                "done": rows,
                "s": t4 - t0,
                "state_s": t1 - t0,
                "write_s": t2 - t1,
                "record_s": t3 - t2,
                "bytes": sum(f.stat().st_size for f in dest.iterdir() if f.stat().st_nlink == 1),  # (written now)
                "chain_bytes": sum(f.stat().st_size for f in dest.iterdir()),
                "base": not delta,
                "changed": max(self.changed, 1),
                "why": why,
            }
        )
        self.committed_rows, self.changed = rows, 0
        self.ckpts = [c for c in self.ckpts if c != dest] + [dest]
        for old in self.ckpts[:-2]:
            shutil.rmtree(old, ignore_errors=True)
        self.ckpts = self.ckpts[-2:]

    def resubmit(self) -> None:
        """A stop mid-epoch (its checkpoint commits what was trained) and the job submitted again:
        a new ledger from the checkpoint's ledger state, the record rolled back to its rows, new
        replicas and a new store (and a new Committer: its first checkpoint writes a base)."""
        if self.record.pending:
            self.checkpoint("stop")
        self.chaos.record(self.clock.t, self.step, "resubmit", f"at {self.done} samples")
        self.events += self.ledger_events()
        t0 = self.timer()
        if self.actor is not None:
            import ray

            ray.kill(self.actor)
        state = load_ledger_state(self.ckpts[-1]) if self.ckpts else None
        self.chain = LedgerChain()
        self.ledger = self.new_ledger()
        self.sync_clock()
        if state is not None:
            self.ledger.load_state_dict(state, 0)
            self.ledger.settle()
        self.step, rows = self.last_checkpoint()
        self.record.rollback_to(rows)
        self.recovery.setdefault("resubmit (new ledger + load_state_dict + rollback_to)", []).append(self.timer() - t0)
        self.committed_rows, self.master_gen = rows, 0
        self.hangs["cleared by resubmit"] += sum(r.hung for r in self.replicas.values())
        self.incarnation += 1
        self.search = PoisonSearch()  # (the driver's: a resubmitted job has none)
        self.replicas = {}
        for g in self.groups:
            for _ in range(self.a.replicas):
                self.add_replica(g)
        self.restarts["job: resubmit"] += 1

    # ---- the run -------------------------------------------------------------------------------
    def run(self) -> dict:
        a, wall0, idle_since, ended = self.a, time.perf_counter(), 0.0, None
        try:
            while True:
                if time.perf_counter() - wall0 > a.cap_s:
                    ended = f"capped at --cap-s {a.cap_s:g} after {self.done} of {self.total} samples"
                    break
                self.clock.t += a.step_s
                self.sync_clock()
                frac = self.done / self.total
                if self.resubmit_at and frac >= self.resubmit_at[0]:
                    self.resubmit_at.pop(0)
                    self.resubmit()
                self.waiting = [k for k in self.waiting + self.chaos.draw(a.step_s, frac) if not self.inject(k)]
                self.produce()
                counts = self.supervise()
                what = self.train_step(counts)
                if what == "drained":
                    break
                if what == "stepped":
                    idle_since = self.clock.t
                elif self.clock.t - idle_since > a.data_timeout_s:
                    raise Stalled(
                        f"no step for {a.data_timeout_s:g} simulated s at step {self.step}: {counts.per_state()}"
                    )
            if ended is None:
                self.checkpoint("final")
        except Exception as e:  # noqa: BLE001 - a fault the run did not survive: say which ones were injected
            last = self.chaos.log[-3:]
            ended = f"{type(e).__name__}: {e} (last faults injected: {last})"
        return self.report(ended, time.perf_counter() - wall0)

    def report(self, ended: str | None, wall_s: float) -> dict:
        events = self.events + self.ledger_events()
        outcome = self.ledger.outcome()
        try:
            proof = self.record.verify(outcome, complete=ended is None)
            proof["ok"] = True
        except ExactlyOnceViolation as e:
            proof = {"ok": False, "error": str(e)}
        table = decile_table(self.step_costs, self.ckpt_costs, self.produce_costs, self.total)
        return {
            "ended": ended,
            "wall_s": wall_s,
            "simulated_h": self.clock.t / 3600,
            "steps": self.step,
            "cpu": cpu_model(),
            "table": table,
            "proof": proof,
            "restarts": dict(self.restarts),
            "injected": dict(self.chaos.injected),
            "chaos_log": self.chaos.log,
            "hangs": dict(self.hangs),
            "failed_causes": {u: (errs or ["?"])[-1] for u, errs in outcome["failed"].items()},
            "full_store": dict(self.full_watch),
            # how many long answers each full-store group reported: late in a run (reused answers,
            # only regenerations left) a group may get too few prompts to reach its watermark
            "full_store_answers": dict(self.big_reported),
            "watermark_samples": self.a.watermark_samples,
            "not_injected": dict(Counter(self.waiting)),
            "quarantined": quarantined(outcome["failed"]),
            "poison_prompts": sorted(self.poison_prompts),
            "poison_samples": dict(self.poison_samples),
            "searches": self.searches,
            "quarantined_samples": poison_samples(outcome["failed"]),
            "ledger_events": Counter(e["event"] for e in events),
            "all_steps": [c for _, c in self.step_costs],
            "chain": chain_summary(self.ckpt_costs),
            "recovery": {k: percentiles(v) + (len(v),) for k, v in self.recovery.items()},
            "calls": {k: percentiles(v) + (len(v),) for k, v in self.calls.items()},
        }


def print_report(r: dict, a: argparse.Namespace) -> None:
    mode = "Ray actor via LedgerClient" if a.ray else "in-process"
    print(
        f"soak: {a.prompts} prompts × {EPOCHS} epochs, {a.groups} groups × {a.replicas} replicas × {a.ranks} ranks, "
        f"checkpoint every {a.checkpoint_every} steps, ledger {mode}, chaos ×{a.chaos_scale:g}, seed {a.seed}, "
        f"costs in {a.clock} time"
    )
    print(
        f"CPU: {r['cpu']}; {r['steps']} steps, {r['simulated_h']:.1f} simulated h in {r['wall_s']:.1f} s wall; "
        f"ended: {r['ended'] or 'drained (all data trained)'}"
    )
    print(format_table(r["table"]))
    c = r["chain"]
    print(
        f"ledger checkpoints: {c['bases']} bases (s max {c['base_s'][2]:.2f}, MB max {c['base_mb_max']:.1f}), "
        f"{c['deltas']} deltas (s p50/p99/max {c['delta_s'][0]:.3f}/{c['delta_s'][1]:.3f}/{c['delta_s'][2]:.3f}, "
        f"MB p50/max {c['delta_mb'][0]:.2f}/{c['delta_mb'][2]:.2f}); a checkpoint's whole chain MB max "
        f"{c['chain_mb_max']:.1f}"
    )
    print(
        "the step's calls (ms p50/p99/max, n): "
        + "; ".join(f"{k} {1e3 * v[0]:.2f}/{1e3 * v[1]:.2f}/{1e3 * v[2]:.2f} ({v[3]})" for k, v in r["calls"].items())
    )
    print(
        "recovery calls (ms p50/p99/max, n): "
        + "; ".join(
            f"{k} {1e3 * v[0]:.1f}/{1e3 * v[1]:.1f}/{1e3 * v[2]:.1f} ({v[3]})" for k, v in r["recovery"].items()
        )
    )
    print("faults injected: " + ", ".join(f"{k} {v}" for k, v in sorted(r["injected"].items())))
    print("restarts by cause: " + ", ".join(f"{k} {v}" for k, v in sorted(r["restarts"].items())))
    print(
        f"hangs: {r['hangs']}; full-store groups seen paused: {r['full_store']}; drawn but nothing to hit "
        f"(generation over): {r['not_injected']}"
    )
    for pid in r["poison_prompts"]:
        q = r["quarantined"].get(pid)
        print(
            f"poison prompt {pid}: " + (f"quarantined, copies {q['copies']} ({q['cause']})" if q else "NOT quarantined")
        )
    for uid, kills in r["poison_samples"].items():
        q = next((v for k, v in r["quarantined_samples"].items() if k.rsplit("@", 1)[0] == uid.rsplit("@", 1)[0]), None)
        print(
            f"poison sample {uid}: killed the trainer {kills} times; "
            + (f"quarantined, copies {q['copies']} ({q['cause']})" if q else "NOT quarantined")
        )
    print(
        "poison-sample searches: "
        + "; ".join(
            f"{x['verdict']} {x['uid']} ({x['failures']} failed tests of {x['samples']} samples, bound {x['bound']})"
            for x in r["searches"]
        )
    )
    innocent = {u: e for u, e in r["failed_causes"].items() if u.rsplit("@", 1)[0] not in r["poison_prompts"]}
    print(
        f"failed besides the poison prompts: {len(innocent)} samples; by last error: "
        + ", ".join(f"{k} {v}" for k, v in Counter(_cause(e) for e in innocent.values()).most_common())
    )
    p = r["proof"]
    print(
        "proof: "
        + (
            f"exactly once: {p['trained']} trained, {len(p['failed'])} failed, {p['not_trained']} not trained"
            if p["ok"]
            else p["error"]
        )
    )
    t = r["table"]
    first, last = next((x for x in t if x["steps"]), None), next((x for x in reversed(t) if x["steps"]), None)
    p99 = percentiles(r["all_steps"])[1] * 1e3
    ck = [x["ckpt_us_per_changed"] for x in t if x["ckpts"]]
    goals = [
        (f"per-step control cost p99 < 10 ms (at {a.prompts} × {EPOCHS}): {p99:.2f} ms", p99 < 10),
        (
            f"last decile step p99 within 1.2× the first: {last['step_ms'][1]:.2f} vs {first['step_ms'][1]:.2f} ms",
            last["step_ms"][1] <= 1.2 * first["step_ms"][1],
        )
        if first
        else ("no steps", False),
        (
            f"checkpoint cost per changed row, last vs first decile with one, within 1.2×: "
            f"{ck[-1] if ck else 0:.1f} vs {ck[0] if ck else 0:.1f} us",
            bool(ck) and ck[-1] <= 1.2 * ck[0],
        ),
        (
            f"every injected fault survived or ended with a message naming it: {r['ended'] or 'survived'}",
            r["ended"] is None and p["ok"],
        ),
    ]
    for text, ok in goals:
        print(f"[{'PASS' if ok else 'FAIL'}] {text}")


def chain_summary(ckpts: list[dict]) -> dict:
    """The checkpoints' ledger chain: its bases and deltas, their time and the bytes written."""
    bases, deltas = [c for c in ckpts if c["base"]], [c for c in ckpts if not c["base"]]
    return {
        "bases": len(bases),
        "deltas": len(deltas),
        "base_s": percentiles([c["s"] for c in bases]),
        "base_mb_max": max((c["bytes"] for c in bases), default=0) / 1e6,
        "delta_s": percentiles([c["s"] for c in deltas]),
        "delta_mb": tuple(x / 1e6 for x in percentiles([c["bytes"] for c in deltas])),
        "chain_mb_max": max((c["chain_bytes"] for c in ckpts), default=0) / 1e6,
    }


def _cause(error: str) -> str:
    for word in ("poison prompt", "poison sample", "chaos", "hung", "gone from the store"):
        if word in error:
            return ("quarantined: " if error.startswith("quarantined") else "") + word
    return error[:60]


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=10_000)
    ap.add_argument("--groups", type=int, default=100)
    ap.add_argument("--replicas", type=int, default=2, help="per group")
    ap.add_argument("--ranks", type=int, default=2, help="per group")
    ap.add_argument("--batch-tokens", type=int, default=600, help="per rank and step (answers are 64..512 tokens)")
    ap.add_argument("--replica-batch", type=int, default=8, help="prompts a replica takes at once")
    ap.add_argument("--checkpoint-every", type=int, default=25, help="steps")
    ap.add_argument("--watermark-samples", type=int, default=200, help="a group's high watermark, in mean samples")
    ap.add_argument("--step-s", type=float, default=30.0, help="simulated seconds per trainer step")
    ap.add_argument("--gen-s", type=float, default=100.0, help="simulated seconds per replica batch (±50%%)")
    ap.add_argument("--hang-timeout-s", type=float, default=1800.0, help="inference.generation_timeout_s")
    ap.add_argument("--data-timeout-s", type=float, default=4 * 3600.0, help="simulated: no step for this long ends it")
    ap.add_argument("--regenerate", action="store_true", help="no reuse across epochs (sampling at temperature > 0)")
    ap.add_argument("--chaos-scale", type=float, default=1.0, help="multiplies every fault rate")
    ap.add_argument("--every-fault", action="store_true", help="each drawn kind at least once")
    ap.add_argument("--poison-prompts", type=int, default=2)
    ap.add_argument("--poison-samples", type=int, default=1)
    ap.add_argument("--resubmit-at", type=float, nargs="*", default=[0.5], help="fractions of the run")
    ap.add_argument("--ray", action="store_true", help="the ledger in a Ray actor (ray.init(num_cpus=2))")
    ap.add_argument("--cap-s", type=float, default=600.0, help="wall-clock cap")
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="measure costs in wall time or in this process's CPU time (a shared machine; in process only)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="run directory (default: a temporary one)")
    ap.add_argument("--json", default=None, help="also write the report here")
    return ap.parse_args(argv)


def run_soak(argv: list[str] | None = None, quiet: bool = False) -> dict:
    a = parse(argv)
    if a.ray:
        import ray

        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}},
        )
    try:
        r = Soak(a).run()
    finally:
        if a.ray:
            ray.shutdown()
    if not quiet:
        print_report(r, a)
    if a.json:
        Path(a.json).write_text(json.dumps({k: v for k, v in r.items() if k != "all_steps"}, indent=1, default=str))
    return r


if __name__ == "__main__":
    run_soak()
