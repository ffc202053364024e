"""The ledger under random failures: whatever the interleaving of replica deaths, master
restarts, trainer restarts and checkpoints, every prompt of every epoch ends trained once, over
several groups; and the global step's assembly (own group first, borrowing from deep queues)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

import pytest

from cluster.data import (
    FAILED,
    LEASED,
    PENDING,
    STORED,
    TRAINED,
    ExactlyOnceViolation,
    LedgerError,
    ProducedSample,
    PromptTask,
    SampleLedger,
    TrainingRecord,
    balance,
    quarantined,
)
from cluster.store import SampleRef


def prompts(n):
    return [{"id": f"p{i}", "messages": [{"role": "user", "content": str(i)}]} for i in range(n)]


@dataclass(frozen=True)
class Ref(SampleRef):
    """A sample's ref of the size the test says (a real one's follows from its shapes)."""

    size: int = 0

    @property
    def nbytes(self) -> int:
        return self.size


def stored(p: PromptTask, tokens: int = 5, nbytes: int = 1) -> ProducedSample:
    """`p`'s sample, stored: `tokens` long, `nbytes` in the store."""
    return ProducedSample(p.uid, Ref(p.key, tokens, (), 0, size=nbytes))


def produce(ledger, replica, n, rng, fail_rate=0.0, group="g0", nbytes=1000):
    handed = ledger.request_prompts(replica, n, group)
    results = []
    for p in handed:
        if rng.random() < fail_rate:
            results.append(ProducedSample(p.uid, error="boom"))
        else:
            results.append(stored(p, rng.randint(5, 50), nbytes))
    return handed, results


@pytest.mark.parametrize("seed", range(20))
def test_random_failures_keep_exactly_once(seed, tmp_path):
    """Two groups (replicas r0/r1 in g0, r2 in g1), three ranks (two in g0, one in g1). The
    training record, rolled back with the model at every trainer crash, is the proof. Beside
    it, a model of the store (a set of keys: a put lands when the replica makes it, even if the
    replica then dies unreported; a master restart empties it; whoever commits removes what the
    ledger returns) proves the ledger leaks nothing and never lets a leased sample go."""
    rng = random.Random(seed)
    ledger = SampleLedger(
        prompts(40),
        epochs=2,
        watermarks={"g0": (15_000, 8_000), "g1": (6_000, 2_000)},
        max_attempts=50,
        reuse_across_epochs=seed % 2 == 1,
    )
    record = TrainingRecord(tmp_path / "trained.jsonl")
    rank_groups = ["g0", "g0", "g1"]
    groups = {"r0": "g0", "r1": "g0", "r2": "g1"}
    checkpoint = {"step": 0, "state": ledger.checkpoint_state(0), "rows": 0}
    step = 0
    in_flight = {}  # replica -> results not yet reported
    generation = 1
    ledger.master_restarted(generation)
    store: set[str] = set()
    lost_with_master: set[str] = set()  # put before a restart, reported after: found gone at the read

    def commit():
        nonlocal checkpoint
        rows = record.commit(step)
        checkpoint = {"step": step, "state": ledger.checkpoint_state(step), "rows": rows}
        store.difference_update(ledger.commit(step) + ledger.abandoned_keys())

    for _ in range(2000):
        if not ledger.outcome()["unfinished"]:
            break
        action = rng.random()
        replica = f"r{rng.randint(0, 2)}"
        if action < 0.35:
            if replica not in in_flight:
                in_flight[replica] = produce(ledger, replica, rng.randint(1, 6), rng, 0.1, groups[replica])[1]
                store.update(r.ref.key for r in in_flight[replica] if r.ref)  # puts land before the report
        elif action < 0.6 and in_flight:
            r = rng.choice(sorted(in_flight))
            ledger.report_produced(r, in_flight.pop(r))
        elif action < 0.63 and in_flight:
            r = rng.choice(sorted(in_flight))
            in_flight.pop(r)
            ledger.replica_died(r)
        elif action < 0.64:
            generation += 1
            ledger.master_restarted(generation)
            lost_with_master.update(r.ref.key for rs in in_flight.values() for r in rs if r.ref)
            store.clear()
        elif action < 0.85:
            lease = ledger.lease_step(step + 1, rank_groups, batch_tokens=60)
            if lease:
                gone = [r.uid for rows in lease for r in rows if r.ref.key not in store | lost_with_master]
                assert not gone, f"leased samples whose objects were removed: {gone}"
                step += 1
                for rank, rows in enumerate(lease):  # what each rank "trained"
                    record.add(step, rank, rank_groups[rank], rows)
        elif action < 0.95:
            commit()
        else:  # trainer crash: the model goes back to the checkpoint, the ledger and the record follow it
            step = checkpoint["step"]
            record.rollback_to(checkpoint["rows"])
            store.difference_update(ledger.load_state_dict(checkpoint["state"], master_generation=generation))
            in_flight.clear()
        if ledger.drained() and not in_flight:  # drain at the end: nothing more to lease → checkpoint
            commit()
    assert not ledger.outcome()["unfinished"], ledger.counts()
    assert store == set(), f"{len(store)} objects left in the store, e.g. {sorted(store)[:3]}"
    proof = record.verify(ledger.outcome())
    failed = proof["failed"]
    assert proof["per_epoch"] == {
        "0": 40 - sum(u.endswith("@0") for u in failed),
        "1": 40 - sum(u.endswith("@1") for u in failed),
    }
    # the record is independent of the ledger's counts: each trained uid appears in it exactly once
    uids = [r["uid"] for r in record.rows()]
    assert len(uids) == len(set(uids)) and set(uids) == {u for u, e in ledger.entries.items() if e.state == TRAINED}
    assert set(proof["generated_by_group"]) <= {"g0", "g1"} and sum(proof["generated_by_group"].values()) == len(uids)


