"""The one wait helper (cluster/waiting.py), on a fake clock."""

from __future__ import annotations

import pytest

from cluster.waiting import wait_until


class FakeClock:
    def __init__(self) -> None:
        self.now, self.sleeps = 0.0, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


def test_returns_what_the_condition_returned_once_it_holds():
    clock, answers = FakeClock(), iter([None, 0, "ready"])
    got = wait_until(lambda: next(answers), timeout_s=10, interval_s=0.5, what="x", clock=clock, sleep=clock.sleep)
    assert got == "ready" and clock.sleeps == [0.5, 0.5]


def test_a_condition_that_holds_at_once_needs_no_time():
    assert wait_until(lambda: True, timeout_s=0, interval_s=1, what="x", sleep=lambda s: pytest.fail("slept"))


def test_past_the_deadline_the_error_names_what_was_awaited():
    clock = FakeClock()
    with pytest.raises(TimeoutError, match=r"the master to answer: not within 2s"):
        wait_until(lambda: False, timeout_s=2, interval_s=0.5, what="the master to answer", clock=clock, sleep=clock.sleep)
    assert clock.now == pytest.approx(2.5)  # polled at 0, 0.5, ..., 2.5: the last poll is past the deadline


def test_a_custom_error_and_a_backoff():
    clock = FakeClock()
    with pytest.raises(KeyError):
        wait_until(lambda: None, timeout_s=0.1, interval_s=lambda n: 0.02 * n, what="x", on_timeout=lambda: KeyError("k"),
                   clock=clock, sleep=clock.sleep)
    assert clock.sleeps[:3] == pytest.approx([0.02, 0.04, 0.06])


def test_the_condition_may_end_the_wait_by_raising():
    def exited():
        raise RuntimeError("exited with 1 at start")

    with pytest.raises(RuntimeError, match="exited"):
        wait_until(exited, timeout_s=10, interval_s=0.1, what="x")
