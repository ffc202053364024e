"""The soak harness (benchmarks/soak.py) at 10^4 prompts × 3 epochs with every fault kind, the
ledger in this process (no Ray): the exactly-once proof holds, the poison prompts are quarantined
with all their epochs, and what the run restarted, by cause, is what the chaos schedule says it
injected (its own record, kept apart from the harness's recovery counts and the ledger's events)."""

from __future__ import annotations

import pytest

from benchmarks.soak import EPOCHS, run_soak

pytestmark = [pytest.mark.slow, pytest.mark.integration]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("soak")
    return run_soak(
        [
            "--prompts",
            "10000",
            "--groups",
            "100",
            "--checkpoint-every",
            "5",
            "--chaos-scale",
            "20",
            "--every-fault",
            "--poison-prompts",
            "2",
            "--poison-samples",
            "2",
            "--resubmit-at",
            "0.3",
            "0.6",
            "--cap-s",
            "240",
            "--seed",
            "7",
            "--out",
            str(out),
        ],
        quiet=True,
    )


def test_every_fault_kind_was_injected_and_survived(report):
    assert report["ended"] is None, report["ended"]
    for kind in (
        "replica_death",
        "rank_death",
        "hang",
        "master_restart",
        "full_store",
        "poison_prompt",
        "poison_sample",
        "resubmit",
    ):
        assert report["injected"].get(kind, 0) >= 1, (kind, report["injected"])


def test_exactly_once_proof(report):
    proof = report["proof"]
    assert proof["ok"], proof.get("error")
    assert proof["not_trained"] == 0
    assert proof["trained"] + len(proof["failed"]) == 10000 * EPOCHS
    assert set(proof["per_epoch"]) == {str(e) for e in range(EPOCHS)}


def test_poison_prompts_quarantined_with_all_their_epochs(report):
    poison = report["poison_prompts"]
    assert len(poison) == report["injected"]["poison_prompt"] == 2
    for pid in poison:
        q = report["quarantined"][pid]
        assert q["copies"] == [f"{pid}@{e}" for e in range(EPOCHS)], q
        assert "poison prompt" in q["cause"], q
    # every other failure names an injected fault as its cause (a prompt in generation at a stop, or
    # stored at a master restart, spends an attempt: a few faults on one prompt give up on it)
    causes = ("poison prompt", "poison sample", "killed by the chaos schedule", "hung:", "gone from the store")
    for uid, error in report["failed_causes"].items():
        assert any(c in error for c in causes), (uid, error)


def test_restarts_by_cause_equal_the_injected_faults(report):
    injected, restarts, events = report["injected"], report["restarts"], report["ledger_events"]
    assert restarts.get("replica: replica_death", 0) == injected["replica_death"]
    assert restarts.get("trainer: rank_death", 0) == injected["rank_death"]
    assert restarts.get("store: master_restart", 0) == injected["master_restart"] == events["master_restarted"]
    assert restarts.get("job: resubmit", 0) == injected["resubmit"] == 2
    # every hang was found by `hung_replicas` (or its replica went with a resubmit), none slow uninjected
    hangs = report["hangs"]
    assert hangs.get("found", 0) + hangs.get("cleared by resubmit", 0) == injected["hang"], hangs
    assert restarts.get("replica: hang", 0) == hangs.get("found", 0)
    assert "replica: slow (not injected)" not in restarts
    # a poison prompt killed a replica at most max_attempts (3) times; together with the others the
    # ledger saw exactly the replica deaths the harness caused
    assert 1 <= restarts["replica: poison_prompt"] <= 3 * len(report["poison_prompts"])
    assert events["replica_died"] == sum(v for k, v in restarts.items() if k.startswith("replica: "))
    # the poison samples: each kills the trainer, then only in the tests of the search that finds it
    # (`cluster.job.poison`: at most log2 of its step's samples), and is quarantined in every epoch
    kills = report["poison_samples"]
    assert len(kills) == injected["poison_sample"] == 2
    for uid in kills:
        q = report["quarantined_samples"][uid]
        assert q["copies"] == [f"{q['prompt_id']}@{e}" for e in range(EPOCHS)], q
        assert "failed on it alone" in q["cause"], q
    searches = report["searches"]
    assert sorted(x["uid"] for x in searches if x["verdict"] == "poison") == sorted(kills), searches
    assert all(x["failures"] <= x["bound"] for x in searches), searches
    assert restarts.get("trainer: poison_sample", 0) == sum(kills.values())
    assert events["trainer_restarted"] == restarts.get("trainer: rank_death", 0) + sum(kills.values())
    # a full store paused the group it was injected into
    # (one whose group reported enough long answers to pass its watermark: 64x wide each; late in
    # the run, with answers reused, a group may get only a regeneration or two)
    full, answers = report["full_store"], report["full_store_answers"]
    enough = {g for g in full if answers.get(g, 0) * 64 >= report["watermark_samples"]}
    assert enough and all(full[g] for g in enough), (full, answers)
