"""`HiddenStateStore`: put/get/remove of whole training samples in the Mooncake store.

One sample is one object under the key `run/group/sample`: a 64-byte header (format, the
hidden states' dtype, the shapes, and a keyed BLAKE2b MAC of the whole sample and its key), then its hidden
states, token ids and loss mask, each section 64-byte aligned, in that order. Only the key and
the shapes (`SampleRef`) travel through Ray; the bytes move between store clients directly.
Reads land in a registered buffer (zero copy on RDMA) and are checked against the header before
anything uses them: the dtype and shapes the reader expects (an fp16 target's states are never
read as bf16) and the MAC under the job's key (`StoreConfig.sample_key`, handed to every actor
of the job through Ray). Mooncake's transfer ports have no authentication (on one node the daemon's
are kept on loopback: `cluster.store.loopback`): whoever reaches them can read or overwrite an
object, but cannot make the trainer train on a changed one, nor on one copied to another key.

Two ways to join the store (`StoreConfig`):
- attached to the node's store daemon (`node_client`, the default in jobs; see
  `cluster.store.node_store`): puts and reads are copies through shared memory with that daemon, and
  only samples held on another node cross the network;
- a full client (no `node_client`): every byte goes over the transport (TCP or RDMA) to
  whichever process lends the memory.

Mooncake reports failures as negative integers; this wrapper turns them into exceptions
that say what happened. Known traps handled here: `setup` against a dead master hangs for
~90 s (we probe the port first); a `put` of an existing key silently keeps the old value (we
always upsert); a full segment fails at once with −200 (raised as `StoreFull`, which callers
treat as backpressure, never as a drop).
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading
from dataclasses import asdict, dataclass, field

import torch

from cluster.store.wire import SampleRef, aligned, sample_from_buffer, sample_parts
from cluster.waiting import wait_until
from dspark.samples import CorruptSampleError, Sample

# Reported to avoid a crash in the local memcpy fast path on TCP-only hosts.
os.environ.setdefault("MC_STORE_MEMCPY", "0")

ERROR_NAMES = {
    -1: "INTERNAL_ERROR",
    -200: "NO_AVAILABLE_HANDLE (segment full)",
    -300: "INVALID_VERSION",
    -400: "INVALID_KEY",
    -500: "WRITE_FAIL",
    -600: "INVALID_PARAMS (value larger than the client's local buffer?)",
    -601: "ILLEGAL_CLIENT",
    -700: "INVALID_WRITE",
    -701: "INVALID_READ",
    -702: "INVALID_REPLICA",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL",
    -901: "RPC_TIMEOUT",
    -1700: "TENANT_QUOTA_EXCEEDED",
}
RPC_FAILURES = {-900, -901}
# Worth a retry: no room yet, or a transfer to a segment whose owner just went away.
TRANSIENT = {-200, -800, -900, -901}


class StoreError(RuntimeError):
    def __init__(self, op: str, code: int, key: str | None = None) -> None:
        self.op, self.code, self.key = op, code, key
        where = f" for key {key!r}" if key else ""
        super().__init__(f"mooncake {op}{where} failed: {code} {ERROR_NAMES.get(code, 'UNKNOWN')}")

    def __reduce__(self):  # crosses Ray actor boundaries intact
        return type(self), (self.op, self.code, self.key)


class StoreFull(StoreError):
    """No room in the store's segments right now; retry after consumers free space."""


class SampleMissing(StoreError):
    """The key is not in the store (never written, removed, or lost with a restarted master)."""


def put_backoff_s(tries: int) -> float:
    """Seconds before the next try of a put the store refused `tries` times: soon after one
    refusal, at most five a second while the store stays full."""
    return min(0.02 * tries, 0.2)


def put_with_retry(
    store: HiddenStateStore, key: str, sample: Sample, timeout_s: float, stopping=lambda: False
) -> tuple[SampleRef, int]:
    """Backpressure and transient faults are waits, never drops: retry until `timeout_s`.
    Returns the ref and how many times it had to wait."""
    waits, last = 0, None

    def put():
        nonlocal waits, last
        try:
            return store.put_sample(key, sample)
        except StoreError as e:
            if e.code not in TRANSIENT or stopping():
                raise
            waits, last = waits + 1, e
            return None

    ref = wait_until(
        put,
        timeout_s=timeout_s,
        interval_s=put_backoff_s,
        what=f"a put of {key}",
        on_timeout=lambda: last,
    )
    return ref, waits