def test_step_takes_own_group_first_then_borrows_from_a_deep_queue():
    ledger = SampleLedger(prompts(12), watermarks={"g0": (10_000, 2_500), "g1": (10_000, 2_500)})
    rng = random.Random(0)
    _, res = produce(ledger, "a", 6, rng, group="g0")  # g0: 6 samples, 6,000 bytes held
    ledger.report_produced("a", res)
    lease = ledger.lease_step(1, ["g0", "g1"], batch_tokens=60)
    g0_rows, g1_rows = lease
    assert g0_rows and all(r.group == "g0" for r in g0_rows)
    assert sum(ledger.entries[r.uid].tokens for r in g0_rows) <= 60 or len(g0_rows) == 1  # its own budget first
    assert g1_rows and all(r.group == "g0" for r in g1_rows)  # g1 had nothing: borrowed from g0's deep queue
    assert all(ledger.entries[r.uid].crossed for r in g1_rows) and not any(
        ledger.entries[r.uid].crossed for r in g0_rows
    )
    assert ledger.lease_step(1, ["g0", "g1"], batch_tokens=60) == lease  # idempotent


def test_no_borrowing_below_the_donors_low_watermark():
    ledger = SampleLedger(prompts(12), watermarks={"g0": (10_000, 5_000), "g1": (10_000, 5_000)})
    _, res = produce(ledger, "a", 4, random.Random(0), group="g0")  # 4,000 bytes: below g0's low watermark
    ledger.report_produced("a", res)
    g0_rows, g1_rows = ledger.lease_step(1, ["g0", "g1"], batch_tokens=10_000)
    assert len(g0_rows) == 4 and g1_rows == []  # g1's rank steps with a zero gradient; g0's samples stay local
    ledger.commit(1)
    _, res = produce(ledger, "b", 3, random.Random(1), group="g1")
    ledger.report_produced("b", res)
    assert ledger.lease_step(2, ["g0", "g1"], batch_tokens=10_000)[0] == []  # and the other way round
    assert ledger.lease_step(3, ["g0", "g1"], batch_tokens=10_000) is None  # nobody has anything ready


def test_backpressure_is_per_group():
    ledger = SampleLedger(prompts(10), watermarks={"g0": (3000, 1000), "g1": (3000, 1000)})
    _, res = produce(ledger, "r0", 3, random.Random(0), group="g0")
    ledger.report_produced("r0", res)
    assert ledger.counts().groups["g0"].paused and ledger.request_prompts("r0", 5, "g0") == []
    assert len(ledger.request_prompts("r1", 2, "g1")) == 2  # g1's store memory is not g0's


def test_backpressure_hysteresis():
    ledger = SampleLedger(prompts(10), watermarks={"g0": (3000, 1000)})
    rng = random.Random(0)
    _, res = produce(ledger, "r0", 3, rng)
    ledger.report_produced("r0", res)
    assert ledger.counts().paused and ledger.request_prompts("r0", 5) == []
    ledger.lease_step(1, ["g0"], 10_000)
    ledger.commit(1)
    assert not ledger.counts().paused and len(ledger.request_prompts("r0", 2)) == 2


def test_epoch_order_and_stale_reports():
    ledger = SampleLedger(prompts(3), epochs=2)
    first = ledger.request_prompts("r0", 10)
    assert [p.uid for p in first] == ["p0@0", "p1@0", "p2@0"]  # epoch 1 waits for epoch 0
    ledger.replica_died("r0")
    ledger.report_produced("r0", [ProducedSample("p0@0", Ref("k", 3, (), 0, size=1))])
    assert ledger.entries["p0@0"].state == PENDING  # a dead replica's late report is ignored
    again = ledger.request_prompts("r1", 10)
    assert again[0].key != first[0].key  # a regenerated sample gets a fresh key


def test_failures_are_final_and_reported(tmp_path):
    ledger = SampleLedger(prompts(1), max_attempts=2)
    for _ in range(2):
        p = ledger.request_prompts("r0", 1)
        ledger.report_produced("r0", [ProducedSample(p[0].uid, error="corrupt")])
    assert ledger.entries["p0@0"].state == FAILED
    assert TrainingRecord(tmp_path / "r.jsonl").verify(ledger.outcome())["failed"] == ["p0@0"]


def test_unfinished_ledger_does_not_verify(tmp_path):
    ledger = SampleLedger(prompts(2))
    with pytest.raises(ExactlyOnceViolation, match="neither trained nor failed"):
        TrainingRecord(tmp_path / "r.jsonl").verify(ledger.outcome())


