"""How a failure is named in the job's messages: one line that says what went wrong.

A Ray error's text is the remote traceback; its last line is the dependency's own message
(`ValueError: prompt of 5000 tokens ...`). An exception with no text is named by its type.
"""

from __future__ import annotations


def cause_of(error: BaseException, limit: int = 400) -> str:
    inner = getattr(error, "cause", None)  # RayTaskError: the exception raised in the actor
    lines = [line for line in str(inner if inner is not None else error).strip().splitlines() if line.strip()]
    return lines[-1].strip()[:limit] if lines else type(inner if inner is not None else error).__name__
