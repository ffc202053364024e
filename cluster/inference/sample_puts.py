"""`SamplePuts`: the hidden-state connector's puts into the store, each with a deadline fixed when
it is queued (a monotonic time). Whoever picks a put up checks that deadline: a put past it is
never tried, so its object is never created, and no try starts after it. The replica's flush, the
call that waits for the puts, waits `PUT_MARGIN_S` longer than a put may take from its enqueue
(`cluster.inference.replica`): a put lands while its waiter still waits, or not at all, and no
object outlives the attempt it belongs to.

A full store is backpressure: a put is tried again, with a backoff, until its deadline. Two ways
to run the tries, as the connector copies a request's states out of the engine:
- CPU (`queue` with the sample, then `advance` at every engine step): the copy happens inside
  vLLM's `execute_model`, and so does each try, but a full store is never waited out inside one
  step: a step tries what is due for at most `step_budget_s`, and the next step tries again. With
  tensor parallelism `execute_model` is an RPC to rank 0's worker that fails the whole engine
  after `VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS` (300 s in vLLM 0.32): a put waiting out a store full
  for five minutes inside it killed the replica. The request's KV blocks are held until its put
  is settled (`QueuedPut.query`), and vLLM keeps stepping an engine while a finished request
  awaits its connector: those steps try the put again while the replica's flush waits. The
  replica is paused, its engine alive, and a put given up at its deadline is reported not stored.
- GPU (`queue` without the sample, then `submit`): the put runs in a writer thread once the
  device→host copy is done; a put that waited in the writer queue past its deadline is dropped
  there, untried.

A put given up says why in a note the replica reads (`notes_dir`: the connector runs in vLLM's
worker, maybe another process than the replica's): for want of room (`capacity`: the store stayed
full, or unreachable, until the deadline; not the prompt's failure) or refused outright (an error
no wait makes pass: the prompt's, counted against its attempts). `take_put_note` reads it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from cluster.store import TRANSIENT, HiddenStateStore, StoreError, put_backoff_s
from dspark.samples import Sample

logger = logging.getLogger(__name__)
STORED = "stored"


@dataclass(eq=False)
class QueuedPut:
    key: str
    deadline: float  # monotonic: when it was queued plus the puts' timeout
    sample: Sample | None = None  # dropped once settled (it holds a copy of the request's states)
    tries: int = 0
    next_try: float = 0.0
    last_error: StoreError | None = None
    outcome: str | None = None  # STORED, or why it was given up (naming the key and the store's error)
    capacity: bool | None = None  # given up: for want of room or of a store to reach (not the sample's fault)

    def query(self) -> bool:
        """Settled (stored or given up). Stands in for a copy event in the connector's bookkeeping
        of finished requests: a request is reported done, and its KV blocks freed, only then."""
        return self.outcome is not None


class SamplePuts:
    def __init__(
        self,
        store: Callable[[], HiddenStateStore],
        timeout_s: float,
        step_budget_s: float,
        writer_threads: int = 8,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        notes_dir: str | None = None,
    ) -> None:
        """`store`: returns the connected store (connected on first use). `timeout_s`: how long a
        put may take from its enqueue. `step_budget_s`: how long one `advance` may spend trying
        (past it, what is due waits for the next step; a try under way is not cut short).
        `notes_dir`: where a put given up leaves its note for the replica (`write_put_note`)."""
        self.store, self.timeout_s, self.step_budget_s, self.notes_dir = store, timeout_s, step_budget_s, notes_dir
        self.writer_threads, self.clock, self.sleep = writer_threads, clock, sleep
        self.waiting: list[QueuedPut] = []
        self._executor: ThreadPoolExecutor | None = None

    def queue(self, key: str, sample: Sample | None = None) -> QueuedPut:
        """A put of `key`, due within `timeout_s` from now. With its sample: tried by the next
        `advance` (CPU); without: `submit` runs it once the sample is ready (GPU)."""
        put = QueuedPut(key, self.clock() + self.timeout_s, sample)
        if sample is not None:
            self.waiting.append(put)
        return put

    def advance(self) -> None:
        """One engine step's share: the puts past their deadline are given up (an untried one is
        never tried), the due ones tried in turn until `step_budget_s` is spent."""
        start, tried = self.clock(), []
        for put in self.waiting:
            now = self.clock()
            if now >= put.deadline:
                self._give_up(put)
            elif now >= put.next_try and now - start < self.step_budget_s:
                self._try(put)
                tried.append(put)
        # Those tried go behind the others: a store slow to refuse would otherwise spend every
        # step's budget on the first puts, and the rest would reach their deadlines untried.
        behind = {id(p) for p in tried}
        self.waiting = [p for p in self.waiting if p.outcome is None and id(p) not in behind] + [
            p for p in tried if p.outcome is None
        ]

    def submit(self, put: QueuedPut, ready: Callable[[], Sample]) -> Future:
        """In a writer thread: wait for `ready()` (the sample, once its copy is done), then try
        until stored or `put`'s deadline."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=self.writer_threads, thread_name_prefix="dspark-hs-put")
        return self._executor.submit(self._put_until_deadline, put, ready)

    def _put_until_deadline(self, put: QueuedPut, ready: Callable[[], Sample]) -> None:
        if self.clock() >= put.deadline:  # queued behind slower puts for all of its time
            self._give_up(put)
            return
        put.sample = ready()
        while put.outcome is None:
            if self.clock() >= put.deadline:
                self._give_up(put)
                return
            self._try(put)
            if put.outcome is None:
                self.sleep(max(0.0, min(put.next_try, put.deadline) - self.clock()))

    def _try(self, put: QueuedPut) -> None:
        try:
            self.store().put_sample(put.key, put.sample)
        except StoreError as e:
            put.tries, put.last_error = put.tries + 1, e
            if e.code not in TRANSIENT:  # no wait makes it pass
                self._settle(put, f"put of {put.key} failed: {e}", capacity=False)
                return
            put.next_try = self.clock() + put_backoff_s(put.tries)
            return
        self._settle(put, STORED)

    def _give_up(self, put: QueuedPut) -> None:
        why = (
            f"the store refused it {put.tries} times, last with: {put.last_error}"
            if put.tries
            else "never tried: its deadline passed while it was queued"
        )
        # (only refusals worth a retry, `TRANSIENT`, or none, come this far: the store's want of room)
        self._settle(put, f"put of {put.key} given up {self.timeout_s:g}s after it was queued: {why}", capacity=True)

    def _settle(self, put: QueuedPut, outcome: str, capacity: bool | None = None) -> None:
        put.outcome, put.sample, put.capacity = outcome, None, capacity
        if outcome != STORED:
            logger.error("hidden states not stored: %s", outcome)
            if self.notes_dir:
                try:
                    write_put_note(self.notes_dir, put.key, bool(capacity), outcome)
                except OSError as e:  # (the replica then counts it against the prompt, as before notes)
                    logger.error("could not leave the note of %s: %r", put.key, e)


def _note_path(notes_dir: str, key: str) -> str:
    return os.path.join(notes_dir, key.replace("/", "_") + ".json")


def write_put_note(notes_dir: str, key: str, capacity: bool, outcome: str) -> None:
    """Leave why the put of `key` was given up for the replica that waits for it (written whole,
    then renamed: a reader never sees half a note)."""
    path = _note_path(notes_dir, key)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump({"capacity": capacity, "outcome": outcome}, f)
    os.replace(path + ".tmp", path)


def take_put_note(notes_dir: str, key: str) -> tuple[bool, str] | None:
    """Why the put of `key` was given up (for want of room, the connector's outcome), removing
    the note; None without one."""
    path = _note_path(notes_dir, key)
    try:
        with open(path, encoding="utf-8") as f:
            note = json.load(f)
        os.remove(path)
    except (OSError, ValueError):
        return None
    return bool(note["capacity"]), str(note["outcome"])


__all__ = ["STORED", "QueuedPut", "SamplePuts", "take_put_note", "write_put_note"]
