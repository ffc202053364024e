"""The indexed ledger against the ledger before its indexes (tests/ledger_reference, the code as
of 7b3a0cd, which scanned its entries): the same random life of a job — several groups with
watermarks that fill, replicas that die, master and trainer restarts, released and committed
steps, a shortened plan, a resume from a checkpoint state — driven through both, every call
must answer the same and leave the same state; and the incrementally kept index must equal
one rebuilt from scratch after every call."""

from __future__ import annotations

import itertools
import random

import pytest

from cluster.data import ProducedSample, PromptTask, SampleLedger
from cluster.data.ledger_index import StoredQueue, rebuilt
from cluster.store import SampleRef
from tests.ledger_reference.typed import TypedReferenceLedger as ReferenceLedger

GROUPS = ("g0", "g1", "g2")


def prompts(n):
    return [{"id": f"p{i}", "messages": [{"role": "user", "content": str(i)}]} for i in range(n)]


def make(cls, n, epochs, reuse, seed):
    ticks = itertools.count()
    return cls(
        prompts(n),
        epochs=epochs,
        key_prefix="run",
        reuse_across_epochs=reuse,
        shuffle_seed=seed,
        watermarks={"g0": (6000, 3000), "g1": (20_000, 10_000)},  # g2 never pauses
        sample_bytes_estimate=800,
        clock=lambda: float(next(ticks)),
    )


LIVE_FIELDS = ("replica", "since", "suspect")  # not saved: a resumed ledger starts them afresh


def saved(state: dict) -> dict:
    """A saved state as the indexed ledger writes it: untouched pending entries left out (a
    ledger of the same prompts starts with them), live fields dropped."""
    rows = [
        {k: v for k, v in d.items() if k not in LIVE_FIELDS}
        for d in state["entries"]
        if d["state"] != "pending" or d["attempts"] or d["failures"]
    ]
    return {**state, "entries": rows}


def index_matches_rebuilt(ledger: SampleLedger) -> None:
    fresh = rebuilt(ledger.entries.values(), ledger.position)
    assert ledger.index.summary() == fresh.summary()


def drive(seed: int, n: int = 40, epochs: int = 3, reuse: bool = False, calls: int = 500) -> int:
    """Random calls on both ledgers; returns how many samples ended trained."""
    rng = random.Random(seed)
    new, ref = make(SampleLedger, n, epochs, reuse, seed), make(ReferenceLedger, n, epochs, reuse, seed)
    handed: dict[str, list[PromptTask]] = {}  # replica -> prompts it holds
    step = committed = 0
    shortened = False

    def both(name, *args):
        a, b = getattr(new, name)(*args), getattr(ref, name)(*args)
        assert a == b, (name, args)
        assert new.state_dict() == saved(ref.state_dict()), name
        return a

    for _ in range(calls):
        op = rng.random()
        if op < 0.30:
            g = rng.choice(GROUPS)
            replica = f"{g}-r{rng.randrange(2)}"
            if replica not in handed:
                handed[replica] = both("request_prompts", replica, rng.randint(1, 6), g)
        elif op < 0.55 and handed:
            replica = rng.choice(sorted(handed))
            # samples of 5-60 tokens, 0.2-1.7 kB (one float32 layer 4-6 wide)
            results = [
                ProducedSample(p.uid, error="boom", blamed=rng.random() < 0.5)
                if rng.random() < 0.1
                else ProducedSample(p.uid, SampleRef(p.key, rng.randint(5, 60), (0,), rng.choice((4, 5, 6)), "float32"))
                for p in handed.pop(replica)
            ]
            both("report_produced", replica, results)
        elif op < 0.58 and handed:
            both("replica_died", handed.pop(rng.choice(sorted(handed))), "killed")
        elif op < 0.80:
            ranks = rng.choice((["g0"], ["g0", "g1"], ["g0", "g0", "g1", "g2"]))
            if both("lease_step", step + 1, ranks, rng.choice((60, 150, 400))) is not None:
                step += 1
                if rng.random() < 0.3:
                    both("release", step)
                if rng.random() < 0.1:
                    leased = [r.uid for rows in new.lease_step(step, ranks, 0) for r in rows]
                    why = rng.choice(("SampleMissing: gone", "CorruptSampleError: bad", "non-finite loss"))
                    both("release_lease", step, rng.sample(leased, 1), why, rng.random() < 0.5)
                    step -= 1
        elif op < 0.90 and step > committed:
            assert new.checkpoint_state(step) == saved(ref.checkpoint_state(step))
            both("commit", step)
            both("abandoned_keys")
            committed = step
        elif op < 0.93:
            both("trainer_restarted", committed)
            step = committed
        elif op < 0.95:
            both("master_restarted", new.master_generation + 1)
        elif op < 0.96 and not shortened and epochs > 1 and new.first_open_epoch() < epochs:
            both("shorten", max(new.first_open_epoch(), epochs - 1))
            shortened, epochs = True, epochs - 1
        elif op < 0.97 and step == committed:
            state = new.checkpoint_state(committed)
            generation = new.master_generation + 1
            both("load_state_dict", state, generation)
            handed.clear()
        assert new.counts() == ref.counts()
        assert new.to_generate() == ref.to_generate() and new.drained() == ref.drained()
        assert new.peek_stored(5) == ref.peek_stored(5)
        index_matches_rebuilt(new)
    assert new.outcome() == ref.outcome()
    return len(new.outcome()["trained"])


@pytest.mark.parametrize("reuse", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_indexed_ledger_answers_as_the_scanning_one(seed, reuse):
    trained = drive(seed, reuse=reuse)
    assert trained > 0  # the walk reached training (else it compared only the generation side)


def test_stored_queue_orders_by_position_and_forgets_what_left():
    q = StoredQueue()
    for uid, pos in (("c", 3), ("a", 1), ("b", 2)):
        q.add(uid, pos)
    q.discard("a")
    q.add("a", 1)  # back again: one live item, not two
    q.discard("b")
    assert [q.pop(), q.pop()] == ["a", "c"] and q.head() is None and len(q) == 0
    for i in range(1000):  # stale items never pile up beyond the live ones
        q.add("x", i)
    assert len(q._heap) <= 2 * len(q) + 64 and q.pop() == "x"
