"""The box's plan from injected paces, against figures worked out by hand from the module's
model (generation U·L/tok_s at the share of the cores the replica gets; a step trains
batch_tokens/(prompt+L) samples; the trainer waits for its first 64 samples, then trains no
faster than they arrive; after generation, a sample's first epoch at the first-epoch pace and
its later ones at the later pace)."""

from __future__ import annotations

import pytest

from cluster.box import Choices, Paces, Workload, choose_plan

FAST = Paces({1: 200.0, 2: 300.0}, {1: 2.0, 2: 1.2}, {2: 0.6})
TEN = Choices(target_epochs=10.0)  # the figures below were worked out for a target of ten epochs


def work(categories: int, window_s: float, cores: int = 2, max_epochs: int = 20) -> Workload:
    return Workload(
        {f"c{i}": 60 for i in range(categories)},
        prompt_tokens=40,
        batch_tokens=1024,
        train_window_s=window_s,
        cores=cores,
        max_epochs=max_epochs,
    )


def test_a_fast_box_keeps_long_answers_and_takes_the_most_prompts_that_reach_ten_epochs():
    plan = choose_plan(work(4, 200), FAST, TEN)
    # 24 a category (96 prompts), answers of 128: a step trains 1024/168 = 6.095 samples.
    # The replica on one core, the trainer on the other (neither shares): 96*128/200 = 61.44 s of
    # generation, answers at 1.5625/s; the trainer waits 64/1.5625 = 40.96 s for its first 64,
    # then trains the other 32 as they come. After: the 64 first epochs at 6.095/1.2 = 5.079/s
    # (12.60 s), then later epochs at 6.095/0.6 = 10.16/s for 200 - 61.44 - 12.60 = 125.96 s:
    # 1279.6. In all 96 + 1279.6 = 1375.6, 14.3 epochs.
    # The replica on both cores with the trainer's thread beside them: unshared, answers would
    # arrive at 96/(96*128/300) = 2.344/s against the trainer's 6.095/2.0 = 3.048/s, so it
    # steps 76.9% of the time and the replica's team keeps 1 - 0.65*0.769 = 0.500 of its pace:
    # 81.9 s of generation, 1167.7 samples (12.2 epochs). 48 a category: 4.4 epochs at answers of
    # 128 (12.2 at 64) — long answers first.
    assert (plan.prompts_per_category, plan.prompts, plan.answer_tokens) == (24, 96, 128)
    assert (plan.replica_threads, plan.trainer_threads) == (1, 1)
    assert plan.generation_s == pytest.approx(61.4, abs=0.05)
    assert plan.trained_samples == 1375 and plan.epochs == pytest.approx(14.33, abs=0.01)
    assert plan.worth_serving and "train 10 epochs" in plan.reasons[0]


def test_both_cores_to_the_replica_where_the_trainer_mostly_waits():
    # a trainer 4x faster than FAST's: unshared, 48 a category (192 prompts) of 128 tokens would
    # arrive at 300/128 = 2.344/s on both cores against the trainer's 6.095/0.5 = 12.19/s: it
    # steps 19.2% of the time, the replica's team keeps 1 - 0.65*0.1923 = 0.875 of 300 tok/s:
    # 24576/262.5 = 93.62 s of generation, 2.051/s; 64 waited for (31.21 s), the other 128 trained
    # as they come; after: 64 first epochs at 6.095/0.4 = 15.24/s (4.20 s), later epochs at
    # 6.095/0.3 = 20.32/s for 200 - 93.62 - 4.20 = 102.18 s: 2076.0. 192 + 2076.0 = 2268.0, 11.8
    # epochs. On one thread: 122.88 s of generation, 8.7 epochs, short of ten.
    fast_trainer = Paces(FAST.generation_tok_s, {1: 0.5, 2: 0.4}, {2: 0.3})
    plan = choose_plan(work(4, 200), fast_trainer, TEN)
    assert (plan.prompts_per_category, plan.answer_tokens, plan.replica_threads, plan.trainer_threads) == (
        48,
        128,
        2,
        1,
    )
    assert plan.generation_s == pytest.approx(93.6, abs=0.05)
    assert plan.trained_samples == 2268 and plan.epochs == pytest.approx(11.81, abs=0.01)