def test_lease_is_idempotent_and_balanced():
    ledger = SampleLedger(prompts(8))
    p = ledger.request_prompts("r0", 8)
    ledger.report_produced("r0", [stored(x, 10 * (i + 1), 1) for i, x in enumerate(p)])
    a = ledger.lease_step(1, ["g0", "g0"], 1000)
    assert a == ledger.lease_step(1, ["g0", "g0"], 1000)
    loads = [sum(ledger.entries[r.uid].tokens for r in rank) for rank in a]
    assert abs(loads[0] - loads[1]) <= 10
    assert all(e.state == LEASED for e in ledger.entries.values())
    ledger.trainer_restarted(0)
    assert all(e.state == STORED for e in ledger.entries.values())


def test_balance():
    assert sorted(map(len, balance([("a", 5), ("b", 5), ("c", 5), ("d", 5)], 2))) == [2, 2]


def test_duplicate_ids_rejected():
    with pytest.raises(LedgerError, match="unique"):
        SampleLedger(prompts(2) + prompts(1))


def test_greedy_epochs_reuse_stored_samples():
    ledger = SampleLedger(prompts(3), epochs=3, reuse_across_epochs=True)
    handed = ledger.request_prompts("r0", 10)
    assert [p.uid for p in handed] == ["p0@0", "p1@0", "p2@0"]
    ledger.report_produced("r0", [stored(p, 5, 1) for p in handed])
    removed = []
    for step in range(1, 4):  # no commit in between: the next epoch is available at once
        lease = ledger.lease_step(step, ["g0"], 1000)
        assert sorted(r.ref.key for r in lease[0]) == sorted(p.key for p in handed)
        assert ledger.request_prompts("r0", 10) == []  # nothing is ever regenerated
    assert ledger.lease_step(4, ["g0"], 1000) is None
    for step in range(1, 4):
        removed += ledger.commit(step)
    assert sorted(removed) == sorted(p.key for p in handed)  # dropped after the last epoch only
    assert not ledger.outcome()["unfinished"] and ledger.counts().trained == 9


def test_later_epochs_wait_for_every_sample_of_the_current_one():
    ledger = SampleLedger(prompts(6), epochs=2, reuse_across_epochs=True)
    first = ledger.request_prompts("r0", 2)  # a slow replica: only two samples exist so far
    ledger.report_produced("r0", [stored(p, 5, 1) for p in first])
    lease = ledger.lease_step(1, ["g0"], 1000)
    assert sorted(r.uid for r in lease[0]) == ["p0@0", "p1@0"]
    assert ledger.counts().to_generate == 4  # the rest of epoch 0; epoch 1 reuses it all
    assert ledger.queued_bytes() == 2  # leased p0@0 and stored p0@1 are one object in the store
    assert ledger.entries["p0@1"].state == STORED  # its next epoch reuses the sample...
    assert ledger.lease_step(2, ["g0"], 1000) is None  # ...but waits until epoch 0 is all leased
    rest = ledger.request_prompts("r0", 10)
    ledger.report_produced("r0", [stored(p, 5, 1) for p in rest])
    assert sorted(r.uid for r in ledger.lease_step(2, ["g0"], 1000)[0]) == [f"p{i}@0" for i in range(2, 6)]
    epoch1 = [r.uid for r in ledger.lease_step(3, ["g0"], 1000)[0]]
    assert sorted(epoch1) == [f"p{i}@1" for i in range(6)]
    assert epoch1 == [u for u in ledger.order if u.endswith("@1")]
    assert epoch1 != sorted(epoch1)  # shuffled, deterministically by the seed
    assert [u for u in SampleLedger(prompts(6), epochs=2).order if u.endswith("@1")] == epoch1


def test_a_full_store_lifts_the_epoch_wait():
    # The store holds two samples: they and their reused next epochs must be trainable, or
    # producers (paused) and the trainer (waiting for epoch 0) would wait on each other.
    ledger = SampleLedger(prompts(4), epochs=2, reuse_across_epochs=True, watermarks={"g0": (2000, 0)})
    first = ledger.request_prompts("r0", 2)
    ledger.report_produced("r0", [stored(p, 5, 1000) for p in first])
    assert ledger.request_prompts("r0", 2) == []  # paused
    ledger.lease_step(1, ["g0"], 1000)
    ledger.commit(1)
    assert ledger.counts().paused  # epoch 1 still holds both samples
    lease = ledger.lease_step(2, ["g0"], 1000)
    assert sorted(r.uid for r in lease[0]) == ["p0@1", "p1@1"]
    assert sorted(ledger.commit(2)) == sorted(p.key for p in first)
    assert len(ledger.request_prompts("r0", 2)) == 2  # room again


def test_released_samples_leave_the_store_after_their_step_and_are_regenerated_on_rollback():
    ledger = SampleLedger(prompts(4), watermarks={"g0": (3000, 1000)})
    _, res = produce(ledger, "r0", 3, random.Random(0))  # 3,000 bytes held: producers pause
    ledger.report_produced("r0", res)
    assert ledger.counts().paused
    leased = [r.uid for r in ledger.lease_step(1, ["g0"], 10_000)[0]]
    keys = ledger.release(1)  # trainer.release_samples=after_step
    assert sorted(keys) == sorted(ledger.entries[u].ref.key for u in leased) and ledger.queued_bytes() == 0
    assert not ledger.counts().paused  # the bytes are gone: producers go on before the checkpoint
    assert ledger.release(1) == []  # once
    ledger.trainer_restarted(0)  # the model went back before step 1: those samples must be generated again
    assert all(ledger.entries[u].state == PENDING for u in leased)
    assert ledger.to_generate() == 4  # the released three and the one never generated


