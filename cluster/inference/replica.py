"""`InferenceActor`: one vLLM replica that regenerates responses and streams hidden states.

Per prompt it (a) regenerates the assistant answer with the frozen target (on-policy: the
drafter learns the distribution it will be verified against), and (b) exports the aux-layer
and final pre-norm hidden states of the whole conversation: the target, loaded as its
capturing class (`cluster.inference.capture_model`), caches them while it decodes (a plain engine, no
speculative step), and our `MooncakeHiddenStatesConnector` puts them into the
Mooncake store. What comes back through Ray is one `SampleRef` (key and shapes) per prompt.

How the engine is laid out (`executor_backend`):
- CPU, TP 1: the engine runs inside this actor's process (tests, the local job).
- CPU, TP > 1: vLLM's multiprocessing executor, one worker process per rank, each bound to its
  own share of the replica's cores (`omp_bind_per_rank`). vLLM's Ray executor is no route on CPU:
  its CPU platform has no Ray device ("current platform cpu does not support ray"), and inside a
  placement group vLLM would pick it by itself. The workers are new processes: the capture class
  reaches them by name (`model_class_overrides`), not by a registration in this process.
- GPU, TP > 1: vLLM's Ray executor, which places one worker on each GPU bundle of the replica's
  placement group in the order it is told (`VLLM_RAY_BUNDLE_INDICES`), on one node or two: the
  placement group already owns those GPUs, and no process of ours has to run on the second node.

A start-up that fails in a worker process reaches this process only as vLLM's "WorkerProc
initialization failed ... See stack trace for root cause"; the worker's own exception is in the
stderr the workers share with this actor, and `InferenceActor` names it (`EngineStartError`).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from cluster.config import SamplingConfig, TargetConfig
from cluster.data import ProducedSample, PromptTask
from cluster.errors import last_exception_line
from cluster.inference.capture_model import capture_engine_kwargs
from cluster.inference.producer import Producer
from cluster.inference.sample_puts import take_put_note
from cluster.store import HiddenStateStore, SampleRef, StoreConfig
from cluster.waiting import wait_until
from dspark.chat import TOKENIZER_DEFAULT, ChatFormat

CONNECTOR = "MooncakeHiddenStatesConnector"
SAMPLE_KEY_ENV = "DSPARK_SAMPLE_KEY"
CONNECTOR_MODULE = "cluster.inference.hidden_states_connector"
# A put retries against a full store until this long before its flush gives up: a put that
# outlived the flush would store a sample the replica had already reported failed (a leaked
# object, and an attempt lost); so the put ends first, and a failed put stores nothing. The put's
# deadline runs from when the connector queues it: during `generate`, or in the flush's first engine
# step (no forward in it), so well within this margin of the flush's start.
PUT_MARGIN_S = 10.0


@dataclass
class InferenceSettings:
    """A replica's settings: the config's own `target` and `sampling` sections (not copies of
    their fields, whose defaults drifted apart), with `target.path` the resolved checkpoint
    directory, and what the job derives for this replica."""

    target: TargetConfig  # path: the checkpoint directory the engine loads (resolved by the job)
    layer_ids: list[int]  # aux layers then the final pre-norm layer, speculators indexing
    key_prefix: str  # run/group
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    backend: str = "mooncake"  # mooncake | file
    file_dir: str = "/tmp/dspark-hidden-states"
    device: str = "cpu"
    extract: bool = True  # False: a plain engine (reference generations in tests)
    chat: ChatFormat = TOKENIZER_DEFAULT  # how prompts are rendered (target.chat_template*)
    # How long a batch's hidden states may take to reach the store, a full store's backpressure
    # included; the connector's puts give up `PUT_MARGIN_S` sooner (`engine_kwargs`). The replica
    # is paused that long, its engine alive: with TP > 1 on CPU each engine step, an RPC that vLLM
    # gives up after VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, tries the puts for a share of that only
    # (`cluster.inference.sample_puts`), so this may be longer.
    flush_timeout_s: float = 600.0
    cpu_threads: int | None = None  # CPU: the replica's cores, shared by its TP ranks (None: this process's)
    span: EngineSpan | None = None  # an engine over several nodes: this process's part of it
    # where the connector's puts given up leave why (`sample_puts`; the replica makes one if unset):
    # a put given up for want of store room is no failure of its prompt
    put_notes_dir: str | None = None


@dataclass(frozen=True)
class EngineSpan:
    """A CPU replica whose tensor-parallel ranks span `nnodes` nodes (`target.nodes_per_replica`),
    run by vLLM's multiprocessing executor across nodes: the leader (node rank 0) is the replica's
    engine; every other node runs a `HeadlessEngineWorker` for its ranks (what `vllm serve
    --headless` runs); they meet at the leader's `master_addr:master_port`."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int


