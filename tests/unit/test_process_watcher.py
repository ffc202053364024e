"""The store's process watcher (`SupervisedProcess`): restarts bounded by a rate with backoff,
its giving up and its own death reported (`info()["failure"]`), and the job's services check
stopping on it (`StoreServices.check` → ServiceFailure)."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from cluster.store import SupervisedProcess


class Flaky(SupervisedProcess):
    """A process that exits at once; its start is a real child process (`python -c exit`)."""

    name = "flaky"

    def __init__(self, start_error: Exception | None = None) -> None:
        super().__init__("127.0.0.1", 1, None, watch_interval_s=0.01)
        self.start_error, self.starts = start_error, 0

    def start(self, timeout: float = 30.0) -> None:
        self.starts += 1
        if self.start_error is not None:
            raise self.start_error
        self._proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
        self._proc.wait()
        self.generation += 1


def test_a_crash_loop_is_restarted_a_bounded_number_of_times_then_reported():
    proc = Flaky()
    proc.restart_budget.clock = iter([float(i) for i in range(1000)]).__next__  # a restart a second: within the window
    proc._stopping.wait = lambda timeout=None: False  # no backoff or interval sleeps in the test
    proc.start()
    rounds = 0
    while proc.watch_once():
        rounds += 1
        assert rounds < 50, "the watcher never gave up"
    assert proc.restarts == 5 and proc.starts == 6  # the first start and five restarts
    failure = proc.info()["failure"]
    assert "flaky on 127.0.0.1:1 exited 6 times within 600 s (last exit code 3" in failure
    assert "not restarted again" in failure


def test_a_start_that_cannot_open_its_log_spends_the_budget_and_names_the_error():
    proc = Flaky(start_error=OSError(28, "No space left on device"))
    proc._stopping.wait = lambda timeout=None: False
    while proc.watch_once():
        pass
    assert proc.starts == 5
    assert "last start error: OSError: [Errno 28] No space left on device" in proc.info()["failure"]


def test_the_watchers_own_death_is_reported():
    proc = Flaky()
    proc.start()
    proc.watch_once = lambda: (_ for _ in ()).throw(ValueError("a bug in the watcher"))
    proc._watcher = threading.Thread(target=proc._watch, daemon=True)
    proc._watcher.start()
    proc._watcher.join(timeout=10)
    assert not proc._watcher.is_alive()
    assert proc.info()["failure"] == "flaky's watcher died: ValueError: a bug in the watcher"


def test_a_service_nobody_watches_stops_the_job_naming_why():
    from cluster.store.services import ServiceFailure, unwatched

    unwatched({"address": "127.0.0.1:5", "failure": None}, "the Mooncake master")
    with pytest.raises(ServiceFailure, match=r"the Mooncake master at 127.0.0.1:5: mooncake_master .* not restarted"):
        unwatched(
            {
                "address": "127.0.0.1:5",
                "failure": "mooncake_master on 127.0.0.1:5 exited 6 times within 600 s "
                "(last exit code 1): not restarted again",
            },
            "the Mooncake master",
        )
