"""The end-of-job pictures draw what the run's history and evaluation hold: a history written
through `RunHistory` (clock injected), pictures drawn from it, and every plotted series
compared with the rows it came from."""

from __future__ import annotations

import itertools

from cluster.job.history import RunHistory, read_history
from cluster.job.plots import plot_run, training_acceptance

PNG = b"\x89PNG\r\n\x1a\n"


def test_pictures_show_the_history_and_the_evaluation(tmp_path):
    ticks = itertools.count(start=100.0, step=2.5)
    history = RunHistory(tmp_path / "history.jsonl", started=100.0, clock=lambda: next(ticks))
    for step in range(1, 31):
        history.step(
            step,
            {
                "loss": 5.0 / step,
                "expected_tau": 1.0 + step / 30,
                "accept_pos1": 0.5 + step / 100,
                "accept_pos2": 0.25,
                "lr": 1e-4,
            },
        )
        if step % 10 == 0:
            history.progress(step, {"g0": 90.0 + step, "g1": 40.0}, data_wait_s=step / 10, train_s=step * 0.5)
    rows = read_history(tmp_path / "history.jsonl")
    evaluations = {
        "held-out": {
            "tau": 1.6,
            "per_position_acceptance": [0.6, 0.3, 0.1],
            "per_category": {"chat": {"tau": 1.7}, "code": {"tau": 1.4}, "empty": {"tau": None}},
        },
        "ood": {"tau": 1.4, "per_position_acceptance": [0.5, 0.2], "per_category": {"chat": {"tau": 1.4}}},
    }
    drawn = plot_run(tmp_path / "plots", rows, evaluations)

    assert set(drawn) == {"training", "acceptance", "tau_per_category", "generation"}
    for picture in drawn.values():
        data = open(picture["path"], "rb").read()
        assert data.startswith(PNG) and len(data) > 5000  # a drawn figure, not an empty canvas
    steps = [r for r in rows if r["kind"] == "step"]
    training = drawn["training"]["data"]
    assert training["loss by step"]["loss"] == ([r["step"] for r in steps], [5.0 / s for s in range(1, 31)])
    assert training["tau~ by wall clock (s)"]["tau~"][0] == [r["t"] for r in steps]
    assert steps[0]["t"] == 0.0 and steps[1]["t"] == 2.5  # seconds from the job's start
    # the last 20 steps' mean acceptance per position, computed here independently
    expect = [sum(0.5 + s / 100 for s in range(11, 31)) / 20, 0.25]
    assert training_acceptance(rows) == expect
    acceptance = drawn["acceptance"]["data"]["acceptance per draft position"]
    assert acceptance["training: c* per slot, last steps"] == ([1, 2], expect)
    assert acceptance["eval ood"] == ([1, 2], [0.5, 0.2])
    assert drawn["tau_per_category"]["data"]["tau per category: held-out"]["tau"] == (["chat", "code"], [1.7, 1.4])
    generation = drawn["generation"]["data"]
    assert generation["generation tok/s by wall clock (s)"]["g0"][1] == [100.0, 110.0, 120.0]
    assert generation["trainer data wait (s) by wall clock (s)"]["data wait"][1] == [1.0, 2.0, 3.0]


def test_a_job_without_history_still_draws_its_evaluation(tmp_path):
    drawn = plot_run(
        tmp_path,
        [],
        {"held-out": {"tau": 1.2, "per_position_acceptance": [0.2], "per_category": {"chat": {"tau": 1.2}}}},
    )
    assert drawn["tau_per_category"]["data"]["tau per category: held-out"]["tau"] == (["chat"], [1.2])
    assert drawn["training"]["data"]["loss by step"]["loss"] == ([], [])