def test_one_replica_thread_where_a_second_buys_less_than_the_trainer_takes():
    # two replica threads make 210 tok/s against one's 200: with the trainer stepping 53.8% of the
    # time beside them the team would keep 1 - 0.65*0.538 = 0.650 of them, 137 tok/s. On one
    # thread: 61.44 s of generation, 64 samples' wait (40.96 s), 32 trained by then; the other 64
    # first epochs in 12.60 s; later epochs for 200 - 61.44 - 12.60 = 125.96 s at 10.16/s: 96 +
    # 1279.6 = 1375.6
    plan = choose_plan(work(4, 200), Paces({1: 200.0, 2: 210.0}, FAST.first_step_s, FAST.later_step_s), TEN)
    assert (plan.prompts_per_category, plan.replica_threads, plan.trainer_threads) == (24, 1, 1)
    assert plan.trained_samples == 1375


def test_the_slow_box_of_the_issue_gets_few_prompts_and_short_answers():
    # a 2-core first-generation EPYC: plain vLLM 67 tok/s on one core, 94 on two, a trainer step
    # 4.1 s on one thread; 330 s of training after start-up; 12 categories
    plan = choose_plan(work(12, 330), Paces({1: 67.0, 2: 94.0}, {1: 4.1, 2: 2.6}, {2: 1.6}, source="probe"), TEN)
    # 12 a category (144 prompts), answers of 64 (9.846 samples a step), the replica on one core,
    # the trainer on the other: 144*64/67 = 137.55 s of generation, 1.047/s; the trainer's first
    # 64 take 61.13 s, the other 80 are trained as they come; those 64 first epochs at
    # 9.846/2.6 = 3.787/s (16.90 s); later epochs at 6.154/s for 330 - 137.55 - 16.90 = 175.55 s:
    # 144 + 1080.3 = 1224.3 samples, 8.5 epochs. (Both cores to the replica: unshared 98.0 s,
    # 1.469/s against the trainer's 2.40/s, busy 61.2%, the team keeps 0.602: 162.7 s, 7.4
    # epochs.) Nothing reaches ten (answers of 96: 4.3 epochs), so the most epochs.
    assert (plan.prompts_per_category, plan.prompts, plan.answer_tokens, plan.replica_threads) == (12, 144, 64, 1)
    assert plan.trained_samples == 1224 and plan.epochs == pytest.approx(8.50, abs=0.01) and plan.worth_serving
    assert plan.reasons[0].startswith("no choice trains 10 epochs") and "(probe)" in plan.reasons[1]


def test_a_box_that_cannot_train_one_epoch_says_so_and_what_to_raise():
    plan = choose_plan(work(12, 120, cores=1), Paces({1: 10.0}, {1: 30.0}, {1: 20.0}), TEN)
    # one core shared: the trainer, stepping 47.6% of the time, leaves the replica 1/1.476 of it;
    # 144 prompts x 64 tokens take 1360 s to generate, and the trainer's first 64 alone 605 s:
    # nothing is trained within the 120 s window
    assert (plan.prompts_per_category, plan.answer_tokens) == (12, 64)
    assert plan.trained_samples == 0 and plan.epochs == 0 and not plan.worth_serving
    assert plan.generation_s == pytest.approx(1360.3, abs=0.1)
    assert "raise trainer.time_budget_s by more than 1240 s" in plan.reasons[-1]


