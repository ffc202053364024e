"""A small wrapper over `ray.util.metrics`: metrics by name, created on first use, with the
job's tags attached, so call sites stay one line (`metrics.gauge("queue_depth", 12, group="g0")`).

Every metric is exported as `ray_dspark_<name>` (Ray adds `ray_`) on the node's Prometheus endpoint, which the Ray
dashboard's metrics view reads.

Ray's metrics agent drops a gauge that was not set for two export intervals (~20 s, measured on
Ray 2.60), even while the process that set it lives: a job that reports every minute
(configs/kimi_k3.yaml) would show each gauge a third of the time, and none while it calibrates,
exports and evaluates at its end. `keep_alive` sets every gauge again to its last value every few
seconds until the job ends (tests/integration/test_job.py reads the series through Prometheus).
"""

from __future__ import annotations

import logging
import re
import threading

_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
log = logging.getLogger("dspark.metrics")


class Metrics:
    def __init__(self, prefix: str = "dspark", tags: dict[str, str] | None = None, backend=None) -> None:
        if backend is None:
            from ray.util import metrics as backend
        self.backend, self.prefix = backend, prefix
        self.tags = dict(tags or {})
        self._metrics: dict[str, object] = {}
        self._last: dict[tuple, tuple] = {}  # (name, tags) -> (gauge, value, tags): what `refresh` sets again
        self._lock = threading.Lock()

    def _get(self, kind: str, name: str, tag_keys: tuple[str, ...]):
        if not _NAME.match(name):
            raise ValueError(f"invalid metric name {name!r}")
        full = f"{self.prefix}_{name}"
        m = self._metrics.get(full)
        if m is None:
            cls = {"gauge": self.backend.Gauge, "counter": self.backend.Counter}[kind]
            m = cls(full, description=f"dspark-cluster {name.replace('_', ' ')}", tag_keys=tag_keys)
            self._metrics[full] = (m, tag_keys, kind)
            return m, tag_keys
        metric, keys, was = m
        if was != kind:
            raise ValueError(f"metric {full} is a {was}, not a {kind}")
        return metric, keys

    def _tags(self, tags: dict) -> tuple[tuple[str, ...], dict[str, str]]:
        merged = {**self.tags, **{k: str(v) for k, v in tags.items()}}
        return tuple(sorted(merged)), merged

    def gauge(self, name: str, value: float, **tags) -> None:
        keys, merged = self._tags(tags)
        metric, expected = self._get("gauge", name, keys)
        if keys != expected:
            raise ValueError(f"metric {name} was created with tags {expected}, got {keys}")
        with self._lock:  # (a refresh between the two would set the old value after the new one)
            metric.set(float(value), tags=merged)
            self._last[(name, tuple(sorted(merged.items())))] = (metric, float(value), merged)

    def refresh(self) -> None:
        """Every gauge set again to the value it was last set to."""
        with self._lock:
            for metric, value, tags in self._last.values():
                metric.set(value, tags=tags)

    def keep_alive(self, stop: threading.Event, interval_s: float = 5.0) -> None:
        """`refresh` every `interval_s` until `stop` is set (a thread of the job's driver)."""
        while not stop.wait(interval_s):
            try:
                self.refresh()
            except Exception as e:  # noqa: BLE001 - a metric is not worth failing the job for
                log.warning("refreshing the gauges failed: %r", e)

    def count(self, name: str, value: float = 1.0, **tags) -> None:
        if value <= 0:
            return
        keys, merged = self._tags(tags)
        metric, expected = self._get("counter", name, keys)
        if keys != expected:
            raise ValueError(f"metric {name} was created with tags {expected}, got {keys}")
        metric.inc(float(value), tags=merged)
