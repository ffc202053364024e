"""Training samples from conversations with transformers as the target (no vLLM needed).

For users and benchmarks that have conversations (e.g. target-regenerated responses) but no
hidden-state dumps: render each conversation with the chat template, run the target once,
and write one sample file per conversation in the format `dspark.samples` reads.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from .chat import render_with_loss_mask
from .prompts import Conversation
from .samples import Sample, write_sample
from .targets import hidden_states_for, load_target


def sample_filename(conv_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", conv_id) + ".safetensors"


def build_samples(
    target_dir: str | Path,
    conversations: list[Conversation],
    out_dir: str | Path,
    layer_ids: list[int],
    dtype: torch.dtype = torch.bfloat16,
    max_tokens: int = 4096,
) -> list[Path]:
    """Write (or reuse) one sample per conversation; returns the sample paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model, tok = load_target(target_dir, dtype)
    paths = []
    for c in conversations:
        path = out_dir / sample_filename(c.id)
        paths.append(path)
        if path.exists():
            continue
        ids, mask = render_with_loss_mask(tok, c.messages)
        ids, mask = ids[:max_tokens], mask[:max_tokens]
        hidden = hidden_states_for(model, torch.tensor(ids), layer_ids).to(torch.bfloat16)
        write_sample(path, Sample(torch.tensor(ids), torch.tensor(mask), hidden, list(layer_ids)))
    return paths
