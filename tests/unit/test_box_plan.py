"""The box's plan from injected paces, against figures worked out by hand from the module's
model (generation U·L/tok_s; a step trains batch_tokens/(prompt+L) samples; while generating
the trainer trains no faster than samples arrive)."""

from __future__ import annotations

import pytest

from cluster.scaling.box_plan import Choices, Paces, Workload, choose_plan


def work(categories: int, window_s: float, cores: int = 2, max_epochs: int = 20) -> Workload:
    return Workload({f"c{i}": 60 for i in range(categories)}, prompt_tokens=40, batch_tokens=1024,
                    train_window_s=window_s, cores=cores, max_epochs=max_epochs)


def test_a_fast_box_keeps_long_answers_and_takes_the_most_prompts_that_reach_ten_epochs():
    plan = choose_plan(work(4, 360), Paces({1: 200.0}, {1: 2.0, 2: 1.2}))
    # answers of 128: a step trains 1024/168 = 6.095 samples. 24 a category (96 prompts):
    # generated in 96*128/200 = 61.4 s, trained as they come (1.56/s, under the trainer's
    # 6.095/2.0 = 3.05/s), then 6.095/1.2 = 5.08/s for 298.6 s: 96 + 1516.5 = 1612.5 samples,
    # 16.8 epochs. 48 a category: 192 + 5.08 * (360 - 122.9) = 1396 samples, 7.3 epochs: short
    # of ten. (48 a category reaches ten with answers of 64: 13.8 epochs; long answers first.)
    assert (plan.prompts_per_category, plan.prompts, plan.answer_tokens) == (24, 96, 128)
    assert (plan.replica_threads, plan.trainer_threads) == (1, 1)
    assert plan.generation_s == pytest.approx(61.4, abs=0.05)
    assert plan.trained_samples == 1612 and plan.epochs == pytest.approx(16.80, abs=0.01)
    assert plan.worth_serving and "train 10 epochs" in plan.reasons[0]


def test_the_slow_box_of_the_issue_gets_few_prompts_and_short_answers():
    # a 2-core first-generation EPYC: plain vLLM 67 tok/s on one core, a trainer step 4.1 s on
    # one thread; 330 s of training after start-up; 12 categories
    plan = choose_plan(work(12, 330), Paces({1: 67.0, 2: 94.0}, {1: 4.1, 2: 2.6}, source="probe"))
    # no choice reaches ten epochs. 12 a category (144 prompts) with answers of 64: generated in
    # 144*64/67 = 137.6 s, then 1024/104/2.6 = 3.787 samples/s for 192.4 s: 144 + 728.6 = 872.6
    # samples, 6.06 epochs; with answers of 128: 144 + 2.344 * 54.9 = 272.7 samples, 1.9 epochs
    assert (plan.prompts_per_category, plan.prompts, plan.answer_tokens) == (12, 144, 64)
    assert plan.epochs == pytest.approx(6.06, abs=0.01) and plan.worth_serving
    assert plan.reasons[0].startswith("no choice trains 10 epochs") and "(probe)" in plan.reasons[1]


def test_a_box_that_cannot_train_one_epoch_says_so_and_what_to_raise():
    plan = choose_plan(work(12, 120), Paces({1: 10.0}, {1: 30.0, 2: 20.0}))
    # 144 prompts x 64 tokens take 921.6 s to generate, longer than the 120 s window: the
    # trainer trains what arrives, 0.156/s (under its 9.846/30 = 0.33/s): 18.75 samples
    assert (plan.prompts_per_category, plan.answer_tokens) == (12, 64)
    assert plan.trained_samples == 18 and plan.epochs == pytest.approx(18.75 / 144, abs=0.001)
    assert not plan.worth_serving and "raise trainer.time_budget_s" in plan.reasons[-1]


def test_four_cores_split_where_the_most_samples_are_trained():
    paces = Paces({1: 100.0, 2: 180.0, 3: 240.0}, {1: 4.0, 2: 2.2, 3: 1.6, 4: 1.3})
    plan = choose_plan(work(4, 360, cores=4, max_epochs=100), paces)
    # 24 a category (96 prompts), answers of 128 (6.095 samples a step, 4.689/s on 4 threads):
    #   1 replica thread: generated in 122.9 s; 96 + 4.689 * 237.1 = 1207.8
    #   2: 68.3 s; 96 + 4.689 * 291.7 = 1463.8
    #   3: 51.2 s, the trainer on one thread trains 6.095/4 = 1.52/s < 1.875/s arriving:
    #      78.0 + 4.689 * 308.8 = 1525.8 -> three replica threads, 15.9 epochs
    # 48 a category at its best split (3): 156.1 + 4.689 * 257.6 = 1364 samples, 7.1 epochs
    assert (plan.prompts_per_category, plan.answer_tokens, plan.replica_threads, plan.trainer_threads) == (24, 128, 3, 1)
    assert plan.trained_samples == 1525


def test_categories_smaller_than_the_cap_count_what_they_have():
    w = Workload({"big": 60, "small": 5}, prompt_tokens=40, batch_tokens=1024, train_window_s=360, cores=2, max_epochs=20)
    plan = choose_plan(w, Paces({1: 200.0}, {1: 2.0, 2: 1.2}), Choices(prompts_per_category=(48,), answer_tokens=(128,)))
    assert plan.prompts == 48 + 5
    # every choice trains max_epochs: 20 epochs of 53 prompts
    assert plan.trained_samples == 20 * 53 and plan.epochs == 20


@pytest.mark.parametrize("overrides, why", [
    ([], None),
    (["device=cuda", "topology.groups.0.gpus_per_node=2"], "device cuda"),
    (["inference.backend=replay", "inference.replay_dir=/tmp"], "the replay backend generates nothing"),
    (["trainer.time_budget_s=null"], "no trainer.time_budget_s"),
    (["trainer.max_steps=10"], "trainer.max_steps=10 ends training first"),
])
def test_the_plan_applies_to_one_cpu_box_generating_in_a_time_budget(overrides, why):
    from cluster.config import load_config
    from cluster.job.box import box_unfit

    assert box_unfit(load_config("configs/local.yaml", overrides)) == why
    assert box_unfit(load_config("configs/local_2groups.yaml", ["trainer.time_budget_s=100"])) == "2 groups"


@pytest.mark.parametrize("override", ["box_plan.answer_tokens=[]", "box_plan.prompts_per_category=[0,12]",
                                      "box_plan.answer_tokens=[2048]"])
def test_choices_that_cannot_be_made_are_config_errors(override):
    from cluster.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"box_plan\."):
        load_config("configs/local.yaml", [override])