def test_a_lower_target_takes_more_prompts_at_fewer_epochs():
    # the fast box above with a target of 6 epochs: 48 a category (4.4 epochs at answers of 128)
    # still falls short; with answers of 96 (1024/136 = 7.53 samples a step) it reaches 6 with
    # the replica on one core: 192*96/200 = 92.16 s of generation, 2.083/s; 64 waited for
    # (30.72 s), 128 trained as they come; after: 64 first epochs at 7.53/1.2 = 6.275/s (10.2 s),
    # later epochs at 12.55/s for 200 - 92.16 - 10.20 = 97.64 s: 1225.3; 192 + 1225.3 = 1417.3,
    # 7.4 epochs. Answers of 128 first: at 128 only 24 a category reaches 6, at 96 48 does — the
    # longest answers win: 24 a category, 128 tokens.
    plan = choose_plan(work(4, 200), FAST, Choices(target_epochs=6.0))
    assert (plan.prompts_per_category, plan.answer_tokens) == (24, 128)
    wider = choose_plan(work(4, 200), FAST, Choices(answer_tokens=(64, 96), target_epochs=6.0))
    assert (wider.prompts_per_category, wider.answer_tokens, wider.replica_threads) == (48, 96, 1)
    assert abs(wider.trained_samples - 1417) <= 1 and wider.epochs == pytest.approx(7.38, abs=0.01)  # (rounding above)


def test_categories_smaller_than_the_cap_count_what_they_have():
    w = Workload(
        {"big": 60, "small": 5}, prompt_tokens=40, batch_tokens=1024, train_window_s=360, cores=2, max_epochs=20
    )
    plan = choose_plan(w, FAST, Choices(prompts_per_category=(48,), answer_tokens=(128,)))
    assert plan.prompts == 48 + 5
    # fewer prompts than the trainer's first 64: it starts once generation ends; max_epochs then caps
    assert plan.trained_samples == 20 * 53 and plan.epochs == 20


@pytest.mark.parametrize(
    "overrides, why",
    [
        ([], None),
        (["device=cuda", "topology.groups.0.gpus_per_node=2"], "device cuda"),
        (["inference.backend=replay", "inference.replay_dir=/tmp"], "the replay backend generates nothing"),
        (["trainer.time_budget_s=null"], "no trainer.time_budget_s"),
        (["trainer.max_steps=10"], "trainer.max_steps=10 ends training first"),
    ],
)
def test_the_plan_applies_to_one_cpu_box_generating_in_a_time_budget(overrides, why):
    from cluster.box import box_unfit
    from cluster.config_load import load_config

    assert box_unfit(load_config("configs/local.yaml", overrides)) == why
    assert box_unfit(load_config("configs/local_2groups.yaml", ["trainer.time_budget_s=100"])) == "2 groups"


@pytest.mark.parametrize(
    "override", ["box_plan.answer_tokens=[]", "box_plan.prompts_per_category=[0,12]", "box_plan.answer_tokens=[2048]"]
)
def test_choices_that_cannot_be_made_are_config_errors(override):
    from cluster.config import ConfigError
    from cluster.config_load import load_config

    with pytest.raises(ConfigError, match=r"box_plan\."):
        load_config("configs/local.yaml", [override])


