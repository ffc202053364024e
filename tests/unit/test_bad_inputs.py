"""Bad inputs fail at once, before any actor starts, with a message that names the cause: the
config key, the file and line, the prompt file's line; never a bare traceback from deep inside
a library, never a hang."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from cluster.config import ROOT, ConfigError, JobConfig
from cluster.config_checks import check_against_target
from cluster.config_fields import RANGE, declared
from cluster.config_load import load_config

LOCAL = ROOT / "configs" / "local.yaml"


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.lr=-0.001", r"`trainer\.lr`: -0\.001 is out of range \(must be > 0\)"),
        ("trainer.batch_tokens=0", r"`trainer\.batch_tokens`: 0 is out of range"),
        ("trainer.checkpoint_interval=0", r"`trainer\.checkpoint_interval`"),
        ("data.epochs=0", r"`data\.epochs`"),
        (
            "trainer.time_budget_s=-60",
            r"`trainer\.time_budget_s`: -60\.0 is out of range \(must be > 0 and <= 2592000\)",
        ),
        (
            "data.heldout_fraction=1.0",
            r"`data\.heldout_fraction`: 1\.0 is out of range \(must be > 0 and < 1: the job evaluates",
        ),
        ("trainer.zero_stage=7", r"`trainer\.zero_stage`: 7 is out of range \(must be >= 0 and <= 3\)"),
        (
            "sampling.max_tokens=1024",
            r"`sampling\.max_tokens`: 1024 leaves no room for a prompt within target\.max_model_len=1024",
        ),
        ("run_name=../escape", r"`run_name`: '\.\./escape' must be one folder name"),
        ("run_name=a/b", r"`run_name`"),
        ("transport.master_port=70000", r"`transport\.master_port`"),
        ("sampling.top_p=0", r"`sampling\.top_p`"),
        ("data.max_failed_fraction=2", r"`data\.max_failed_fraction`"),
        ("drafter.num_anchors=0", r"`drafter\.num_anchors`"),
    ],
)
def test_bad_input_config_value_names_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(LOCAL, [override])


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.epochs=1000", r"`data\.epochs`: 1000 is out of range \(must be >= 1 and <= 100: "),
        (
            "trainer.time_budget_s=.inf",
            r"`trainer\.time_budget_s`: inf is not a finite number \(must be > 0 and <= 2592000\)",
        ),
        (
            "trainer.data_timeout_s=1e9",
            r"`trainer\.data_timeout_s`: 1000000000\.0 is out of range \(must be > 0 and <= 86400\)",
        ),
        ("inference.generation_timeout_s=.inf", r"`inference\.generation_timeout_s`: inf is not a finite number"),
        ("autoscaler.cooldown_s=-1", r"`autoscaler\.cooldown_s`: -1\.0 is out of range \(must be >= 0 and <= 86400\)"),
        ("trainer.lr=.nan", r"`trainer\.lr`: nan is not a finite number"),
        (
            "data.heldout_fraction=0",
            r"`data\.heldout_fraction`: 0\.0 is out of range \(must be > 0 and < 1: the job evaluates "
            r"the drafter on the held-out prompts\)",
        ),
    ],
)
def test_bad_input_unbounded_values_are_refused(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(LOCAL, [override])


def test_every_wait_and_the_epochs_declare_an_upper_bound():
    """A new timeout, delay or interval (a `*_s` field that is not a rate) without a bound fails
    here: `.inf` or a typo of a few zeros would hide the hang it is there to catch."""

    def keys(cls, prefix=""):
        for f in fields(cls):
            section = f.default_factory() if f.default_factory is not MISSING else None
            yield from keys(type(section), f"{prefix}{f.name}.") if is_dataclass(section) else [f"{prefix}{f.name}"]

    bounded = {key for key, r in declared(JobConfig, RANGE) if r.hi is not None}
    waits = {k for k in keys(JobConfig) if k.endswith("_s") and not k.endswith("_per_s")}
    assert waits and waits | {"data.epochs"} <= bounded, sorted(waits - bounded)


def test_bad_input_config_file_names_the_file_and_line(tmp_path):
    listed = tmp_path / "list.yaml"
    listed.write_text("- run_name: x\n- device: cpu\n")
    with pytest.raises(ConfigError, match=r"list\.yaml: the top level must be a mapping of sections .* not a list"):
        load_config(listed)
    broken = tmp_path / "broken.yaml"
    broken.write_text("run_name: x\ntrainer:\n  lr: [1, 2\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml: line \d+, column \d+: not valid YAML"):
        load_config(broken)
    with pytest.raises(ConfigError, match=r"missing\.yaml: No such file"):
        load_config(tmp_path / "missing.yaml")


def test_bad_input_against_the_target_names_the_key():
    smol = SimpleNamespace(num_hidden_layers=30, vocab_size=49152, max_position_embeddings=8192)
    for override, key in [
        ("target.aux_layer_ids=[2,8,31]", "target.aux_layer_ids"),
        ("target.aux_layer_ids=[2,2]", "target.aux_layer_ids"),
        ("drafter.draft_vocab_size=60000", "drafter.draft_vocab_size"),
        ("drafter.mask_token_id=49152", "drafter.mask_token_id"),
        ("target.max_model_len=16384", "target.max_model_len"),
    ]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            check_against_target(load_config(LOCAL, [override, "sampling.max_tokens=160"]), smol)
    check_against_target(load_config(LOCAL), smol)  # the shipped config is fine


def test_bad_input_prompts_file_names_the_line(tmp_path):
    from cluster.data import load_prompts
    from dspark.prompts import read_conversations

    f = tmp_path / "prompts.jsonl"
    f.write_bytes(
        json.dumps({"id": "a", "prompt": "hello"}).encode()
        + b"\n"
        + b'{"id": "b", "prompt": "caf\xe9"}\n'
        + b"not json\n"
    )
    convs, report = read_conversations(f)
    assert [c.id for c in convs] == ["a"]
    assert report.bad[0][0] == 2 and "not UTF-8: byte 0xe9" in report.bad[0][1] and report.bad[1][0] == 3
    assert "line 2: not UTF-8" in report.summary()
    # The job refuses the file, naming each bad line (it used to skip them and find nothing to train on)
    with pytest.raises(
        ConfigError,
        match=r"`data\.prompts\[0\]`: 2 malformed line\(s\) of .*prompts\.jsonl: "
        r".*prompts\.jsonl:2: not UTF-8: byte 0xe9.*prompts\.jsonl:3: Expecting value",
    ):
        load_prompts(load_config(LOCAL, [f"data.prompts=[{f}]"]))
    many = tmp_path / "many.jsonl"
    many.write_text("[1]\n" * 8)
    with pytest.raises(
        ConfigError,
        match=r"8 malformed line\(s\) .*many\.jsonl:5: expected a JSON object, got list "
        r"\(and 3 more\)",
    ):
        load_prompts(load_config(LOCAL, [f"data.prompts=[{many}]"]))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match=r"`data\.prompts\[0\]`: no prompts in .*empty\.jsonl"):
        load_prompts(load_config(LOCAL, [f"data.prompts=[{empty}]"]))
    once, again = tmp_path / "once.jsonl", tmp_path / "again.jsonl"
    once.write_text(json.dumps({"id": "a", "prompt": "hello"}) + "\n")
    again.write_text(json.dumps({"id": "a", "prompt": "hello again"}) + "\n")
    with pytest.raises(
        ConfigError,
        match=r"prompt id 'a' appears twice across data\.prompts \(.*once\.jsonl and "
        r".*again\.jsonl\)",
    ):
        load_prompts(load_config(LOCAL, [f"data.prompts=[{once},{again}]"]))


def test_bad_input_paths_are_named_before_anything_starts(tmp_path):
    from cluster.preflight import check_inputs

    def refused(overrides, message):
        with pytest.raises(ConfigError, match=message):
            check_inputs(load_config(LOCAL, [f"output_dir={tmp_path / 'out'}", *overrides]))

    refused([f"target.path={tmp_path / 'nowhere'}"], r"`target\.path`: .*nowhere does not exist")
    refused([f"target.path={tmp_path}"], r"`target\.path`: .* has no config\.json")
    (tmp_path / "file").write_text("")
    refused([f"output_dir={tmp_path / 'file'}"], r"`output_dir`: .*file is a file, not a directory")
    refused([f"output_dir={tmp_path / 'file' / 'below'}"], r"`output_dir`: .*file is a file")
    refused(
        [f"data.prompts=[{tmp_path / 'missing.jsonl'}]"],
        r"`data\.prompts\[0\]`: .*missing\.jsonl does not exist \(.*data/prompts holds .*default\.jsonl",
    )
    refused(
        ["data.eval_sets={ood: data/prompts/odd.jsonl}"],
        r"`data\.eval_sets\.ood`: .*odd\.jsonl does not exist \(.*holds .*ood\.jsonl",
    )
    two = tmp_path / "two.jsonl"
    two.write_text("".join(json.dumps({"id": f"p{i}", "prompt": "hi"}) + "\n" for i in range(2)))
    refused(
        [f"data.prompts=[{two}]", "data.heldout_fraction=0.01"],
        r"`data\.heldout_fraction`: 0\.01 of 2 prompts holds out none, and the job evaluates",
    )
    with pytest.raises(ConfigError, match=r"`data\.eval_sets`: '\.\./x' must be a name"):
        load_config(LOCAL, ["data.eval_sets={../x: data/prompts/ood.jsonl}"])


def test_a_target_transformers_cannot_read_is_named(tmp_path):
    from cluster.target import read_config

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(
        ConfigError,
        match=rf"`target\.path`: transformers cannot read {tmp_path} as a model: "
        r"Unrecognized model",
    ):
        read_config(str(tmp_path), False)
    (tmp_path / "config.json").write_text("not json")
    with pytest.raises(ConfigError, match=r"`target\.path`: .* is not a valid JSON file"):
        read_config(str(tmp_path), False)


def test_a_run_directory_is_written_by_one_job_at_a_time(tmp_path):
    from cluster.preflight import RunDirLock

    run_dir = tmp_path / "runs" / "r"
    with RunDirLock(run_dir):
        with pytest.raises(
            ConfigError, match=rf"run directory {run_dir} is in use by another job: pid {os.getpid()} on "
        ):
            RunDirLock(run_dir).acquire()
    RunDirLock(run_dir).acquire().release()  # released with the job
    with pytest.raises(ConfigError, match=r"`output_dir`: cannot write /sys/dspark-run: "):
        RunDirLock(Path("/sys/dspark-run")).acquire()  # not writable, even by root
    # A holder that dies without a word (SIGKILL) leaves no lock behind: the kernel drops it
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from cluster.preflight import RunDirLock; "
            f"RunDirLock({str(run_dir)!r}).acquire(); print('held', flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=rf"pid {holder.pid} on "):
            RunDirLock(run_dir).acquire()
    finally:
        holder.kill()
        holder.wait(timeout=10)
    RunDirLock(run_dir).acquire().release()


def closed_port() -> int:
    with socket.socket() as s:  # bound, then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_dead_ray_head_is_named_not_waited_on(tmp_path):
    from cluster.preflight import check_ray_head, ray_head_address

    record = tmp_path / "ray_current_cluster"
    assert ray_head_address({}, record) is None  # no record: ray.init starts its own
    port = closed_port()
    record.write_text(f"127.0.0.1:{port}\n")
    with pytest.raises(
        ConfigError,
        match=rf"no Ray head answers at 127\.0\.0\.1:{port} \(connection refused\), the "
        rf"address in Ray's record of the current cluster, {record}: .*Remove that "
        r"file \(or run `ray stop`.*RAY_ADDRESS=host:port",
    ):
        check_ray_head({}, record)
    with pytest.raises(ConfigError, match=rf"RAY_ADDRESS=127\.0\.0\.1:{port}: no Ray head answers .*RAY_ADDRESS=local"):
        check_ray_head({"RAY_ADDRESS": f"127.0.0.1:{port}"}, record)  # the environment first, as Ray reads it
    check_ray_head({"RAY_ADDRESS": "local"}, record)  # a fresh Ray: nothing to probe
    with socket.socket() as live:
        live.bind(("127.0.0.1", 0))
        live.listen()
        record.write_text(f"127.0.0.1:{live.getsockname()[1]:d}")
        check_ray_head({}, record)


def test_evaluate_takes_remote_code_only_from_its_flag(tmp_path):
    from dspark import evaluate

    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"dspark_cluster": {"target_trust_remote_code": True}}))
    args = evaluate.parse_args(
        ["--target", str(tmp_path / "target"), "--drafter", str(drafter), "--prompts", "p.jsonl", "--json", "o.json"]
    )
    with pytest.raises(
        SystemExit, match=r"trained on a target that runs its own model code .*pass --trust-remote-code"
    ):
        evaluate.check_remote_code(args)
    args.trust_remote_code = True
    evaluate.check_remote_code(args)


def run_entry(args: list[str], env: dict[str, str], shell: bool = False) -> subprocess.Popen:
    """The job's entry point as users start it. RAY_ADDRESS names a closed port unless the case
    sets its own: should a check let a bad input through, the job stops at the probe, in a
    second, instead of starting Ray."""
    base = {**os.environ, "RAY_ADDRESS": f"127.0.0.1:{closed_port()}"}
    base.pop("DSPARK_JOB_ARGS", None)
    cmd = [sys.executable, "jobs/train_kimi_k3.py", *args]
    return subprocess.Popen(
        shlex.join(cmd) if shell else cmd,
        shell=shell,
        cwd=ROOT,
        env={**base, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_the_job_refuses_bad_input_in_one_line_without_a_traceback(tmp_path):
    """The entry point, as a subprocess: each case exits 2 within seconds with one line naming the
    cause; the cases run side by side."""
    from cluster.preflight import RunDirLock

    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"id": "a", "prompt": "hi"}\n{"id": "b", "prompt": "caf\xe9"}\n{"id": "c", "prompt": \n')
    (tmp_path / "ray" / "ray").mkdir(parents=True)
    dead = closed_port()
    (tmp_path / "ray" / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{dead}")
    out = f"output_dir={tmp_path / 'out'}"
    shell_env = json.loads(
        subprocess.run(
            [sys.executable, "scripts/runtime_env.py", "--config", "configs/local.yaml", "run_name=$HOME;echo x", out],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
            env={"DSPARK_CACHE": str(tmp_path), **os.environ},
        ).stdout
    )["env_vars"]
    cases = [
        (
            ["data.prompts=[/nowhere/prompts.jsonl]", out],
            {},
            r"`data\.prompts\[0\]`: /nowhere/prompts\.jsonl does not exist",
        ),
        (["target.path=/nowhere/target", out], {}, r"`target\.path`: /nowhere/target does not exist"),
        (
            [f"data.prompts=[{bad}]", out],
            {},
            rf"{re.escape(str(bad))}:2: not UTF-8: byte 0xe9 at column \d+; {re.escape(str(bad))}:3: Expecting value",
        ),
        (
            ["run_name=busy", out],
            {},
            rf"run directory {re.escape(str(tmp_path / 'out' / 'busy'))} is in use by another job: "
            rf"pid {os.getpid()} on ",
        ),
        (
            [out],
            {"RAY_ADDRESS": "", "RAY_TMPDIR": str(tmp_path / "ray")},
            rf"no Ray head answers at 127\.0\.0\.1:{dead} \(connection refused\), the address in Ray's record",
        ),
        # Ray runs the entrypoint with `sh -c`: the override travels in the environment, as written
        ([], shell_env, r"`run_name`: '\$HOME;echo x' must be one folder name"),
    ]
    with RunDirLock(tmp_path / "out" / "busy"):
        running = [(run_entry(args, env, shell=not args), message) for args, env, message in cases]
        try:
            for proc, message in running:
                output, _ = proc.communicate(timeout=60)
                lines = output.strip().splitlines()
                assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in output, output
                assert re.search(message, lines[0]), (message, output)
                assert "\nx\n" not in output
        finally:  # a case that hangs (the old `ray.init` on a dead head) is not left behind
            for proc, _ in running:
                proc.kill()
                proc.wait()


def test_a_failure_is_named_by_its_own_last_line():
    from cluster.errors import cause_of

    traceback = 'Traceback (most recent call last):\n  File "x.py", line 3\nValueError: prompt p7 is too long\n\n'
    assert cause_of(RuntimeError(traceback)) == "ValueError: prompt p7 is too long"
    assert cause_of(RuntimeError("  \n ")) == "RuntimeError"  # no text: the type (the old code raised IndexError)

    class RemoteFailure(Exception):  # what Ray's RayTaskError carries: the actor's own exception
        cause = KeyError("sample g0/p3 missing")

    assert cause_of(RemoteFailure("ray's traceback text")) == "'sample g0/p3 missing'"
    assert len(cause_of(RuntimeError("x" * 1000), 300)) == 300


@pytest.mark.parametrize("text", ["abc", "12", "0x4", "x4", "12x", "3x-1", "12x4x2"])
def test_bad_input_simulate_flag_is_a_message_not_a_traceback(text, capsys):
    """`--plan --simulate NxG` with anything else: one line naming the flag, exit 2 (it was a
    ValueError's traceback), before Ray starts."""
    sys.path.insert(0, str(ROOT))
    from jobs.train_kimi_k3 import main, simulated_cluster

    assert simulated_cluster("12x4") == (12, 4) and simulated_cluster(" 2X0 ") == (2, 0)
    assert main(["--config", str(ROOT / "configs" / "local.yaml"), "--plan", "--simulate", text, "run_name=r"]) == 2
    err = capsys.readouterr().err
    assert f"--simulate {text!r}: expected NxG" in err and "Traceback" not in err


def test_joining_ray_has_a_deadline_and_answers_a_stop():
    """`ray.init` against a head it cannot reach waits without end (a loopback head joined
    without Ray's one-machine switch): `join_ray` gives up at its deadline naming the address and
    the switch, and a stop sent meanwhile ends the wait; a head on loopback gets the switch."""
    import threading

    from cluster.control import ControlChannel, JobStopped, Stop
    from cluster.preflight import LOOPBACK_SWITCH, RayHead, join_ray, keep_ray_on_loopback

    forever = threading.Event()
    head = RayHead("127.0.0.1:6379", None)
    with pytest.raises(
        ConfigError, match=r"did not connect to 127\.0\.0\.1:6379 within 0\.3 s.*RAY_ENABLE_WINDOWS_OR_OSX"
    ):
        join_ray(forever.wait, head, lambda: None, timeout_s=0.3, poll_s=0.05)
    control = ControlChannel()
    threading.Timer(0.2, lambda: control.send(Stop("SIGTERM received"))).start()
    with pytest.raises(JobStopped, match="stopped while joining Ray: SIGTERM received"):
        join_ray(forever.wait, head, lambda: control.stop_sent, timeout_s=30, poll_s=0.05)
    join_ray(lambda: None, head, lambda: None, timeout_s=1)  # a join that works returns
    with pytest.raises(ValueError, match="bad address"):
        join_ray(lambda: (_ for _ in ()).throw(ValueError("bad address")), head, lambda: None, timeout_s=1)
    forever.set()

    environ = {}
    keep_ray_on_loopback(RayHead("10.0.0.5:6379", None), environ)
    assert LOOPBACK_SWITCH not in environ  # a cluster's head: Ray's own addressing
    for address in ("127.0.0.1:6379", "localhost:6379", "[::1]:6379"):
        environ = {}
        keep_ray_on_loopback(RayHead(address, None), environ)
        assert environ == {LOOPBACK_SWITCH: "0"}
    environ = {}
    keep_ray_on_loopback(None, environ)  # a Ray of the job's own
    assert environ == {LOOPBACK_SWITCH: "0"}


def test_bad_input_relative_output_dir_under_ray_job_submit_is_refused(tmp_path):
    """Under `ray job submit --working-dir` the job runs in Ray's copy of the working directory: a
    relative `output_dir` would put the run (checkpoints, the drafter) there. Refused, naming the
    key; an absolute one, or a job not submitted, goes on."""
    from cluster.preflight import SUBMITTED_JOB_ENV, check_output_dir

    cfg = load_config(ROOT / "configs" / "local.yaml", ["run_name=r", "output_dir=outputs"])
    check_output_dir(cfg, environ={})
    with pytest.raises(ConfigError, match=r"config error at `output_dir`: 'outputs' is relative.*ray job submit"):
        check_output_dir(cfg, environ={SUBMITTED_JOB_ENV: "{}"})
    cfg = load_config(ROOT / "configs" / "local.yaml", ["run_name=r", f"output_dir={tmp_path}"])
    check_output_dir(cfg, environ={SUBMITTED_JOB_ENV: "{}"})
