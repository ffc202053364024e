"""`wait_until`: the one way this package waits for something, always with a deadline.

A condition is polled every interval until it returns something truthy (which is returned);
past the deadline the wait ends with an exception that names what was awaited. The condition
may raise itself to end the wait early (a process that exited, an error that will not pass).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    condition: Callable[[], T],
    *,
    timeout_s: float,
    interval_s: float | Callable[[int], float],
    what: str,
    on_timeout: Callable[[], BaseException] | None = None,
    clock=time.monotonic,
    sleep=time.sleep,
) -> T:
    """Poll `condition` until it returns a truthy value, and return that value.

    `interval_s`: seconds between polls, or a function of the number of polls so far (a
    backoff). The deadline is checked after each poll, so a condition that holds at once
    returns even with `timeout_s=0`. Past it: `on_timeout()` is raised, or a TimeoutError
    naming `what`.
    """
    deadline = clock() + timeout_s
    polls = 0
    while True:
        got = condition()
        if got:
            return got
        if clock() > deadline:
            raise on_timeout() if on_timeout is not None else TimeoutError(f"{what}: not within {timeout_s:g}s")
        polls += 1
        sleep(interval_s(polls) if callable(interval_s) else interval_s)