class StoreUnavailable(RuntimeError):
    """The master does not answer."""


def wants_room(e: BaseException) -> bool:
    """Whether a put failed for want of room or of a store to reach (a full segment, a transfer
    or RPC failure, an unavailable master, `put_with_retry`'s wait run out), not for what it
    put: its prompt is not to blame (`ProducedSample.blamed`)."""
    return isinstance(e, (StoreUnavailable, TimeoutError)) or (isinstance(e, StoreError) and e.code in TRANSIENT)


def raise_for(op: str, code: int, key: str | None = None) -> None:
    if code >= 0:
        return
    cls = {-200: StoreFull, -704: SampleMissing}.get(code, StoreError)
    raise cls(op, code, key)


def probe(address: str, timeout: float = 2.0) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except OSError:
        return False


@dataclass
class StoreConfig:
    master: str = "127.0.0.1:50051"  # host:port of mooncake_master's RPC
    # The address this client's transfer engine gives its peers. Empty: resolved where the client
    # connects (`resolve_local_hostname`), never by whoever made the config (the job's driver runs
    # on another node than most clients).
    local_hostname: str = ""
    protocol: str = "tcp"  # tcp | rdma
    rdma_devices: str = ""
    metadata_server: str = "P2PHANDSHAKE"
    # Memory this client lends to the distributed pool. Only the node daemons (or the master's
    # actor) lend any, so the death of a producer or a trainer rank takes no stored sample with it.
    segment_bytes: int = 0
    buffer_bytes: int = 256 << 20  # client-local staging for puts (and the first read buffer)
    # The node's store daemon, host:port. Empty: looked up in `node_clients` (Ray node id ->
    # address, filled by the job) for the node this process runs on; none there: a full client.
    node_client: str = ""
    node_clients: dict = field(default_factory=dict)
    # The job's key for the samples' MACs (hex): puts sign with it, reads check it. Made by the
    # driver per job, handed to the actors through Ray (and to vLLM's connector in its config).
    sample_key: str = ""
    extra: dict = field(default_factory=dict)

    def resolve_node_client(self) -> str:
        if self.node_client or not self.node_clients:
            return self.node_client
        import ray

        node = ray.get_runtime_context().get_node_id()
        if node not in self.node_clients:
            raise StoreUnavailable(
                f"no store daemon (mooncake_client) on node {node[:12]}; the job starts one on "
                f"every node it places work on: {sorted(self.node_clients)}"
            )
        return self.node_clients[node]

    def resolve_local_hostname(self) -> str:
        """This client's address for its peers, found in the process that connects (a replica's
        actor, vLLM's worker that runs the connector, a trainer rank): the set `local_hostname`,
        else over RDMA the IP of the node this process runs on (a peer's transfer engine connects
        back to it for the handshake), else loopback (over TCP the peers never connect to a
        client: it calls them)."""
        if self.local_hostname:
            return self.local_hostname
        if self.protocol == "rdma":
            import ray

            return ray.util.get_node_ip_address()  # the raylet's address in a Ray process, else the routed one
        return "127.0.0.1"

    def to_dict(self) -> dict:
        return asdict(self)


class _Attachment:
    """One dummy client per process and daemon, shared by every `HiddenStateStore` attached to
    it: Mooncake keeps a process-wide table of shared buffers and a client re-registers the
    whole table when it reconnects, so two live clients in one process trip over each other's
    buffers. After the daemon restarts, the client is replaced (`renew`) and every store drops
    its buffers for fresh ones: the old ones stay marked as registered in that table, and the
    new daemon would refuse them (−600)."""

    _all: dict[str, _Attachment] = {}
    _guard = threading.Lock()

    def __init__(self, address: str) -> None:
        self.address, self.users, self.lock = address, 0, threading.RLock()
        self.client = self._setup()

    def _setup(self, timeout: float = 0.0):
        from mooncake.store import MooncakeDistributedStore

        rc = None

        def attached():
            nonlocal rc
            rc = None
            if probe(self.address, 0.5):  # a setup against a daemon that is not up takes ~4 s to fail
                client = MooncakeDistributedStore()
                rc = client.setup_dummy(0, 16 << 20, self.address)
                if rc == 0:
                    return client
            return None

        return wait_until(
            attached,
            timeout_s=timeout,
            interval_s=0.2,
            what=f"the store daemon {self.address}",
            on_timeout=lambda: StoreUnavailable(
                f"attaching to the store daemon {self.address} failed"
                + (f" with {rc}" if rc is not None else ": it does not answer")
            ),
        )

    def renew(self, broken, timeout: float = 60.0) -> None:
        """Replace `broken` (unless another store already did)."""
        with self.lock:
            if self.client is broken:
                # Closing waits for its reconnect loop (~5 s measured): let it go on its own.
                threading.Thread(target=broken.close, daemon=True).start()
                self.client = self._setup(timeout)

    @classmethod
    def acquire(cls, address: str) -> _Attachment:
        with cls._guard:
            att = cls._all.get(address) or cls(address)
            cls._all[address] = att
            att.users += 1
            return att

    def release(self) -> None:
        with self._guard:
            self.users -= 1
            if self.users == 0:
                self._all.pop(self.address, None)
                self.client.close()


