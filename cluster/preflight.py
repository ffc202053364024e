"""What the job checks before it connects to Ray or starts anything: each problem a
`ConfigError` naming the key, the file and the line, printed as one line (no traceback).

    conversations = check_inputs(cfg)   # output_dir, target.path, every line of data.prompts, eval_sets
    lock = RunDirLock(cfg.run_dir).acquire()   # one job writes a run directory at a time
    check_ray_head()                    # a dead head is named, not waited on forever

Light imports only (no torch, no Ray at module level): the entry script runs these before its
heavy imports, so a mistake costs a second, not a start-up.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from cluster.config import LOCAL_TARGET, RANDOM_TARGET, ROOT, ConfigError, JobConfig

PROMPTS_DIR = ROOT / "data" / "prompts"
SHOWN_BAD_LINES = 5  # malformed lines named in one message; the rest counted
RAY_PROBE_TIMEOUT_S = 5.0  # a live head answers a TCP connect in milliseconds, even across a rack


def repo_path(src: str) -> Path:
    """A path of the config: absolute, or relative to the repository."""
    return Path(src) if Path(src).is_absolute() else ROOT / src


def check_inputs(cfg: JobConfig) -> list:
    """Everything the job reads from disk before it starts, cheapest first; the conversations of
    `data.prompts` (read once, every line checked), for the job to split."""
    check_output_dir(cfg)
    check_target_path(cfg)
    conversations = read_prompt_files(cfg)
    check_split(cfg, conversations)
    for where, src in judged_sets(cfg).items():
        read_checked(repo_path(src), where)
    return conversations


def judged_sets(cfg: JobConfig) -> dict[str, str]:
    """The prompt files the job judges the drafter on besides the held-out split, by the config
    key that names each: `data.eval_sets.<name>` and `data.long_context_prompts`."""
    out = {f"data.eval_sets.{name}": src for name, src in cfg.data.eval_sets.items()}
    if cfg.data.long_context_prompts:
        out["data.long_context_prompts"] = cfg.data.long_context_prompts
    return out


SUBMITTED_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # set by Ray in the driver of a `ray job submit` job


def check_output_dir(cfg: JobConfig, environ=os.environ) -> None:
    """The run directory can be made: neither it, `output_dir` nor anything above is a file.
    (Whether it can be written is learnt by writing its lock: `RunDirLock`.) Under `ray job
    submit --working-dir` a relative `output_dir` is refused: the job runs in Ray's copy of the
    working directory, where the run (checkpoints, the drafter) would land and be lost with it."""
    if SUBMITTED_JOB_ENV in environ and not Path(cfg.output_dir).is_absolute():
        raise ConfigError(
            f"config error at `output_dir`: {cfg.output_dir!r} is relative, and this job was submitted "
            f"with `ray job submit`: it runs in Ray's copy of the working directory ({ROOT}), which Ray "
            f"removes with the job's files. Give an absolute path (on a cluster: storage every node "
            f"shares; scripts/run_local.sh passes output_dir=$PWD/outputs)"
        )
    for above in (cfg.run_dir, *cfg.run_dir.parents):
        if above.exists():
            if not above.is_dir():
                raise ConfigError(
                    f"config error at `output_dir`: {above} is a file, not a directory (the run "
                    f"directory would be {cfg.run_dir})"
                )
            return


def check_target_path(cfg: JobConfig) -> None:
    """`target.path` is one of the built-in targets or a directory with a config.json."""
    if cfg.target.path in (LOCAL_TARGET, RANDOM_TARGET):
        return
    path = Path(cfg.target.path)
    if not path.exists():
        raise ConfigError(
            f"config error at `target.path`: {path} does not exist (a Hugging Face checkpoint directory, "
            f"or `{LOCAL_TARGET}` / `{RANDOM_TARGET}`)"
        )
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"config error at `target.path`: {path} has no config.json: not a Hugging Face checkpoint directory"
        )


def read_checked(path: Path, key: str) -> list:
    """The conversations of one prompt file; a missing file, a file without prompts or any
    malformed line (not UTF-8, not JSON, not a conversation) refused naming `key`, the file and
    the line. Refused, not skipped: a file with bad lines is not the data its author meant (a
    file of them left the job with "no training prompts ... 0 read" after Ray had started)."""
    from dspark.prompts import read_conversations

    if not path.exists():
        there = sorted(p.name for p in PROMPTS_DIR.glob("*.jsonl"))
        raise ConfigError(
            f"config error at `{key}`: {path} does not exist"
            + (f" ({PROMPTS_DIR} holds {', '.join(there)})" if there else "")
        )
    try:
        convs, report = read_conversations(path)
    except OSError as e:
        raise ConfigError(f"config error at `{key}`: cannot read {path}: {e.strerror or e}") from None
    if report.bad:
        shown = "; ".join(f"{path}:{line}: {why}" for line, why in report.bad[:SHOWN_BAD_LINES])
        more = f" (and {len(report.bad) - SHOWN_BAD_LINES} more)" if len(report.bad) > SHOWN_BAD_LINES else ""
        raise ConfigError(
            f"config error at `{key}`: {len(report.bad)} malformed line(s) of {path}: {shown}{more}; fix or remove them"
        )
    if not convs:
        raise ConfigError(f"config error at `{key}`: no prompts in {path}")
    return convs


def read_prompt_files(cfg: JobConfig) -> list:
    """Every `data.prompts` file, checked line by line; an id in two places refused."""
    convs, where = [], {}
    for i, src in enumerate(cfg.data.prompts):
        path = repo_path(src)
        for c in read_checked(path, f"data.prompts[{i}]"):
            if c.id in where:
                raise ConfigError(
                    f"config error at `data.prompts`: prompt id {c.id!r} appears twice across "
                    f"data.prompts ({where[c.id]} and {path})"
                )
            where[c.id] = path
            convs.append(c)
    if not convs:
        raise ConfigError("config error at `data.prompts`: no prompt files")
    return convs


def check_split(cfg: JobConfig, convs: list) -> None:
    """Both sides of the split hold prompts: the job trains on one and evaluates on the other
    (an empty held-out side failed the evaluation after the whole training)."""
    from dspark.prompts import split

    train, held = split(convs, cfg.data.heldout_fraction, cfg.data.split_seed)
    if not held:
        raise ConfigError(
            f"config error at `data.heldout_fraction`: {cfg.data.heldout_fraction} of {len(convs)} prompts "
            f"holds out none, and the job evaluates the drafter on the held-out prompts: raise it"
        )
    if not train:
        raise ConfigError(
            f"config error at `data.heldout_fraction`: {cfg.data.heldout_fraction} holds out all "
            f"{len(convs)} prompts: none is left to train on"
        )


class RunDirLock:
    """One job writes a run directory at a time: an exclusive `flock` on `<run_dir>/job.lock`,
    taken before the job writes anything there and held while its process lives. The kernel
    drops it when the process ends, however it ends: a crashed job leaves no stale lock. The
    file names the holder for the job refused. (`flock` is per host on some network file
    systems: two hosts writing one shared run directory are not caught.)"""

    FILE = "job.lock"

    def __init__(self, run_dir: Path) -> None:
        self.run_dir, self.fd = Path(run_dir), None

    def acquire(self) -> RunDirLock:
        path = self.run_dir / self.FILE
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by the job's subprocesses
        except OSError as e:
            raise ConfigError(f"config error at `output_dir`: cannot write {self.run_dir}: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "a process that has not said who it is"
            os.close(fd)
            raise ConfigError(
                f"run directory {self.run_dir} is in use by another job: {holder}. Wait for it to end "
                "(or stop it), or give this one another run_name or output_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(
            fd,
            f"pid {os.getpid()} on {socket.gethostname()}, since "
            f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}\n".encode(),
            0,
        )
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the only descriptor drops the lock
            self.fd = None

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def ray_record_path() -> Path:
    """Where `ray start` records the current cluster's address (`ray.init()` without an address
    reads it): under $RAY_TMPDIR, $TMPDIR or /tmp, as Ray decides."""
    try:
        from ray._common.utils import get_ray_address_file

        return Path(get_ray_address_file(None))
    except ImportError:  # another Ray layout: its documented default
        return Path(os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp") / "ray" / "ray_current_cluster"


@dataclass(frozen=True)
class RayHead:
    address: str  # host:port of its GCS
    record: Path | None  # the record of `ray start` that named it; None: $RAY_ADDRESS did


def ray_head_address(environ=os.environ, record: Path | None = None) -> RayHead | None:
    """The head `ray.init()` without an address connects to, in Ray's order ($RAY_ADDRESS, then
    the record of `ray start`), or None where Ray starts its own (RAY_ADDRESS=local, no record)."""
    env = environ.get("RAY_ADDRESS", "")
    if env and env != "auto":
        return None if env == "local" else RayHead(env.removeprefix("ray://"), None)
    record = record or ray_record_path()
    try:
        text = record.read_text().strip()
    except OSError:
        return None
    return RayHead(text, record) if text else None


def check_ray_head(
    environ=os.environ, record: Path | None = None, timeout_s: float = RAY_PROBE_TIMEOUT_S
) -> RayHead | None:
    """A TCP connect to the head's GCS within `timeout_s`, before `ray.init`: against a head
    that died (a crash, a reboot that left the record behind), `ray.init` waits on its address
    without end, saying only "Connecting to existing Ray cluster"."""
    head = ray_head_address(environ, record)
    if head is None:
        return None
    host, _, port = head.address.rpartition(":")
    if not host or not port.isdigit():
        return head  # not host:port: Ray's own error names it
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        why = f"no answer within {timeout_s:g} s" if isinstance(e, TimeoutError) else (e.strerror or str(e)).lower()
        if head.record is None:
            raise ConfigError(
                f"RAY_ADDRESS={environ['RAY_ADDRESS']}: no Ray head answers at {head.address} ({why}). "
                "Start that head, or point RAY_ADDRESS at a running one (RAY_ADDRESS=local: the job "
                "starts its own)"
            ) from None
        raise ConfigError(
            f"no Ray head answers at {head.address} ({why}), the address in Ray's record of the current "
            f"cluster, {head.record}: the head it names is gone (a crash, or a reboot that left the record "
            f"behind). Remove that file (or run `ray stop`, which also stops this user's other Ray "
            f"processes here) and the job starts its own Ray; or set RAY_ADDRESS=host:port to a running "
            f"head"
        ) from None
    return head


LOOPBACK_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # Ray's one-machine switch (ENVIRONMENT.md)
RAY_INIT_TIMEOUT_S = 120.0  # joining a live head takes seconds; Ray's own wait never ends


def keep_ray_on_loopback(head: RayHead | None, environ=os.environ) -> None:
    """A job that starts its own Ray, or joins a head on loopback (scripts/run_local.sh's): Ray's
    one-machine switch, as that head was started with. Without it Ray turns 127.0.0.1 into the
    machine's address, where a loopback head does not listen, and `ray.init` waits without end
    printing "Failed to connect to GCS at address <host>:6379"."""
    host = head.address.rpartition(":")[0].strip("[]") if head is not None else None
    if head is None or host in ("127.0.0.1", "localhost", "::1") or host.startswith("127."):
        environ.setdefault(LOOPBACK_SWITCH, "0")


def join_ray(init, head: RayHead | None, stop_sent, timeout_s: float = RAY_INIT_TIMEOUT_S, poll_s: float = 0.5) -> None:
    """`init()` (ray.init) within `timeout_s`, answering a stop meanwhile: it runs in a daemon
    thread while this one waits. ConfigError naming the address and what to do past the
    deadline; `stop_sent()` truthy (a SIGTERM's Stop) ends the wait with JobStopped. Either way the
    caller exits the process (the thread may still be inside Ray)."""
    import threading

    from cluster.control import JobStopped

    outcome: dict = {}

    def run() -> None:
        try:
            init()
            outcome["done"] = True
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True, name="ray-init")
    thread.start()
    deadline = time.monotonic() + timeout_s
    while thread.is_alive():
        thread.join(poll_s)
        stop = stop_sent()
        if stop is not None and thread.is_alive():
            raise JobStopped(f"stopped while joining Ray: {stop.reason}", "start-up (joining Ray)")
        if time.monotonic() > deadline and thread.is_alive():
            where = head.address if head is not None else "a Ray of its own"
            raise ConfigError(
                f"ray.init did not connect to {where} within {timeout_s:g} s. A head started on loopback "
                f"needs {LOOPBACK_SWITCH}=0 in every process that joins it (the job sets it where the "
                f"head's address is 127.0.0.1); check the head with `ray status`, or run with "
                f"RAY_ADDRESS=local (the job starts its own Ray)"
            )
    if "error" in outcome:
        raise outcome["error"]
