"""The connector's puts against a full store (cluster/inference/sample_puts.py,
cluster/inference/hidden_states_connector.py), on a fake clock: each put's deadline runs from its
enqueue, none is tried past it (so no object outlives the flush that waits for it), and on CPU a
store that stays full is retried at the engine's next steps, each of them well inside vLLM's
`execute_model` RPC timeout, instead of being waited out inside one step."""

from __future__ import annotations

import math

import pytest
import torch

from cluster.inference.sample_puts import STORED, SamplePuts, take_put_note, write_put_note
from cluster.store import StoreError, StoreFull
from dspark.samples import Sample

STEP_S = 0.01  # the replica's flush steps the engine this often


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


class StoreFullUntil:
    """No room before `free_at` on the clock: a put is refused with −200, as Mooncake refuses
    one, after `try_s` (a slow daemon). Keeps what it stores, and when each key was tried."""

    def __init__(self, clock: FakeClock, free_at: float = math.inf, try_s: float = 0.0) -> None:
        self.clock, self.free_at, self.try_s = clock, free_at, try_s
        self.objects: dict[str, Sample] = {}
        self.tried_at: dict[str, list[float]] = {}

    def put_sample(self, key: str, sample: Sample) -> None:
        self.tried_at.setdefault(key, []).append(self.clock.now)
        self.clock.now += self.try_s
        if self.clock.now < self.free_at:
            raise StoreFull("upsert", -200, key)
        self.objects[key] = sample


def sample(tokens: int = 6) -> Sample:
    return Sample(
        torch.arange(tokens),
        torch.ones(tokens, dtype=torch.bool),
        torch.zeros(tokens, 2, 8, dtype=torch.bfloat16),
        [1, 2],
    )


def puts_on(store: StoreFullUntil, clock: FakeClock, timeout_s: float, step_budget_s: float = 30.0, threads=1):
    return SamplePuts(lambda: store, timeout_s, step_budget_s, threads, clock=clock, sleep=clock.sleep)


def rank_zero_connector(puts: SamplePuts, kv_cache: torch.Tensor):
    """The connector as rank 0's worker holds it on CPU, with `puts` (its __init__ needs a whole
    vLLM config): the state vLLM's worker gives it, `kv_cache` [blocks, layers, block size, hidden]."""
    from cluster.inference.hidden_states_connector import MooncakeHiddenStatesConnector

    c = MooncakeHiddenStatesConnector.__new__(MooncakeHiddenStatesConnector)
    c._is_tp_rank_zero, c.backend, c.layer_ids, c._block_size = True, "mooncake", [1, 2], kv_cache.shape[2]
    c._kv_cache, c._puts = kv_cache, puts
    c._req_copy_events, c._accumulated_finished_req_ids, c._connector_metadata = {}, set(), None
    return c


def finish_request(c, req_id: str, key: str, block_ids: list[int], tokens: int):
    """The engine step after `req_id` finished: its save planned, `get_finished` called."""
    from cluster.inference.hidden_states_connector import PlannedSave, StoreSaveMetadata

    mask = torch.ones(tokens, dtype=torch.bool)
    c.bind_connector_metadata(StoreSaveMetadata([PlannedSave(req_id, key, torch.arange(tokens), mask, block_ids)]))
    done, _ = c.get_finished({req_id})
    c.clear_connector_metadata()
    return done


def step_until_settled(puts: SamplePuts, queued, clock: FakeClock, max_steps: int = 200_000) -> list[float]:
    """The flush's loop: an engine step (`advance`) every STEP_S until every put is settled.
    Returns how long each step spent on the puts."""
    spent = []
    for _ in range(max_steps):
        start = clock()
        puts.advance()
        spent.append(clock() - start)
        if all(p.query() for p in queued):
            return spent
        clock.now += STEP_S
    raise AssertionError(f"puts not settled after {max_steps} steps: {[p.key for p in queued if not p.query()]}")


def test_a_put_lands_once_the_store_frees_room_within_its_deadline():
    clock = FakeClock()
    store = StoreFullUntil(clock, free_at=100.0)
    puts = puts_on(store, clock, timeout_s=590.0)
    put = puts.queue("run/g0/p0@0.1", sample())
    step_until_settled(puts, [put], clock)
    assert put.outcome == STORED and list(store.objects) == ["run/g0/p0@0.1"]
    assert 100.0 <= clock() < 101.0, "retried at the engine's steps, with a backoff of at most 0.2 s"


