"""How conversations become tokens: the chat template and its options (`ChatFormat`), and the
renderings the job needs — a prompt up to where the assistant answers next, and a whole
conversation with an assistant-only loss mask.

One `ChatFormat` is used wherever the target reads a conversation: when the replicas regenerate
answers, when τ is measured, and in the serving recipe (it is recorded in the exported
drafter's config.json). A drafter trained on one template (say, thinking on) and judged or
served on another sees a different distribution and accepts little, silently.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ChatFormat:
    template: str | None = None  # Jinja text; None: the tokenizer's own
    kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. {"enable_thinking": False}

    @classmethod
    def from_options(cls, template_file: str | None, kwargs: dict[str, Any] | None) -> ChatFormat:
        return cls(Path(template_file).read_text() if template_file else None, dict(kwargs or {}))

    @classmethod
    def from_record(cls, record: dict[str, Any] | None) -> ChatFormat:
        """The format an exported drafter was trained with (`DSparkConfig.chat_format`)."""
        record = record or {}
        return cls(record.get("template"), dict(record.get("kwargs") or {}))

    def text(self, tok) -> str:
        template = self.template or getattr(tok, "chat_template", None)
        if not template:
            raise ValueError("the tokenizer has no chat template; set target.chat_template to a template file")
        return template

    def record(self, tok) -> dict[str, Any]:
        """What the exported checkpoint keeps: the template text actually used (the tokenizer's,
        if none was configured), its hash, and the options."""
        text = self.text(tok)
        return {
            "template": text,
            "sha256": hashlib.sha256(text.encode()).hexdigest(),
            "kwargs": dict(self.kwargs),
            "source": "config" if self.template else "tokenizer",
        }

    def render(self, tok, messages: list[dict], add_generation_prompt: bool) -> str:
        return tok.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=self.text(tok),
            **self.kwargs,
        )


TOKENIZER_DEFAULT = ChatFormat()


def render_prompt(tok, messages: list[dict], chat: ChatFormat = TOKENIZER_DEFAULT) -> list[int]:
    """Token ids of the conversation up to the point where the assistant answers next."""
    text = chat.render(tok, messages, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def render_with_loss_mask(
    tok, messages: list[dict], chat: ChatFormat = TOKENIZER_DEFAULT
) -> tuple[list[int], list[bool]]:
    """Token ids of a whole conversation and a mask that is True exactly on assistant tokens.

    Spans come from the chat template itself: the text the template adds for assistant turn i
    is the difference between rendering turns [0, i] and turns [0, i) with a generation
    prompt. A span runs through the end-of-turn token (the target must learn to stop) and
    excludes what the template appends after it (e.g. a newline).
    """
    text = chat.render(tok, messages, add_generation_prompt=False)
    spans = []
    eos = tok.eos_token or ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = chat.render(tok, messages[:i], add_generation_prompt=True)
        full = chat.render(tok, messages[: i + 1], add_generation_prompt=False)
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


def render_prompt_with_spans(
    tok, messages: list[dict], chat: ChatFormat = TOKENIZER_DEFAULT
) -> tuple[list[int], list[tuple[int, int]]]:
    """Prompt ids (with the generation prompt) and the [start, end) token spans of the
    assistant turns already inside it; the answer generated next is all assistant tokens."""
    ids = render_prompt(tok, messages, chat)
    spans: list[tuple[int, int]] = []
    if any(m["role"] == "assistant" for m in messages):
        full, mask = render_with_loss_mask(tok, messages, chat)
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
