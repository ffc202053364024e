"""A Prometheus beside a local job, on loopback only: what `scripts/monitor.sh` starts next to the
head of `scripts/run_local.sh`, and what the end-to-end test runs to read the dashboard's queries
against a real job (tests/integration/test_job.py).

It scrapes the targets Ray writes to its service-discovery file (`<ray temp dir>/
prom_metrics_service_discovery.json`: the node's metrics agent, the autoscaler monitor, the
dashboard) or a fixed list, loads the alerting rules of `deploy/prometheus/dspark_alerts.yaml`,
listens on `127.0.0.1:PORT` only and keeps its data in a directory of the run with a bounded
retention. `python -m cluster.monitoring start|stop|status` runs it detached under a small watcher
that stops it when the Ray head is gone (its GCS port stops answering) or on `stop`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
ALERTS = ROOT / "deploy" / "prometheus" / "dspark_alerts.yaml"
RETENTION = "15d"  # and at most RETENTION_SIZE on disk, whichever comes first
RETENTION_SIZE = "1GB"
DEFAULT_PORT = 9090  # Ray's dashboard looks there unless RAY_PROMETHEUS_HOST says otherwise


def ray_sd_file() -> Path:
    """Where Ray's head writes the scrape targets of its nodes (a link to the session's file),
    under Ray's temp dir: $RAY_TMPDIR/ray, /tmp/ray by default."""
    return Path(os.environ.get("RAY_TMPDIR", "/tmp")) / "ray" / "prom_metrics_service_discovery.json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_answers(host: str, port: int, timeout: float = 2.0) -> bool:
    try:
        socket.create_connection((host, port), timeout).close()
        return True
    except OSError:
        return False


def config_text(
    *,
    sd_file: Path | None = None,
    targets: list[str] | None = None,
    scrape_interval_s: float = 10,
    rule_files: list[Path] | tuple = (ALERTS,),
) -> str:
    """prometheus.yml: Ray's nodes (from the service-discovery file, or the given host:port list)
    scraped every `scrape_interval_s`, the rules evaluated as often."""
    if (sd_file is None) == (targets is None):
        raise ValueError("give either sd_file or targets")
    job: dict = {"job_name": "ray"}
    if sd_file is not None:  # re-read every 10 s: a new head session re-points Ray's link
        job["file_sd_configs"] = [{"files": [str(sd_file)], "refresh_interval": "10s"}]
    else:
        job["static_configs"] = [{"targets": list(targets), "labels": {"job": "ray"}}]
    interval = f"{scrape_interval_s:g}s"
    cfg = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval, "scrape_timeout": interval},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": [job],
    }
    return yaml.safe_dump(cfg, sort_keys=False)


def command(config: Path, data_dir: Path, port: int, prometheus: str = "prometheus") -> list[str]:
    """The server on loopback only, its TSDB in `data_dir`, retention bounded in time and size."""
    return [
        prometheus,
        f"--config.file={config}",
        f"--web.listen-address=127.0.0.1:{port}",
        f"--storage.tsdb.path={data_dir}",
        f"--storage.tsdb.retention.time={RETENTION}",
        f"--storage.tsdb.retention.size={RETENTION_SIZE}",
        "--log.level=warn",
    ]


class PrometheusError(RuntimeError):
    pass


