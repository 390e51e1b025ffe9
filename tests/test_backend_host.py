"""HostBackend: the conformance suite, segment reuse, capacity, survival of the writer."""

from __future__ import annotations

import mmap
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


def _payload(n: int) -> bytes:
    return bytes((i * 131 + (i >> 9)) % 251 for i in range(n))


def test_get_range_of_another_process_object_maps_the_range_alone(shm_root):
    """A reader that did not write the object (its own kept mappings: none) maps the range's pages only,
    from a page boundary below it: every offset, aligned or not, reads the right bytes."""
    writer, reader = HostBackend(shm_root), HostBackend(shm_root)
    data = _payload(3 * 65_536 + 777)
    writer.put("m/l/1/0", data)
    n = len(data)
    for off, length in [(0, 1), (1, 4095), (4095, 2), (65_535, 65_538), (70_001, 100_000), (n - 3, 3), (n - 3, 50)]:
        got = reader.get_range("m/l/1/0", off, length)
        assert bytes(got) == data[off : off + length], (off, length)
        assert len(got.obj) <= min(length, n - off) + mmap.ALLOCATIONGRANULARITY  # the range's pages, not all
    writer.close()
    reader.close()


def test_a_get_range_view_keeps_its_segment_from_reuse_in_the_writer_too(shm_root):
    """The writer reads through its kept mapping; the view holds the shared lock as :meth:`get`'s does, so the
    deleted object's segment is not overwritten under it by the next put of the same size."""
    b = HostBackend(shm_root, recycle_grace_s=0.0)
    first = b"a" * 8192
    b.put("m/l/1/0", first)
    view = b.get_range("m/l/1/0", 100, 5000)
    assert b.delete("m/l/1/0")
    b.put("m/l/2/0", b"b" * 8192)  # the pool's segment is locked by the view: a fresh one
    assert bytes(view) == first[100:5100]
    assert bytes(b.get("m/l/2/0")) == b"b" * 8192
    del view
    b.close()


def test_past_the_descriptor_budget_reads_are_private_copies(shm_root, monkeypatch):
    """Each read view holds its object's descriptor (its shared lock); with as many alive as the budget
    allows, reads return private copies that hold none, and views again once those go."""
    import backends.host as host

    budget = host._Held.count + 2  # two more views, whatever else this process holds
    monkeypatch.setattr(host, "read_view_budget", lambda: budget)
    b = HostBackend(shm_root, recycle_grace_s=0.0)
    reader = HostBackend(shm_root)  # not the writer: its views are its own mappings
    for i in range(4):
        b.put(f"m/l/{i}/0", bytes([i]) * 8192)
    views = [reader.get("m/l/0/0"), reader.get_range("m/l/1/0", 10, 100)]
    assert all(isinstance(v, memoryview) for v in views)
    whole, part = reader.get("m/l/2/0"), reader.get_range("m/l/3/0", 4000, 5000)
    assert isinstance(whole, bytes) and whole == b"\x02" * 8192
    assert isinstance(part, bytes) and part == b"\x03" * 4192
    assert b.delete("m/l/2/0")  # a private copy holds no lock: its segment is reused at once
    b.put("m/l/9/0", b"z" * 8192)
    assert whole == b"\x02" * 8192
    del views
    assert isinstance(reader.get("m/l/0/0"), memoryview)
    b.close()
    reader.close()


def test_a_delete_removes_its_steps_directory_once_empty_and_keeps_it_while_not(shm_root):
    """Every step saved made one directory per layer that stayed, empty, for good: over a long run, millions of
    tmpfs inodes, and every listing of the tier walked them."""
    b = HostBackend(shm_root / "node", recycle_grace_s=0.0)
    for step in range(1, 4):
        for rank in range(2):
            b.put(f"m/l/{step}/{rank}.t", b"x" * 64)
    assert b.delete("m/l/1/0.t")
    assert (shm_root / "node" / "m" / "l" / "1").is_dir(), "rank 1's copy of the step is still in it"
    assert b.delete("m/l/1/1.t")
    assert not (shm_root / "node" / "m" / "l" / "1").exists()
    assert (shm_root / "node" / "m" / "l").is_dir()
    for step in (2, 3):
        assert bytes(b.get(f"m/l/{step}/0.t")) == b"x" * 64
    b.put("m/l/1/0.u", b"again")  # the step's directory is made again by the next publish into it
    assert bytes(b.get("m/l/1/0.u")) == b"again"
    b.close()


def test_publishes_racing_the_deletes_that_empty_their_directory_all_land(shm_root):
    """A writer publishing into a step's directory while another thread deletes that directory's last object
    (and so removes it): each publish makes the directory again, none fails, nothing published is lost."""
    import threading

    b = HostBackend(shm_root / "node", recycle_grace_s=0.0)
    stop = threading.Event()
    errors: list[BaseException] = []

    def churn() -> None:  # one object in the directory, deleted again and again: the directory goes each time
        i = 0
        while not stop.is_set():
            try:
                b.put(f"m/l/7/9.c{i}", b"c")
                b.delete(f"m/l/7/9.c{i}")
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
                return
            i += 1

    t = threading.Thread(target=churn)
    t.start()
    read: list[bytes] = []
    try:
        for i in range(300):  # its own objects go too, so the directory empties from both sides
            n = f"m/l/7/0.p{i}"
            b.put(n, n.encode())
            read.append(bytes(b.get(n)))
            assert b.delete(n)
    finally:
        stop.set()
        t.join(30)
    assert not errors, errors
    assert read == [f"m/l/7/0.p{i}".encode() for i in range(300)]
    b.put("m/l/7/0.last", b"kept")
    assert bytes(b.get("m/l/7/0.last")) == b"kept"
    b.close()
