"""`InferenceActor`: one vLLM replica that regenerates responses and streams hidden states.

Per prompt it (a) regenerates the assistant answer with the frozen target (on-policy: the
drafter learns the distribution it will be verified against), and (b) exports the aux-layer
and final pre-norm hidden states of the whole conversation: the target, loaded as its
capturing class (`cluster.capture_model`), caches them while it decodes (a plain engine, no
speculative step), and our `MooncakeHiddenStatesConnector` puts them into the
Mooncake store. What comes back through Ray is one `SampleRef` (key and shapes) per prompt.

The CPU build runs the engine inside this actor's process (tests, the local job); on GPU the
engine spans the placement group's bundles with tensor parallelism (`tp_size` GPUs, possibly
on two nodes, Ray as the distributed executor).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from cluster.capture_model import capture_engine_kwargs
from cluster.producer import Producer
from cluster.store import HiddenStateStore, SampleRef, StoreConfig
from dspark.chat import TOKENIZER_DEFAULT, ChatFormat

CONNECTOR = "MooncakeHiddenStatesConnector"
SAMPLE_KEY_ENV = "DSPARK_SAMPLE_KEY"
CONNECTOR_MODULE = "cluster.hidden_states_connector"


@dataclass
class InferenceSettings:
    target_path: str
    layer_ids: list[int]  # aux layers then the final pre-norm layer, speculators indexing
    key_prefix: str  # run/group
    store: StoreConfig = field(default_factory=StoreConfig)
    backend: str = "mooncake"  # mooncake | file
    file_dir: str = "/tmp/dspark-hidden-states"
    device: str = "cpu"
    dtype: str = "bfloat16"
    tensor_parallel_size: int = 1
    max_model_len: int = 2048
    max_num_seqs: int = 64
    kv_cache_dtype: str = "auto"
    enforce_eager: bool = True
    gpu_memory_utilization: float = 0.85
    cpu_kvcache_space_gb: int = 2
    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 256
    extract: bool = True  # False: a plain engine (reference generations in tests)
    trust_remote_code: bool = False  # target.trust_remote_code
    chat: ChatFormat = TOKENIZER_DEFAULT  # how prompts are rendered (target.chat_template*)
    flush_timeout_s: float = 60.0


@dataclass
class Produced:
    """One prompt's outcome: a stored sample, or an error that sends it back to pending."""

    prompt_id: str
    ref: dict | None = None  # SampleRef fields
    response_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    error: str | None = None


def uses_mla(target_path: str) -> bool:
    """Whether the target's attention is multi-head latent attention (DeepSeek-V3, Kimi K2/K3),
    read from its config.json (no remote code); a multimodal config nests it under text_config."""
    path = Path(target_path) / "config.json"
    if not path.exists():  # a hub name: vLLM resolves it, and its own selection stands
        return False
    cfg = json.loads(path.read_text())
    return bool(cfg.get("kv_lora_rank") or (cfg.get("text_config") or {}).get("kv_lora_rank"))