class HiddenStateStore:
    """Thread-safe: actors serve and report from several threads, and a reconnect must never
    swap the client out from under a transfer in flight (the native client would crash)."""

    def __init__(self, config: StoreConfig | dict) -> None:
        self.config = config if isinstance(config, StoreConfig) else StoreConfig(**config)
        self.key = bytes.fromhex(self.config.sample_key)
        self._client = None
        self.node_client = ""  # resolved at connect
        self._attachment: _Attachment | None = None
        self._read_buf: torch.Tensor | None = None
        self._staging: torch.Tensor | None = None  # attached: puts are packed here, in shared memory
        self._lock = threading.RLock()

    # ---- connection ---------------------------------------------------------------------
    def connect(self, timeout: float = 30.0) -> HiddenStateStore:
        """Probe the master (or the node's daemon), then set up; raises StoreUnavailable
        instead of hanging."""
        from mooncake.store import MooncakeDistributedStore

        cfg = self.config
        self.node_client = cfg.resolve_node_client()
        target, what = (self.node_client, "store daemon") if self.node_client else (cfg.master, "mooncake master")
        wait_until(
            lambda: probe(target),
            timeout_s=timeout,
            interval_s=0.2,
            what=f"{what} {target}",
            on_timeout=lambda: StoreUnavailable(f"{what} {target} does not answer (waited {timeout:.0f}s)"),
        )
        if self.node_client:
            self._attachment = _Attachment.acquire(self.node_client)
            self._client, self._lock = self._attachment.client, self._attachment.lock
            return self
        with self._lock:
            client = MooncakeDistributedStore()
            rc = client.setup(
                cfg.resolve_local_hostname(),
                cfg.metadata_server,
                cfg.segment_bytes,
                cfg.buffer_bytes,
                cfg.protocol,
                cfg.rdma_devices,
                cfg.master,
            )
            if rc != 0:
                raise StoreUnavailable(f"mooncake setup against {target} failed with {rc}")
            self._client = client
            self._read_buf = None
        return self

    def reconnect(self, timeout: float = 60.0) -> None:
        """After a master restart: a new client (old registrations are gone with the old one).
        Attached to a daemon there is nothing to do: the daemon re-registers its memory with a
        restarted master by itself."""
        if self.node_client:
            return
        with self._lock:
            self.close()
            self.connect(timeout)

    def close(self) -> None:
        with self._lock:
            if self._client is None:
                return
            try:
                if self._attachment is not None:
                    self._attachment.release()
                    self._attachment = None
                else:
                    self._client.close()
            finally:
                self._client = None
                self._read_buf = self._staging = None

    @property
    def client(self):
        if self._client is None:
            raise StoreUnavailable("HiddenStateStore is not connected; call connect()")
        if self._attachment is not None and self._client is not self._attachment.client:
            # Another store of this process renewed the shared client: our buffers died with it.
            self._client, self._read_buf, self._staging = self._attachment.client, None, None
        return self._client

    def _call(self, fn):
        """Run `fn(client)`; after a failure that a restart explains, renew the client once and
        retry, so producers and consumers ride through a master (or daemon) restart. A full
        client sees a restarted master as an RPC failure; an attached one sees a restarted
        daemon as an RPC failure or, on our buffers, as −600 (the new daemon does not know them)."""
        retry_on = RPC_FAILURES | ({-600} if self._attachment else set())
        with self._lock:
            rc = fn(self.client)
            codes = rc if isinstance(rc, list) else [rc]
            if any(c in retry_on for c in codes if isinstance(c, int)):
                if self._attachment is None:
                    self.reconnect()
                else:
                    self._attachment.renew(self._client)
                rc = fn(self.client)
            return rc

    def _shared(self, current: torch.Tensor | None, nbytes: int) -> torch.Tensor:
        """A buffer of at least `nbytes` in memory the node's daemon can read and write: carved
        from a shared-memory file and registered with it. Grows by doubling (Mooncake has no
        call to return such memory, so growth should be rare)."""
        if current is not None and current.numel() >= nbytes:
            return current
        size = max(self.config.buffer_bytes, 1 << 20)
        while size < nbytes:
            size *= 2
        if current is not None:
            self.client.unregister_buffer(current.data_ptr())
        ptr = self.client.alloc_from_mem_pool(size)
        if not ptr:
            raise StoreError("alloc_from_mem_pool", -1)
        raise_for("register_buffer", self.client.register_buffer(ptr, size))
        return torch.frombuffer((ctypes.c_uint8 * size).from_address(ptr), dtype=torch.uint8)

    # ---- samples ------------------------------------------------------------------------
    def put_sample(self, key: str, sample: Sample) -> SampleRef:
        ref = SampleRef.for_sample(key, sample)
        parts = sample_parts(sample, self.key, store_key=key)
        if not self.node_client:
            # upsert_parts: Mooncake stages the parts itself; measured faster than our own copy
            # into a registered buffer + upsert_from (1.1-1.3 vs 0.9-1.0 GB/s on loopback).
            raise_for("upsert", self._call(lambda c: c.upsert_parts(key, *parts)), key)
            return ref

        def put(client):
            # One copy into shared memory; the daemon takes it from there (a parts upsert would
            # send the bytes through its RPC socket instead).
            self._staging = self._shared(self._staging, ref.nbytes)
            o = 0
            for part in parts:
                n = len(part) if isinstance(part, bytes) else part.nbytes
                self._staging[o : o + n].numpy()[:] = memoryview(part).cast("B")
                o += n
            return client.upsert_from(key, self._staging.data_ptr(), ref.nbytes)

        raise_for("upsert", self._call(put), key)  # `_call` holds the lock: the staging buffer is ours
        return ref

    def _buffer(self, nbytes: int) -> torch.Tensor:
        if self.node_client:
            self._read_buf = self._shared(self._read_buf, nbytes)
        elif self._read_buf is None or self._read_buf.numel() < nbytes:
            if self._read_buf is not None:
                self.client.unregister_buffer(self._read_buf.data_ptr())
            buf = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8)
            raise_for("register_buffer", self.client.register_buffer(buf.data_ptr(), buf.numel()))
            self._read_buf = buf
        return self._read_buf

    def get_samples(self, refs: list[SampleRef], copy: bool = True) -> list[Sample]:
        """Read several samples with one batched transfer into the registered buffer.

        The returned hidden states are copies, or with `copy=False` views into the read buffer,
        valid until this store's next read: for a caller that copies them anyway at once (the
        trainer packs a step into one batch), which saves a copy of every byte read. A missing
        key raises SampleMissing; a short read raises CorruptSampleError. Nothing is returned
        partially.
        """
        if not refs:
            return []
        offsets, total = [], 0
        for r in refs:
            offsets.append(total)
            total += aligned(r.nbytes)
        keys, sizes = [r.key for r in refs], [r.nbytes for r in refs]

        def read(client):
            buf = self._buffer(total)  # a reconnect drops the registration: (re)register here
            return client.batch_get_into(keys, [buf.data_ptr() + o for o in offsets], sizes)

        with self._lock:  # the shared read buffer stays ours until the copies are made
            codes = self._call(read)
            buf = self._read_buf
            out = []
            for r, o, rc in zip(refs, offsets, codes):
                raise_for("get", rc, r.key)
                if rc != r.nbytes:
                    raise CorruptSampleError(f"{r.key}: read {rc} bytes, expected {r.nbytes}")
                out.append(sample_from_buffer(r, buf[o : o + r.nbytes], copy=copy, key=self.key))  # ids, mask: copies
            return out

    def remove(self, key: str) -> bool:
        """True if removed, False if it was not there.

        Forced: our callers remove only what is committed (or stale), and a recent read leaves
        a lease on the object that would otherwise refuse the removal (−706)."""
        rc = self._call(lambda c: c.remove(key, True))
        if rc == -704:
            return False
        raise_for("remove", rc, key)
        return True

    def exists(self, key: str) -> bool:
        rc = self._call(lambda c: c.is_exist(key))
        raise_for("is_exist", rc, key)
        return rc == 1
