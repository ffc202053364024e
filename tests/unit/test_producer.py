"""The producers' pull loop (cluster/inference/producer.py), without Ray: a stop that arrives before the
loop starts ends it (a replica replaced just as the job ends gets both calls queued)."""

from __future__ import annotations

from cluster.inference import Producer


class NoLedger:
    """Any call on it fails the test: a stopped producer must not ask for prompts."""

    def __getattr__(self, name):
        raise AssertionError(f"a stopped producer asked the ledger for {name}")


def test_a_stop_before_serve_ends_the_loop_at_once():
    p = Producer("g0-r8", "g0")
    p.stop()
    stats = p.serve(NoLedger(), batch_size=4)
    assert stats["replica_id"] == "g0-r8" and stats["prompts"] == 0