def test_on_a_store_full_past_the_deadline_every_step_ends_inside_the_rpc_timeout_and_nothing_is_stored():
    """A TP-2 replica on CPU: the puts run inside rank 0's `execute_model`, an RPC vLLM gives up
    after VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (the engine dies with a TimeoutError). 20 puts that
    each take 20 s to be refused would take 400 s in one step; each step stops at its budget."""
    import vllm.envs as envs

    from cluster.inference.hidden_states_connector import step_put_budget_s

    rpc_timeout_s = envs.VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS
    clock = FakeClock()
    store = StoreFullUntil(clock, try_s=20.0)
    puts = puts_on(store, clock, timeout_s=590.0, step_budget_s=step_put_budget_s({}))
    queued = [puts.queue(f"run/g0/p{i}@0.1", sample()) for i in range(20)]
    spent = step_until_settled(puts, queued, clock)
    assert max(spent) < rpc_timeout_s / 2, (max(spent), rpc_timeout_s)
    assert len(spent) > 1, "the replica stayed paused over several steps"
    assert store.objects == {}
    for p in queued:
        assert p.outcome.startswith(f"put of {p.key} given up 590s after it was queued"), p.outcome
        assert "-200 NO_AVAILABLE_HANDLE" in p.outcome, "the give-up names the store's error"
        assert max(store.tried_at[p.key]) < p.deadline, "a try started past the put's deadline"


def test_a_put_past_its_deadline_is_given_up_untried_at_the_next_step():
    clock = FakeClock()
    store = StoreFullUntil(clock, free_at=0.0)
    puts = puts_on(store, clock, timeout_s=5.0)
    late = puts.queue("run/g0/p0@0.1", sample())
    clock.now += 6.0  # a forward pass longer than the put's whole timeout
    puts.advance()
    assert "never tried" in late.outcome and store.objects == {} and "run/g0/p0@0.1" not in store.tried_at


def test_a_put_queued_behind_a_slow_one_is_never_tried_after_its_deadline():
    """The GPU path: one writer thread. The first put holds it until both deadlines (10 s from
    their enqueue) have passed; the second, picked up then, is not tried, although the store
    has room again by then: tried, it would land after the flush gave up on it (a leaked object)."""
    clock = FakeClock()
    store = StoreFullUntil(clock, free_at=10.5)
    puts = puts_on(store, clock, timeout_s=10.0, threads=1)
    first, second = puts.queue("run/g0/p0@0.1"), puts.queue("run/g0/p1@0.1")
    futures = [puts.submit(p, sample) for p in (first, second)]
    for f in futures:
        f.result(timeout=60)  # real seconds: the fake clock makes the retries instant
    assert "the store refused it" in first.outcome and "never tried" in second.outcome
    assert store.objects == {} and "run/g0/p1@0.1" not in store.tried_at
    assert max(store.tried_at["run/g0/p0@0.1"]) < first.deadline


def test_a_tp2_rank_zero_on_a_full_store_holds_the_request_and_reports_it_once_given_up():
    """The connector at rank 0 of a TP-2 replica on CPU, driven as vLLM drives it: every engine
    step calls `get_finished`. The store is full for longer than the put's deadline: no step
    raises or outlasts its budget, the request is held (its KV blocks with it, the engine kept
    stepping: the replica paused) until the put is given up, then reported done, nothing stored."""
    clock = FakeClock()
    store = StoreFullUntil(clock, try_s=1.0)
    budget_s, timeout_s = 5.0, 60.0
    puts = puts_on(store, clock, timeout_s=timeout_s, step_budget_s=budget_s)
    c = rank_zero_connector(puts, torch.randn(4, 2, 4, 8).to(torch.bfloat16))
    done = finish_request(c, "req-0", "run/g0/p0@0.1", [2, 3], tokens=6)
    steps = 1
    while done is None:
        assert steps < 100_000, "the request was never reported done"
        clock.now += STEP_S
        start = clock()
        done, _ = c.get_finished(set())
        assert clock() - start <= budget_s + store.try_s
        steps += 1
    assert done == {"req-0"} and clock() >= timeout_s and steps > 1
    assert store.objects == {} and len(store.tried_at["run/g0/p0@0.1"]) > 1


@pytest.mark.parametrize("free_at", [0.0, 30.0], ids=["room at once", "room after 30s"])
def test_a_tp2_rank_zero_stores_the_requests_rows_once_there_is_room(free_at):
    clock = FakeClock()
    store = StoreFullUntil(clock, free_at=free_at)
    c = rank_zero_connector(puts_on(store, clock, timeout_s=60.0), torch.randn(4, 2, 4, 8).to(torch.bfloat16))
    done = finish_request(c, "req-0", "k", [2, 3], tokens=6)
    while done is None and clock() < 60.0:
        clock.now += STEP_S
        done, _ = c.get_finished(set())
    assert done == {"req-0"}
    # rows 0-5 of blocks 2 and 3: block 2's four slots, then block 3's first two
    expected = torch.cat([c._kv_cache[2].transpose(0, 1), c._kv_cache[3, :, :2].transpose(0, 1)])
    assert torch.equal(store.objects["k"].hidden_states, expected)


