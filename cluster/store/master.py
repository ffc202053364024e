"""The Mooncake master's lifecycle: start `mooncake_master`, wait until it answers, restart it
when it dies, stop it with the job.

`MooncakeMaster` is a plain class; the job runs it as a Ray actor (one per job, or one per
group) so it lives on a known node and dies with the job. A restarted master has lost every
key: `generation` counts restarts so store users (and the ledger) can tell that stored
samples are gone and must be regenerated.
"""

from __future__ import annotations

from cluster.store.process import SupervisedProcess, free_port, mooncake_binary

__all__ = ["MooncakeMaster", "free_port"]


class MooncakeMaster(SupervisedProcess):
    """With `segment_bytes` (`transport.segment_host: master`) this actor also lends the store's
    memory from its own process: samples then outlive the death of any producer or trainer rank
    and are lost only with the master, whose restart loses every key anyway. The default keeps
    the memory in per-node daemons instead (`cluster.store.node_store`)."""

    name = "mooncake_master"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        log_dir: str | None = None,
        watch_interval_s: float = 0.5,
        extra_args: list[str] | None = None,
        segment_bytes: int = 0,
        protocol: str = "tcp",
        rdma_devices: str = "",
    ) -> None:
        super().__init__(host, port, log_dir, watch_interval_s)
        self.metrics_port = free_port(host, avoid=(self.port,))  # (the RPC port may not be bound yet)
        self.extra_args = list(extra_args or [])
        self.segment_bytes, self.protocol, self.rdma_devices = segment_bytes, protocol, rdma_devices
        self._holder = None
        self.launch()

    def command(self) -> list[str]:
        # No eviction: by default the master drops objects (unread samples among them) once its
        # memory is 90% used, and an evicted sample is silently gone until a reader misses it.
        # With eviction off a full store refuses puts (-200), which producers treat as
        # backpressure, and the ledger's watermarks keep it from filling in the first place.
        return [
            mooncake_binary("mooncake_master"),
            f"--rpc_address={self.host}",
            f"--rpc_port={self.port}",
            f"--metrics_host={self.host}",
            f"--metrics_port={self.metrics_port}",
            "--eviction_ratio=0",
            "--eviction_high_watermark_ratio=1.0",
            *self.extra_args,
        ]

    def info(self) -> dict:
        return {**super().info(), "metrics": f"http://{self.host}:{self.metrics_port}/metrics"}

    def stored_objects(self, timeout_s: float = 5.0) -> dict:
        """What the master holds now, from its own Prometheus endpoint: `keys` and
        `allocated_bytes`. A job that removes what it trained ends with none: anything left is a
        leak (an object whose put outlived the attempt that made it, or a key nobody removed)."""
        import urllib.request

        metrics = self.info()["metrics"]
        with urllib.request.urlopen(metrics, timeout=timeout_s) as r:  # noqa: S310 - our own loopback endpoint
            lines = r.read().decode().splitlines()
        values = dict(line.split(" ", 1) for line in lines if line and not line.startswith("#") and " " in line)
        try:
            return {
                "keys": int(float(values["master_key_count"])),
                "allocated_bytes": int(float(values["master_allocated_bytes"])),
            }
        except KeyError as e:
            raise RuntimeError(f"mooncake_master's metrics at {metrics} have no {e}: its metric names changed") from e

    def after_start(self) -> None:
        if not self.segment_bytes:
            return
        from cluster.store.client import HiddenStateStore, StoreConfig

        if self._holder is not None:
            self._holder.close()
        self._holder = HiddenStateStore(
            StoreConfig(
                master=self.address,
                local_hostname=self.advertise_host,
                protocol=self.protocol,
                rdma_devices=self.rdma_devices,
                segment_bytes=self.segment_bytes,
                buffer_bytes=16 << 20,
            )
        ).connect()

    def stop(self) -> None:
        self._stopping.set()
        if self._holder is not None:
            self._holder.close()
            self._holder = None
        super().stop()
