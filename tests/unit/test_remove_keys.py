"""A rank's removal of samples from the store (`TrainerRank.remove_keys`, what every commit
calls): an error on one key does not stop the others, a failed key is tried again, and one the
store keeps refusing is named, not fatal. The store is a fake that fails as Mooncake does."""

from __future__ import annotations

from types import SimpleNamespace

from cluster.store import StoreError
from cluster.training import TrainerRank


class FlakyStore:
    def __init__(self, fail_times: dict[str, int]) -> None:
        self.fail_times, self.present, self.calls = dict(fail_times), set(), []

    def remove(self, key: str) -> bool:
        self.calls.append(key)
        if self.fail_times.get(key, 0) > 0:
            self.fail_times[key] -= 1
            raise StoreError("remove", -900, key)
        was = key in self.present
        self.present.discard(key)
        return was


def test_removal_goes_past_an_error_retries_it_and_names_what_stays(monkeypatch, capsys):
    import cluster.training.trainer_rank as rank_module

    monkeypatch.setattr(rank_module.time, "sleep", lambda s: None)
    store = FlakyStore({"b": 2, "d": 99})  # b fails twice then goes; d never goes
    store.present = {"a", "b", "c", "d", "x"}
    rank = SimpleNamespace(store=store)
    removed = TrainerRank.remove_keys(rank, ["a", "b", "c"], abandoned=["d", "x"])
    assert removed == 4  # a, c, x at once; b on its third try; d never
    assert store.present == {"d"}
    assert store.calls[:5] == ["a", "b", "c", "d", "x"]  # the first error (b) did not stop c, d, x
    assert store.calls.count("b") == 3 and store.calls.count("d") == rank_module.REMOVE_TRIES
    err = capsys.readouterr().err
    assert (
        f"sample d stays in the store after {rank_module.REMOVE_TRIES} tries: mooncake remove for key 'd' failed: -900"
        in err
    )
    assert "sample b" not in err
