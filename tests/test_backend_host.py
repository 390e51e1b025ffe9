"""HostBackend: the conformance suite, segment reuse, capacity, survival of the writer."""

from __future__ import annotations

import os
import time

import pytest

from backends.host import HostBackend
from tests.conformance import BackendConformance
from tierstore.errors import TierFullError


class TestHostConformance(BackendConformance):
    @pytest.fixture
    def backend(self, shm_root):
        b = HostBackend(shm_root / "node", recycle_grace_s=0.0)
        yield b
        b.close()


def test_objects_are_files_in_shared_memory(shm_root):
    b = HostBackend(shm_root)
    b.put("m/l/1/0", b"hello")
    assert (shm_root / "m" / "l" / "1" / "0").read_bytes() == b"hello"
    assert bytes(b.get("m/l/1/0")) == b"hello"


def test_reservation_invisible_until_commit(shm_root):
    b = HostBackend(shm_root)
    res = b.reserve("m/l/1/0", 4)
    res.buffer[:] = b"abcd"
    assert b.get("m/l/1/0") is None and list(b.list()) == []
    res.commit()
    assert bytes(b.get("m/l/1/0")) == b"abcd"


def test_deleted_segment_is_reused_after_grace(shm_root):
    b = HostBackend(shm_root, recycle_grace_s=0.2)
    b.put("m/l/1/0", b"x" * 8192)
    ino = os.stat(shm_root / "m/l/1/0").st_ino
    assert b.delete("m/l/1/0")
    b.put("m/l/2/0", b"y" * 8192)  # within the grace period: a fresh segment
    assert os.stat(shm_root / "m/l/2/0").st_ino != ino
    time.sleep(0.3)
    b.put("m/l/3/0", b"z" * 8192)
    assert os.stat(shm_root / "m/l/3/0").st_ino == ino
    assert bytes(b.get("m/l/3/0")) == b"z" * 8192
    assert b.list() and list(b.list()) == ["m/l/2/0", "m/l/3/0"]


def test_capacity_limit_raises_tier_full(shm_root):
    b = HostBackend(shm_root, capacity_bytes=64 << 10, pool_bytes=0)
    b.put("m/l/1/0", b"a" * (40 << 10))
    with pytest.raises(TierFullError) as ei:
        b.put("m/l/2/0", b"b" * (40 << 10))
    assert "full" in str(ei.value) and ei.value.capacity == 64 << 10
    assert not b.exists("m/l/2/0")
    b.delete("m/l/1/0")
    b.put("m/l/2/0", b"b" * (40 << 10))


def test_preallocate_fills_pool(shm_root):
    b = HostBackend(shm_root)
    b.preallocate([4096, 4096])
    assert len(list((shm_root / ".pool").iterdir())) == 2
    b.put("m/l/1/0", b"q" * 4096)
    assert len(list((shm_root / ".pool").iterdir())) == 1
