"""The store's background threads run nicer than the trainer (StoreConfig.background_nice)."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

import tierstore
from tierstore import ShardKey
from tierstore.background import thread_nice
from tierstore.config import StoreConfig
from tierstore.errors import ConfigError
from tierstore.migration import Migrator

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")


def _nice_of(prefix: str) -> list[int]:
    out = []
    for t in threading.enumerate():
        if t.name.startswith(prefix) and t.native_id is not None:
            nice = thread_nice(t.native_id)
            assert nice is not None
            out.append(nice)
    return out


def _open(tmp_path, redis_url, shm_root, **kw):
    return tierstore.open(tmp_path / "home", redis=redis_url, durable=f"file://{tmp_path / 'durable'}",
                          host_root=str(shm_root / "node0"), node_id="node0", **kw)


def test_migration_and_sealing_threads_run_nicer(tmp_path, redis_url, shm_root):
    base = thread_nice()
    s = _open(tmp_path, redis_url, shm_root, migration_workers=2, background_nice=7)
    try:
        assert _nice_of("tierstore-migrate-") == [min(19, base + 7)] * 2
        pend = [s.snapshot(ShardKey("m", f"l{i}", 1, 0), {"w": torch.randn(100)}) for i in range(3)]
        infos = s.finish_async(pend).result(timeout=60)
        assert [i.key.layer for i in infos] == ["l0", "l1", "l2"]
        assert _nice_of("tierstore-seal") == [min(19, base + 7)]
        s.flush()
        assert set(s.info(ShardKey("m", "l2", 1, 0)).tiers) == {"durable", "host"}
        assert thread_nice() == base  # the trainer's thread keeps its priority
    finally:
        s.close()
    assert not _nice_of("tierstore-seal")  # closed with the store


def test_default_is_documented_and_zero_keeps_priority(tmp_path, redis_url, shm_root):
    assert StoreConfig().background_nice == 10
    base = thread_nice()
    s = _open(tmp_path, redis_url, shm_root, background_nice=0)
    try:
        assert _nice_of("tierstore-migrate-") == [base]
    finally:
        s.close()


def test_replication_workers_take_the_priority(tmp_path, redis_url, shm_root):
    s = _open(tmp_path, redis_url, shm_root, migrate=False)
    try:
        m = Migrator(s.host, s.durable, s.index, name="replicate-test", nice=5)
        assert _nice_of("tierstore-replicate-test-") == [min(19, thread_nice() + 5)]
        m.close()
    finally:
        s.close()


def test_finish_async_aborts_the_rest_when_one_fails(tmp_path, redis_url, shm_root):
    s = _open(tmp_path, redis_url, shm_root)
    try:
        pend = [s.snapshot(ShardKey("m", f"l{i}", 1, 0), {"w": torch.randn(10)}) for i in range(3)]
        pend[1].finish()  # finishing it twice is an error: the second one fails in the background
        with pytest.raises(RuntimeError, match="already finished"):
            s.finish_async(pend).result(timeout=60)
        assert s.info(ShardKey("m", "l0", 1, 0)) is not None
        assert s.get(ShardKey("m", "l2", 1, 0)) is None and not s.host.exists("m/l2/1/0")
    finally:
        s.close()


@pytest.mark.parametrize("bad", [-1, 20])
def test_out_of_range_is_refused(bad):
    with pytest.raises(ConfigError):
        StoreConfig(background_nice=bad)


def test_environment_override():
    assert StoreConfig.from_env({"TIERSTORE_BACKGROUND_NICE": "3"}).background_nice == 3
    assert StoreConfig.from_env({"TIERSTORE_BACKGROUND_NICE": "3"}, background_nice=5).background_nice == 5
    with pytest.raises(ConfigError):
        StoreConfig.from_env({"TIERSTORE_BACKGROUND_NICE": "x"})
