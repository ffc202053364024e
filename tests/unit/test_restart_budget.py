"""`RestartBudget`: restarts as a rate over a sliding window, checked with an injected clock
against a count done by hand."""

from __future__ import annotations

import random

from cluster.restart_budget import RestartBudget


def test_the_window_slides_a_restart_ages_out_exactly_after_the_window():
    now = [0.0]
    budget = RestartBudget(2, 100.0, clock=lambda: now[0])
    assert budget.spend()
    now[0] = 50.0
    assert budget.spend()
    now[0] = 99.9
    assert not budget.spend() and budget.recent() == 2 and budget.total == 2  # a refusal records nothing
    now[0] = 100.0  # the first restart is 100 s old: out of the window
    assert budget.recent() == 1 and budget.spend() and budget.total == 3
    assert str(budget) == "2 within 100 s"


def test_the_budget_agrees_with_a_count_of_the_last_window_done_by_hand():
    """Random restart requests over a long run: each is granted exactly when fewer than `limit`
    granted restarts lie within the window before it."""
    rng = random.Random(7)
    now = [0.0]
    budget = RestartBudget(3, 600.0, clock=lambda: now[0])
    granted: list[float] = []
    for _ in range(2000):
        now[0] += rng.expovariate(1 / 150.0)
        expected = sum(1 for t in granted if now[0] - t < 600.0) < 3
        assert budget.spend() == expected
        if expected:
            granted.append(now[0])
    assert budget.total == len(granted) and 0 < len(granted) < 2000


def test_a_zero_budget_refuses_the_first_restart():
    assert not RestartBudget(0, 3600.0, clock=lambda: 0.0).spend()
