"""Generate `data/prompts/magpie.jsonl`: user prompts written by the target itself.

The Magpie technique (Xu et al., 2024): an instruction-tuned model given only the start of a
user turn in its own chat template (everything up to where the user's text would begin) writes
a plausible user request, from the distribution of requests it was tuned on. That widens the
training prompts towards what users ask, without a public benchmark's text (those prompts are
how drafters are judged). Then:
- cleaned: one line of plain text, 20 to 500 characters, no template markup, mostly letters;
- deduplicated: exactly (case and spacing folded) and near-exactly (word 4-gram Jaccard ≥ 0.5
  with an earlier kept prompt);
- kept apart from the evaluation sets: a prompt that shares as much with a prompt of
  `data/prompts/ood.jsonl` or the long-context set is dropped (the OOD set must stay unseen);
- categorised by keywords (`magpie_coding`, `_math`, `_writing`, `_translation`, `_explanation`,
  `_chat`: apart from the template set's categories, so `data.max_prompts_per_category` caps
  each source on its own and the per-category figures tell them apart).

Deterministic for a seed on a given machine (vLLM's sampling is seeded).

    python scripts/make_magpie_prompts.py --target DIR [--num 1200] [--out data/prompts/magpie.jsonl]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SENTINEL = "\x00USER-TEXT\x00"
KEEP_APART = ("ood.jsonl", "long_context.jsonl")
CATEGORIES = [  # first match wins
    (
        "coding",
        r"\b(code|function|python|javascript|java|c\+\+|sql|program|script|algorithm|bug|compile|regex|html|api)\b",
    ),
    ("translation", r"\b(translate|translation|in (french|spanish|german|italian|chinese|japanese))\b"),
    ("math", r"(\d+\s*[-+*/x%^]\s*\d+|\b(calculate|equation|solve|sum of|how many|percent|probability|average)\b)"),
    ("writing", r"\b(write|poem|story|essay|letter|email|paragraph|slogan|haiku|summar\w+|rewrite)\b"),
    ("explanation", r"\b(explain|what is|what are|why|how does|how do|difference between|define)\b"),
]


def user_turn_prefix(tok, chat) -> str:
    """The chat template's text up to where a user's words start, with its default system turn."""
    text = chat.render(tok, [{"role": "user", "content": SENTINEL}], add_generation_prompt=False)
    if SENTINEL not in text:
        raise SystemExit("the chat template does not render the user's text verbatim")
    return text[: text.index(SENTINEL)]


def clean(text: str) -> str | None:
    t = " ".join(text.strip().split())
    if not 20 <= len(t) <= 500 or "<|" in t or "|>" in t or "\ufffd" in t:
        return None
    letters = sum(c.isalpha() for c in t)
    if letters < 0.6 * len(t) or not re.search(r"[a-zA-Z]{3}", t):
        return None
    return t


def shingles(text: str, n: int = 4) -> set[tuple[str, ...]]:
    words = re.findall(r"[a-z0-9]+", text.lower())
    return {tuple(words[i : i + n]) for i in range(max(1, len(words) - n + 1))}


def jaccard(a: set, b: set) -> float:
    return len(a & b) / max(1, len(a | b))


def category(text: str) -> str:
    low = text.lower()
    return next((name for name, pattern in CATEGORIES if re.search(pattern, low)), "chat")


def select(candidates: list[str], apart: list[str], threshold: float = 0.5) -> tuple[list[str], dict]:
    """Cleaned, deduplicated candidates that share little with the `apart` prompts; and counts."""
    kept, kept_sh, seen = [], [], set()
    apart_sh = [shingles(a) for a in apart]
    why = {"unclean": 0, "duplicate": 0, "near_duplicate": 0, "near_evaluation_prompt": 0}
    for raw in candidates:
        t = clean(raw)
        if t is None:
            why["unclean"] += 1
            continue
        key = t.lower()
        if key in seen:
            why["duplicate"] += 1
            continue
        seen.add(key)
        sh = shingles(t)
        if any(jaccard(sh, k) >= threshold for k in kept_sh):
            why["near_duplicate"] += 1
            continue
        if any(jaccard(sh, a) >= threshold for a in apart_sh):
            why["near_evaluation_prompt"] += 1
            continue
        kept.append(t)
        kept_sh.append(sh)
    return kept, why


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--num", type=int, default=1200, help="prompts to keep")
    ap.add_argument("--out", default=str(ROOT / "data" / "prompts" / "magpie.jsonl"))
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.95)
    args = ap.parse_args()

    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams

    from dspark.chat import TOKENIZER_DEFAULT
    from dspark.prompts import read_conversations

    apart = []
    for name in KEEP_APART:
        convs, _ = read_conversations(ROOT / "data" / "prompts" / name)
        apart += [m["content"] for c in convs for m in c.prompt_messages if m["role"] == "user"]
    llm = LLM(
        model=args.target, dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=128, seed=args.seed
    )
    tok = llm.get_tokenizer()
    prefix = tok(user_turn_prefix(tok, TOKENIZER_DEFAULT), add_special_tokens=False)["input_ids"]
    kept, why, asked = [], {}, 0
    for round_ in range(8):  # more candidates until enough survive (bounded)
        n = max(64, int((args.num - len(kept)) * 1.6))
        params = SamplingParams(
            n=n,
            temperature=args.temperature,
            top_p=args.top_p,
            max_tokens=96,
            seed=args.seed + round_,
            stop_token_ids=[tok.eos_token_id],
        )
        out = llm.generate([{"prompt_token_ids": prefix}], params, use_tqdm=False)[0]
        asked += n
        kept, why = select([*kept, *[o.text for o in out.outputs]], apart)
        print(f"round {round_}: {asked} written, {len(kept)} kept ({why})", flush=True)
        if len(kept) >= args.num:
            break
    kept = kept[: args.num]
    rows = [{"id": f"magpie-{i:04d}", "category": f"magpie_{category(t)}", "prompt": t} for i, t in enumerate(kept)]
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["category"]] = counts.get(r["category"], 0) + 1
    print(f"wrote {len(rows)} prompts to {args.out}: {counts}")


if __name__ == "__main__":
    main()
