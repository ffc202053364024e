"""Prompt and conversation readers.

Accepted shapes, one conversation per JSONL line or dataset row:
  {"messages": [{"role": ..., "content": ...}, ...]}      OpenAI chat
  {"prompt": "..."}                                        one user turn
  {"conversations": [{"from": "human"|"gpt"|"system", "value": ...}]}   ShareGPT
and a Hugging Face `datasets` folder saved with `save_to_disk` holding rows of those shapes.
A malformed line is counted and reported with its line number; it never stops the read and
never vanishes silently.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

ROLES = {"system", "user", "assistant"}
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "chatgpt": "assistant",
}


@dataclass
class Conversation:
    id: str
    messages: list[dict]
    category: str | None = None  # the domain τ is reported by (math, coding, ...), from the record's `category`

    @property
    def prompt_messages(self) -> list[dict]:
        """What the target answers when regenerating: the conversation without a final
        assistant turn (earlier assistant turns stay, as written)."""
        return self.messages[:-1] if self.messages[-1]["role"] == "assistant" else self.messages

    def prompt_record(self) -> dict:
        """What an evaluation reads back (a JSONL line, or a request): id, category, prompt messages."""
        return {"id": self.id, "category": self.category, "messages": self.prompt_messages}


@dataclass
class ReadReport:
    source: str
    ok: int = 0
    bad: list[tuple[int, str]] = field(default_factory=list)

    def summary(self) -> str:
        head = f"{self.source}: {self.ok} conversations, {len(self.bad)} malformed"
        if not self.bad:
            return head
        shown = "; ".join(f"line {n}: {why}" for n, why in self.bad[:5])
        more = f" (+{len(self.bad) - 5} more)" if len(self.bad) > 5 else ""
        return f"{head} — {shown}{more}"


class MalformedRecord(ValueError):
    pass


def to_messages(obj) -> list[dict]:
    if not isinstance(obj, dict):
        raise MalformedRecord(f"expected a JSON object, got {type(obj).__name__}")
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise MalformedRecord("'messages' must be a non-empty list")
        out = []
        for m in msgs:
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise MalformedRecord(f"bad message {str(m)[:60]!r}: needs role in {sorted(ROLES)} and string content")
            out.append({"role": m["role"], "content": m["content"]})
    elif "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"].strip():
            raise MalformedRecord("'prompt' must be a non-empty string")
        out = [{"role": "user", "content": obj["prompt"]}]
    elif "conversations" in obj:
        turns = obj["conversations"]
        if not isinstance(turns, list) or not turns:
            raise MalformedRecord("'conversations' must be a non-empty list")
        out = []
        for t in turns:
            role = SHAREGPT_ROLES.get(str(t.get("from", "")).lower()) if isinstance(t, dict) else None
            if role is None or not isinstance(t.get("value"), str):
                raise MalformedRecord(f"bad ShareGPT turn {str(t)[:60]!r}")
            out.append({"role": role, "content": t["value"]})
    else:
        raise MalformedRecord("no 'messages', 'prompt' or 'conversations' field")
    if not any(m["role"] == "user" for m in out):
        raise MalformedRecord("conversation has no user turn")
    return out


def read_conversations(path: str | Path) -> tuple[list[Conversation], ReadReport]:
    path = Path(path)
    report = ReadReport(str(path))
    convs: list[Conversation] = []
    if path.is_dir():
        from datasets import load_from_disk

        ds = load_from_disk(str(path))
        rows = enumerate(ds, start=1)
    else:

        def lines():
            with open(path, "rb") as f:
                for n, raw in enumerate(f, start=1):
                    if raw.strip():
                        yield n, raw

        rows = lines()
    for n, row in rows:
        try:
            if isinstance(row, bytes):  # one undecodable line is one malformed record, named by its line
                try:
                    row = row.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise MalformedRecord(f"not UTF-8: byte 0x{row[e.start]:02x} at column {e.start + 1}") from None
            obj = json.loads(row) if isinstance(row, str) else dict(row)
            msgs = to_messages(obj)
        except (json.JSONDecodeError, MalformedRecord, AttributeError, TypeError) as e:
            report.bad.append((n, str(e)[:200]))
            continue
        cid = str(obj.get("id")) if obj.get("id") is not None else f"{path.stem}:{n}"
        cat = obj.get("category")
        convs.append(Conversation(cid, msgs, str(cat) if cat not in (None, "") else None))
        report.ok += 1
    return convs, report


def id_hash(conv_id: str, seed: int, purpose: str) -> float:
    """A uniform number in [0, 1) from the id: stable across runs, machines and file order.
    `purpose` salts it, so that choices made for different reasons (held out, capped) are independent."""
    return int.from_bytes(hashlib.sha256(f"{purpose}:{seed}:{conv_id}".encode()).digest()[:8], "big") / 2**64


def is_heldout(conv_id: str, heldout_fraction: float, seed: int = 0, purpose: str = "eval") -> bool:
    """Deterministic split by a hash of the id (the evaluation prompts, the trainer's
    calibration samples: each `purpose` its own)."""
    return id_hash(conv_id, seed, purpose) < heldout_fraction


def cap_per_category(
    convs: list[Conversation], max_per_category: int | None, seed: int = 0, caps: dict[str, int] | None = None
) -> list[Conversation]:
    """At most `max_per_category` conversations of each category (`caps[category]` for those it
    names; None: no cap for the others), the kept ones in their order.

    Which ones: those whose ids hash lowest, a sample spread over the whole category. Prompt
    files list a category template by template, so its first N in file order would be a few
    templates (19 of the default set's first 24 coding training prompts are "In <language>, how
    would I write code that ...?", the other 5 "Show me a clean <language> implementation ...").
    """
    by_category: dict[str | None, list[Conversation]] = {}
    for c in convs:
        by_category.setdefault(c.category, []).append(c)
    caps = caps or {}
    kept = {
        c.id
        for category, group in by_category.items()
        for c in sorted(group, key=lambda c: id_hash(c.id, seed, "cap"))[: caps.get(category, max_per_category)]
    }
    return [c for c in convs if c.id in kept]


def split(
    convs: list[Conversation], heldout_fraction: float, seed: int = 0
) -> tuple[list[Conversation], list[Conversation]]:
    train, held = [], []
    for c in convs:
        (held if is_heldout(c.id, heldout_fraction, seed) else train).append(c)
    return train, held