class Prometheus:
    """One Prometheus server, started in `workdir` (its config, TSDB and log), and a client of its
    HTTP API. Every wait has a deadline; `stop` ends the process (SIGTERM, then SIGKILL)."""

    def __init__(self, workdir: Path, port: int | None = None, prometheus: str | None = None) -> None:
        self.workdir = Path(workdir)
        self.port = port or free_port()
        self.binary = prometheus or shutil.which("prometheus")
        if not self.binary:
            raise PrometheusError("no `prometheus` binary on PATH: run scripts/bootstrap.sh (it installs Debian's)")
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, config: str, ready_timeout_s: float = 60.0, detach: bool = False) -> Prometheus:
        self.workdir.mkdir(parents=True, exist_ok=True)
        cfg = self.workdir / "prometheus.yml"
        cfg.write_text(config)
        if port_answers("127.0.0.1", self.port, 0.5):
            raise PrometheusError(f"port 127.0.0.1:{self.port} is taken")
        log = open(self.workdir / "prometheus.log", "ab")  # noqa: SIM115 - the child keeps it
        try:
            self.proc = subprocess.Popen(
                command(cfg, self.workdir / "data", self.port, self.binary),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=detach,
            )
        finally:
            log.close()
        self.wait_ready(ready_timeout_s)
        return self

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise PrometheusError(f"prometheus exited ({self.proc.returncode}): {self.log_tail()}")
            try:
                if urllib.request.urlopen(self.url + "/-/ready", timeout=2).status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise PrometheusError(f"prometheus not ready after {timeout_s:.0f} s: {self.log_tail()}")

    def log_tail(self, n: int = 2000) -> str:
        p = self.workdir / "prometheus.log"
        return p.read_text(errors="replace")[-n:] if p.exists() else ""

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)

    def __enter__(self) -> Prometheus:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- the HTTP API ------------------------------------------------------------------------
    def api(self, path: str, timeout_s: float = 30.0, **params) -> dict | list:
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params, doseq=True)
        try:
            body = json.loads(urllib.request.urlopen(url, timeout=timeout_s).read())
        except urllib.error.HTTPError as e:  # a bad query answers 400 with the reason
            body = json.loads(e.read() or b"{}")
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        return self.api("query", **params)["result"]

    def query_range(self, expr: str, start: float, end: float, step_s: float) -> list[dict]:
        return self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step_s:g}")["result"]

    def label_values(self, label: str, match: str, start: float | None = None, end: float | None = None) -> list[str]:
        params: dict = {"match[]": match}
        if start is not None:
            params.update(start=f"{start:.3f}", end=f"{end:.3f}")
        return self.api(f"label/{label}/values", **params)

    def targets_up(self) -> list[dict]:
        return [t for t in self.api("targets")["activeTargets"] if t["health"] == "up"]

    def rules(self) -> list[dict]:
        return [r for g in self.api("rules")["groups"] for r in g["rules"]]

    def wait_for(self, expr: str, timeout_s: float) -> list[dict]:
        """The instant result of `expr` once it is not empty (or [] at the deadline)."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.query(expr)
            if result or time.monotonic() >= deadline:
                return result
            time.sleep(0.5)


# -- scripts/monitor.sh: a detached server beside the local head -------------------------------
def _pidfile(workdir: Path) -> Path:
    return workdir / "monitor.pid"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


def _running(workdir: Path) -> int | None:
    """The watcher's pid if one of ours runs for `workdir`."""
    try:
        pid = int(_pidfile(workdir).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    try:  # the pid is ours only if that process is our watcher (pids are reused)
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    return pid if b"cluster.monitoring" in cmdline and b"serve" in cmdline and _alive(pid) else None


def serve(args) -> int:
    """The watcher: runs Prometheus and stops it when the head's GCS port stops answering (twice
    in a row, 5 s apart), on SIGTERM/SIGINT, or exits when Prometheus does."""
    workdir = Path(args.dir)
    prom = Prometheus(workdir, args.port)
    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stopping.append(1))
    prom.start(config_text(sd_file=Path(args.sd_file), scrape_interval_s=args.scrape_interval_s))
    host, _, port = args.head.rpartition(":")
    misses = 0
    try:
        while not stopping and prom.proc.poll() is None:
            misses = 0 if port_answers(host, int(port)) else misses + 1
            if misses >= 2:
                print(f"[monitor] the Ray head at {args.head} is gone: stopping Prometheus", flush=True)
                break
            for _ in range(10):
                if stopping:
                    break
                time.sleep(0.5)
    finally:
        prom.stop()
        _pidfile(workdir).unlink(missing_ok=True)
    return 0


def start(args) -> int:
    workdir = Path(args.dir)
    workdir.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{args.port}"
    if (pid := _running(workdir)) is not None:
        print(f"[monitor] Prometheus already runs at {url} (watcher {pid}, {workdir})")
        return 0
    if port_answers("127.0.0.1", args.port, 0.5):
        print(f"[monitor] port 127.0.0.1:{args.port} is taken: set DSPARK_PROMETHEUS_PORT", file=sys.stderr)
        return 1
    if not shutil.which("prometheus"):
        print("[monitor] no `prometheus` binary: run scripts/bootstrap.sh", file=sys.stderr)
        return 1
    log = open(workdir / "monitor.log", "ab")  # noqa: SIM115 - the child keeps it
    cmd = [sys.executable, "-m", "cluster.monitoring", "serve", "--dir", str(workdir), "--port", str(args.port)]
    cmd += ["--sd-file", args.sd_file, "--head", args.head, "--scrape-interval-s", str(args.scrape_interval_s)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
    )
    log.close()
    _pidfile(workdir).write_text(f"{proc.pid}\n")
    client = Prometheus(workdir, args.port)
    try:
        client.wait_ready(60)
    except PrometheusError as e:
        if proc.poll() is None:
            proc.terminate()
        print(f"[monitor] {e}\n{(workdir / 'monitor.log').read_text(errors='replace')[-1500:]}", file=sys.stderr)
        return 1
    kept = f"kept {RETENTION} / {RETENTION_SIZE}"
    print(f"[monitor] Prometheus at {url} (loopback only; data in {workdir / 'data'}, {kept})")
    print(f"[monitor] scraping Ray's targets from {args.sd_file}; alerts: {url}/alerts; stops with the head")
    return 0


def stop(args) -> int:
    workdir = Path(args.dir)
    pid = _running(workdir)
    if pid is None:
        print("[monitor] no Prometheus of ours runs for", workdir)
        return 0
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    print("[monitor] stopped" if not _alive(pid) else f"[monitor] watcher {pid} still runs after 30 s")
    return 0 if not _alive(pid) else 1


def status(args) -> int:
    pid = _running(Path(args.dir))
    print(f"[monitor] running (watcher {pid}) at http://127.0.0.1:{args.port}" if pid else "[monitor] not running")
    return 0 if pid else 3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster.monitoring", description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=["start", "stop", "status", "serve"])
    p.add_argument("--dir", default=str(ROOT / "outputs" / "prometheus"), help="config, TSDB and logs")
    p.add_argument("--port", type=int, default=int(os.environ.get("DSPARK_PROMETHEUS_PORT", DEFAULT_PORT)))
    p.add_argument("--sd-file", default=str(ray_sd_file()), help="Ray's service-discovery file")
    p.add_argument("--head", default="127.0.0.1:6379", help="the head's GCS address: Prometheus stops with it")
    p.add_argument("--scrape-interval-s", type=float, default=10.0)
    args = p.parse_args(argv)
    return {"start": start, "stop": stop, "status": status, "serve": serve}[args.action](args)


if __name__ == "__main__":
    sys.exit(main())