def test_commit_does_not_hand_back_released_keys():
    ledger = SampleLedger(prompts(2))
    _, res = produce(ledger, "r0", 2, random.Random(0))
    ledger.report_produced("r0", res)
    ledger.lease_step(1, ["g0"], 10_000)
    released = ledger.release(1)
    assert len(released) == 2 and ledger.commit(1) == [] and not ledger.outcome()["unfinished"]


def test_no_rank_gets_more_than_its_budget():
    ledger = SampleLedger(prompts(3))
    handed = ledger.request_prompts("r0", 3)
    ledger.report_produced("r0", [stored(p, t, 1) for p, t in zip(handed, (90, 90, 20))])
    lease = ledger.lease_step(1, ["g0", "g0"], batch_tokens=100)
    assert sorted(sum(ledger.entries[r.uid].tokens for r in rows) for rows in lease) == [90, 90]
    assert [r.uid for r in ledger.lease_step(2, ["g0", "g0"], 100)[0]] == ["p2@0"]  # the 20 waits for the next step


def test_a_reused_sample_lost_after_its_predecessor_was_leased_is_regenerated():
    # p0@1 inherits p0@0's stored sample when p0@0 is leased; if that object is then found gone
    # (p0@1's read fails) before p0@0 is committed, p0@1 must be generated again, or the job
    # would wait for it forever at the end of the data.
    ledger = SampleLedger(prompts(1), epochs=2, reuse_across_epochs=True)
    handed = ledger.request_prompts("r0", 1)
    ledger.report_produced("r0", [stored(handed[0], 5, 1)])
    ledger.lease_step(1, ["g0"], 100)  # p0@0 leased, p0@1 inherits its sample
    assert ledger.lease_step(2, ["g0"], 100)[0][0].uid == "p0@1"
    ledger.release_lease(2, ["p0@1"])  # gone from the store
    assert ledger.to_generate() == 1 and [p.uid for p in ledger.request_prompts("r0", 5)] == ["p0@1"]


def generate_with_poison(ledger, poison: str, deaths: int) -> tuple[list[dict], int]:
    """One request of replica r<deaths>: it dies if `poison` is in its batch (the prompts go
    back), else it stores them all. Returns what it was handed and the deaths so far."""
    handed = ledger.request_prompts(f"r{deaths}", 4)
    if any(p.id == poison for p in handed):
        ledger.replica_died(f"r{deaths}", "segfault")
        return handed, deaths + 1
    ledger.report_produced(f"r{deaths}", [stored(p, 5, 1) for p in handed])
    return handed, deaths


def test_a_poison_prompt_fails_alone():
    # p1 kills every replica that generates it; its batch-mates are retried one at a time and
    # go through, p1 ends FAILED after max_attempts deaths, with each death named.
    ledger = SampleLedger(prompts(4), max_attempts=3)
    deaths = 0
    for _ in range(20):
        handed, deaths = generate_with_poison(ledger, "p1", deaths)
        if not handed:
            break
    assert deaths == 3 and ledger.entries["p1@0"].state == FAILED
    assert ledger.entries["p1@0"].errors == [f"replica r{i} died while generating it: segfault" for i in range(3)]
    assert all(ledger.entries[f"p{i}@0"].state == STORED for i in (0, 2, 3))


@pytest.mark.parametrize("reuse", [False, True])
def test_a_poison_prompt_is_quarantined_in_every_epoch(reuse):
    # 3 epochs: p1 kills the 3 replicas that take it in epoch 0 and is given up on in all three
    # (3 deaths, not 9); the others train every epoch; the result names the prompt and why.
    ledger = SampleLedger(prompts(4), epochs=3, max_attempts=3, reuse_across_epochs=reuse)
    deaths, step = 0, 0
    while not ledger.drained() and step < 50:
        before = deaths
        _, deaths = generate_with_poison(ledger, "p1", deaths)
        if deaths > before:
            continue
        step += 1
        if ledger.lease_step(step, ["g0"], 100) is not None:
            ledger.commit(step)
    assert deaths == 3
    outcome = ledger.outcome()
    assert sorted(outcome["trained"]) == sorted(f"p{i}@{e}" for i in (0, 2, 3) for e in range(3))
    assert sorted(outcome["failed"]) == ["p1@0", "p1@1", "p1@2"] and not outcome["unfinished"]
    assert quarantined(outcome["failed"]) == {
        "p1": {
            "failed": "p1@0",
            "cause": "replica r2 died while generating it: segfault",
            "copies": ["p1@0", "p1@1", "p1@2"],
        }
    }
    # a later submission with more epochs resumes with the prompt still quarantined
    resumed = SampleLedger(prompts(4), epochs=4, reuse_across_epochs=reuse)
    resumed.load_state_dict(ledger.state_dict())
    assert resumed.entries["p1@3"].state == FAILED and resumed.remaining_per_epoch() == [0, 0, 0, 3]


