"""The paces a probe measured, kept for later runs on the same machine (`cluster.box.kept_paces`):
what is kept comes back for the same key within its age and never for another key, a later or
an earlier clock; a file or an entry that cannot be read means a probe, and is rewritten."""

from __future__ import annotations

import json

from cluster.box import Paces
from cluster.box.kept_paces import keep_paces, kept_paces, paces_key
from cluster.config_load import load_config
from cluster.hardware import CpuInfo

PACES = Paces({1: 215.0, 2: 290.1}, {1: 1.19, 2: 0.87}, {2: 0.69}, source="probe")
T0 = 1_800_000_000.0  # a clock reading, seconds since the epoch


def key(**cpu):
    cfg = load_config("configs/local.yaml")
    info = CpuInfo(**{"model": "Xeon", "cores": 2, "flags": frozenset(), **cpu})
    return paces_key(cfg, info, "/cache/targets/SmolLM2-135M-Instruct", 58, 128)


def test_kept_paces_come_back_for_the_same_machine_within_their_age(tmp_path):
    path = tmp_path / "box_paces.json"
    assert kept_paces(path, key(), 3600, T0) is None  # nothing kept yet
    keep_paces(path, key(), PACES, 24.4, T0)
    assert kept_paces(path, key(), 3600, T0 + 3599) == (PACES, 24.4, T0)  # thread counts back as ints
    assert kept_paces(path, key(), 3600, T0 + 3601) is None  # too old
    assert kept_paces(path, key(), 3600, T0 - 1) is None  # a clock set back: not trusted
    assert kept_paces(path, key(), 0, T0) is None  # keep_paces_s=0: probe every run
    # another machine, a quota, another answer length: not the same paces
    assert kept_paces(path, key(model="EPYC"), 3600, T0) is None
    assert kept_paces(path, key(quota=0.66), 3600, T0) is None
    cfg = load_config("configs/local.yaml")
    other = paces_key(cfg, CpuInfo("Xeon", 2, frozenset()), "/cache/targets/SmolLM2-135M-Instruct", 58, 96)
    assert kept_paces(path, other, 3600, T0) is None
    # a second machine's paces beside the first's, each under its own key
    slow = Paces({1: 129.4}, {1: 2.69}, {1: 1.85}, source="probe")
    keep_paces(path, key(quota=0.66), slow, 28.9, T0 + 10)
    assert kept_paces(path, key(quota=0.66), 3600, T0 + 20)[0] == slow
    assert kept_paces(path, key(), 3600, T0 + 20)[0] == PACES
    # the file says what each entry was measured for, in JSON
    entries = json.loads(path.read_text())
    assert sorted(e["key"]["quota"] or 0 for e in entries.values()) == [0, 0.66]


def test_a_file_or_an_entry_that_cannot_be_read_means_a_probe(tmp_path, caplog):
    path = tmp_path / "box_paces.json"
    path.write_text("{not json")
    assert kept_paces(path, key(), 3600, T0) is None
    assert "cannot be read" in caplog.text
    keep_paces(path, key(), PACES, 24.4, T0)  # rewritten whole
    assert kept_paces(path, key(), 3600, T0)[0] == PACES
    entries = json.loads(path.read_text())
    (digest,) = entries
    del entries[digest]["first_step_s"]
    path.write_text(json.dumps(entries))
    assert kept_paces(path, key(), 3600, T0) is None
    assert "damaged" in caplog.text
    path.write_text("[1, 2]")  # JSON, but not what this job writes
    assert kept_paces(path, key(), 3600, T0) is None


def test_the_key_names_what_the_paces_depend_on():
    k = key(affinity=1)
    assert (k["cpu"], k["cores"], k["affinity"], k["quota"]) == ("Xeon", 2, 1, None)
    assert k["target"] == "SmolLM2-135M-Instruct" and (k["prompt_tokens"], k["answer_tokens"]) == (58, 128)
    cfg = load_config("configs/local.yaml")
    assert k["batch_tokens"] == cfg.trainer.batch_tokens and k["dtype"] == cfg.target.dtype
    assert k["drafter"][1:4] == [cfg.drafter.num_layers, cfg.drafter.block_size, cfg.drafter.markov_rank]