# ---- why a put was given up, for the replica: the store's want of room is not the prompt's failure --
class RefusedOutright(StoreFullUntil):
    """Refuses every put with an error no wait makes pass (a value larger than the buffer)."""

    def put_sample(self, key: str, sample: Sample) -> None:
        self.tried_at.setdefault(key, []).append(self.clock.now)
        raise StoreError("upsert", -600, key)


@pytest.mark.parametrize("store_kind, capacity", [(StoreFullUntil, True), (RefusedOutright, False)])
def test_a_put_given_up_leaves_a_note_saying_whether_the_store_wanted_room(tmp_path, store_kind, capacity):
    clock = FakeClock()
    store = store_kind(clock)
    puts = SamplePuts(lambda: store, 60.0, 30.0, 1, clock=clock, sleep=clock.sleep, notes_dir=str(tmp_path))
    put = puts.queue("run/g0/p0@0.1", sample())
    step_until_settled(puts, [put], clock)
    assert put.outcome != STORED and put.capacity is capacity
    assert take_put_note(str(tmp_path), "run/g0/p0@0.1") == (capacity, put.outcome)
    assert take_put_note(str(tmp_path), "run/g0/p0@0.1") is None and list(tmp_path.iterdir()) == []


def test_a_stored_put_leaves_no_note(tmp_path):
    clock = FakeClock()
    store = StoreFullUntil(clock, free_at=0.0)
    puts = SamplePuts(lambda: store, 60.0, 30.0, 1, clock=clock, sleep=clock.sleep, notes_dir=str(tmp_path))
    step_until_settled(puts, [puts.queue("k", sample())], clock)
    assert list(tmp_path.iterdir()) == []


def test_the_replicas_flush_blames_a_prompt_only_for_a_put_refused_outright(tmp_path):
    """The flush's verdict per missing sample: given up for want of room (the note says so): not
    the prompt's failure; refused outright, or no note at all (as before notes): its failure."""
    from types import SimpleNamespace

    from cluster.inference.replica import InferenceActor, Produced
    from cluster.store import SampleRef

    write_put_note(str(tmp_path), "run/g0/full@0.1", True, "put of run/g0/full@0.1 given up 590s after ...")
    write_put_note(str(tmp_path), "run/g0/big@0.1", False, "put of run/g0/big@0.1 failed: -600 INVALID_PARAMS")
    actor = InferenceActor.__new__(InferenceActor)
    actor.settings = SimpleNamespace(backend="mooncake", flush_timeout_s=0.0, put_notes_dir=str(tmp_path))
    actor.llm = SimpleNamespace(llm_engine=SimpleNamespace(step=lambda: None))
    actor._store = SimpleNamespace(exists=lambda key: key == "run/g0/ok@0.1")
    produced = [
        Produced(p, SampleRef(f"run/g0/{p}@0.1", 4, (1,), 8, "bfloat16")) for p in ("full", "big", "lost", "ok")
    ]
    actor._flush(produced)
    verdicts = {r.prompt_id: (r.ref is None, r.blamed) for r in produced}
    assert verdicts == {"full": (True, False), "big": (True, True), "lost": (True, True), "ok": (False, True)}
    assert "given up 590s" in produced[0].error and "INVALID_PARAMS" in produced[1].error
    assert "still missing" in produced[2].error and produced[3].error is None
    assert list(tmp_path.iterdir()) == []  # (each note read once)


def test_a_replay_put_given_up_for_room_is_not_the_prompts_failure():
    from types import SimpleNamespace

    from cluster.data import PromptTask
    from cluster.inference.replay import ReplayActor
    from cluster.store import StoreUnavailable

    def replay_refusing(error: Exception) -> ReplayActor:
        actor = ReplayActor.__new__(ReplayActor)
        actor.s = SimpleNamespace(crash_on=[], hang_on=[], samples_per_s=0.0)
        actor.samples, actor.totals = [sample()], {"failed": 0}

        def refuse(key, s):
            raise error

        actor._put = refuse
        return actor

    task = PromptTask("p0", "p0@0", "run/g0/p0@0.1", [])
    for error, blamed in (
        (StoreFull("upsert", -200, "k"), False),
        (StoreError("upsert", -800, "k"), False),
        (StoreUnavailable("the master does not answer"), False),
        (StoreError("upsert", -600, "k"), True),
        (ValueError("no such sample"), True),
    ):
        (report,) = replay_refusing(error).produce([task])
        assert report.ref is None and report.blamed is blamed, error
