"""The target as a vLLM model that also writes its hidden states into a cache while it decodes.

vLLM's own route to a target's hidden states is the `extract_hidden_states` speculative method:
its "drafter" caches the aux states in a KV-cache-shaped buffer that a KV connector reads when a
request finishes. Being a speculative method, it runs one draft position per request at every
decode step (`num_speculative_tokens == 1` is asserted), a second forward position that is
thrown away: 30-45% of a compute-bound CPU decode (`benchmarks/generation.py`).

Here the target itself does the caching. `DSparkCapture<Arch>` is the target's own vLLM class
(resolved from vLLM's registry) plus one `CacheOnlyAttentionLayer`, vLLM's cache-only layer of
that method; its forward asks the base model for the aux-layer states (the EAGLE-3 interface
`extract_hidden_states` uses too) and writes them to that layer at the tokens' KV slots. Every
token is fed through the target exactly once (prompt tokens in prefill, each generated token at
the next decode step), so a finished request's slots hold the states of all its tokens but the
last, which is what `MooncakeHiddenStatesConnector` reads. The engine runs as a plain engine: no
speculative config, one position per request per step.

The engine selects the class with `capture_engine_kwargs`: vLLM's `hf_overrides` and its
model registry (`model_class_overrides` where the engine has worker processes), no patch of vLLM.
"""

from __future__ import annotations

import dataclasses

import torch

# vLLM's class for an architecture, and whether it can capture: the driver asks the same before
# any replica starts (`cluster.target.read_target`), so the two live on the ground floor
from cluster.target import capture_gap, vllm_class

PREFIX = "DSparkCapture"
CACHE_LAYER = "dspark_hidden_states"  # the cache layer's name (plus its index) in vLLM's forward context
LAYER_IDS_KEY = "dspark_capture_layer_ids"  # the hf_config attribute carrying the layer ids


def capture_name(arch: str) -> str:
    return f"{PREFIX}{arch}"


def native_architecture(target_path: str, trust_remote_code: bool) -> str:
    """The class name vLLM resolves the target to: its own architecture, or the Transformers
    backend's class for one vLLM does not implement (a remote-code target)."""
    from vllm.config import ModelConfig

    return ModelConfig(model=target_path, trust_remote_code=trust_remote_code).architecture


def capture_engine_kwargs(target_path: str, trust_remote_code: bool, layer_ids: list[int], in_process: bool) -> dict:
    """The engine arguments that load the capturing class: `hf_overrides` renames the
    architecture and carries the layer ids. An engine that runs in this process (CPU) gets the
    class registered here; one that starts processes of its own (GPU workers) gets
    `model_class_overrides`, which registers the name in each of them. (That is a lazy
    registration, and vLLM inspects a lazily registered class in a subprocess, ~12 s on a 2-core
    box the first time: avoided where the class can be handed over.)"""
    arch = native_architecture(target_path, trust_remote_code)
    name = capture_name(arch)
    kwargs = {"hf_overrides": {"architectures": [name], LAYER_IDS_KEY: list(layer_ids)}}
    if in_process:
        from vllm.model_executor.models.registry import ModelRegistry

        ModelRegistry.register_model(name, capture_class(arch))
    else:
        kwargs["model_class_overrides"] = {name: f"{__name__}:{name}"}
    return kwargs


def capture_class(arch: str) -> type:
    """`DSparkCapture<arch>`: vLLM's class for `arch` that caches its aux hidden states."""
    from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer
    from vllm.model_executor.models.utils import maybe_prefix

    native = vllm_class(arch)
    if native is None:
        raise ValueError(f"vLLM has no model class for architecture {arch!r}")
    if gap := capture_gap(native):
        raise ValueError(gap)

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        native.__init__(self, vllm_config=vllm_config, prefix=prefix)
        hf_config = vllm_config.model_config.hf_config
        layer_ids = tuple(getattr(hf_config, LAYER_IDS_KEY, None) or ())
        if not layer_ids:
            raise ValueError(f"{type(self).__name__} needs hf_overrides[{LAYER_IDS_KEY!r}] (capture_engine_kwargs)")
        self.set_aux_hidden_state_layers(layer_ids)
        # One cache "head" per captured layer, as extract_hidden_states lays out its buffer: the
        # connector reads [tokens, layers, hidden] rows by slot.
        self.dspark_hidden_states = CacheOnlyAttentionLayer(
            num_heads=len(layer_ids),
            head_size=vllm_config.model_config.get_hidden_size(),
            # The hidden states are stored in the model's dtype whatever the attention layers'
            # KV cache holds: vLLM's cache-only layer refuses a quantized (fp8) cache dtype, and
            # an fp8 copy would lose what the drafter learns from.
            cache_config=dataclasses.replace(vllm_config.cache_config, cache_dtype="auto"),
            # vLLM orders KV caches by the one integer in a layer's name: after the target's own
            # layers, as extract_hidden_states numbers its cache-only layer
            prefix=maybe_prefix(prefix, f"{CACHE_LAYER}.{vllm_config.model_config.hf_text_config.num_hidden_layers}"),
        )

    def forward(self, *args, **kwargs):
        out = native.forward(self, *args, **kwargs)
        if not isinstance(out, tuple):  # e.g. a pipeline stage's intermediate tensors
            return out
        hidden, aux = out
        self.dspark_hidden_states(torch.stack(aux, dim=1))
        return hidden

    return type(capture_name(arch), (native,), {"__init__": __init__, "forward": forward, "__module__": __name__})


def __getattr__(name: str):
    """`DSparkCapture<Arch>`, built on first use: how vLLM's registry imports a class by name."""
    if name.startswith(PREFIX):
        cls = capture_class(name[len(PREFIX) :])
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
