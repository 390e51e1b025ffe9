"""A home's state through the library: the host tier's pool freed by open/close, read-only opens that
create nothing, and what :func:`tierstore.home.describe` and :func:`~tierstore.home.purge` see and remove."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tierstore
from tierstore.errors import UnknownError
from tierstore.home import HostUsers, describe, host_dir, host_lock_path, purge, users
from tierstore.keys import ShardKey

from tests import _warm

REPO = Path(__file__).resolve().parents[1]


def _pool(root: Path) -> list[Path]:
    return sorted((root / ".pool").iterdir())


def _open(tmp_path, redis_url, root: Path):
    return tierstore.open(tmp_path / "home", redis=redis_url, durable="none", host_root=str(root))


def _garbage(store, step: int) -> None:
    """Put and delete an object: its segment goes to the pool."""
    key = ShardKey("m", "l", step, 0)
    store.put(key, {"w": torch.ones(4096)})
    store.delete(key)


def test_the_last_store_to_close_frees_the_pool(tmp_path, redis_url, shm_root):
    root = shm_root / "node0"
    a = _open(tmp_path, redis_url, root)
    b = _open(tmp_path, redis_url, root)
    _garbage(a, 1)
    _garbage(b, 2)  # b may reuse the segment a freed (one pool per node)
    pooled = _pool(root)
    assert pooled
    a.close()
    assert _pool(root) == pooled  # b still holds the tier and may reuse them
    b.close()
    assert _pool(root) == []  # the last holder: nobody maps them any more


def test_open_frees_a_pool_that_a_killed_process_left(tmp_path, redis_url, shm_root):
    root = shm_root / "node0"
    code = ("import sys, torch, tierstore\n"
            "s = tierstore.open(sys.argv[1], redis=sys.argv[2], durable='none', host_root=sys.argv[3])\n"
            "k = tierstore.ShardKey('m', 'l', 1, 0)\ns.put(k, {'w': torch.ones(4096)})\ns.delete(k)\n"
            "print('ready', flush=True)\nsys.stdin.read()\n")
    p = _warm.popen([sys.executable, "-c", code, str(tmp_path / "home"), redis_url, str(root)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        assert p.stdout.readline().strip() == "ready"
        assert len(_pool(root)) == 1
        s = _open(tmp_path, redis_url, root)  # the other process still holds the tier: its pool stays
        s.close()
        assert len(_pool(root)) == 1
    finally:
        p.send_signal(signal.SIGKILL)  # no close(): the segment stays, the lock goes with the process
        p.wait(30)
    assert len(_pool(root)) == 1
    s = _open(tmp_path, redis_url, root)
    try:
        assert _pool(root) == []
    finally:
        s.close()


def test_host_users_counts_holders():
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        root = Path(d) / "node"
        a, b = HostUsers(root), HostUsers(root)
        assert a.acquire() is True and b.acquire() is False
        assert host_lock_path(root).parent == Path(d) and not root.exists()  # the lock sits beside the tier
        assert a.release() is False and b.release() is True
        assert a.release() is False  # idempotent


def test_a_read_only_open_creates_nothing(tmp_path, redis_url):
    home = tmp_path / "home"
    with pytest.raises(UnknownError, match="no tierstore home at"):
        tierstore.open(home, create=False)
    assert not home.exists()
    shm = tmp_path / "shm"
    s = tierstore.open(home, redis=redis_url, durable=f"file://{tmp_path / 'durable'}",
                       host_root=str(shm / "node0"), create=False)
    try:
        assert [t.tier for t in s.tiers] == ["host", "durable"]
        assert s.get(ShardKey("m", "l", 1, 0)) is None and s.list("m") == []
        with pytest.raises(tierstore.TierUnavailableError, match="does not exist"):
            s.put(ShardKey("m", "l", 1, 0), {"w": torch.ones(2)})
    finally:
        s.close()
    assert not shm.exists() and not (tmp_path / "durable").exists() and not home.exists()


def test_describe_and_purge_an_embedded_home(tmp_path):
    home = tmp_path / "home"
    s = tierstore.open(home)
    s.put(ShardKey("m", "l", 1, 0), {"w": torch.ones(1024)})
    s.flush()
    state = describe(home)
    assert state.exists and len(state.servers) == 1
    assert {w for w, _p, _n in state.paths} == {"index", "durable tier", "host tier (every node)"}
    assert all(n > 0 for _w, _p, n in state.paths)
    held = users(home)
    assert held.connections >= 1 and any(held.host_holders.values())
    s.close()
    assert not users(home)
    removed = purge(home)
    assert host_dir(home) in removed and home in removed and not home.exists() and not host_dir(home).exists()
    assert describe(home).empty
