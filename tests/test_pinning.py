"""The pinned host tier (:mod:`backends.pinning`): budget, fallback, unregister before free, stale pages.

On the CPU the registration calls are injected (pure logic of when to register and unregister, against
real shared-memory segments and the real reuse pool); the real ``cudaHostRegister`` runs in the CUDA-only
cases at the end.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

import backends.shm_mapping as shm_mapping
from backends.host import HostBackend
from backends.pinning import Pinner
from backends.shm_mapping import release_pages

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class Calls:
    """Injected registration calls that record what was (un)registered, and in which order with munmap."""

    def __init__(self, monkeypatch, fail: bool = False) -> None:
        self.fail = fail
        self.registered: dict[int, int] = {}
        self.events: list[tuple[str, int]] = []
        real = shm_mapping._munmap

        def munmap(addr, length):
            self.events.append(("munmap", addr))
            return real(addr, length)

        monkeypatch.setattr(shm_mapping, "_munmap", munmap)

    def register(self, addr: int, nbytes: int) -> bool:
        if self.fail:
            return False
        assert addr not in self.registered, "registered twice without an unregister"
        self.registered[addr] = nbytes
        self.events.append(("register", addr))
        return True

    def unregister(self, addr: int) -> None:
        assert addr in self.registered, "unregister of memory never registered"
        del self.registered[addr]
        self.events.append(("unregister", addr))

    @property
    def pair(self):
        return self.register, self.unregister


def _host(root, calls: Calls, budget: int = 1 << 30) -> HostBackend:
    return HostBackend(root, pin_bytes=budget, pin_calls=calls.pair)


def _write(host: HostBackend, name: str, nbytes: int, fill: int, pin: bool = True) -> bool:
    res = host.reserve(name, nbytes)
    pinned = host.pin(res.buffer) if pin else False
    res.buffer[:] = bytes([fill]) * nbytes
    res.commit()
    return pinned


def _addr(buf: memoryview) -> int:
    return buf.obj._tierstore_mapping.addr


def test_a_segment_is_registered_once_and_stays_so_while_pooled_and_reused(shm_root, monkeypatch):
    calls = Calls(monkeypatch)
    host = _host(shm_root, calls)
    assert _write(host, "a", 1 << 20, 1)
    assert host.pinner.pins == 1 and host.pinner.pinned_bytes == 1 << 20
    assert host.delete("a")  # into the pool, mapping kept: still registered
    assert len(calls.registered) == 1 and host.pinner.pinned_bytes == 1 << 20
    assert _write(host, "b", 1 << 20, 2)  # the same segment, the same size: no second registration
    assert host.pinner.pins == 1 and host.pinner.hits == 1
    got = host.get("b")
    assert bytes(got[:4]) == b"\x02" * 4
    del got
    host.close()


def test_a_segment_reused_at_another_size_is_registered_again_for_it(shm_root, monkeypatch):
    calls = Calls(monkeypatch)
    host = _host(shm_root, calls)
    _write(host, "a", 1 << 20, 1)
    (addr,) = calls.registered
    host.delete("a")
    res = host.reserve("b", (1 << 20) - 4096)  # same size class: the pooled segment, truncated
    assert addr not in calls.registered  # the registration went before the resize (it would hold stale pages)
    assert host.pin(res.buffer) and calls.registered[_addr(res.buffer)] == (1 << 20) - 4096
    assert calls.events.index(("unregister", addr)) < calls.events.index(("register", addr), 1)
    res.abort()
    host.close()


def test_a_segment_another_process_pooled_is_not_trusted_to_hold_the_registered_pages(shm_root, monkeypatch):
    calls = Calls(monkeypatch)
    a = _host(shm_root, calls)
    b = HostBackend(shm_root, pin_bytes=0)  # another process on the node (its own pool state), never pins
    _write(a, "x", 1 << 20, 1)
    (addr,) = calls.registered
    a.delete("x")  # pooled by a, whose mapping stays registered
    res = b.reserve("y", 1 << 20)  # b claims it (and may resize it: here it truncates and regrows it)
    fd = os.open(res._tmp, os.O_RDWR)
    os.ftruncate(fd, 0)
    os.ftruncate(fd, 1 << 20)
    os.close(fd)
    res.buffer[:] = b"\x03" * (1 << 20)
    res.commit()
    del res
    b.delete("y")  # pooled again, by b
    res = a.reserve("z", 1 << 20)  # a gets it back: its old registration must not be reused
    assert addr not in calls.registered
    assert a.pin(res.buffer) and a.pinner.pins == 2 and a.pinner.hits == 0
    res.abort()
    a.close()
    b.close()


def test_the_budget_caps_pinned_bytes_and_the_rest_is_copied_pageable(shm_root, monkeypatch):
    calls = Calls(monkeypatch)
    host = _host(shm_root, calls, budget=3 << 20)
    assert _write(host, "a", 2 << 20, 1)
    assert not _write(host, "b", 2 << 20, 2)  # over the budget: pageable, still written
    assert host.pinner.fallbacks == 1 and host.pinner.pinned_bytes == 2 << 20
    assert bytes(host.get("b")[-3:]) == b"\x02" * 3
    assert _write(host, "c", 1 << 20, 3)  # what still fits is pinned
    assert host.pinner.pinned_bytes == 3 << 20 and len(calls.registered) == 2
    host.close()


def test_a_failed_registration_falls_back_to_pageable_copies(shm_root, monkeypatch):
    calls = Calls(monkeypatch, fail=True)
    host = _host(shm_root, calls)
    assert not _write(host, "a", 1 << 20, 7)
    assert host.pinner.failures == 1 and host.pinner.pinned_bytes == 0
    assert bytes(host.get("a")[:2]) == b"\x07\x07"
    host.close()


def test_memory_is_unregistered_before_it_is_unmapped_or_its_pages_released(shm_root, monkeypatch):
    calls = Calls(monkeypatch)
    host = _host(shm_root, calls)
    _write(host, "a", 1 << 20, 1)
    (addr,) = calls.registered
    host.delete("a")
    assert host.drain_pool() == 1 << 20  # freed: the pool forgets the mapping, unmapped once unused
    gc.collect()
    assert addr not in calls.registered and host.pinner.pinned_bytes == 0
    assert calls.events.index(("unregister", addr)) < calls.events.index(("munmap", addr))
    res = host.reserve("b", 1 << 20)
    assert host.pin(res.buffer)
    addr = _addr(res.buffer)
    release_pages(res.buffer)  # pages given back: the registration goes first
    assert addr not in calls.registered
    res.abort()
    host.close()


def test_the_budget_counts_every_mapping_of_this_process_and_zero_never_pins(shm_root, monkeypatch):
    calls = Calls(monkeypatch)
    never = HostBackend(shm_root, pin_bytes=0, pin_calls=calls.pair)
    assert not _write(never, "a", 4096, 1)
    assert not calls.registered and never.pinner.stats()["budget_bytes"] == 0
    never.close()

    class Fake:
        addr, pinned, pinner = 4096, 0, None

    p = Pinner(10, calls.pair)
    m1, m2 = Fake(), Fake()
    m2.addr = 8192
    assert p.pin(m1, 6) and not p.pin(m2, 6) and p.pin(m2, 4)
    p.unpin(m1)
    p.unpin(m1)  # idempotent
    assert p.pinned_bytes == 4 and p.pin(m1, 6) and p.pinned_bytes == 10


def test_cpu_tensors_pin_nothing_and_need_no_cuda(store):
    assert store.host.pinner.budget_bytes > 0  # the default budget: a quarter of the machine's memory
    store.put("m/l/0/0", {"w": torch.ones(1024)})
    store.put("m/l/1/0", {"w": torch.ones(1024)})
    st = store.host.pinner.stats()
    assert (st["pins"], st["failures"], st["fallbacks"], st["pinned_bytes"]) == (0, 0, 0, 0)
    assert not store.host.pinner._looked_up  # the CUDA runtime was never asked


@cuda
@pytest.mark.cuda
def test_cuda_snapshots_land_in_page_locked_segments(tmp_path, redis_url, shm_root):
    import tierstore

    s = tierstore.open(tmp_path / "home", redis=redis_url, durable="none", host_root=str(shm_root / "n"),
                       device_tier="off")
    try:
        t = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
        p = s.snapshot("m/l/0/0", {"w": t})
        view = torch.frombuffer(p.reservation.buffer, dtype=torch.uint8)
        assert view.is_pinned()  # registered with the driver: the D2H copy ran at the copy engine's rate
        p.finish()
        assert torch.equal(s.get("m/l/0/0")["w"], t.cpu())
        assert s.host.pinner.pins == 1 and s.host.pinner.failures == 0
    finally:
        s.close()
    gc.collect()


@cuda
@pytest.mark.cuda
def test_cuda_pinned_segments_are_unregistered_when_freed(shm_root):
    host = HostBackend(shm_root, pin_bytes=1 << 30)
    res = host.reserve("a", 1 << 20)
    assert host.pin(res.buffer)
    buf = torch.frombuffer(res.buffer, dtype=torch.uint8)
    assert buf.is_pinned()
    buf.copy_(torch.full((1 << 20,), 5, dtype=torch.uint8, device="cuda"), non_blocking=True)
    torch.cuda.synchronize()
    del buf
    res.commit()
    host.delete("a")
    host.drain_pool()
    gc.collect()
    assert host.pinner.pinned_bytes == 0
    host.close()