def test_a_non_finite_step_leases_its_samples_again_without_regenerating_them():
    ledger = SampleLedger(prompts(2), max_attempts=2)
    handed = ledger.request_prompts("r0", 2)
    ledger.report_produced("r0", [stored(p, 5, 1) for p in handed])
    for step in (1, 2):
        rows = ledger.lease_step(step, ["g0"], 100)[0]
        assert [r.uid for r in rows] == ["p0@0", "p1@0"]
        ledger.release_lease(step, {"p0@0": "non-finite loss on rank 0"}, regenerate=False)
        assert ledger.request_prompts("r0", 2) == []  # nothing to regenerate: the data is fine
    assert ledger.entries["p0@0"].state == FAILED and ledger.entries["p1@0"].state == STORED


def test_a_batch_never_overfills_the_store():
    # 10,000 bytes before producers pause; samples of 1,000 bytes once measured, 4,000 assumed
    # before: the first request gets 2 prompts, later ones what fits beside what is held and in
    # generation, and nothing while the room is taken.
    ledger = SampleLedger(prompts(40), watermarks={"g0": (10_000, 5_000)}, sample_bytes_estimate=4000)
    first = ledger.request_prompts("r0", 16)
    assert len(first) == 2
    ledger.report_produced("r0", [stored(p, 5, 1000) for p in first])
    second = ledger.request_prompts("r0", 16)
    assert len(second) == 8  # 10,000 - 2,000 held = 8 samples of 1,000
    assert ledger.request_prompts("r1", 16) == []  # 2,000 held + 8 in generation: no room
    ledger.replica_died("r0")  # its 8 go back (to be retried alone, after the others)
    third = ledger.request_prompts("r1", 16)
    assert len(third) == 8 and not {p.uid for p in third} & {p.uid for p in second}


@pytest.mark.parametrize("reuse", [False, True])
def test_reserved_prompts_are_generated_after_epoch_0_and_never_trained(reuse):
    # Two reserved prompts (a calibration split): handed out once epoch 0 is, before epoch 1's
    # prompts; stored but never leased; outside the plan's counts and outcome, inside the
    # group's store bytes; a replica death sends them back like any prompt; a resume regenerates them.
    ledger = SampleLedger(
        prompts(3), epochs=2, reuse_across_epochs=reuse, reserved=[{"id": f"cal{i}", "messages": []} for i in range(2)]
    )
    first = ledger.request_prompts("r0", 3)
    # still to generate: 3 in generation, 2 reserved (and without reuse, epoch 1's 3)
    assert [p.uid for p in first] == ["p0@0", "p1@0", "p2@0"] and ledger.to_generate() == (5 if reuse else 8)
    second = ledger.request_prompts("r1", 10)  # (epoch 1 waits for epoch 0's answers)
    assert [p.uid for p in second] == ["cal0@-1", "cal1@-1"]
    ledger.replica_died("r1")
    assert ledger.reserved_waiting() == 2 and ledger.reserved_rows() == []
    third = ledger.request_prompts("r2", 1)  # retried alone, as any prompt of a dead replica
    assert [p.uid for p in third] == ["cal0@-1"]
    report = lambda handed: [stored(p, 5, 100) for p in handed]  # noqa: E731
    ledger.report_produced("r0", report(first))
    ledger.report_produced("r2", report(third))
    ledger.report_produced("r3", report(ledger.request_prompts("r3", 1)))
    assert [r.uid for r in ledger.reserved_rows()] == ["cal0@-1", "cal1@-1"] and ledger.reserved_waiting() == 0
    assert ledger.queued_bytes("g0") == 5 * 100 and ledger.counts().stored == 3 and ledger.counts().total == 6
    step = 0
    while not ledger.drained():
        if not reuse:
            ledger.report_produced("r4", report(ledger.request_prompts("r4", 10)))
        step += 1
        leased = ledger.lease_step(step, ["g0"], 1000)
        assert leased and not any(r.uid.endswith("@-1") for r in leased[0])
        ledger.commit(step)
    assert sorted(ledger.outcome()["trained"]) == sorted(f"p{i}@{e}" for i in range(3) for e in range(2))
    assert not ledger.outcome()["unfinished"] and ledger.counts().trained == 6
    resumed = SampleLedger(prompts(3), epochs=2, reserved=[{"id": "cal0", "messages": []}])
    resumed.load_state_dict(ledger.state_dict())
    assert resumed.reserved_waiting() == 1 and [p.uid for p in resumed.request_prompts("r0", 5)] == ["cal0@-1"]


def test_reserved_ids_must_differ_from_the_training_ids():
    with pytest.raises(LedgerError, match=r"unique; duplicated: \['p1'\]"):
        SampleLedger(prompts(2), reserved=[{"id": "p1", "messages": []}])


def test_handing_out_thousands_keeps_the_order_through_the_pools_compaction():
    # The pending pool is rebuilt once more than 1024 of its keys are gone: the order it hands
    # prompts out in is the same before and after (epoch 0 in generation order).
    ledger = SampleLedger(prompts(3000), epochs=2)
    handed = [p.uid for _ in range(30) for p in ledger.request_prompts("r0", 100)]
    assert handed == [f"p{i}@0" for i in range(3000)]
    ledger.replica_died("r0")  # all 3000 back to pending (in ledger order), retried alone first...
    first = ledger.request_prompts("r1", 5)
    assert [p.uid for p in first] == ["p0@0"]  # ...suspects go one at a time


