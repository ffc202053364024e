"""`EventLog`: what happened to a run that its user should read: result.json's `events`, in
order, each also a line of the job's log. Every phase that decides something the user did not
ask for (a restart, an early checkpoint, dropped epochs) says it here."""

from __future__ import annotations

import logging

log = logging.getLogger("dspark.job")


class EventLog:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, message: str, level: int = logging.INFO) -> None:
        self.lines.append(message)
        log.log(level, "%s", message)
