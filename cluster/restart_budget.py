"""`RestartBudget`: how many restarts a supervised part may take, as a rate over a sliding window.

A run of days meets scattered deaths (a replica every few hours, a rank now and then) that it
must survive, and crash loops (a bad node, a poison input) that it must stop in minutes. A
total over the job cannot tell them apart: six unrelated deaths over three days would end a run
that five deaths in a minute should. So the budget counts the restarts of the last `window_s`
seconds only: `limit` within any window, then the part gives up with the last cause. Pure, the
clock injected (tests live days in a loop)."""

from __future__ import annotations

import time
from collections import deque


class RestartBudget:
    def __init__(self, limit: int, window_s: float, clock=time.monotonic) -> None:
        self.limit, self.window_s, self.clock = limit, window_s, clock
        self.times: deque[float] = deque()  # the restarts within the window, oldest first
        self.total = 0  # over the whole run, for reports

    def _age_out(self) -> None:
        now = self.clock()
        while self.times and now - self.times[0] >= self.window_s:
            self.times.popleft()

    def recent(self) -> int:
        """Restarts within the window now."""
        self._age_out()
        return len(self.times)

    def spend(self) -> bool:
        """Take one restart: True if the window had room for it (recorded), False if `limit` were
        already taken within the window (nothing recorded: the caller gives up)."""
        if self.recent() >= self.limit:
            return False
        self.times.append(self.clock())
        self.total += 1
        return True

    def __str__(self) -> str:
        return f"{self.limit} within {self.window_s:g} s"
