"""Mooncake's transfer engine on loopback, for one-node (local) runs.

The engine binds its handshake and data ports to every interface whatever hostname it is given
(measured with mooncake-transfer-engine-non-cuda 0.3.13.post1: `*` and `0.0.0.0`), and it has no
switch for the address and no authentication. On one node nothing outside the machine needs
them, so the processes that run an engine there get `loopback_bind.c` preloaded: it turns binds
of the wildcard address into binds of loopback (see the file). On a cluster the ports must be
reachable from the other nodes; what protects them there is the cluster's private network and
the samples' MAC (`cluster.store.wire`).

The shim is compiled with the system's C compiler (`cc`) at first use into the cache
(`DSPARK_CACHE`, named after its source's hash, so an edit rebuilds it); without a compiler the
run goes on with the engine on every interface, after a warning that says so and what to install.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

log = logging.getLogger("dspark.store")
SOURCE = Path(__file__).with_name("loopback_bind.c")
_lock = threading.Lock()
_warned = False


def shim_path() -> Path | None:
    """The compiled shim (built now if needed), or None where it cannot be built (warned once)."""
    global _warned
    from dspark.targets import cache_root

    source = SOURCE.read_bytes()
    out = cache_root() / f"loopback_bind-{hashlib.sha256(source).hexdigest()[:16]}.so"
    with _lock:
        if out.exists():
            return out
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        why = "no C compiler (cc) found" if not cc else ""
        if cc:
            out.parent.mkdir(parents=True, exist_ok=True)
            # Built beside its final name and renamed: processes on the node starting at once
            # never load a half-written library.
            fd, tmp = tempfile.mkstemp(prefix=out.name, suffix=".tmp", dir=out.parent)
            os.close(fd)
            try:
                r = subprocess.run(
                    [cc, "-shared", "-fPIC", "-O2", "-o", tmp, str(SOURCE), "-ldl"],
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
                why = "" if r.returncode == 0 else f"{cc} failed: {r.stderr.strip()[-300:]}"
            except (OSError, subprocess.TimeoutExpired) as e:
                why = f"{cc} could not run: {e}"
            if not why:
                os.replace(tmp, out)
                return out
            os.unlink(tmp)
        if not _warned:
            _warned = True
            log.warning(
                "Mooncake's transfer engine will listen on every interface, without authentication (%s): "
                "install a C compiler (e.g. apt-get install gcc) so that one-node runs keep it on loopback; "
                "the samples' MAC still refuses a changed sample",
                why,
            )
        return None


def loopback_env(env: dict[str, str]) -> dict[str, str]:
    """`env` for a process whose wildcard binds should land on loopback: the shim preloaded
    (before whatever else it preloads) and switched on. Unchanged where the shim cannot be built."""
    shim = shim_path()
    if shim is None:
        return env
    preload = ":".join(filter(None, [str(shim), env.get("LD_PRELOAD", "")]))
    return {**env, "LD_PRELOAD": preload, "DSPARK_BIND_LOOPBACK": "1"}