@dataclass
class Produced:
    """One prompt's outcome as the engine gives it (`process`): a stored sample, or an error
    that sends it back to pending; with the answer's tokens (the stats, and tests compare them).
    What the ledger hears of it is its `ProducedSample` (`produce`)."""

    prompt_id: str
    ref: SampleRef | None = None
    path: str | None = None  # the file backend's file
    response_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    error: str | None = None
    blamed: bool = True  # the error is the prompt's failure (not a put given up for want of store room)


def uses_mla(target_path: str) -> bool:
    """Whether the target's attention is multi-head latent attention (DeepSeek-V3, Kimi K2/K3),
    read from its config.json (no remote code); a multimodal config nests it under text_config."""
    path = Path(target_path) / "config.json"
    if not path.exists():  # a hub name: vLLM resolves it, and its own selection stands
        return False
    cfg = json.loads(path.read_text())
    return bool(cfg.get("kv_lora_rank") or (cfg.get("text_config") or {}).get("kv_lora_rank"))


class EngineStartError(RuntimeError):
    """The engine did not start; the message is the cause (a worker's own exception where one
    failed), the same text for the same fault, so that the pool can tell a fault that repeats."""


def executor_backend(device: str, tensor_parallel_size: int) -> str | None:
    """vLLM's distributed executor for a replica (module docstring): None for an engine in this
    process, `mp` for CPU tensor parallelism, `ray` for GPU tensor parallelism."""
    if tensor_parallel_size == 1:
        return None
    return "mp" if device == "cpu" else "ray"