def test_the_end_evaluation_fits_the_box():
    from cluster.box import EvaluationFit, fit_evaluation

    # the reference box (330 tok/s): 15 + 42 + 25 + 35 = 117 s, everything kept within 120
    assert fit_evaluation(330.0, 120, 16, True, True) == EvaluationFit(16, True, True, 117.0)
    # within 90 s: both extras do not fit even beside 12 greedy prompts (15 + 31.5 + 60 = 106.5 s);
    # without the long-context set all 16 do, with the sampled one: 15 + 42 + 25 = 82 s
    assert fit_evaluation(330.0, 90, 16, True, True) == EvaluationFit(16, True, False, 82.0)
    # a faster box (420 tok/s, 0.7857 of the time): both extras with 16 prompts take 91.9 s, with
    # 15 0.7857 * (15 + 39.375 + 60) = 89.9 s: fewer greedy prompts first, both extras kept
    assert fit_evaluation(420.0, 90, 16, True, True) == EvaluationFit(15, True, True, 89.9)
    # this Xeon's slower readings (290 tok/s, x1.138): the sampled set with 16 prompts 93.3 s, 15
    # 90.3 s, 14 1.138 * (15 + 36.75 + 25) = 87.3 s
    assert fit_evaluation(290.0, 90, 16, True, True) == EvaluationFit(14, True, False, 87.3)
    # only the long-context set asked for: 15 + 39.375 + 35 = 89.4 s with 15 prompts
    assert fit_evaluation(330.0, 90, 16, False, True) == EvaluationFit(15, False, True, 89.4)
    # 2.56x slower (129 tok/s): the sampled set beside 12 prompts 2.558 * 71.5 = 182.9 s; without
    # the extras 2.558 * (15 + 2.625 * limit) <= 120 holds up to 12 prompts: 119.0 s
    assert fit_evaluation(129.0, 120, 16, True, True) == EvaluationFit(12, False, False, 119.0)
    # and within 90 s: not under 8 prompts, whatever it costs: 2.558 * 36 = 92.1 s
    assert fit_evaluation(129.0, 90, 16, True, True) == EvaluationFit(8, False, False, 92.1)
    # 8.25x slower: 8.25 * (15 + 21) = 297 s
    assert fit_evaluation(40.0, 120, 16, True, True) == EvaluationFit(8, False, False, 297.0)
    assert fit_evaluation(129.0, 120, 16, False, False).sampled is False  # none to drop: fewer prompts
    # a configured limit under the floors is kept, not raised: 8.25 * (15 + 42 * 6 / 16) = 253.7 s
    assert fit_evaluation(40.0, 90, 6, True, True) == EvaluationFit(6, False, False, 253.7)


def test_start_up_takes_longer_on_a_slower_box():
    from cluster.box import startup_seconds

    # the reference pace (330 tok/s) or faster: as configured; 129 tok/s (a 0.66-core quota's
    # probe): 330/129 = 2.558 times as long
    assert startup_seconds(60.0, 330.0) == 60.0 and startup_seconds(60.0, 400.0) == 60.0
    assert startup_seconds(60.0, 129.0) == pytest.approx(153.5, abs=0.05)


def test_the_configs_own_choice_stands_within_the_forecasts_error():
    # The fast box above with a target of 4 epochs: 48 a category at answers of 128 forecasts 4.4
    # epochs (test_a_lower_target_...), enough for the forecast alone; but the config's 24 (14.3
    # epochs forecast) is within the forecast's error of the target, and 48 is not twice over it.
    only_128 = dict(answer_tokens=(128,), target_epochs=4.0)
    assert choose_plan(work(4, 200), FAST, Choices(**only_128)).prompts_per_category == 48
    plan = choose_plan(work(4, 200), FAST, Choices(**only_128, baseline=(24, 128)))
    assert (plan.prompts_per_category, plan.answer_tokens) == (24, 128)
    assert plan.epochs == pytest.approx(14.33, abs=0.01) and "the config's 24 prompts a category" in plan.reasons[0]


def test_more_prompts_than_the_config_only_where_the_forecast_is_twice_the_target():
    # the fast trainer of test_both_cores_...: 48 a category at 128 forecasts 11.81 epochs, over
    # 2 x 5; over 2 x 6 it would not be
    fast_trainer = Paces(FAST.generation_tok_s, {1: 0.5, 2: 0.4}, {2: 0.3})
    plan = choose_plan(work(4, 200), fast_trainer, Choices(target_epochs=5.0, baseline=(24, 128)))
    assert (plan.prompts_per_category, plan.answer_tokens, plan.epochs) == (48, 128, pytest.approx(11.81, abs=0.01))
    assert "more prompts than the config's 24" in plan.reasons[0]
    assert choose_plan(work(4, 200), fast_trainer, Choices(target_epochs=6.0, baseline=(24, 128))).prompts == 96


