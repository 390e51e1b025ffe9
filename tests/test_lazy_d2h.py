"""Lazy device-to-host snapshots (:mod:`tierstore.store.copies`): the protocol, on the CPU, and on CUDA.

On the CPU a stand-in for :class:`~tierstore.store.copies.DeviceCopies` (the same calls, synchronous copies)
drives the CUDA code path of the Checkpointer and the store: ``save()`` opens the copies, the background
thread enqueues every object through them and records their event before releasing the gate, the
optimizer's pre-hook orders the update after them (and checks the version counters: the copies' completion
is not known on the host there), sealing waits for them; the device tier is never used on this path. The
CUDA cases run the real thing: side stream, pinned segments, no extra GPU memory.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
from torch import nn

import tierstore
from tests.test_lazy_inplace import DIM, SelfDecay, _batch, _check_step, _train_from
from tests.test_lazy_snapshot import _CopyAfterStepStarts, _hostile, _reference
from tierstore.errors import SnapshotChangedError
from tierstore.store.copies import DeviceCopies
from tierstore.train.checkpointer import Checkpointer

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class FakeCopies:
    """DeviceCopies' protocol on the CPU: records the calls in ``log`` (shared); its copies are synchronous."""

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.done = False
        self._lock = threading.Lock()

    def _note(self, what: str) -> None:
        with self._lock:
            self.log.append(what)

    def stream_context(self):
        self._note("copy")
        return contextlib.nullcontext()

    def enqueued(self) -> None:
        self._note("enqueued")
        self.done = True

    def completed(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self._note("synchronize")

    def order_update(self) -> None:
        self._note("order_update")


@pytest.fixture
def fake_copies(monkeypatch):
    log: list[str] = []
    monkeypatch.setattr(DeviceCopies, "after_current", staticmethod(lambda tensors: FakeCopies(log)))
    return log


@pytest.fixture
def cpu_device_tier_store(tmp_path, redis_url, shm_root):
    s = tierstore.open(tmp_path / "home", redis=redis_url, durable="none", host_root=str(shm_root / "n"),
                       device_tier="cpu")
    yield s
    s.close()


def test_the_cuda_path_orders_the_update_after_the_copies_and_never_uses_the_device_tier(
        cpu_device_tier_store, monkeypatch, fake_copies):
    store = cpu_device_tier_store
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, DIM), nn.Linear(DIM, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ck = Checkpointer(store, "d2h", model, opt, lazy=True, keep_last=None)
    gate = _CopyAfterStepStarts(ck, monkeypatch)
    hostile = _hostile(opt)  # changes everything the moment the Checkpointer's pre-hook returns
    update = opt.register_step_pre_hook(lambda o, a, k: fake_copies.append("update"))
    refs = {}
    try:
        for s in range(3):
            opt.zero_grad()
            model(torch.randn(4, DIM)).sum().backward()
            opt.step()
            refs[s] = _reference(ck)
            gate.reached.clear()
            ck.save(s)
        model(torch.randn(4, DIM)).sum().backward()
        opt.step()
        assert ck.wait() == "committed"
    finally:
        gate.remove()
        hostile.remove()
        update.remove()
        ck.close()
    for s, r in refs.items():
        assert _check_step(store, "d2h", s, r) == 16  # 2 layers x (weight, bias) x (param, exp_avg, exp_avg_sq, step)
    assert store.device_tier.staged == 0  # straight into the host tier: no device (here: cpu) buffers
    # per save: the copies enqueued, their event recorded, then (the gate) the update ordered after them,
    # then the update; sealing waited for them
    log = fake_copies
    for i in [i for i, x in enumerate(log) if x == "update"][1:]:  # every update after a save
        last_enqueued = max(j for j in range(i) if log[j] == "enqueued")
        assert "order_update" in log[last_enqueued:i], log
    assert log.count("enqueued") == 3 and log.count("synchronize") >= 3
    first_enqueued = log.index("enqueued")
    assert "copy" in log[:first_enqueued] and log.index("order_update") > first_enqueued


def test_on_the_cuda_path_the_version_check_runs_at_the_gate(store, monkeypatch, fake_copies):
    torch.manual_seed(1)
    model = SelfDecay()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ck = Checkpointer(store, "d2h-decay", model, opt, lazy=True, keep_last=None)
    gate = _CopyAfterStepStarts(ck, monkeypatch)
    try:
        opt.zero_grad()
        model(*_batch(0)).backward()
        opt.step()
        gate.reached.clear()
        ck.save(0)
        model(*_batch(1)).backward()  # changes `gain` in place before the copy
        opt.step()
        with pytest.raises(SnapshotChangedError) as err:
            ck.wait()
        assert err.value.fields["tensors"] == ["param/gain"]
        refs = _train_from(ck, model, opt, gate, 1, 2)
        assert ck.wait() == "committed"
    finally:
        gate.remove()
        ck.close()
    for s, r in refs.items():
        assert _check_step(store, "d2h-decay", s, r) == 2


# ---- CUDA ---------------------------------------------------------------------------------------------------


@cuda
@pytest.mark.cuda
def test_cuda_lazy_save_returns_without_a_host_sync_and_uses_no_gpu_memory(tmp_path, redis_url, shm_root):
    s = tierstore.open(tmp_path / "home", redis=redis_url, durable="none", host_root=str(shm_root / "n"))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ck = Checkpointer(s, "cuda-lazy", model, opt, lazy=True, keep_last=None)
    try:
        x = torch.randn(64, 1024, device="cuda")
        refs = {}
        for step in range(3):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            refs[step] = _reference(ck)
            before = torch.cuda.memory_allocated()
            ck.save(step)
            assert torch.cuda.memory_allocated() == before  # no GPU memory on the lazy path
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()  # ordered after the copies on the device; the host waits only if they are not enqueued
            assert ck.wait() == "committed"
        assert s.host.pinner.pins > 0 and s.host.pinner.failures == 0  # page-locked host-tier segments
        assert s.device_tier is None or s.device_tier.staged == 0  # the lazy path never stages on the device
        assert ck.stats.changed_in_forward == 0
    finally:
        ck.close()
    for step, ref in refs.items():
        assert _check_step(s, "cuda-lazy", step, ref) > 0
    s.close()


@cuda
@pytest.mark.cuda
def test_cuda_in_place_change_in_forward_is_never_committed(tmp_path, redis_url, shm_root):
    s = tierstore.open(tmp_path / "home", redis=redis_url, durable="none", host_root=str(shm_root / "n"))
    torch.manual_seed(1)
    model = SelfDecay().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ck = Checkpointer(s, "cuda-decay", model, opt, lazy=True, keep_last=None)
    x, y = (t.cuda() for t in _batch(0))
    refs, voted_down = {}, 0
    try:
        for step in range(4):
            opt.zero_grad()
            model(x, y).backward()
            opt.step()
            refs[step] = _reference(ck)
            ck.save(step)
            model(x, y).backward()  # changes `gain` in place, maybe before the copy ran: never committed so
            opt.step()
            try:
                assert ck.wait() == "committed"
            except SnapshotChangedError as e:
                assert e.fields["tensors"] == ["param/gain"]
                voted_down += 1
                del refs[step]
    finally:
        ck.close()
    assert voted_down <= 1 and refs  # once caught, `gain` is copied at save()
    for step, ref in refs.items():
        assert _check_step(s, "cuda-decay", step, ref) == 2
    s.close()
