from __future__ import annotations

import math

import pytest

from cluster.metrics import Metrics


class FakeMetric:
    def __init__(self, name, description, tag_keys):
        self.name, self.tag_keys, self.values = name, tag_keys, []

    def set(self, v, tags):
        assert set(tags) == set(self.tag_keys)
        self.values.append(("set", v, dict(tags)))

    def inc(self, v, tags):
        assert set(tags) == set(self.tag_keys)
        self.values.append(("inc", v, dict(tags)))


class FakeBackend:
    Gauge = Counter = FakeMetric


def test_gauges_and_counters_carry_job_tags():
    m = Metrics(tags={"run": "r1"}, backend=FakeBackend)
    m.gauge("queue_depth", 3, group="g0")
    m.gauge("queue_depth", 5, group="g1")
    m.count("samples_trained", 2, group="g0")
    m.count("samples_trained", 0, group="g0")  # no-op, counters only grow
    gauge = m._metrics["dspark_queue_depth"][0]
    assert gauge.values == [("set", 3.0, {"run": "r1", "group": "g0"}), ("set", 5.0, {"run": "r1", "group": "g1"})]
    assert m._metrics["dspark_samples_trained"][0].values == [("inc", 2.0, {"run": "r1", "group": "g0"})]


def test_gauges_are_set_again_until_the_job_ends():
    # Ray's agent drops a gauge not set for ~20 s: the job's driver sets each again to its last
    # value (a counter is cumulative and kept by Ray: never added to again)
    import threading
    import time

    m = Metrics(tags={"run": "r1"}, backend=FakeBackend)
    m.gauge("queue_depth", 3, group="g0")
    m.gauge("queue_depth", 5, group="g0")
    m.gauge("queue_depth", 1, group="g1")
    m.count("samples_trained", 2)
    m.refresh()
    gauge = m._metrics["dspark_queue_depth"][0]
    assert gauge.values[3:] == [("set", 5.0, {"run": "r1", "group": "g0"}), ("set", 1.0, {"run": "r1", "group": "g1"})]
    assert m._metrics["dspark_samples_trained"][0].values == [("inc", 2.0, {"run": "r1"})]
    stop = threading.Event()
    t = threading.Thread(target=m.keep_alive, args=(stop, 0.01))
    t.start()
    deadline = time.monotonic() + 10
    while len(gauge.values) < 9 and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    t.join(5)
    assert not t.is_alive() and gauge.values[-2:] == gauge.values[3:5]


def test_misuse_is_an_error():
    m = Metrics(backend=FakeBackend)
    m.gauge("x", 1, group="a")
    with pytest.raises(ValueError, match="tags"):
        m.gauge("x", 1, rank="0")
    with pytest.raises(ValueError, match="gauge"):
        m.count("x", 1, group="a")
    with pytest.raises(ValueError, match="invalid"):
        m.gauge("bad-name", 1)


def test_eta_is_the_slower_of_generation_and_training():
    from dataclasses import replace

    from cluster.data import LedgerCounts
    from cluster.job import TrainingStats, eta

    # 10 steps took 20 s of training and trained 40 samples: 4 per step, 2 s per step.
    g = TrainingStats(step=10, train_s=20.0)
    counts = LedgerCounts(trained=30, leased=10, total=100, to_generate=10, produced_tokens=2000, produced_samples=20)
    # training: 60 samples left = 15 steps = 30 s; generation: 10 samples x 100 tokens at 50 tok/s = 20 s
    assert eta(g, counts, gen_rate=50.0) == pytest.approx(30.0)
    # a slower replica makes generation the bound: 1000 tokens at 10 tok/s
    assert eta(g, counts, gen_rate=10.0) == pytest.approx(100.0)
    assert math.isnan(eta(TrainingStats(), replace(counts, trained=0, leased=0), 50.0))
