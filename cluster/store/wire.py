"""The wire format of one training sample in the Mooncake store, apart from any client.

One sample is one object: a 64-byte header (format, the hidden states' dtype, the shapes, and a
keyed BLAKE2b MAC of the whole sample and of the key it is stored under), then its hidden states,
token ids and loss mask, each section 64-byte aligned, in that order. The MAC covers the store key
so that a sample copied (or replayed) under another key is refused: the ledger trusts that the
bytes at a key are the answer to that key's prompt. `SampleRef` (key + shapes) is what travels through Ray;
`sample_parts` lays a sample out for a put, `sample_from_buffer` checks and reads one back.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from dspark.samples import CorruptSampleError, Sample

ALIGN = 64
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


HEADER = 64
_HEADER = struct.Struct("<4sBBHIHI16s")  # magic, version, dtype, -, tokens, layers, hidden, MAC
# Version 2: the MAC covers the store key (version 1's covered the header and sections only).
MAGIC, VERSION = b"DSPK", 2
DTYPE_CODES = {name: i for i, name in enumerate(DTYPES)}
PIECE = 16 << 20  # MAC'd in pieces of this size, in threads for big samples
_hashers = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="sample-mac")


@dataclass(frozen=True)
class SampleRef:
    """Everything a consumer needs to read a sample back, small enough to travel through Ray."""

    key: str
    num_tokens: int
    layer_ids: tuple[int, ...]
    hidden_size: int
    dtype: str = "bfloat16"

    @property
    def sections(self) -> tuple[int, int, int]:
        """Byte sizes of hidden states, token ids (int32), loss mask (uint8)."""
        t = self.num_tokens
        item = torch.empty((), dtype=DTYPES[self.dtype]).element_size()
        return t * len(self.layer_ids) * self.hidden_size * item, 4 * t, t

    @property
    def nbytes(self) -> int:
        h, i, m = self.sections
        return HEADER + aligned(h) + aligned(i) + m

    def to_dict(self) -> dict:
        """The JSON form a saved ledger state keeps (`ledger.json` in a checkpoint); the ref
        itself is what travels through Ray. Field by field (`asdict` deep-copies: a checkpoint
        writes one per stored entry)."""
        return {
            "key": self.key,
            "num_tokens": self.num_tokens,
            "layer_ids": list(self.layer_ids),
            "hidden_size": self.hidden_size,
            "dtype": self.dtype,
        }

    @classmethod
    def from_dict(cls, d: dict) -> SampleRef:
        """From `to_dict()` output, ignoring extra fields (a checkpoint written before refs
        travelled typed kept a file backend's `path` beside them)."""
        return cls(
            d["key"], int(d["num_tokens"]), tuple(d["layer_ids"]), int(d["hidden_size"]), d.get("dtype", "bfloat16")
        )

    @classmethod
    def for_sample(cls, key: str, sample: Sample) -> SampleRef:
        dtype = next(k for k, v in DTYPES.items() if v == sample.hidden_states.dtype)
        return cls(key, sample.num_tokens, tuple(sample.layer_ids), int(sample.hidden_states.shape[-1]), dtype)

    def header_fields(self) -> bytes:
        """The header up to the MAC: what the MAC also covers."""
        return _HEADER.pack(
            MAGIC, VERSION, DTYPE_CODES[self.dtype], 0, self.num_tokens, len(self.layer_ids), self.hidden_size, b""
        )[:-16]

    def mac_input(self) -> bytes:
        """What the MAC covers besides the sections: the header fields and the store key
        (length-prefixed, so that no two (fields, key) pairs read the same)."""
        name = self.key.encode()
        return self.header_fields() + struct.pack("<I", len(name)) + name


def sample_mac(key: bytes, fields: bytes, sections: list) -> bytes:
    """Keyed BLAKE2b (16 bytes) of `fields` (`SampleRef.mac_input`) and the sections (byte views),
    a digest per piece of PIECE bytes (computed in threads: hashlib releases the GIL) then one over
    them all."""
    pieces = [
        memoryview(v).cast("B")[i : i + PIECE] for v in sections for i in range(0, max(memoryview(v).nbytes, 1), PIECE)
    ]

    def digest(b) -> bytes:
        return hashlib.blake2b(b, key=key, digest_size=16).digest()

    digests = list(_hashers.map(digest, pieces)) if len(pieces) > 2 else [digest(p) for p in pieces]
    return hashlib.blake2b(fields + b"".join(digests), key=key, digest_size=16).digest()


def sample_parts(sample: Sample, key: bytes = b"", *, store_key: str) -> list:
    """The object's byte sections (numpy views, no copy of the hidden states): the header, then
    each section padded to ALIGN. `key` signs, `store_key` is the key it will be stored under
    (covered by the MAC)."""
    h = sample.hidden_states.contiguous().view(torch.uint8).reshape(-1)
    ids = sample.token_ids.to(torch.int32).contiguous().view(torch.uint8)
    mask = sample.loss_mask.to(torch.uint8).contiguous()
    sections = [t.numpy() for t in (h, ids, mask)]
    ref = SampleRef.for_sample(store_key, sample)
    header = (ref.header_fields() + sample_mac(key, ref.mac_input(), sections)).ljust(HEADER, b"\0")
    parts = [header]
    for arr, last in zip(sections, (False, False, True)):
        parts.append(arr)
        pad = aligned(arr.nbytes) - arr.nbytes
        if pad and not last:
            parts.append(bytes(pad))
    return parts


def sample_from_buffer(ref: SampleRef, buf: torch.Tensor, copy: bool = False, key: bytes = b"") -> Sample:
    """From `buf` (uint8, at least `ref.nbytes`), after checking its header against `ref` (format,
    dtype, shapes) and its MAC under `key` (which covers `ref.key`: a sample stored under another
    key is refused); CorruptSampleError names the key and what differs.
    Without `copy` the hidden states view `buf`: copy them before reusing it."""
    magic, version, dtype, _, tokens, layers, hidden, mac = _HEADER.unpack(buf[: _HEADER.size].numpy().tobytes())
    if magic != MAGIC or version != VERSION:
        raise CorruptSampleError(f"{ref.key}: not a sample of this format (header {magic!r} v{version})")
    found = (next((n for n, c in DTYPE_CODES.items() if c == dtype), f"code {dtype}"), tokens, layers, hidden)
    expected = (ref.dtype, ref.num_tokens, len(ref.layer_ids), ref.hidden_size)
    if found != expected:
        raise CorruptSampleError(f"{ref.key}: stored as (dtype, tokens, layers, hidden) {found}, read as {expected}")
    h_n, i_n, m_n = ref.sections
    o_ids = HEADER + aligned(h_n)
    o_mask = o_ids + aligned(i_n)
    sections = [
        buf[HEADER : HEADER + h_n].numpy(),
        buf[o_ids : o_ids + i_n].numpy(),
        buf[o_mask : o_mask + m_n].numpy(),
    ]
    if not hmac.compare_digest(mac, sample_mac(key, ref.mac_input(), sections)):
        raise CorruptSampleError(
            f"{ref.key}: its bytes do not match their MAC (changed in the store, written "
            "under another job's key, or stored under another key)"
        )
    t = ref.num_tokens
    hidden_states = buf[HEADER : HEADER + h_n].view(DTYPES[ref.dtype]).view(t, len(ref.layer_ids), ref.hidden_size)
    ids = buf[o_ids : o_ids + i_n].view(torch.int32).long()
    mask = buf[o_mask : o_mask + m_n].bool()
    return Sample(ids, mask, hidden_states.clone() if copy else hidden_states, list(ref.layer_ids))
