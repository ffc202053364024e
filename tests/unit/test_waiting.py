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
        wait_until(
            lambda: False, timeout_s=2, interval_s=0.5, what="the master to answer", clock=clock, sleep=clock.sleep
        )
    assert clock.now == pytest.approx(2.5)  # polled at 0, 0.5, ..., 2.5: the last poll is past the deadline


def test_a_custom_error_and_a_backoff():
    clock = FakeClock()
    with pytest.raises(KeyError):
        wait_until(
            lambda: None,
            timeout_s=0.1,
            interval_s=lambda n: 0.02 * n,
            what="x",
            on_timeout=lambda: KeyError("k"),
            clock=clock,
            sleep=clock.sleep,
        )
    assert clock.sleeps[:3] == pytest.approx([0.02, 0.04, 0.06])


def test_the_condition_may_end_the_wait_by_raising():
    def exited():
        raise RuntimeError("exited with 1 at start")

    with pytest.raises(RuntimeError, match="exited"):
        wait_until(exited, timeout_s=10, interval_s=0.1, what="x")


def test_the_trainers_wait_for_data_has_a_deadline_counted_from_its_last_step_or_sample():
    """`trainer.data_timeout_s`: a wait that began long ago ends the job, naming where the samples
    are; a sample stored recently (or a first wait) restarts the count."""
    import time
    from types import SimpleNamespace

    from cluster.config import JobConfig
    from cluster.data import GroupCounts, LedgerCounts
    from cluster.job.loop import TrainingLoop

    cfg = JobConfig()
    cfg.trainer.data_timeout_s = 100.0
    counts = LedgerCounts(
        pending=3, generating=2, total=5, epochs=1, produced_samples=7, groups={"g0": GroupCounts(generating=2)}
    )
    now = time.monotonic()
    committer = SimpleNamespace(uncommitted=[])
    loop = TrainingLoop(
        cfg.trainer,
        True,
        SimpleNamespace(counts=lambda: counts),
        gang=None,
        world=None,
        committer=committer,
        record=None,
        supervisor=None,
        reporter=None,
        planner=None,
        stats=None,
        control=None,
        events=None,
    )
    loop.produced_seen, loop.produced_at = 7, now - 500.0
    loop.wait_for_data()  # the first wait: the count starts now
    assert loop.waiting_since >= now
    loop.waiting_since = now - 200.0
    loop.produced_at = now - 50.0  # a sample stored 50 s ago: still within the deadline
    loop.wait_for_data()
    loop.produced_at = now - 150.0
    with pytest.raises(RuntimeError) as e:
        loop.wait_for_data()
    assert "trainer.data_timeout_s=100" in str(e.value) and "3 pending" in str(e.value)
    assert "g0: 2 generating, 0 stored" in str(e.value)


def test_a_free_port_is_not_one_chosen_but_not_bound_yet(monkeypatch):
    """The kernel may hand the same free port to successive binds of port 0: `free_port` skips
    the ports in `avoid` (a master's metrics port equal to its RPC port made it exit at every
    start), and gives up with a message after its tries."""
    import socket

    from cluster.store import free_port

    handed = iter([5001, 5001, 5002])

    class FakeSocket:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, address):
            self.port = next(handed)

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(socket, "socket", FakeSocket)
    assert free_port("127.0.0.1", avoid=(5001,)) == 5002
    handed = iter([7, 7, 7])
    with pytest.raises(RuntimeError, match=r"no free port on '127.0.0.1' outside \[7\] in 3 tries"):
        free_port("127.0.0.1", avoid=(7,), tries=3)