def omp_bind_per_rank(cores: list[int], tensor_parallel_size: int, threads: int | None = None) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for a CPU replica of `tensor_parallel_size` ranks: the first
    `threads` of `cores` split into one contiguous set per rank ("0|1", "0-3|4-7"). vLLM refuses to
    bind two CPU workers on one NUMA node unless each rank is given its set. A replica with fewer
    cores than ranks binds ranks to shared cores (slow, but it runs)."""
    cores = sorted(cores)[:threads] if threads else sorted(cores)
    if not cores:
        raise ValueError("no cores to bind the replica's ranks to")
    per_rank = max(1, len(cores) // tensor_parallel_size)
    sets = []
    for r in range(tensor_parallel_size):
        start = (r * per_rank) % len(cores)
        mine = cores[start : start + per_rank]
        sets.append(
            str(mine[0])
            if len(mine) == 1
            else f"{mine[0]}-{mine[-1]}"
            if mine[-1] - mine[0] == len(mine) - 1
            else ",".join(map(str, mine))
        )
    return "|".join(sets)


def engine_kwargs(s: InferenceSettings) -> dict:
    t = s.target
    kwargs = dict(
        model=t.path,
        dtype=t.dtype,
        max_model_len=t.max_model_len,
        max_num_seqs=t.max_num_seqs,
        enforce_eager=t.enforce_eager,
        tensor_parallel_size=t.tensor_parallel_size,
        kv_cache_dtype=t.kv_cache_dtype,
        seed=0,
        trust_remote_code=t.trust_remote_code,
    )
    if s.span is not None:
        kwargs.update(
            nnodes=s.span.nnodes,
            node_rank=s.span.node_rank,
            master_addr=s.span.master_addr,
            master_port=s.span.master_port,
        )
    if t.kv_cache_blocks is not None:
        kwargs.update(num_gpu_blocks_override=t.kv_cache_blocks)
    if backend := executor_backend(s.device, t.tensor_parallel_size):
        kwargs.update(distributed_executor_backend=backend)
    if s.device == "cpu" and t.dtype != "bfloat16" and uses_mla(t.path):
        # On a CPU with AMX, vLLM serves multi-head latent attention with its AMX backend, which
        # takes bf16 weights only ("expect weight to be bfloat16, float16, int8, ..." at load);
        # its reference CPU backend runs every dtype (and is what non-AMX CPUs get anyway).
        kwargs.update(attention_backend="CPU_MLA")
    if s.device == "cuda":
        kwargs.update(gpu_memory_utilization=t.gpu_memory_utilization)
    if s.extract:
        # the target's class with a hidden-state cache (cluster.inference.capture_model): a plain engine
        in_process = executor_backend(s.device, t.tensor_parallel_size) is None and s.device == "cpu"
        kwargs.update(capture_engine_kwargs(t.path, t.trust_remote_code, s.layer_ids, in_process=in_process))
        kwargs["kv_transfer_config"] = {
            "kv_connector": CONNECTOR,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {
                # vLLM carries this as JSON to the connector (possibly in another process) and logs
                # it: the samples' key goes by environment instead (SAMPLE_KEY_ENV)
                "backend": s.backend,
                "key_prefix": s.key_prefix,
                "store": asdict(replace(s.store, sample_key="")),
                "put_retry_s": max(s.flush_timeout_s - PUT_MARGIN_S, 1.0),
                "put_notes_dir": s.put_notes_dir,
                "shared_storage_path": s.file_dir,
            },
        }
    return kwargs


def set_cpu_engine_env(s: InferenceSettings) -> None:
    """The environment vLLM's CPU engine reads in this process and its workers: the KV cache's
    GiB per rank, and with TP a core set per rank of this node (its share of the ranks)."""
    tp = s.target.tensor_parallel_size
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(s.target.cpu_kvcache_space_gb))
    local_ranks = tp // (s.span.nnodes if s.span else 1)
    if tp > 1:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = omp_bind_per_rank(
            list(os.sched_getaffinity(0)), local_ranks, s.cpu_threads
        )


def output_files() -> list[Path]:
    """The files this process's stdout and stderr go to (a Ray worker's `.out` and `.err` logs),
    those that are regular files: vLLM's worker processes inherit them and log their tracebacks
    there (vLLM logs to stdout by default)."""
    found = []
    for fd in (1, 2):
        try:
            path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
        if path.is_file() and path not in found:
            found.append(path)
    return found


def start_engine(kwargs: dict):
    """`vllm.LLM(**kwargs)`; a failure is an `EngineStartError` naming its cause: vLLM's own
    message, or, where it only says a worker process failed, the worker's exception as logged
    to the output it shares with this process since the start was attempted."""
    from vllm import LLM

    logs = {path: path.stat().st_size for path in output_files()}
    try:
        return LLM(**kwargs)
    except Exception as e:  # noqa: BLE001 - named and raised again as EngineStartError
        # the whole message on one line (pydantic's ValidationError puts the cause on its second
        # line and a link on its last)
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip() and "errors.pydantic.dev" not in ln]
        message = " ".join(lines)[:600] or type(e).__name__
        worker = None
        if "WorkerProc" in message:
            sys.stdout.flush()
            sys.stderr.flush()
            for path, offset in logs.items():
                with open(path, "rb") as f:
                    f.seek(offset)
                    worker = last_exception_line(f.read().decode("utf-8", "replace")) or worker
        if worker and len(worker) > 600:  # vLLM's "not supported" lists every architecture it has
            worker = worker[:600] + " ..."
        cause = f"a worker process failed to start: {worker}" if worker else f"{type(e).__name__}: {message}"
        raise EngineStartError(f"vLLM engine did not start: {cause}") from e


class InferenceActor(Producer):
    """Wrapped with `ray.remote` by the job; usable directly in-process too."""

    def __init__(self, settings: InferenceSettings, replica_id: str = "r0", group: str = "g0") -> None:
        super().__init__(replica_id, group)
        self.settings = s = settings
        # The connector may run in an engine process outside Ray: name this node's daemon for it.
        s.store = replace(s.store, node_client=s.store.resolve_node_client())
        # ... and hand it the samples' key in the environment, which vLLM copies to its Ray
        # workers when told to (it would print a key passed in its config).
        os.environ[SAMPLE_KEY_ENV] = s.store.sample_key
        extra = [v for v in os.environ.get("VLLM_RAY_EXTRA_ENV_VARS_TO_COPY", "").split(",") if v]
        os.environ["VLLM_RAY_EXTRA_ENV_VARS_TO_COPY"] = ",".join(sorted({*extra, SAMPLE_KEY_ENV}))
        if s.put_notes_dir is None and s.extract and s.backend == "mooncake":  # (rank 0 writes: this node)
            s.put_notes_dir = tempfile.mkdtemp(prefix="dspark-put-notes-")
        if s.device == "cpu":
            # One engine process per actor: the actor *is* the replica, and the store client
            # of the connector lives here too (with TP, rank 0's worker holds another).
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            set_cpu_engine_env(s)
        self.llm = start_engine(engine_kwargs(s))
        self.tokenizer = self.llm.get_tokenizer()
        self._store: HiddenStateStore | None = None

    def stats(self) -> dict:
        """The producer's totals, and how many tokens the engine's KV cache holds (all ranks alike)."""
        cache = self.llm.llm_engine.vllm_config.cache_config
        return {**super().stats(), "kv_cache_tokens": (cache.num_gpu_blocks or 0) * cache.block_size}

    def store(self) -> HiddenStateStore:
        if self._store is None:
            self._store = HiddenStateStore(self.settings.store).connect()
        return self._store

    def _sampling(self, key: str, spans):
        from vllm import SamplingParams

        s = self.settings
        extra = None
        if s.extract:
            extra = {
                "kv_transfer_params": {"include_output_tokens": True, "dspark": {"key": key, "assistant_spans": spans}}
            }
        return SamplingParams(
            temperature=s.sampling.temperature,
            top_p=s.sampling.top_p,
            max_tokens=s.sampling.max_tokens,
            extra_args=extra,
        )

    def process(self, prompts: list[dict]) -> list[Produced]:
        """Regenerate and extract a batch: `prompts` are {"id", "messages", optional "key"} dicts
        (the ledger names keys so that a regenerated sample never aliases an old one)."""
        from dspark.chat import render_prompt_with_spans

        s = self.settings
        t0 = time.perf_counter()
        ready, results = [], {}
        keys = {p["id"]: p.get("key") or f"{s.key_prefix}/{p['id']}" for p in prompts}
        for p in prompts:
            try:
                ids, spans = render_prompt_with_spans(self.tokenizer, p["messages"], s.chat)
                if len(ids) >= s.target.max_model_len - 1:
                    raise ValueError(f"prompt of {len(ids)} tokens does not fit max_model_len={s.target.max_model_len}")
                ready.append((p["id"], ids, spans))
            except (ValueError, KeyError, TypeError) as e:
                results[p["id"]] = Produced(p["id"], error=f"render: {e}")
        outs = (
            self.llm.generate(
                [{"prompt_token_ids": ids} for _, ids, _ in ready],
                [self._sampling(keys[pid], spans) for pid, _, spans in ready],
                use_tqdm=False,
            )
            if ready
            else []
        )
        for (pid, ids, _), out in zip(ready, outs):
            gen = list(out.outputs[0].token_ids)
            produced = Produced(pid, response_ids=gen, prompt_tokens=len(ids))
            if s.extract:
                p = (out.kv_transfer_params or {}).get("dspark")
                if p is None:
                    produced.error = "engine returned no hidden-state reference"
                else:
                    produced.ref = SampleRef(
                        p["key"], p["num_tokens"], tuple(p["layer_ids"]), p["hidden_size"], p.get("dtype", "bfloat16")
                    )
                    produced.path = p.get("path")
            results[pid] = produced
        if s.extract:
            self._flush([r for r in results.values() if r.ref is not None])
        dt = time.perf_counter() - t0
        done = [results[p["id"]] for p in prompts]
        self.totals["prompts"] += len(done)
        self.totals["failed"] += sum(r.error is not None for r in done)
        self.totals["prompt_tokens"] += sum(r.prompt_tokens for r in done)
        self.totals["generated_tokens"] += sum(len(r.response_ids) for r in done)
        self.totals["seconds"] += dt
        return done

    def _flush(self, produced: list[Produced]) -> None:
        """Writes happen when the engine next steps after a request finishes; step until every
        sample is in the store (or its file exists), or mark the missing ones failed: their puts
        were given up (the connector logs why, with the store's error), so nothing of them
        lands later, and the ledger hands their prompts out again. A put given up for want of
        room (the connector's note says so: `sample_puts.take_put_note`) is not counted against
        its prompt; one refused outright, or without a note, is."""
        s = self.settings

        def present(r: Produced) -> bool:
            if s.backend == "file":
                return os.path.exists(r.path)
            return self.store().exists(r.ref.key)

        waiting = [r for r in produced if not present(r)]

        def flushed() -> bool:
            nonlocal waiting
            if waiting:
                self.llm.llm_engine.step()
                waiting = [r for r in waiting if not present(r)]
            return not waiting

        try:
            wait_until(
                flushed, timeout_s=s.flush_timeout_s, interval_s=0.01, what="the hidden states to reach the store"
            )
        except TimeoutError:
            pass  # what is still missing is reported below, per prompt
        for r in waiting:
            note = take_put_note(s.put_notes_dir, r.ref.key) if s.put_notes_dir else None
            if note is not None:
                capacity, outcome = note
                r.error, r.blamed = f"hidden states not stored: {outcome}", not capacity
            else:
                r.error = (
                    f"hidden states not stored: {r.ref.key} still missing after {s.flush_timeout_s:g}s "
                    "(a store full all that time, or a put the store refused: the engine's log names its error)"
                )
            r.ref = None

    def produce(self, prompts: list[PromptTask]) -> list[ProducedSample]:
        done = self.process([{"id": t.id, "messages": t.messages, "key": t.key} for t in prompts])
        return [ProducedSample(t.uid, r.ref, r.error, r.blamed) for t, r in zip(prompts, done)]


class HeadlessEngineWorker:
    """A CPU replica's ranks on a node other than its leader's (`EngineSpan.node_rank` >= 1):
    vLLM's multiprocessing executor in headless mode, as `vllm serve --headless` starts it. Its
    constructor returns once its workers joined the leader's (so the leader must be starting
    too); they then take their part of every step the leader's engine schedules. They do not
    end with the leader: the replica's owner kills this actor, and vLLM's workers exit with it
    (they watch their parent through a pipe)."""

    def __init__(self, settings: InferenceSettings) -> None:
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.executor.multiproc_executor import MultiprocExecutor

        assert settings.span is not None and settings.span.node_rank > 0, "the leader is an InferenceActor"
        os.environ[SAMPLE_KEY_ENV] = settings.store.sample_key  # (its ranks write nothing: rank 0 is the leader's)
        set_cpu_engine_env(settings)
        config = EngineArgs(**engine_kwargs(settings)).create_engine_config(headless=True)
        self.executor = MultiprocExecutor(config, monitor_workers=False)