def test_a_box_far_slower_than_the_config_was_written_for_gets_less_than_it():
    # the first-generation EPYC above: the config's 24 a category at 128 forecasts far less than
    # 10 / 2 epochs (12 a category at 96 already only 4.3), so the choices below it are weighed,
    # as without a baseline: 12 a category, answers of 64
    epyc = Paces({1: 67.0, 2: 94.0}, {1: 4.1, 2: 2.6}, {2: 1.6}, source="probe")
    plan = choose_plan(work(12, 330), epyc, Choices(target_epochs=10.0, baseline=(24, 128)))
    assert (plan.prompts_per_category, plan.answer_tokens, plan.trained_samples) == (12, 64, 1224)
    assert plan.reasons[0].startswith("the config's 24 prompts a category would train")


def test_what_the_user_set_survives_the_plan(monkeypatch):
    """`plan_box` with the paces injected (no probe, no target read): the keys the user set on
    the command line keep their values and are listed as kept; the others are the plan's."""
    import cluster.box.apply as apply
    import cluster.target
    from cluster.config_load import explicit_keys, load_config

    overrides = ["data.max_prompts_per_category=8", "trainer.torch_threads=2"]
    cfg = load_config("configs/local.yaml", overrides)
    explicit = explicit_keys("configs/local.yaml", overrides, "configs/local.yaml")
    assert {"data.max_prompts_per_category", "trainer.torch_threads"} <= explicit
    assert "sampling.max_tokens" not in explicit  # (set by the embedded default's file: the plan's to change)
    monkeypatch.setattr(cluster.target, "read_target", lambda cfg: type("T", (), {"path": "unused"})())
    monkeypatch.setattr(apply, "prompt_tokens", lambda target, train: 40.0)
    monkeypatch.setattr(apply, "probe_or_kept", lambda *a: (FAST, 0.0, None))
    record = apply.plan_box(cfg, None, 0.0, clock=lambda: 0.0, explicit=explicit)
    assert cfg.data.max_prompts_per_category == 8 and cfg.trainer.torch_threads == 2
    assert record["kept"] == {"data.max_prompts_per_category": 8, "trainer.torch_threads": 2}
    assert record["prompts_per_category"] == 8 and record["trainer_threads"] == 2
    assert "data.max_prompts_per_category" not in record["replaced"]
    assert cfg.sampling.max_tokens == record["answer_tokens"] and cfg.inference.cpu_threads == record["replica_threads"]
    # without the overrides the same paces choose otherwise: the test above is not the plan's own choice
    plain = load_config("configs/local.yaml")
    apply.plan_box(plain, None, 0.0, clock=lambda: 0.0, explicit=frozenset())
    assert plain.data.max_prompts_per_category != 8 and plain.trainer.torch_threads != 2


def test_explicit_keys_are_the_overrides_and_a_users_own_file(tmp_path):
    from cluster.config_load import explicit_keys

    mine = tmp_path / "mine.yaml"
    mine.write_text("data:\n  max_prompts_per_category: 10\ntrainer:\n  time_budget_s: 300\n")
    assert explicit_keys(mine, ["sampling={max_tokens: 64}"], "configs/local.yaml") == {
        "data.max_prompts_per_category",
        "trainer.time_budget_s",
        "sampling.max_tokens",
    }
    assert explicit_keys("configs/local.yaml", [], "configs/local.yaml") == frozenset()


def planned(cap: int = 24) -> dict:
    """What `plan_box` records, as the revision reads it: the FAST box, 4 categories of 60."""
    return {
        "prompts_per_category": cap,
        "answer_tokens": 128,
        "replica_threads": 1,
        "trainer_threads": 1,
        "paces": {"first_step_s": {"1": 2.0, "2": 1.2}, "later_step_s": {"2": 0.6}},
        "workload": {"prompts_per_category": {f"c{i}": 60 for i in range(4)}, "prompt_tokens": 40, "usable_cores": 2},
    }


