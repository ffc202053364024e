"""The ledger under random failures: whatever the interleaving of replica deaths, master
restarts, trainer restarts and checkpoints, every prompt of every epoch ends trained once."""

from __future__ import annotations

import random

import pytest

from cluster.ledger import FAILED, LEASED, PENDING, STORED, TRAINED, LedgerError, SampleLedger, balance


def prompts(n):
    return [{"id": f"p{i}", "messages": [{"role": "user", "content": str(i)}]} for i in range(n)]


def produce(ledger, replica, n, rng, fail_rate=0.0):
    handed = ledger.request_prompts(replica, n)
    results = []
    for p in handed:
        if rng.random() < fail_rate:
            results.append({"uid": p["uid"], "error": "boom"})
        else:
            results.append({"uid": p["uid"], "ref": {"key": p["key"]}, "tokens": rng.randint(5, 50), "nbytes": 1000})
    return handed, results


@pytest.mark.parametrize("seed", range(20))
def test_random_failures_keep_exactly_once(seed):
    rng = random.Random(seed)
    ledger = SampleLedger("g0", prompts(40), epochs=2, high_watermark_bytes=15_000, low_watermark_bytes=8_000, max_attempts=50,
                          reuse_across_epochs=seed % 2 == 1)
    trained_log = []  # (uid, step) as a "model" would see them, reset on trainer restart
    checkpoint = {"step": 0, "state": ledger.checkpoint_state(0), "log": []}
    step = 0
    in_flight = {}  # replica -> results not yet reported
    generation = 1
    ledger.master_restarted(generation)
    for _ in range(2000):
        if ledger.done():
            break
        action = rng.random()
        replica = f"r{rng.randint(0, 2)}"
        if action < 0.35:
            if replica not in in_flight:
                in_flight[replica] = produce(ledger, replica, rng.randint(1, 6), rng, fail_rate=0.1)[1]
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
        elif action < 0.85:
            lease = ledger.lease_step(step + 1, world_size=2, batch_tokens=60)
            if lease:
                step += 1
                trained_log += [(row["uid"], step) for rank in lease for row in rank]
        elif action < 0.95:
            checkpoint = {"step": step, "state": ledger.checkpoint_state(step), "log": list(trained_log)}
            ledger.commit(step)
        else:  # trainer crash: the model goes back to the checkpoint, the ledger follows it
            step = checkpoint["step"]
            trained_log = list(checkpoint["log"])
            ledger.load_state_dict(checkpoint["state"], master_generation=generation)
            in_flight.clear()
        # drain at the end: nothing more to lease → checkpoint
        if ledger.drained() and not in_flight:
            checkpoint = {"step": step, "state": ledger.checkpoint_state(step), "log": list(trained_log)}
            ledger.commit(step)
    assert ledger.done(), ledger.counts()
    report = ledger.verify_exactly_once()
    assert report["per_epoch"] == {"0": 40 - sum(u.endswith("@0") for u in report["failed"]),
                                   "1": 40 - sum(u.endswith("@1") for u in report["failed"])}
    # the model's view agrees: each trained uid appears once in what the final model saw
    seen = [u for u, _ in trained_log]
    assert len(seen) == len(set(seen))
    assert set(seen) == {u for u, e in ledger.entries.items() if e.state == TRAINED}


def test_backpressure_hysteresis():
    ledger = SampleLedger("g0", prompts(10), high_watermark_bytes=3000, low_watermark_bytes=1000)
    rng = random.Random(0)
    _, res = produce(ledger, "r0", 3, rng)
    ledger.report_produced("r0", res)
    assert ledger.counts()["paused"] and ledger.request_prompts("r0", 5) == []
    ledger.lease_step(1, 1, 10_000)
    ledger.commit(1)
    assert not ledger.counts()["paused"] and len(ledger.request_prompts("r0", 2)) == 2


def test_epoch_order_and_stale_reports():
    ledger = SampleLedger("g0", prompts(3), epochs=2)
    first = ledger.request_prompts("r0", 10)
    assert [p["uid"] for p in first] == ["p0@0", "p1@0", "p2@0"]  # epoch 1 waits for epoch 0
    ledger.replica_died("r0")
    ledger.report_produced("r0", [{"uid": "p0@0", "ref": {"key": "k"}, "tokens": 3, "nbytes": 1}])
    assert ledger.entries["p0@0"].state == PENDING  # a dead replica's late report is ignored
    again = ledger.request_prompts("r1", 10)
    assert again[0]["key"] != first[0]["key"]  # a regenerated sample gets a fresh key


def test_failures_are_final_and_reported():
    ledger = SampleLedger("g0", prompts(1), max_attempts=2)
    for _ in range(2):
        p = ledger.request_prompts("r0", 1)
        ledger.report_produced("r0", [{"uid": p[0]["uid"], "error": "corrupt"}])
    assert ledger.entries["p0@0"].state == FAILED
    assert ledger.verify_exactly_once()["failed"] == ["p0@0"]


def test_unfinished_ledger_does_not_verify():
    ledger = SampleLedger("g0", prompts(2))
    with pytest.raises(LedgerError):
        ledger.verify_exactly_once()


