"""`NodeStore`: the store daemon of one node (`mooncake_client`), which lends that node's memory
to the store and through which every store user on the node moves its bytes.

Why a daemon per node: with the memory in one process elsewhere (the master's actor), a sample
crosses the transport twice, producer → host and host → trainer, each a full TCP (or RDMA) copy
through the kernel. Store users on a node instead attach to their node's daemon over shared
memory (Mooncake's "dummy client" mode, `HiddenStateStore` with `node_client`): a put is a copy
into shared memory, a read of a sample held on the same node is a copy out of it, and only
samples that live on another node cross the network, once, daemon to daemon. Measured in
`benchmarks/transport.py`.

The daemon outlives the death of any producer or trainer rank on its node, so stored samples do
too. If the daemon itself dies, its samples are gone: readers find them missing and the ledger
sends them back for regeneration (as after a master restart, but only for what that node held).
The watcher restarts it; users reconnect on their next failed call. After a master restart the
daemon re-registers its memory by itself (Mooncake's client remounts when the master asks).
"""

from __future__ import annotations

from cluster.store.loopback import loopback_env
from cluster.store.process import SupervisedProcess, mooncake_binary


class NodeStore(SupervisedProcess):
    name = "mooncake_client"

    def __init__(
        self,
        master: str,
        segment_bytes: int,
        host: str = "127.0.0.1",
        port: int = 0,
        protocol: str = "tcp",
        rdma_devices: str = "",
        buffer_bytes: int = 64 << 20,
        threads: int = 2,
        log_dir: str | None = None,
        watch_interval_s: float = 0.5,
    ) -> None:
        super().__init__(host, port, log_dir, watch_interval_s)
        self.master, self.segment_bytes, self.buffer_bytes = master, segment_bytes, buffer_bytes
        self.protocol, self.rdma_devices, self.threads = protocol, rdma_devices, threads
        self.launch()

    def command(self) -> list[str]:
        return [
            mooncake_binary("mooncake_client"),
            f"--host={self.advertise_host}",
            f"--port={self.port}",
            f"--global_segment_size={self.segment_bytes}",
            f"--local_buffer_size={self.buffer_bytes}",
            f"--master_server_address={self.master}",
            "--metadata_server=P2PHANDSHAKE",
            f"--protocol={self.protocol}",
            f"--device_names={self.rdma_devices}",
            f"--threads={self.threads}",
        ]

    def environment(self) -> dict:
        # Moving bytes between its memory and its attached clients' shared buffers is a copy
        # within this host: let Mooncake do it as one (measured 2.3 vs 1.4 GB/s for reads going
        # through its TCP transport to itself), whatever store clients elsewhere are told.
        env = {**super().environment(), "MC_STORE_MEMCPY": "1"}
        # A daemon on loopback serves this node only: its transfer engine (which binds every
        # interface) is kept there too (`cluster.store.loopback`).
        return loopback_env(env) if self.host.startswith("127.") else env
