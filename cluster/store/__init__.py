"""The store room: where the samples' bytes live and how they move.

Owns the wire format of a sample (header, MAC: `wire`), the Mooncake client (`client`), the
supervised daemons (`process`, `master`, `node_store`; `loopback` keeps a one-node daemon's
transfer engine on loopback) and the job's store services (`services`). The vLLM connector that
puts a replica's hidden states into the store is the inference room's
(`cluster.inference.hidden_states_connector`): the store room imports no other room.
"""

from cluster.store.client import (
    TRANSIENT,
    HiddenStateStore,
    SampleMissing,
    StoreConfig,
    StoreError,
    StoreFull,
    StoreUnavailable,
    probe,
    put_backoff_s,
    put_with_retry,
    wants_room,
)
from cluster.store.master import MooncakeMaster
from cluster.store.node_store import NodeStore
from cluster.store.process import SupervisedProcess, free_port, mooncake_binary
from cluster.store.services import StoreServices
from cluster.store.wire import SampleRef, sample_from_buffer, sample_parts

__all__ = [
    "TRANSIENT",
    "HiddenStateStore",
    "MooncakeMaster",
    "NodeStore",
    "SampleMissing",
    "SampleRef",
    "StoreConfig",
    "StoreError",
    "StoreFull",
    "StoreServices",
    "StoreUnavailable",
    "SupervisedProcess",
    "free_port",
    "mooncake_binary",
    "probe",
    "put_backoff_s",
    "put_with_retry",
    "sample_from_buffer",
    "sample_parts",
    "wants_room",
]
