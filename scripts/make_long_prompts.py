"""Generate the long-context evaluation set, `data/prompts/long_context.jsonl`.

Long prompts from our own long documents: this project's source modules, and its README
followed by its commented configs, cut
to a ladder of lengths (in the target's tokens) up to near the local target's context limit,
each with a task that needs the whole document (explain a module, summarise a document, answer
about its end). Never trained on (the job reads `data.prompts`, not this file), no public
benchmark text. The text is frozen into the file when it is generated: later edits to the
sources do not change the set. Each line has `id`, `category` (`long_code`, `long_doc`),
`prompt`, and `approx_tokens` (the document's length in the target's tokens).

    python scripts/make_long_prompts.py --target DIR [--out data/prompts/long_context.jsonl]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Document lengths in target tokens: the last stays below SmolLM2's 8192-token context with
# room for the template and an answer of up to 512 tokens.
LENGTHS = (1000, 2000, 4000, 7000)
CODE = [
    "cluster/data/ledger.py",
    "cluster/job/training_job.py",
    "cluster/store/client.py",
    "dspark/model.py",
    "cluster/config.py",
    "cluster/scaling/policy.py",
    "dspark/config.py",
    "cluster/training/trainer_rank.py",
]
TASKS_CODE = [
    "Explain what this module does, then list its classes and public functions with one sentence each.",
    "What are the failure cases this code handles, and what does it do in each? Answer as a list.",
    "Write a short docstring-style summary for the last function or class in this module, and explain how it "
    "relates to the rest of the file.",
]
TASKS_DOC = [
    "Summarise the document above in five bullet points.",
    "List every configuration key the document mentions, each with what it controls.",
    "What does the last section of the document say? Answer in a short paragraph.",
]


def cut(text: str, tokenizer, n_tokens: int) -> str:
    """The longest prefix of whole lines of `text` within `n_tokens` tokens."""
    out, used = [], 0
    for line in text.splitlines(keepends=True):
        n = len(tokenizer.encode(line, add_special_tokens=False))
        if used + n > n_tokens:
            break
        out.append(line)
        used += n
    return "".join(out)


def build(tokenizer) -> list[dict]:
    code = "\n\n".join(f"# file: {f}\n{(ROOT / f).read_text()}" for f in CODE)
    # The README alone is shorter than the longest rung: the commented configs follow it (no
    # text repeats, which a drafter could copy).
    doc = "\n\n".join(
        [(ROOT / "README.md").read_text()]
        + [f"# {f.name}\n{f.read_text()}" for f in sorted((ROOT / "configs").glob("*.yaml"))]
    )
    rows = []
    for i, n in enumerate(LENGTHS):
        for _j, (cat, source, tasks) in enumerate((("long_code", code, TASKS_CODE), ("long_doc", doc, TASKS_DOC))):
            # Each rung starts at a different place in the sources, so the rungs are not prefixes of each other.
            lines = source.splitlines(keepends=True)
            start = (i * len(lines)) // (len(LENGTHS) + 1)
            body = cut("".join(lines[start:] + lines[:start]), tokenizer, n)
            fence = ("```python\n", "\n```") if cat == "long_code" else ("", "")
            for k in range(2 if n < LENGTHS[-1] else 3):
                task = tasks[(i + k) % len(tasks)]
                rows.append(
                    {
                        "id": f"long-{n}-{cat}-{k}",
                        "category": cat,
                        "approx_tokens": n,
                        "prompt": f"{fence[0]}{body}{fence[1]}\n\n{task}",
                    }
                )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True, help="the target's directory (its tokenizer measures the lengths)")
    ap.add_argument("--out", default=str(ROOT / "data" / "prompts" / "long_context.jsonl"))
    args = ap.parse_args()
    from transformers import AutoTokenizer

    rows = build(AutoTokenizer.from_pretrained(args.target))
    with open(args.out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"wrote {len(rows)} long prompts to {args.out}: lengths {LENGTHS} tokens")


if __name__ == "__main__":
    main()
