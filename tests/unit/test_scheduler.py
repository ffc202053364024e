from __future__ import annotations

import torch

from dspark.scheduler import StepRateTable, schedule_prefixes


def reference_algorithm1(confs, sps):
    """Independent transcription: enumerate the global order, evaluate Θ for every prefix of it,
    and stop at the first prefix size whose Θ does not improve."""
    order = []
    for r, c in enumerate(confs):
        a = 1.0
        for j, cj in enumerate(c.tolist()):
            a *= cj
            order.append((a, j, r))
    order.sort(key=lambda t: (-t[0], t[1]))
    base = len(confs)
    thetas = [base * sps(base)]
    for i in range(1, len(order) + 1):
        thetas.append((base + sum(a for a, _, _ in order[:i])) * sps(base + i))
    stop = next((i for i in range(1, len(thetas)) if thetas[i] <= thetas[i - 1]), len(thetas))
    lengths = [0] * len(confs)
    for _, _, r in order[: stop - 1]:
        lengths[r] += 1
    return lengths


def test_matches_reference_and_keeps_prefixes():
    gen = torch.Generator().manual_seed(0)
    sps = StepRateTable([1, 8, 16, 32, 64, 128], [100, 98, 90, 70, 45, 24])
    for trial in range(50):
        confs = [torch.rand(7, generator=gen) ** 0.3 for _ in range(1 + trial % 9)]
        got = schedule_prefixes(confs, sps)
        assert got == reference_algorithm1(confs, sps)
        assert all(0 <= n <= 7 for n in got)


def test_load_dependence():
    """Light load verifies long prefixes; heavy load trims the unlikely suffixes."""
    sps = StepRateTable([1, 16, 64, 256], [100, 95, 60, 20])
    conf = torch.full((8,), 0.8)
    light = schedule_prefixes([conf], sps)[0]
    heavy = schedule_prefixes([conf] * 48, sps)
    assert light == 8
    assert sum(heavy) / len(heavy) < light


def test_flat_table_keeps_everything():
    assert schedule_prefixes([torch.tensor([0.9, 0.5, 0.1])], StepRateTable.flat()) == [3]


def test_rate_table_interpolates():
    t = StepRateTable([10, 20], [100.0, 50.0])
    assert t(5) == 100 and t(15) == 75 and t(40) == 25
