"""`ControlChannel`: the one way other threads ask the training loop to change something.

The training loop owns the trainer world and the step counter; only it may restart the world
or end the run, and only at a point where that is safe (between steps; a resize at a
checkpoint boundary). The autoscaler thread, a signal handler or a test therefore never touch
the trainer: they `send` a request, and the loop `take`s pending requests at the top of each
iteration. Resize requests fold together (later ones override earlier ones per group) into
one new world; a stop is final. Each resize carries the sender's sequence number, and the loop
records the highest one it has acted on (`TrainingStats.resize_seq_handled`), so a sender knows
when its request has been applied or refused. `send` is safe in a signal handler (a
`SimpleQueue` takes no lock the interrupted thread could hold).
"""

from __future__ import annotations

import queue
from dataclasses import dataclass


@dataclass(frozen=True)
class ResizeTrainer:
    """Trainer ranks wanted per group (groups left out keep theirs), applied together at the
    next checkpoint: one new world."""

    ranks: dict[str, int]
    reason: str = ""
    seq: int = 0


@dataclass(frozen=True)
class Stop:
    reason: str


class JobStopped(Exception):
    """A stop arrived outside the training loop's steps (start-up, the first answers' wait, a
    trainer restart, the end): the job ends after the `phase` it was in, with result.json."""

    def __init__(self, message: str, phase: str) -> None:
        super().__init__(message)
        self.phase = phase


class ControlChannel:
    def __init__(self) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        # Set by `send` (a plain assignment: safe in a signal handler, unlike an Event's lock),
        # read by the start-up between its phases, before the loop takes the request.
        self.stop_sent: Stop | None = None

    def send(self, request: ResizeTrainer | Stop) -> None:
        if isinstance(request, Stop) and self.stop_sent is None:
            self.stop_sent = request
        self._q.put(request)

    def raise_if_stopped(self, phase: str) -> None:
        """Between phases, and inside a long wait: a stop sent meanwhile ends the job here."""
        if self.stop_sent is not None:
            raise JobStopped(f"stopped during {phase}: {self.stop_sent.reason}", phase)

    def take(self) -> tuple[ResizeTrainer | None, Stop | None]:
        """Everything sent since the last call, folded: the merged resize (later requests
        override earlier ones per group) and the first stop."""
        resize, stop = None, None
        while True:
            try:
                r = self._q.get_nowait()
            except queue.Empty:
                return resize, stop
            if isinstance(r, Stop):
                stop = stop or r
            else:
                merged = {**(resize.ranks if resize else {}), **r.ranks}
                resize = ResizeTrainer(merged, r.reason, max(r.seq, resize.seq if resize else 0))