# A checkpoint's ledger.json as the ledger wrote it before a sample's ref travelled typed
# (written by that code: cluster/data/ledger*.py before issue 49): p0 trained (a vLLM replica's
# ref, with a file backend's `path` beside it), p1 stored (the replay producer's), p2 failed.
SAVED_BEFORE_TYPED_REFS = (
    '{"epochs": 1, "committed_step": 1, "master_generation": 0, "totals": {"produced_samples": 2, '
    '"produced_tokens": 16, "produced_bytes": 720, "trained_samples": 1, "trained_tokens": 7, "crossed_samples": 0}, '
    '"group_totals": {"g0": {"produced_samples": 2, "produced_tokens": 16, "produced_bytes": 720, '
    '"trained_samples": 1, "trained_tokens": 7, "crossed_samples": 0}}, "entries": [{"prompt_id": "p0", "epoch": 0, '
    '"state": "trained", "group": "g0", "ref": {"key": "run/g0/p0@0.1", "num_tokens": 7, "layer_ids": [1, 3], '
    '"hidden_size": 4, "dtype": "bfloat16", "path": null}, "tokens": 7, "nbytes": 263, "step": 1, "rank": 0, '
    '"crossed": false, "released": false, "attempts": 1, "errors": [], "trained_at_step": 1}, {"prompt_id": "p1", '
    '"epoch": 0, "state": "stored", "group": "g0", "ref": {"key": "run/g0/p1@0.1", "num_tokens": 9, '
    '"layer_ids": [1, 3], "hidden_size": 4, "dtype": "float32"}, "tokens": 9, "nbytes": 457, "step": null, '
    '"rank": null, "crossed": false, "released": false, "attempts": 1, "errors": [], "trained_at_step": null}, '
    '{"prompt_id": "p2", "epoch": 0, "state": "failed", "group": "g0", "ref": null, "tokens": 0, "nbytes": 0, '
    '"step": null, "rank": null, "crossed": false, "released": false, "attempts": 1, "errors": ["render: too long"], '
    '"trained_at_step": null}]}'
)


def test_a_checkpoint_written_before_typed_refs_loads_and_is_saved_in_the_same_json():
    before = json.loads(SAVED_BEFORE_TYPED_REFS)
    ledger = SampleLedger(prompts(3), max_attempts=1)
    assert ledger.load_state_dict(before) == ["run/g0/p0@0.1", "run/g0/p1@0.1"]  # what may linger in the store
    assert ledger.entries["p0@0"].state == TRAINED and ledger.entries["p2@0"].state == FAILED
    assert ledger.entries["p0@0"].ref == SampleRef("run/g0/p0@0.1", 7, (1, 3), 4, "bfloat16")
    assert ledger.entries["p1@0"].state == PENDING and ledger.entries["p1@0"].attempts == 1  # in flight: again
    after = json.loads(json.dumps(ledger.checkpoint_state(1)))
    assert {k: v for k, v in after.items() if k != "entries"} == {k: v for k, v in before.items() if k != "entries"}
    rows = {d["prompt_id"]: d for d in after["entries"]}
    # the same fields in the same order, and the blamed failures counted since (after the attempts)
    fields = list(before["entries"][0])
    assert list(rows["p0"]) == [*fields[: fields.index("errors")], "failures", *fields[fields.index("errors") :]]
    # the same row, but the file path nobody read (a ref is its key and shapes); a loaded trained
    # entry holds no bytes in the store (so it was before: load_state_dict does not restore nbytes)
    ref = {k: v for k, v in before["entries"][0]["ref"].items() if k != "path"}
    assert rows["p0"] == {**before["entries"][0], "ref": ref, "nbytes": 0, "failures": 0}
    assert rows["p2"] == {**before["entries"][2], "failures": 1}  # (derived: its one error)
    # and a state saved now loads into a fresh ledger and is saved again unchanged
    fresh = SampleLedger(prompts(3), max_attempts=1)
    fresh.load_state_dict(json.loads(json.dumps(after)))
    assert json.loads(json.dumps(fresh.checkpoint_state(1))) == after


def test_a_stored_ref_is_saved_as_its_fields_and_leased_as_it_was_reported():
    ledger = SampleLedger(prompts(1))
    [p] = ledger.request_prompts("r0", 1)
    ref = SampleRef(p.key, 7, (1, 3), 4, "float32")
    ledger.report_produced("r0", [ProducedSample(p.uid, ref)])
    assert ledger.entries[p.uid].tokens == 7 and ledger.entries[p.uid].nbytes == ref.nbytes
    [[leased]] = ledger.lease_step(1, ["g0"], 100)
    assert leased.ref is ref and leased.group == "g0"  # the very ref, no round trip
    [row] = json.loads(json.dumps(ledger.checkpoint_state(1)))["entries"]
    assert row["ref"] == {"key": p.key, "num_tokens": 7, "layer_ids": [1, 3], "hidden_size": 4, "dtype": "float32"}


# ---- blamed failures: only what the prompt or its sample is to blame for counts -----------------
def hand_out(ledger, replica="r0") -> PromptTask:
    (p,) = ledger.request_prompts(replica, 1)
    return p


def store_and_lease(ledger, step: int) -> str:
    p = hand_out(ledger)
    ledger.report_produced("r0", [stored(p, 5, 1)])
    (rows,) = ledger.lease_step(step, ["g0"], 100)
    return rows[0].uid


