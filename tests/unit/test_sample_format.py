"""A stored sample carries its dtype, shapes and a MAC under the job's key that covers the key it
is stored under: a reader refuses a changed byte, another job's key, a sample replayed under
another store key, or a dtype it did not expect, naming the key and what differs; an unchanged
sample reads back bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cluster.store import SampleRef, sample_from_buffer, sample_parts
from dspark.samples import CorruptSampleError, Sample

KEY = bytes(range(32))


def object_bytes(sample: Sample, key: bytes = KEY, store_key: str = "k") -> torch.Tensor:
    raw = b"".join(
        p if isinstance(p, bytes) else np.ascontiguousarray(p).tobytes()
        for p in sample_parts(sample, key, store_key=store_key)
    )
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def sample(dtype=torch.bfloat16, t: int = 37) -> Sample:
    g = torch.Generator().manual_seed(0)
    return Sample(
        torch.randint(0, 49152, (t,), generator=g),
        torch.rand(t, generator=g) > 0.5,
        torch.randn(t, 3, 64, generator=g).to(dtype),
        [2, 8, 30],
    )


def test_a_sample_reads_back_exactly():
    s = sample()
    ref = SampleRef.for_sample("run/g0/p1@0.1", s)
    buf = object_bytes(s, store_key=ref.key)
    assert buf.numel() == ref.nbytes
    back = sample_from_buffer(ref, buf, key=KEY)
    assert torch.equal(back.hidden_states, s.hidden_states) and torch.equal(back.token_ids, s.token_ids)
    assert torch.equal(back.loss_mask, s.loss_mask)


@pytest.mark.parametrize("where", ["hidden", "ids", "mask", "header"])
def test_a_changed_byte_is_refused(where):
    s = sample()
    ref = SampleRef.for_sample("run/g0/p1@0.1", s)
    buf = object_bytes(s, store_key=ref.key)
    h, i, _ = ref.sections
    # (the header's MAC itself sits at bytes 18-33)
    offset = {"hidden": 64 + 100, "ids": 64 + ((h + 63) // 64) * 64 + 5, "mask": ref.nbytes - 1, "header": 20}[where]
    buf[offset] ^= 0x01
    with pytest.raises(CorruptSampleError, match=r"run/g0/p1@0\.1: its bytes do not match their MAC"):
        sample_from_buffer(ref, buf, key=KEY)


def test_another_jobs_key_is_refused():
    s = sample()
    ref = SampleRef.for_sample("k", s)
    with pytest.raises(CorruptSampleError, match="another job's key"):
        sample_from_buffer(ref, object_bytes(s, key=b"x" * 32), key=KEY)


def test_a_sample_replayed_under_another_key_is_refused():
    """Bytes signed for one prompt's key, copied to another key (by anyone who reaches the
    store's unauthenticated transfer ports), do not pass as that other prompt's answer."""
    s = sample()
    signed_for = object_bytes(s, store_key="run/g0/p1@0.1")
    as_other = SampleRef.for_sample("run/g0/p2@0.1", s)  # same shapes: only the key differs
    with pytest.raises(CorruptSampleError, match=r"run/g0/p2@0\.1: .*stored under another key"):
        sample_from_buffer(as_other, signed_for.clone(), key=KEY)
    assert torch.equal(
        sample_from_buffer(SampleRef.for_sample("run/g0/p1@0.1", s), signed_for, key=KEY).token_ids, s.token_ids
    )


def test_a_sample_is_never_read_in_another_dtype():
    s = sample(torch.float16)  # an fp16 target's states
    stored = SampleRef.for_sample("k", s)
    as_bf16 = SampleRef(stored.key, stored.num_tokens, stored.layer_ids, stored.hidden_size, "bfloat16")
    with pytest.raises(
        CorruptSampleError,
        match=r"stored as \(dtype, tokens, layers, hidden\) \('float16', 37, 3, 64\), "
        r"read as \('bfloat16', 37, 3, 64\)",
    ):
        sample_from_buffer(as_bf16, object_bytes(s), key=KEY)
    assert sample_from_buffer(stored, object_bytes(s), key=KEY).hidden_states.dtype == torch.float16
