"""`MooncakeHiddenStatesConnector`: a vLLM KV connector that writes each finished request's
hidden states, token ids and loss mask straight into the Mooncake store (no disk).

Loaded by vLLM through `kv_connector_module_path="cluster.inference.hidden_states_connector"`
together with the capturing target (`capture_model`, this room's too), which caches the chosen layers' states per
token in a KV-cache-shaped buffer as it decodes. When a request finishes, the scheduler side of this
connector plans a save (key, token ids, loss mask) and the worker side copies the request's
rows out of that buffer and puts them into the store:
- on CPU synchronously (no CUDA streams or pinned memory there), the put tried at once and, on a
  full store, again at the engine's next steps (never waited out inside one: `sample_puts`);
- on GPU with an asynchronous device→host copy on a side stream, the put running in a
  thread pool once the copy's event fires (the forward pass is not blocked).
Each put has a deadline from when it is queued (`put_retry_s`), shorter than the replica's flush
waits for it: past it the put is given up, untried if it never was, and the sample reported not
stored.
Only tensor-parallel rank 0 writes. The request's `kv_transfer_params` carry our inputs
(`{"dspark": {"key": ..., "assistant_spans": [[start, end), ...]}}`) and come back with the
`SampleRef` fields (key, shapes; and a file backend's path) as a plain dict, since vLLM carries
them across its engine processes; the replica (`InferenceActor.process`) makes them the
`SampleRef` that goes on to the ledger as it is.

Backends: `mooncake` (default) and `file`, which writes vLLM's on-disk format
(`hidden_states`, `token_ids`) plus our `loss_mask` as one safetensors file per request, for
building offline datasets.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import vllm.envs as envs
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)
from vllm.logger import init_logger

from cluster.inference.capture_model import LAYER_IDS_KEY
from cluster.inference.sample_puts import SamplePuts
from cluster.store import HiddenStateStore
from dspark.samples import Sample, write_sample

logger = init_logger(__name__)
PARAMS_KEY = "dspark"
# The share of vLLM's `execute_model` RPC timeout one engine step may spend trying puts (CPU, where
# the tries run inside that call): 30 s of the default 300 s, the rest left to the step's forward.
STEP_PUT_SHARE = 0.1


def step_put_budget_s(extra: dict) -> float:
    """How long one engine step may spend trying puts (`step_put_budget_s` in the connector's
    config, or `STEP_PUT_SHARE` of vLLM's `execute_model` timeout as this process reads it)."""
    return float(extra.get("step_put_budget_s", envs.VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS * STEP_PUT_SHARE))


def loss_mask_for(num_tokens: int, prompt_len: int, assistant_spans: list) -> torch.Tensor:
    """Earlier assistant turns inside the prompt, plus every generated token."""
    mask = torch.zeros(num_tokens, dtype=torch.bool)
    for start, end in assistant_spans:
        mask[start : min(end, num_tokens)] = True
    mask[prompt_len:] = True
    return mask


@dataclass
class PlannedSave:
    req_id: str
    key: str
    token_ids: torch.Tensor
    loss_mask: torch.Tensor
    block_ids: list[int]


@dataclass
class StoreSaveMetadata(KVConnectorMetadata):
    saves: list[PlannedSave] = field(default_factory=list)


class _Done:
    """Stands in for a CUDA event when the copy already happened synchronously."""

    @staticmethod
    def query() -> bool:
        return True


class MooncakeHiddenStatesConnector(ExampleHiddenStatesConnector):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        # Not the parent's __init__: it asserts a speculative config (its states come from the
        # extract_hidden_states "drafter"; ours from the target itself, cluster.inference.capture_model).
        # The state below is what the inherited methods (group lookup, register_kv_caches,
        # the GPU copy stream) read.
        KVConnectorBase_V1.__init__(self, vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._cache_kv_group_id = self._find_cache_kv_group_id(kv_cache_config)
        self._block_size = self._get_cache_block_size(vllm_config, kv_cache_config, self._cache_kv_group_id)
        self.cache_layers: list[str] = []
        self._kv_cache: torch.Tensor | None = None
        self._is_tp_rank_zero = True
        self._copy_stream = None
        self._req_copy_events: dict[str, Any] = {}
        self._accumulated_finished_req_ids: set[str] = set()
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        writer_threads = int(extra.get("num_writer_threads", 8))
        # GPU writer threads (started on first use): the file backend's here, the store's in `_puts`
        self._executor = ThreadPoolExecutor(max_workers=writer_threads, thread_name_prefix="dspark-hs-file")
        self.backend = extra.get("backend", "mooncake")
        if self.backend not in ("mooncake", "file"):
            raise ValueError(f"unknown hidden-state backend {self.backend!r} (mooncake | file)")
        self.key_prefix = extra.get("key_prefix", "dspark")
        # The samples' MAC key comes by environment (the inference actor sets it; vLLM copies it
        # to its Ray workers), never in this config, which vLLM logs.
        self.store_config = {**extra.get("store", {}), "sample_key": os.environ.get("DSPARK_SAMPLE_KEY", "")}
        self.put_retry_s = float(extra.get("put_retry_s", 600.0))
        # a put given up leaves a note saying why for the replica (`sample_puts`), there if it asked
        notes_dir = extra.get("put_notes_dir")
        self._puts = SamplePuts(
            self.store, self.put_retry_s, step_put_budget_s(extra), writer_threads, notes_dir=notes_dir
        )
        self.out_dir = Path(extra.get("shared_storage_path", "/tmp/dspark-hidden-states"))
        self.layer_ids = list(getattr(vllm_config.model_config.hf_config, LAYER_IDS_KEY, None) or [])
        if not self.layer_ids:
            raise ValueError(
                f"{type(self).__name__} needs the capturing target (hf_overrides "
                f"{LAYER_IDS_KEY!r}, cluster.inference.capture_model.capture_engine_kwargs)"
            )
        self._planned: dict[str, PlannedSave] = {}
        self._keys: dict[str, str] = {}
        self._store: HiddenStateStore | None = None

    # ---- scheduler side -----------------------------------------------------------------
    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = StoreSaveMetadata(saves=list(self._planned.values()))
        self._planned.clear()
        for new_req in scheduler_output.scheduled_new_reqs:
            params = self._params(new_req.sampling_params)
            self._keys[new_req.req_id] = params.get("key") or f"{self.key_prefix}/{new_req.req_id}"
        return meta

    @staticmethod
    def _params(sampling_params) -> dict:
        extra = (sampling_params.extra_args or {}) if sampling_params is not None else {}
        return (extra.get("kv_transfer_params") or {}).get(PARAMS_KEY, {})

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        key = self._keys.pop(request.request_id, None)
        if key is None:  # aborted before it was ever scheduled: nothing cached, nothing to save
            return False, None
        params = (request.kv_transfer_params or {}).get(PARAMS_KEY, {})
        # The last token was sampled, never fed back: it has no hidden state.
        token_ids = torch.tensor(list(request.all_token_ids)[:-1], dtype=torch.long)
        prompt_len = len(request.prompt_token_ids or [])
        mask = loss_mask_for(token_ids.numel(), prompt_len, params.get("assistant_spans", []))
        self._planned[request.request_id] = PlannedSave(request.request_id, key, token_ids, mask, list(block_ids))
        return True, {
            PARAMS_KEY: {
                "key": key,
                "num_tokens": int(token_ids.numel()),
                "layer_ids": self.layer_ids,
                "hidden_size": self._vllm_config.model_config.get_hidden_size(),
                "prompt_len": prompt_len,
                # what the reader expects; the stored header says what was written (they must agree)
                "dtype": str(self._vllm_config.model_config.dtype).removeprefix("torch."),
                "backend": self.backend,
                "path": str(self._file_path(key)) if self.backend == "file" else None,
            }
        }

    def _file_path(self, key: str) -> Path:
        return self.out_dir / f"{key.replace('/', '_')}.safetensors"

    # ---- worker side --------------------------------------------------------------------
    def wait_for_save(self) -> None:
        pass  # no lock files to pre-create

    def get_finished(self, finished_req_ids: set[str]):
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, StoreSaveMetadata):
                for save in meta.saves:
                    self._save(save)
        self._puts.advance()
        return self._report_finished(finished_req_ids)

    def _report_finished(self, finished_req_ids):
        # The parent's bookkeeping: a request is done sending once its copy event completed.
        self._accumulated_finished_req_ids.update(finished_req_ids)
        done = set()
        for req_id in list(self._accumulated_finished_req_ids):
            event = self._req_copy_events.get(req_id)
            if event is not None and not event.query():
                continue
            self._req_copy_events.pop(req_id, None)
            self._accumulated_finished_req_ids.discard(req_id)
            if event is not None:
                done.add(req_id)
        return done or None, None

    def store(self) -> HiddenStateStore:
        if self._store is None:
            self._store = HiddenStateStore(self.store_config).connect()
        return self._store

    def _save(self, save: PlannedSave) -> None:
        if not self._is_tp_rank_zero:
            return
        n = save.token_ids.numel()
        blocks = torch.tensor(save.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + torch.arange(self._block_size)[None, :]).flatten()
        kv = self._kv_cache
        if kv.device.type == "cpu":
            hidden = extract_from_kv_cache(kv, slots, n)  # advanced indexing: already a copy
            if self.backend == "file":
                self._write_file(save, hidden)
                self._req_copy_events[save.req_id] = _Done()
                return
            # Tried by this step's `advance`. The request is reported done (its KV blocks freed) once
            # the put is settled; until then vLLM keeps stepping the engine, and those steps retry a
            # put the store refused.
            self._req_copy_events[save.req_id] = self._puts.queue(save.key, self._sample(save, hidden))
            return
        stream = self._get_copy_stream()
        ready = torch.cuda.Event()
        ready.record()
        stream.wait_event(ready)
        with torch.cuda.stream(stream):
            on_device = extract_from_kv_cache(kv, slots.to(kv.device, non_blocking=True), n)
            host = torch.empty_like(on_device, device="cpu", pin_memory=True)
            host.copy_(on_device, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(stream)
        self._req_copy_events[save.req_id] = copied

        def copied_host() -> torch.Tensor:
            copied.synchronize()
            return host

        if self.backend == "file":
            future = self._executor.submit(lambda: self._write_file(save, copied_host()))
        else:
            # queued now: its deadline runs from here, not from when a writer thread is free
            future = self._puts.submit(self._puts.queue(save.key), lambda: self._sample(save, copied_host()))
        future.add_done_callback(
            lambda f, rid=save.req_id: (
                f.exception() and logger.error("hidden-state put failed for %s: %r", rid, f.exception())
            )
        )

    def _sample(self, save: PlannedSave, hidden: torch.Tensor) -> Sample:
        return Sample(save.token_ids, save.loss_mask, hidden, self.layer_ids)

    def _write_file(self, save: PlannedSave, hidden: torch.Tensor) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        write_sample(self._file_path(save.key), self._sample(save, hidden))


__all__ = ["MooncakeHiddenStatesConnector", "loss_mask_for", "step_put_budget_s"]