def test_a_prompt_generating_at_every_stop_is_never_failed():
    # stop + resubmit while p0 generates, five times: each resumed job hands it out again (a new
    # attempt, a new key), none is its failure
    ledger, keys = SampleLedger(prompts(1), max_attempts=3), set()
    for _ in range(5):
        keys.add(hand_out(ledger).key)
        resumed = SampleLedger(prompts(1), max_attempts=3)
        resumed.load_state_dict(json.loads(json.dumps(ledger.checkpoint_state(0))), master_generation=1)
        ledger = resumed
        assert ledger.entries["p0@0"].state == PENDING and ledger.entries["p0@0"].failures == 0
    p = hand_out(ledger)
    assert p.key not in keys and ledger.entries["p0@0"].attempts == 6
    ledger.replica_died("r0")  # (by the old count, its 6th attempt: FAILED)
    assert ledger.entries["p0@0"].state == PENDING and ledger.entries["p0@0"].failures == 1
    ledger.report_produced("r1", [stored(hand_out(ledger, "r1"))])
    assert ledger.entries["p0@0"].state == STORED


def test_a_sample_lost_to_master_restarts_is_never_failed():
    ledger = SampleLedger(prompts(1), max_attempts=3)
    for generation in range(1, 6):
        p = hand_out(ledger)
        ledger.report_produced("r0", [stored(p)])
        assert ledger.master_restarted(generation) == 1
        assert ledger.entries["p0@0"].state == PENDING and ledger.entries["p0@0"].failures == 0
    hand_out(ledger)
    ledger.replica_died("r0")  # (by the old count, its 6th attempt: FAILED)
    assert ledger.entries["p0@0"].state == PENDING and ledger.entries["p0@0"].failures == 1
    ledger.report_produced("r1", [stored(hand_out(ledger, "r1"))])
    assert ledger.entries["p0@0"].state == STORED and ledger.entries["p0@0"].attempts == 7


@pytest.mark.parametrize(
    "why", ["SampleMissing: mooncake get for key 'k' failed: -704 OBJECT_NOT_FOUND", None, "StoreUnavailable: down"]
)
def test_a_sample_missing_from_the_store_is_never_failed(why):
    ledger = SampleLedger(prompts(1), max_attempts=3)
    for step in range(1, 6):
        uid = store_and_lease(ledger, step)
        ledger.release_lease(step, {uid: why} if why else [uid])  # (a list: "gone from the store")
        assert ledger.entries[uid].state == PENDING and ledger.entries[uid].failures == 0
    assert len(ledger.entries["p0@0"].errors) == 5  # each kept, none counted


def test_a_sample_lost_at_every_try_is_given_up_on_after_the_unblamed_bound():
    # however innocent, a loss at every try is not retried for ever (a store that refuses it for good)
    from cluster.data.ledger import UNBLAMED_LOSSES

    ledger = SampleLedger(prompts(1), max_attempts=3)
    for step in range(1, UNBLAMED_LOSSES + 1):
        assert ledger.entries["p0@0"].state != FAILED, step
        uid = store_and_lease(ledger, step)
        ledger.release_lease(step, {uid: f"SampleMissing: lost at try {step}"})
    e = ledger.entries["p0@0"]
    assert (e.state, e.failures, len(e.errors)) == (FAILED, 0, UNBLAMED_LOSSES)
    assert e.errors[-1] == f"step {UNBLAMED_LOSSES}: SampleMissing: lost at try {UNBLAMED_LOSSES}"


@pytest.mark.parametrize(
    "why",
    ["CorruptSampleError: the sample's MAC does not match", "token id 151700 >= the target's vocabulary (151643)"],
)
def test_a_corrupt_sample_fails_after_max_attempts(why):
    ledger = SampleLedger(prompts(1), max_attempts=3, epochs=2)
    for step in range(1, 4):
        uid = store_and_lease(ledger, step)
        assert uid == "p0@0" and ledger.entries[uid].state == LEASED
        ledger.release_lease(step, {uid: why})
    assert ledger.entries["p0@0"].state == FAILED and ledger.entries["p0@0"].failures == 3
    assert ledger.entries["p0@1"].state == FAILED  # quarantined with it


def test_a_put_given_up_on_a_full_store_is_never_failed_a_producer_error_is():
    ledger = SampleLedger(prompts(2), max_attempts=3)
    full = "hidden states not stored: k still missing after 600s (put given up: the store stayed full)"
    for _ in range(5):
        handed = {p.id: p for p in ledger.request_prompts("r0", 2)}
        reports = [ProducedSample(handed["p0"].uid, error=full, blamed=False)]
        if "p1" in handed:
            reports.append(ProducedSample(handed["p1"].uid, error="put: INVALID_PARAMS"))
        ledger.report_produced("r0", reports)
    p0, p1 = ledger.entries["p0@0"], ledger.entries["p1@0"]
    assert (p0.state, p0.attempts, p0.failures) == (PENDING, 5, 0)
    assert (p1.state, p1.attempts, p1.failures) == (FAILED, 3, 3)


