"""The ledger's checkpoint chain (cluster/data/ledger_checkpoint.py): a base and the deltas after
it, replayed, give the state the live ledger has once each checkpoint is committed (its
`state_dict`, which walks every entry: an independent computation), through a random life with
restarts and failed saves; a delta holds only what changed; a new base comes once the deltas
would outgrow it; a checkpoint with only an old `ledger.json` still loads."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from cluster.data import ProducedSample, SampleLedger
from cluster.data.ledger_checkpoint import CHAIN_FILE, LedgerChain, chain_files, load_ledger_state, write_ledger_state
from cluster.store import SampleRef
from tests.unit.test_ledger import SAVED_BEFORE_TYPED_REFS

GROUPS = ("g0", "g1")


def prompts(n):
    return [{"id": f"p{i}", "messages": []} for i in range(n)]


def by_uid(state: dict) -> dict[str, dict]:
    rows = {f"{d['prompt_id']}@{d['epoch']}": d for d in state["entries"]}
    assert len(rows) == len(state["entries"])  # (a sample once)
    return rows


def header(state: dict) -> dict:
    return {k: v for k, v in state.items() if k != "entries"}


class Checkpoints:
    """`Committer.commit`'s ledger part, into step folders under `root` (the last two kept, as
    `CheckpointDir.rotate` keeps them): the chain link, written, published, then the commit."""

    def __init__(self, root: Path, ledger: SampleLedger, chain: LedgerChain) -> None:
        self.root, self.ledger, self.chain, self.kept = root, ledger, chain, []
        self.kinds: list[str] = []

    def save(self, step: int, fail: bool = False) -> Path | None:
        state = None if self.chain.wants_base() else self.ledger.checkpoint_delta(step)
        delta = state is not None
        state = self.chain.link(json.loads(json.dumps(state if delta else self.ledger.checkpoint_state(step))), delta)
        if fail:  # the save never finished: no publish, no commit
            return None
        dest = self.root / f"step-{step:06d}"
        dest.mkdir(parents=True)
        write_ledger_state(dest, state)
        self.chain.published(dest)
        self.ledger.commit(step)
        self.kinds.append("delta" if delta else "base")
        self.kept.append(dest)
        for old in self.kept[:-2]:  # rotation: the chain's files must survive it
            for f in old.iterdir():
                f.unlink()
            old.rmdir()
        self.kept = self.kept[-2:]
        return dest


def random_life(ledger: SampleLedger, ckpts: Checkpoints, rng: random.Random, calls: int) -> int:
    """Producers, steps, releases, restarts and checkpoints (some of whose saves fail) in random
    order; after each published checkpoint its chain, replayed, must be the live state."""
    step = committed = 0
    handed: dict[str, list] = {}
    checked = 0
    for _ in range(calls):
        op = rng.random()
        if op < 0.3:
            g = rng.choice(GROUPS)
            replica = f"{g}-r{rng.randrange(2)}"
            if replica not in handed:
                handed[replica] = ledger.request_prompts(replica, rng.randint(1, 6), g)
        elif op < 0.55 and handed:
            replica = rng.choice(sorted(handed))
            ledger.report_produced(replica, [
                ProducedSample(p.uid, error="boom") if rng.random() < 0.05
                else ProducedSample(p.uid, SampleRef(p.key, rng.randint(5, 60), (0,), 4, "float32"))
                for p in handed.pop(replica)
            ])  # fmt: skip
        elif op < 0.58 and handed:
            ledger.replica_died(handed.pop(rng.choice(sorted(handed))), "killed")
        elif op < 0.8:
            if ledger.lease_step(step + 1, ["g0", "g0", "g1"], rng.choice((60, 150))) is not None:
                step += 1
                if rng.random() < 0.3:
                    ledger.release(step)
                if rng.random() < 0.1:
                    leased = [r.uid for rows in ledger.lease_step(step, ["g0", "g0", "g1"], 0) for r in rows]
                    ledger.release_lease(step, rng.sample(leased, 1), "unreadable", rng.random() < 0.5)
                    step -= 1
        elif op < 0.92 and step > committed:
            dest = ckpts.save(step, fail=rng.random() < 0.15)
            if dest is not None:
                committed = step
                saved, live = load_ledger_state(dest), ledger.state_dict()
                assert header(saved) == header(live)
                assert by_uid(saved) == by_uid(live)  # row by row
                checked += 1
        elif op < 0.95:
            ledger.trainer_restarted(committed)
            step = committed
        elif op < 0.97:
            ledger.master_restarted(ledger.master_generation + 1)
    return checked


@pytest.mark.parametrize("reuse", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_a_chain_replayed_is_the_live_ledger_at_each_checkpoint(tmp_path, seed, reuse):
    rng = random.Random(seed)
    ledger = SampleLedger(
        prompts(60),
        epochs=3,
        reuse_across_epochs=reuse,
        shuffle_seed=seed,
        watermarks={"g0": (6000, 3000)},
        sample_bytes_estimate=800,
    )
    ckpts = Checkpoints(tmp_path, ledger, LedgerChain(max_deltas=6))
    assert random_life(ledger, ckpts, rng, 600) >= 5
    assert "delta" in ckpts.kinds and ckpts.kinds.count("base") >= 2  # (rebased: max_deltas, or outgrown)
    # a resumed job: a new ledger from the last checkpoint, whose next checkpoint is a base again
    last = ckpts.kept[-1]
    fresh = SampleLedger(prompts(60), epochs=3, reuse_across_epochs=reuse, shuffle_seed=seed)
    fresh.load_state_dict(load_ledger_state(last))
    assert fresh.checkpoint_delta(fresh.committed_step + 1) is None
    final = {u: d["state"] for u, d in by_uid(load_ledger_state(last)).items() if d["state"] in ("trained", "failed")}
    assert {u: e.state for u, e in fresh.entries.items() if e.state in ("trained", "failed")} == final


def produce(ledger: SampleLedger, n: int, group: str = "g0") -> list[str]:
    done = []
    while len(done) < n and (handed := ledger.request_prompts("r", min(8, n - len(done)), group)):
        ledger.report_produced("r", [ProducedSample(p.uid, SampleRef(p.key, 10, (0,), 4, "float32")) for p in handed])
        done += [p.uid for p in handed]
    return done


@pytest.mark.parametrize("size", [200, 5000])
def test_a_delta_holds_only_what_changed_whatever_the_ledger_size(tmp_path, size):
    """After a base with `size // 2` samples in it, 30 more produced and one step of 4 leased:
    the delta's rows are exactly those 34 (whatever the ledger holds), its bytes ~34 rows'."""
    ledger = SampleLedger(prompts(size), epochs=2)
    ckpts = Checkpoints(tmp_path, ledger, LedgerChain())
    produce(ledger, size // 2)
    [[*_]] = ledger.lease_step(1, ["g0"], 40)  # (4 samples of 10 tokens)
    base = ckpts.save(1)
    new = produce(ledger, 30)
    leased = [r.uid for rows in ledger.lease_step(2, ["g0"], 40) for r in rows]
    delta = ckpts.save(2)
    assert ckpts.kinds == ["base", "delta"]
    [base_file], [_, delta_file] = chain_files(base), chain_files(delta)
    rows = [json.loads(line) for line in (delta / delta_file["name"]).read_text().splitlines()]
    assert sorted(f"{d['prompt_id']}@{d['epoch']}" for d in rows) == sorted(new + leased)
    assert len(leased) == 4 and {d["state"] for d in rows if f"{d['prompt_id']}@0" in leased} == {"trained"}
    per_row = base_file["bytes"] / (size // 2)
    assert delta_file["bytes"] < 1.5 * per_row * 34  # (proportional to the change, not to the ledger)
    assert (delta / base_file["name"]).samefile(base / base_file["name"])  # linked, not written again


def test_a_new_base_once_the_deltas_would_outgrow_it(tmp_path):
    ledger = SampleLedger(prompts(400), epochs=1)
    ckpts = Checkpoints(tmp_path, ledger, LedgerChain())
    produce(ledger, 20)
    step = 0
    for _ in range(12):
        produce(ledger, 20)
        step += 1
        ledger.lease_step(step, ["g0"], 100)
        dest = ckpts.save(step)
        files = chain_files(dest)
        deltas = sum(f["bytes"] for f in files[1:])
        assert files[0]["name"].startswith("ledger.base-")
        assert deltas <= files[0]["bytes"] + max(f["bytes"] for f in files)  # (at most one delta past it)
    assert ckpts.kinds.count("base") >= 3


def test_a_chain_link_whose_source_is_gone_is_a_base(tmp_path):
    ledger = SampleLedger(prompts(10))
    chain = LedgerChain()
    ckpts = Checkpoints(tmp_path, ledger, chain)
    produce(ledger, 2)
    first = ckpts.save(1)
    assert not chain.wants_base()
    (first / CHAIN_FILE).unlink()  # (someone removed the last checkpoint)
    assert chain.wants_base()


def test_a_checkpoint_with_an_old_ledger_json_still_loads(tmp_path):
    """Checkpoints from before the chain hold one `ledger.json` (this one as issue 49's code wrote it)."""
    (tmp_path / "ledger.json").write_text(SAVED_BEFORE_TYPED_REFS)
    state = load_ledger_state(tmp_path)
    assert state == json.loads(SAVED_BEFORE_TYPED_REFS)
    ledger = SampleLedger(prompts(3), max_attempts=1)
    assert ledger.load_state_dict(state) == ["run/g0/p0@0.1", "run/g0/p1@0.1"]
    assert ledger.entries["p0@0"].state == "trained" and ledger.entries["p2@0"].state == "failed"
    # a whole state handed to the writer (no chain link) is still written as that one file
    other = tmp_path / "again"
    other.mkdir()
    write_ledger_state(other, state)
    assert [p.name for p in other.iterdir()] == ["ledger.json"] and load_ledger_state(other) == state
