"""One drafter per job over two groups (real local Ray, Mooncake, DeepSpeed gloo; the replay
backend instead of a target): both groups' trainer ranks form one world of 2, every prompt is
trained exactly once over both groups, and when one group's replica is throttled its rank keeps
stepping with samples borrowed from the other group's deeper queue."""

from __future__ import annotations

import json

import pytest

from cluster.config_load import load_config
from tests.helpers import NO_CALIBRATION, QUICK_EVAL

pytestmark = pytest.mark.integration


@pytest.mark.slow  # the suite's 15 minutes: the default run keeps one whole job (test_job.py)
def test_a_starved_group_trains_on_the_other_groups_samples(ray_cluster, smol_target, replay_dir, tmp_path):
    from cluster.job import TrainingJob

    # g0's replica is unthrottled and fills its share of the store past the low watermark (the
    # two groups share the box's 64 MiB segment, half each: 0.15 of 32 MiB = 4.8 MiB, ~4
    # samples); g1's makes one sample every two seconds (at one a second, on a slow hour of a
    # 2-core AMD EPYC (Zen 4), the ranks' start took long enough for g1 to queue 10 samples and its rank
    # never ran dry: nothing borrowed). Producers pause at half their share, and requests
    # of 4 prompts keep a batch's overshoot far below Mooncake's eviction threshold (0.9 of the
    # segment, allocator overhead included).
    cfg = load_config(
        "configs/local_2groups.yaml",
        [
            "run_name=two-groups",
            f"output_dir={tmp_path}",
            "inference.backend=replay",
            f"inference.replay_dir={replay_dir}",
            "topology.groups.1.replay_samples_per_s=0.5",
            "transport.segment_mb=64",
            "transport.low_watermark=0.15",
            "transport.high_watermark=0.5",
            "inference.prompt_batch=4",
            "data.max_prompts=40",
            "data.epochs=1",
            "drafter.draft_vocab_size=null",
            "drafter.num_anchors=4",
            "drafter.markov_rank=16",
            "trainer.batch_tokens=300",
            "trainer.checkpoint_interval=4",
            "trainer.release_samples=after_step",
            "data.eval_limit=1",
            "data.eval_max_new_tokens=8",
            "logging.wandb_mode=disabled",
            "logging.progress_interval_s=3",
            NO_CALIBRATION,
            *QUICK_EVAL,
        ],
    )
    result = TrainingJob(cfg).run()
    proof = result["exactly_once"]
    assert proof["per_epoch"] == {"0": 40} and proof["failed"] == [] and result["world"] == {"g0": 1, "g1": 1}
    assert sorted(result["groups"]) == ["g0", "g1"] and result["drafter"].endswith("final")
    rows = [json.loads(line) for line in (tmp_path / "two-groups" / "trained.jsonl").read_text().splitlines()]
    assert len({r["uid"] for r in rows}) == len(rows) == 40
    # g1's rank trained more than g1 generated: the rest came from g0 (crossed), and the
    # record names each of those (prompt, step, rank 1, group g1, source g0)
    borrowed = [r for r in rows if r["group"] == "g1" and r["source"] == "g0"]
    assert borrowed and proof["crossed"] == len([r for r in rows if r["group"] != r["source"]]) >= len(borrowed)
    assert proof["trained_by_group"]["g1"] > proof["generated_by_group"].get("g1", 0)
    assert all(r["rank"] == 1 for r in rows if r["group"] == "g1")
    assert not any("gone from the store" in e for e in result["events"]), result["events"]  # nothing evicted