def test_blamed_failures_of_every_kind_add_up_and_survive_a_resume():
    # a replica death and a corrupt read before a checkpoint, a producer error after the resume:
    # three failures its own, whatever else happened between (a lost sample, a master restart)
    ledger = SampleLedger(prompts(1), max_attempts=3)
    hand_out(ledger)
    ledger.replica_died("r0", "killed")
    uid = store_and_lease(ledger, 1)
    ledger.release_lease(1, {uid: "CorruptSampleError: truncated"})
    uid = store_and_lease(ledger, 1)
    ledger.release_lease(1, [uid])  # gone from the store: not counted
    ledger.report_produced("r0", [stored(hand_out(ledger))])
    ledger.master_restarted(1)
    assert ledger.entries[uid].failures == 2 and ledger.entries[uid].state == PENDING
    state = json.loads(json.dumps(ledger.checkpoint_state(0)))
    assert [d["failures"] for d in state["entries"]] == [2]
    resumed = SampleLedger(prompts(1), max_attempts=3)
    resumed.load_state_dict(state, master_generation=2)
    assert resumed.entries[uid].failures == 2
    p = hand_out(resumed)
    resumed.report_produced("r0", [ProducedSample(p.uid, error="engine returned no hidden-state reference")])
    assert resumed.entries[uid].state == FAILED


def test_a_row_saved_before_failures_were_counted_derives_them_from_its_errors():
    # an entry in flight at a checkpoint written before `failures`: each of its errors counted
    # but the non-finite steps' (the old rule counted every attempt)
    row = {
        "prompt_id": "p0",
        "epoch": 0,
        "state": "leased",
        "group": "g0",
        "ref": None,
        "tokens": 5,
        "nbytes": 1,
        "step": 4,
        "rank": 0,
        "crossed": False,
        "released": False,
        "attempts": 3,
        "errors": ["replica g0-r0 died while generating it", "step 3: non-finite loss on rank 0", "step 2: boom"],
        "trained_at_step": None,
    }
    state = {"epochs": 1, "committed_step": 3, "master_generation": 0, "totals": {}, "group_totals": {}}
    ledger = SampleLedger(prompts(1), max_attempts=3)
    ledger.load_state_dict({**state, "entries": [row]})
    e = ledger.entries["p0@0"]
    assert e.state == PENDING and e.attempts == 3 and e.failures == 2
    ledger.report_produced("r0", [ProducedSample(hand_out(ledger).uid, error="boom")])
    assert e.state == FAILED


def test_read_failures_are_blamed_on_the_sample_only_when_it_is_corrupt_or_out_of_the_vocabulary():
    from cluster.data.ledger_entry import saved
    from cluster.data.ledger_rows import read_failure_blamed
    from cluster.store import SampleMissing, StoreError, StoreUnavailable
    from dspark.samples import CorruptSampleError

    def why(e: Exception) -> str:  # as `TrainerRank.fetch` words it
        return f"{type(e).__name__}: {e}"

    assert read_failure_blamed(why(CorruptSampleError("MAC mismatch")))
    assert read_failure_blamed("token id 9 >= the target's vocabulary (8)")
    for e in (SampleMissing("get", -704, "k"), StoreError("get", -800, "k"), StoreUnavailable("down")):
        assert not read_failure_blamed(why(e))
    assert not read_failure_blamed("gone from the store")
    # a checkpoint keeps a row once it was handed out or failed
    assert not saved({"state": PENDING, "attempts": 0}) and saved({"state": PENDING, "attempts": 0, "failures": 1})


def test_dropped_prompts_leave_every_epoch_unless_handed_out_and_stay_dropped_after_a_resume():
    full = SampleLedger(prompts(10), epochs=3, reuse_across_epochs=True, shuffle_seed=7)
    ledger = SampleLedger(prompts(10), epochs=3, reuse_across_epochs=True, shuffle_seed=7)
    handed = ledger.request_prompts("r0", 4)  # p0..p3 are handed out: they stay
    assert ledger.drop_prompts(["p2", "p5", "p6", "p9", "p5"]) == ["p5", "p6", "p9"]
    gone = {"p5", "p6", "p9"}
    # the plan as if never made with them: the full ledger's order without their entries
    assert ledger.order == [u for u in full.order if u.rsplit("@", 1)[0] not in gone]
    assert ledger.counts().total == 7 * 3 and ledger.to_generate() == 4 + 3  # generating p0..p3; p4, p7, p8
    ledger.report_produced("r0", [stored(p) for p in handed])
    ledger.report_produced("r0", [stored(p) for p in ledger.request_prompts("r0", 10)])
    step = 0
    while ledger.lease_step(step + 1, ["g0"], 1000) is not None:
        step += 1
        ledger.commit(step)
    out = ledger.outcome()
    assert sorted(out["trained"]) == sorted(f"p{i}@{e}" for i in (0, 1, 2, 3, 4, 7, 8) for e in range(3))
    assert not out["unfinished"] and not out["failed"]
    # a resumed ledger (built from every prompt again) drops them again from its saved state
    state = json.loads(json.dumps(ledger.checkpoint_state(step)))
    assert state["dropped_prompts"] == ["p5", "p6", "p9"]
    resumed = SampleLedger(prompts(10), epochs=3, reuse_across_epochs=True, shuffle_seed=7)
    resumed.load_state_dict(state)
    assert resumed.dropped_prompts == gone and resumed.counts().total == 21 and resumed.drained()
    assert sorted(resumed.outcome()["trained"]) == sorted(out["trained"])