def test_the_second_look_drops_prompts_where_the_measured_replica_is_far_slower():
    from cluster.box.revision import revise_prompts

    # The replica really generates 100 tok/s (the probe said 200), 100 s of training are left.
    # 24 a category (96 prompts): 122.88 s of generation, answers at 0.78125/s, the trainer's
    # first 64 come after 81.92 s, 18.08 s more train 14.1: 0.15 epochs (x 2 < 10: revised).
    # 12 a category (48 prompts): 61.44 s of generation; the trainer starts with all 48 then,
    # trains their first epochs at 6.095/1.2 = 5.079/s (9.45 s), later ones at 10.16/s for the
    # 38.56 - 9.45 = 29.11 s left: 48 + 295.7 = 343.7 samples, 7.16 epochs.
    r = revise_prompts(planned(), 100.0, 0, 100.0, 1024, 20, (12, 24, 48), 10.0)
    assert r is not None and r.prompts_per_category == 12
    assert r.expected_epochs == pytest.approx(7.16, abs=0.01) and r.planned_epochs == pytest.approx(0.15, abs=0.005)
    assert "100 tok/s" in r.reason
    # 300 s left: the 24 train 18.4 epochs by the model (1767 samples), the plan stands
    assert revise_prompts(planned(), 100.0, 0, 300.0, 1024, 20, (12, 24, 48), 10.0) is None
    # never more prompts than planned, whatever the pace
    assert revise_prompts(planned(12), 5000.0, 0, 300.0, 1024, 20, (12, 24, 48), 10.0) is None


def test_prompts_left_out_by_a_revision_are_those_a_smaller_cap_would_not_keep():
    from cluster.box.revision import prompts_beyond
    from dspark.prompts import cap_per_category

    Conv = type("Conv", (), {})
    train = []
    for i in range(30):
        c = Conv()
        c.id, c.category = f"q{i}", ("a", "b", "c")[i % 3]
        train.append(c)
    left_out = prompts_beyond(train, 4, 0, None)
    assert len(left_out) == 30 - 3 * 4
    kept = [c for c in train if c.id not in left_out]
    assert {cat: sum(c.category == cat for c in kept) for cat in "abc"} == {"a": 4, "b": 4, "c": 4}
    # the very prompts a run configured with that cap trains (the hash choice, its seed)
    assert [c.id for c in kept] == [c.id for c in cap_per_category(train, 4, 0)]
    assert prompts_beyond(train, 4, 1, None) != left_out  # (another seed chooses others: the seed is used)


def test_the_configs_core_split_stands_with_its_choice():
    # The fast box of the first test, the config's 24 a category at 128 and its split (the
    # replica on both cores, the trainer on one beside it): the model prefers one core each
    # (14.3 epochs) but the split stands with the baseline; by the model it trains 1167.7
    # samples, 12.2 epochs (the first test's figures for that split)
    plan = choose_plan(work(4, 200), FAST, Choices(target_epochs=10.0, baseline=(24, 128), baseline_split=(2, 1)))
    assert (plan.prompts_per_category, plan.replica_threads, plan.trainer_threads) == (24, 2, 1)
    assert plan.trained_samples == 1167 and plan.epochs == pytest.approx(12.16, abs=0.01)
    # on a box far too slow for the baseline the model's split is weighed again (the EPYC above)
    epyc = Paces({1: 67.0, 2: 94.0}, {1: 4.1, 2: 2.6}, {2: 1.6}, source="probe")
    slow = choose_plan(work(12, 330), epyc, Choices(target_epochs=10.0, baseline=(24, 128), baseline_split=(2, 1)))
    assert (slow.prompts_per_category, slow.answer_tokens, slow.replica_threads, slow.trainer_threads) == (12, 64, 1, 1)
