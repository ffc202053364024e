from __future__ import annotations

import json

import pytest
import torch

from dspark.prompts import read_conversations, split
from dspark.samples import CorruptSampleError, Sample, pack, read_sample, write_sample


def make_sample(t=12, layers=(2, 4, 6), h=8):
    return Sample(torch.arange(t), torch.arange(t) >= 4, torch.randn(t, len(layers), h), list(layers))


def test_sample_round_trip_and_pack(tmp_path):
    s1, s2 = make_sample(12), make_sample(7)
    write_sample(tmp_path / "a.safetensors", s1)
    back = read_sample(tmp_path / "a.safetensors")
    assert torch.equal(back.hidden_states, s1.hidden_states) and back.layer_ids == [2, 4, 6]
    b = pack([back, s2], aux_layer_ids=[4, 2], last_layer_id=6)
    assert b.num_tokens == 19 and b.doc_ids.tolist() == [0] * 12 + [1] * 7
    assert b.position_ids[12] == 0
    torch.testing.assert_close(b.aux_hidden[0], torch.cat([s1.hidden_states[0, 1], s1.hidden_states[0, 0]]))
    torch.testing.assert_close(b.last_hidden[13], s2.hidden_states[1, 2])


@pytest.mark.parametrize("damage", ["truncate", "nan", "shape"])
def test_corrupt_samples_are_named(tmp_path, damage):
    path = tmp_path / "bad.safetensors"
    s = make_sample()
    if damage == "nan":
        s.hidden_states[3, 1, 2] = float("nan")
        with pytest.raises(CorruptSampleError, match="NaN"):
            Sample(s.token_ids, s.loss_mask, s.hidden_states, s.layer_ids)
        return
    write_sample(path, s)
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:-50])
    else:
        from safetensors.torch import save_file

        save_file(
            {"hidden_states": torch.zeros(5, 3, 8), "token_ids": torch.arange(6)},
            str(path),
            metadata={"layer_ids": "[2, 4, 6]"},
        )
    with pytest.raises(CorruptSampleError, match="bad.safetensors"):
        read_sample(path)


def test_readers_report_malformed_lines(tmp_path):
    f = tmp_path / "p.jsonl"
    lines = [
        {"prompt": "hello"},
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "?"},
            ]
        },
        "not json",
        {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]},
        {"messages": [{"role": "wizard", "content": "x"}]},
        {"other": 1},
    ]
    f.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    convs, rep = read_conversations(f)
    assert rep.ok == 3 and [n for n, _ in rep.bad] == [3, 5, 6]
    assert "line 3" in rep.summary()
    assert convs[2].messages == [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert convs[1].prompt_messages == convs[1].messages  # ends with a user turn: answer it
    assert convs[2].prompt_messages == convs[2].messages[:1]  # ends with an answer: regenerate it


def test_datasets_folder(tmp_path):
    from datasets import Dataset

    Dataset.from_list([{"prompt": "a"}, {"prompt": "b"}]).save_to_disk(str(tmp_path / "ds"))
    convs, rep = read_conversations(tmp_path / "ds")
    assert rep.ok == 2 and convs[1].messages[0]["content"] == "b"


def test_split_is_deterministic_and_disjoint():
    from dspark.prompts import Conversation

    convs = [Conversation(f"id-{i}", [{"role": "user", "content": str(i)}]) for i in range(1000)]
    a, b = split(convs, 0.1)
    a2, b2 = split(list(reversed(convs)), 0.1)
    assert {c.id for c in b} == {c.id for c in b2} and not {c.id for c in a} & {c.id for c in b}
    assert 60 < len(b) < 140


def test_default_prompt_set():
    from pathlib import Path

    convs, rep = read_conversations(Path(__file__).resolve().parents[2] / "data" / "prompts" / "default.jsonl")
    assert rep.ok >= 600 and not rep.bad
    assert len({c.messages[-1]["content"] for c in convs}) == len(convs)
    assert any(len(c.messages) > 1 for c in convs)