def test_lease_is_idempotent_and_balanced():
    ledger = SampleLedger("g0", prompts(8))
    p = ledger.request_prompts("r0", 8)
    ledger.report_produced("r0", [{"uid": x["uid"], "ref": {"key": x["key"]}, "tokens": 10 * (i + 1), "nbytes": 1}
                                  for i, x in enumerate(p)])
    a = ledger.lease_step(1, 2, 1000)
    assert a == ledger.lease_step(1, 2, 1000)
    loads = [sum(ledger.entries[r["uid"]].tokens for r in rank) for rank in a]
    assert abs(loads[0] - loads[1]) <= 10
    assert all(e.state == LEASED for e in ledger.entries.values())
    ledger.trainer_restarted(0)
    assert all(e.state == STORED for e in ledger.entries.values())


def test_balance():
    assert sorted(map(len, balance([("a", 5), ("b", 5), ("c", 5), ("d", 5)], 2))) == [2, 2]


def test_duplicate_ids_rejected():
    with pytest.raises(LedgerError, match="unique"):
        SampleLedger("g0", prompts(2) + prompts(1))


def test_greedy_epochs_reuse_stored_samples():
    ledger = SampleLedger("g0", prompts(3), epochs=3, reuse_across_epochs=True)
    handed = ledger.request_prompts("r0", 10)
    assert [p["uid"] for p in handed] == ["p0@0", "p1@0", "p2@0"]
    ledger.report_produced("r0", [{"uid": p["uid"], "ref": {"key": p["key"]}, "tokens": 5, "nbytes": 1} for p in handed])
    removed = []
    for step in range(1, 4):  # no commit in between: the next epoch is available at once
        lease = ledger.lease_step(step, 1, 1000)
        assert sorted(r["ref"]["key"] for r in lease[0]) == sorted(p["key"] for p in handed)
        assert ledger.request_prompts("r0", 10) == []  # nothing is ever regenerated
    assert ledger.lease_step(4, 1, 1000) is None
    for step in range(1, 4):
        removed += ledger.commit(step)
    assert sorted(removed) == sorted(p["key"] for p in handed)  # dropped after the last epoch only
    assert ledger.verify_exactly_once()["per_epoch"] == {"0": 3, "1": 3, "2": 3}


def test_later_epochs_wait_for_every_sample_of_the_current_one():
    ledger = SampleLedger("g0", prompts(6), epochs=2, reuse_across_epochs=True)
    first = ledger.request_prompts("r0", 2)  # a slow replica: only two samples exist so far
    ledger.report_produced("r0", [{"uid": p["uid"], "ref": {"key": p["key"]}, "tokens": 5, "nbytes": 1} for p in first])
    lease = ledger.lease_step(1, 1, 1000)
    assert sorted(r["uid"] for r in lease[0]) == ["p0@0", "p1@0"]
    assert ledger.counts()["to_generate"] == 4  # the rest of epoch 0; epoch 1 reuses it all
    assert ledger.queued_bytes() == 2  # leased p0@0 and stored p0@1 are one object in the store
    assert ledger.entries["p0@1"].state == STORED  # its next epoch reuses the sample...
    assert ledger.lease_step(2, 1, 1000) is None  # ...but waits until epoch 0 is all leased
    rest = ledger.request_prompts("r0", 10)
    ledger.report_produced("r0", [{"uid": p["uid"], "ref": {"key": p["key"]}, "tokens": 5, "nbytes": 1} for p in rest])
    assert sorted(r["uid"] for r in ledger.lease_step(2, 1, 1000)[0]) == [f"p{i}@0" for i in range(2, 6)]
    epoch1 = [r["uid"] for r in ledger.lease_step(3, 1, 1000)[0]]
    assert sorted(epoch1) == [f"p{i}@1" for i in range(6)]
    assert epoch1 == [u for u in ledger.order if u.endswith("@1")]
    assert epoch1 != sorted(epoch1)  # shuffled, deterministically by the seed
    assert [u for u in SampleLedger("g0", prompts(6), epochs=2).order if u.endswith("@1")] == epoch1


def test_a_full_store_lifts_the_epoch_wait():
    # The store holds two samples: they and their reused next epochs must be trainable, or
    # producers (paused) and the trainer (waiting for epoch 0) would wait on each other.
    ledger = SampleLedger("g0", prompts(4), epochs=2, reuse_across_epochs=True,
                          high_watermark_bytes=2000, low_watermark_bytes=0)
    first = ledger.request_prompts("r0", 2)
    ledger.report_produced("r0", [{"uid": p["uid"], "ref": {"key": p["key"]}, "tokens": 5, "nbytes": 1000} for p in first])
    assert ledger.request_prompts("r0", 2) == []  # paused
    ledger.lease_step(1, 1, 1000)
    ledger.commit(1)
    assert ledger.counts()["paused"]  # epoch 1 still holds both samples
    lease = ledger.lease_step(2, 1, 1000)
    assert sorted(r["uid"] for r in lease[0]) == ["p0@1", "p1@1"]
    assert sorted(ledger.commit(2)) == sorted(p["key"] for p in first)
    assert len(ledger.request_prompts("r0", 2)) == 2  # room again
