"""A small wrapper over `ray.util.metrics`: metrics by name, created on first use, with the
job's tags attached, so call sites stay one line (`metrics.gauge("queue_depth", 12, group="g0")`).

Every metric is exported as `ray_dspark_<name>` (Ray adds `ray_`) on the node's Prometheus endpoint, which the Ray
dashboard's metrics view reads.
"""

from __future__ import annotations

import re

_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


class Metrics:
    def __init__(self, prefix: str = "dspark", tags: dict[str, str] | None = None, backend=None) -> None:
        if backend is None:
            from ray.util import metrics as backend
        self.backend, self.prefix = backend, prefix
        self.tags = dict(tags or {})
        self._metrics: dict[str, object] = {}

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
        metric.set(float(value), tags=merged)

    def count(self, name: str, value: float = 1.0, **tags) -> None:
        if value <= 0:
            return
        keys, merged = self._tags(tags)
        metric, expected = self._get("counter", name, keys)
        if keys != expected:
            raise ValueError(f"metric {name} was created with tags {expected}, got {keys}")
        metric.inc(float(value), tags=merged)
