"""Tensor-parallel replicas, the parts that need no engine: which executor a replica gets, how
its cores are split between its ranks, which TP sizes the target's heads allow, how a worker's
start-up error is found in the log it shares with the replica, and that a start-up error that
repeats ends the group at once. The engine itself: tests/integration/test_tensor_parallel.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from cluster.config import ConfigError
from cluster.config_checks import check_against_target
from cluster.config_load import load_config
from cluster.errors import last_exception_line
from cluster.inference import executor_backend, omp_bind_per_rank

LOCAL = Path(__file__).resolve().parents[2] / "configs" / "local.yaml"


def test_executor_by_design_not_by_vllms_guess():
    assert executor_backend("cpu", 1) is None  # the engine in the actor's own process
    assert executor_backend("cpu", 2) == "mp"  # vLLM's CPU platform has no Ray device
    assert executor_backend("cuda", 8) == "ray"
    assert executor_backend("cuda", 1) is None


@pytest.mark.parametrize(
    "cores, tp, threads, expected",
    [
        ([0, 1], 2, None, "0|1"),
        ([0, 1, 2, 3, 4, 5, 6, 7], 2, None, "0-3|4-7"),
        ([0, 1, 2, 3, 4, 5, 6, 7], 2, 4, "0-1|2-3"),  # the replica's share of the machine, not all of it
        ([3, 1, 7, 5], 2, None, "1,3|5,7"),  # an affinity mask that is not contiguous
        ([0, 1, 2], 3, None, "0|1|2"),  # SmolLM2's 3 KV heads: TP 3
        ([0], 2, None, "0|0"),  # fewer cores than ranks: ranks share, slow but it runs
    ],
)
def test_each_rank_gets_its_own_cores(cores, tp, threads, expected):
    assert omp_bind_per_rank(cores, tp, threads) == expected


def test_tp_size_the_heads_cannot_split_is_refused_naming_both_numbers():
    smol = SimpleNamespace(
        num_hidden_layers=30,
        vocab_size=49152,
        max_position_embeddings=8192,
        num_attention_heads=9,
        num_key_value_heads=3,
    )
    with pytest.raises(
        ConfigError, match=r"`target\.tensor_parallel_size`: 2 ranks cannot split the target's 9 attention heads"
    ):
        check_against_target(load_config(LOCAL, ["target.tensor_parallel_size=2"]), smol)
    check_against_target(load_config(LOCAL, ["target.tensor_parallel_size=3"]), smol)  # 9 and 3 split three ways
    four = SimpleNamespace(**{**vars(smol), "num_attention_heads": 12, "num_key_value_heads": 3})
    with pytest.raises(ConfigError, match=r"4 ranks cannot split the target's 3 key/value heads"):
        check_against_target(load_config(LOCAL, ["target.tensor_parallel_size=4"]), four)
    replicated = SimpleNamespace(**{**vars(smol), "num_attention_heads": 8, "num_key_value_heads": 2})
    check_against_target(load_config(LOCAL, ["target.tensor_parallel_size=4"]), replicated)  # KV heads replicated
    latent = SimpleNamespace(**{**vars(smol), "num_attention_heads": 8, "num_key_value_heads": 3, "kv_lora_rank": 512})
    check_against_target(load_config(LOCAL, ["target.tensor_parallel_size=4"]), latent)  # MLA: no KV heads to split


# A backslash at a line's end joins it with the next (the log's lines are longer than ours);
# \x20 is a line's trailing space.
VLLM_WORKER_LOG = """\
(MainProcess pid=10807) INFO 12-06 03:02:42 [ompmultiprocessing.py:185] 	local_rank=1, core ids=[1]
(VllmWorker-0 pid=10845) ERROR 12-06 03:02:57 [multiproc_executor.py:953] WorkerProc failed to start.
(VllmWorker-0 pid=10845) ERROR 12-06 03:02:57 [multiproc_executor.py:953] Traceback (most recent call last):
(VllmWorker-0 pid=10845) ERROR 12-06 03:02:57 [multiproc_executor.py:953]   File "multiproc_executor.py", \
line 920, in worker_main
(VllmWorker-0 pid=10845) ERROR 12-06 03:02:57 [multiproc_executor.py:953]     worker = WorkerProc(*args, **kwargs)
(VllmWorker-0 pid=10845) ERROR 12-06 03:02:57 [multiproc_executor.py:953]              ^^^^^^^^^^^^^^^^^^^^^^^^^^^
(VllmWorker-0 pid=10845) ERROR 12-06 03:02:57 [multiproc_executor.py:953] KeyError: 'first'
(VllmWorker-0 pid=10845) ERROR 12-06 03:02:57 [multiproc_executor.py:953]\x20
(VllmWorker-0 pid=10845) ERROR 12-06 03:02:57 [multiproc_executor.py:953] During handling of the above exception, \
another exception occurred:
(VllmWorker-0 pid=10845) ERROR 12-06 03:02:57 [multiproc_executor.py:953]\x20
(VllmWorker-0 pid=10845) ERROR 12-06 03:02:57 [multiproc_executor.py:953] Traceback (most recent call last):
(VllmWorker-0 pid=10845) ERROR 12-06 03:02:57 [multiproc_executor.py:953]   File "registry.py", line 3, in resolve
(VllmWorker-0 pid=10845) ERROR 12-06 03:02:57 [multiproc_executor.py:953] ValueError: Model architectures \
['DSparkCaptureLlamaForCausalLM'] are not supported for now.
(MainProcess pid=10807) INFO 12-06 03:02:57 [multiproc_executor.py:479] [shutdown] Executor: \
waiting for worker exit count=2
"""


def test_the_workers_own_exception_is_found_in_the_shared_log():
    assert (
        last_exception_line(VLLM_WORKER_LOG)
        == "ValueError: Model architectures ['DSparkCaptureLlamaForCausalLM'] are not supported for now."
    )
    plain = (
        'noise\nTraceback (most recent call last):\n  File "x.py", line 1\n    f()\n'
        "OSError: [Errno 28] No space left\nlater log line\n"
    )
    assert last_exception_line(plain) == "OSError: [Errno 28] No space left"
    assert last_exception_line("INFO all well\nWARNING a warning\n") is None


class FakeRay:
    """What ReplicaPool.supervise calls on Ray, for replicas that die in their constructor."""

    def __init__(self, errors):
        self.errors, self.killed = errors, []

    def wait(self, refs, timeout):
        return refs, []

    def get(self, ref, timeout=None):
        if isinstance(ref, str):  # a replica's serve loop: it died with its error
            raise self.errors[ref]
        return ref  # the ledger's answer (prompts returned)

    def kill(self, actor, no_restart=True):
        self.killed.append(actor)


class StartFailure(Exception):
    actor_init_failed = True


def supervised_pool(restarts):
    """A pool whose `supervise` runs against fakes: a ledger that takes deaths back (a
    LedgerClient's two calls), no placement, replacements due at once."""
    from cluster.inference import ReplicaPool

    ledger = SimpleNamespace(replica_died=lambda rid, cause="": 0, hung_replicas=lambda timeout: {})
    return ReplicaPool(
        "g0",
        spec=None,
        ledger=ledger,
        services=None,
        role=None,
        run_name="t",
        placement_timeout_s=1,
        restarts=restarts,
        backoff_s=0.0,
    )


def test_a_start_up_error_that_repeats_ends_the_group_at_once():
    from cluster.inference import Replica, ReplicaFailure
    from cluster.restart_budget import RestartBudget

    pool = supervised_pool(RestartBudget(5, 3600.0))
    same = "EngineStartError: vLLM engine did not start: a worker process failed to start: ValueError: bad arch"
    pool.ray = FakeRay({"s0": StartFailure(same), "s1": RuntimeError("node lost"), "s2": StartFailure(same)})
    pool.start = lambda placed, owned=False: None  # replacements are not started here
    pool.replicas["g0-r0"] = Replica("a0", "s0", placed=None, owned=False)
    pool.supervise()  # the first start-up failure: replaced, within the restart budget
    assert pool.restarts.total == 1
    pool.replicas["g0-r1"] = Replica("a1", "s1", placed=None, owned=False)
    pool.supervise()  # a death that is not a start-up failure: replaced
    assert pool.restarts.total == 2
    pool.replicas["g0-r2"] = Replica("a2", "s2", placed=None, owned=False)
    with pytest.raises(
        ReplicaFailure, match=r"failed to start with the same error as an earlier one.*ValueError: bad arch"
    ):
        pool.supervise()
    assert pool.restarts.total == 2  # not another restart


def test_replica_deaths_every_few_minutes_for_days_do_not_end_the_group_a_crash_loop_does():
    """The restart budget is a rate (`inference.max_replica_restarts` per
    `inference.restart_window_s`): a replica dying every 20 minutes for three simulated days is
    replaced every time (216 deaths against a budget of 5); five deaths within a minute, then a
    sixth, end the group with the last cause and the window named."""
    from cluster.inference import Replica, ReplicaFailure
    from cluster.restart_budget import RestartBudget

    now = [0.0]
    pool = supervised_pool(RestartBudget(5, 3600.0, clock=lambda: now[0]))
    errors = {}
    pool.ray = FakeRay(errors)
    started = []
    pool.start = lambda placed, owned=False: started.append(placed)
    for death in range(3 * 24 * 3):  # every 20 minutes for three days
        now[0] = death * 1200.0
        errors[f"s{death}"] = RuntimeError(f"node lost ({death})")
        pool.replicas[f"g0-r{death}"] = Replica(f"a{death}", f"s{death}", placed=f"pg{death}", owned=False)
        pool.supervise()
    assert pool.restarts.total == 216 and len(started) == 216 and pool.restarts.recent() == 3

    for k in range(4):  # a crash loop: two of the window's five are left after the last scattered deaths
        now[0] += 5.0
        errors[f"loop{k}"] = RuntimeError("CUDA error: an illegal memory access")
        pool.replicas[f"g0-l{k}"] = Replica(f"l{k}", f"loop{k}", placed="pgl", owned=False)
        if k < 2:
            pool.supervise()
            continue
        with pytest.raises(
            ReplicaFailure,
            match=r"replicas died 6 times within 3600 s \(inference\.max_replica_restarts=5 "
            r"per inference\.restart_window_s\); last: .*illegal memory access",
        ):
            pool.supervise()
        break
