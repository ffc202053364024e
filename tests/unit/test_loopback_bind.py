"""The loopback shim (cluster/store/loopback_bind.c, preloaded into one-node runs' Mooncake store
daemons): with DSPARK_BIND_LOOPBACK=1 a bind to the wildcard address lands on loopback (IPv4,
IPv6-only, dual-stack); a specific address, and every bind without the switch, are left alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cluster.store.loopback import loopback_env, shim_path

PROBE = r"""
import json, socket
out = {}
s = socket.socket(socket.AF_INET); s.bind(("0.0.0.0", 0)); out["v4_any"] = s.getsockname()[0]
s = socket.socket(socket.AF_INET); s.bind(("127.0.0.1", 0)); out["v4_lo"] = s.getsockname()[0]
for v6only in (1, 0):
    s = socket.socket(socket.AF_INET6); s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, v6only)
    s.bind(("::", 0)); out[f"v6_any_v6only{v6only}"] = s.getsockname()[0]
print(json.dumps(out))
"""


def bound(env: dict) -> dict:
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def shim_env():
    if shim_path() is None:
        pytest.skip("no C compiler to build the loopback shim (cc)")
    return loopback_env(dict(os.environ))


def test_wildcard_binds_land_on_loopback(shim_env):
    assert bound(shim_env) == {
        "v4_any": "127.0.0.1",
        "v4_lo": "127.0.0.1",
        "v6_any_v6only1": "::1",
        "v6_any_v6only0": "::ffff:127.0.0.1",
    }


def test_without_the_switch_nothing_changes(shim_env):
    env = {**shim_env, "DSPARK_BIND_LOOPBACK": "0"}
    assert bound(env) == {"v4_any": "0.0.0.0", "v4_lo": "127.0.0.1", "v6_any_v6only1": "::", "v6_any_v6only0": "::"}
