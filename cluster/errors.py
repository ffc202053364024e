"""How a failure is named in the job's messages: one line that says what went wrong.

A Ray error's text is the remote traceback; its last line is the dependency's own message
(`ValueError: prompt of 5000 tokens ...`). An exception with no text is named by its type.
A mistake in the config is a `ConfigError` whose message names the key to change (the schema
in `cluster.config`, its checks in `cluster.config_checks`, both raise it).
"""

from __future__ import annotations


class ConfigError(ValueError):
    pass


def cause_of(error: BaseException, limit: int = 400) -> str:
    inner = getattr(error, "cause", None)  # RayTaskError: the exception raised in the actor
    lines = [line for line in str(inner if inner is not None else error).strip().splitlines() if line.strip()]
    return lines[-1].strip()[:limit] if lines else type(inner if inner is not None else error).__name__


TRACEBACK = "Traceback (most recent call last):"
CHAIN_LINES = ("During handling of the above exception", "The above exception was the direct cause")


def last_exception_line(log_text: str) -> str | None:
    """The exception line (`ValueError: ...`) of the last traceback printed in `log_text`, None if
    there is none. A logger that prefixes every line of a record (vLLM's: `(Worker pid=7) ERROR
    12-06 03:30:00 [file.py:953] `) gives the traceback's lines the prefix its first line has: the
    record is the run of lines that share it, and its last exception line is the one raised last."""
    lines = log_text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.rstrip().endswith(TRACEBACK)]
    if not starts:
        return None
    first = lines[starts[-1]]
    prefix = first[: first.rindex(TRACEBACK)]
    found = None
    for line in lines[starts[-1] + 1 :]:
        if not line.startswith(prefix):
            break
        body = line[len(prefix) :]
        if not body.strip() or body[0].isspace():
            continue
        if body.startswith(CHAIN_LINES) or body.startswith(TRACEBACK):
            continue
        found = body.strip()
        if not prefix:  # an unprefixed traceback ends at its exception line
            break
    return found