def engine_kwargs(s: InferenceSettings) -> dict:
    kwargs = dict(
        model=s.target_path, dtype=s.dtype, max_model_len=s.max_model_len, max_num_seqs=s.max_num_seqs,
        enforce_eager=s.enforce_eager, tensor_parallel_size=s.tensor_parallel_size, kv_cache_dtype=s.kv_cache_dtype,
        seed=0, trust_remote_code=s.trust_remote_code,
    )
    if s.device == "cpu" and s.dtype != "bfloat16" and uses_mla(s.target_path):
        # On a CPU with AMX, vLLM serves multi-head latent attention with its AMX backend, which
        # takes bf16 weights only ("expect weight to be bfloat16, float16, int8, ..." at load);
        # its reference CPU backend runs every dtype (and is what non-AMX CPUs get anyway).
        kwargs.update(attention_backend="CPU_MLA")
    if s.device == "cuda":
        kwargs.update(gpu_memory_utilization=s.gpu_memory_utilization)
        if s.tensor_parallel_size > 1:
            kwargs.update(distributed_executor_backend="ray")
    if s.extract:
        # the target's class with a hidden-state cache (cluster.capture_model): a plain engine
        kwargs.update(capture_engine_kwargs(s.target_path, s.trust_remote_code, s.layer_ids, in_process=s.device == "cpu"))
        kwargs["kv_transfer_config"] = {
            "kv_connector": CONNECTOR,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {
                # vLLM carries this as JSON to the connector (possibly in another process) and logs
                # it: the samples' key goes by environment instead (SAMPLE_KEY_ENV)
                "backend": s.backend, "key_prefix": s.key_prefix, "store": asdict(replace(s.store, sample_key="")),
                "shared_storage_path": s.file_dir,
            },
        }
    return kwargs


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
        if s.device == "cpu":
            # One engine process per actor: the actor *is* the replica, and the store client
            # of the connector lives here too.
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(s.cpu_kvcache_space_gb))
        from vllm import LLM

        self.llm = LLM(**engine_kwargs(s))
        self.tokenizer = self.llm.get_tokenizer()
        self._store: HiddenStateStore | None = None

    def store(self) -> HiddenStateStore:
        if self._store is None:
            self._store = HiddenStateStore(self.settings.store).connect()
        return self._store

    def _sampling(self, key: str, spans):
        from vllm import SamplingParams

        s = self.settings
        extra = None
        if s.extract:
            extra = {"kv_transfer_params": {"include_output_tokens": True, "dspark": {"key": key, "assistant_spans": spans}}}
        return SamplingParams(temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_tokens, extra_args=extra)

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
                if len(ids) >= s.max_model_len - 1:
                    raise ValueError(f"prompt of {len(ids)} tokens does not fit max_model_len={s.max_model_len}")
                ready.append((p["id"], ids, spans))
            except (ValueError, KeyError, TypeError) as e:
                results[p["id"]] = Produced(p["id"], error=f"render: {e}")
        outs = self.llm.generate(
            [{"prompt_token_ids": ids} for _, ids, _ in ready],
            [self._sampling(keys[pid], spans) for pid, _, spans in ready],
            use_tqdm=False,
        ) if ready else []
        for (pid, ids, _), out in zip(ready, outs):
            gen = list(out.outputs[0].token_ids)
            produced = Produced(pid, response_ids=gen, prompt_tokens=len(ids))
            if s.extract:
                p = (out.kv_transfer_params or {}).get("dspark")
                if p is None:
                    produced.error = "engine returned no hidden-state reference"
                else:
                    produced.ref = asdict(SampleRef(p["key"], p["num_tokens"], tuple(p["layer_ids"]), p["hidden_size"],
                                                    p.get("dtype", "bfloat16")))
                    produced.ref["path"] = p.get("path")
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
        sample is in the store (or its file exists), or mark the missing ones failed."""
        s = self.settings

        def present(r: Produced) -> bool:
            if s.backend == "file":
                return os.path.exists(r.ref["path"])
            return self.store().exists(r.ref["key"])

        deadline = time.monotonic() + s.flush_timeout_s
        waiting = [r for r in produced if not present(r)]
        while waiting and time.monotonic() < deadline:
            self.llm.llm_engine.step()
            waiting = [r for r in waiting if not present(r)]
            if waiting:
                time.sleep(0.01)
        for r in waiting:
            r.error, r.ref = "hidden states never reached the store", None

    def produce(self, prompts: list[dict]) -> list[dict]:
        reports = []
        for p, r in zip(prompts, self.process(prompts)):
            if r.ref is not None:
                ref = SampleRef.from_dict(r.ref)
                reports.append({"uid": p["uid"], "ref": r.ref, "tokens": ref.num_tokens, "nbytes": ref.nbytes})
            else:
                reports.append({"uid": p["uid"], "error": r.error})
        return reports
