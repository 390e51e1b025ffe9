"""Lazy Lightning saves (``TierStoreCheckpoint(lazy_save=True)``), with the real Lightning, CPU.

The save returns before the module's parameters and the optimizer's state are copied; the copy runs while the
next batch's forward and backward run, and the optimizer's next ``step()`` waits for it. The test holds each
copy until the next batch has begun (so the overlap is certain, not a matter of timing): the resumed run must
still be bitwise the uninterrupted one, which it is not if a copy read the state after the next update. A
parameter changed in place outside the optimizer before the copy fails that save, typed, with no pointer.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch", reason="needs PyTorch Lightning (the lightning extra)")

from tests import _lightning_job as J  # noqa: E402
from tierstore.errors import SnapshotChangedError  # noqa: E402
from tierstore.interop.lightning import TierStoreCheckpoint  # noqa: E402
from tierstore.interop.pointer import read_pointer  # noqa: E402
from tierstore.train.checkpointer import Checkpointer  # noqa: E402


def _held(monkeypatch):
    """Hold every lazy copy until a permit is given for it; returns (the permits, the Checkpointers that copied
    lazily)."""
    go, lazies = threading.Semaphore(0), []
    real = Checkpointer._lazy

    def held(self, *a, **kw):
        lazies.append(self)
        assert go.acquire(timeout=30)
        return real(self, *a, **kw)

    monkeypatch.setattr(Checkpointer, "_lazy", held)
    return go, lazies


class Probe(pl.Callback):
    """At each batch start: whether the last save's copy was still pending (the save returned before it), then
    let it go; ``touch`` changes a parameter in place first (what the version rule must catch)."""

    def __init__(self, cb, go, touch=False):
        self.cb, self.go, self.touch, self.pending = cb, go, touch, []

    def _pending(self) -> bool:
        cks = list(self.cb.io._cks.values())
        job = cks[0][0]._gate._current if cks else None
        return job is not None and not job.released

    def on_train_batch_start(self, trainer, module, *args):
        pending = self._pending()
        self.pending.append(pending)
        if self.touch and trainer.global_step == 1:
            with torch.no_grad():
                module.head.bias.mul_(1.0)  # the same values, a new version: not the optimizer's update
        if pending:
            self.go.release()  # one permit per held copy

    def on_train_end(self, trainer, module):
        if self._pending():
            self.go.release()  # the last save's copy: no batch follows it


def test_lazy_saves_overlap_the_next_batch_and_resume_bitwise(store, tmp_path, monkeypatch):
    ref = J.Net()
    J.trainer([], 10, enable_checkpointing=False).fit(ref, J.data())
    go, lazies = _held(monkeypatch)
    ck = tmp_path / "ck"
    cb = TierStoreCheckpoint(store=store, dirpath=str(ck), every_n_train_steps=1, save_top_k=-1, lazy_save=True)
    probe = Probe(cb, go)
    J.trainer([cb, probe], 6).fit(J.Net(), J.data())
    assert lazies and all(ck.lazy for ck in lazies)
    assert any(probe.pending[1:]), probe.pending  # a batch began while the previous save's copy was pending
    assert len(os.listdir(ck)) == 6
    for f in os.listdir(ck):
        ptr = read_pointer(ck / f)
        assert store.steps.state(ptr.model, ptr.step) in ("committed", "durable"), f

    monkeypatch.undo()  # the resumed run's saves copy unheld
    b = J.Net()
    J.trainer([TierStoreCheckpoint(store=store, dirpath=str(tmp_path / "b"), every_n_train_steps=1,
                                   lazy_save=True)], 10).fit(b, J.data(), ckpt_path=str(ck / "epoch=0-step=3.ckpt"))
    assert sorted(b.losses) == list(range(3, 10))  # resumed from a lazy save mid-epoch, into the second epoch
    assert all(b.losses[s] == ref.losses[s] for s in b.losses)
    pr, pb = J.params(ref), J.params(b)
    assert all(torch.equal(pr[n], pb[n]) for n in pr)


def test_a_parameter_changed_outside_the_optimizer_fails_that_lazy_save_with_no_pointer(store, tmp_path,
                                                                                        monkeypatch):
    go, _ = _held(monkeypatch)
    ck = tmp_path / "ck"
    cb = TierStoreCheckpoint(store=store, dirpath=str(ck), every_n_train_steps=1, save_top_k=-1, lazy_save=True)
    with pytest.raises(SnapshotChangedError, match=r"head\.bias") as ei:
        J.trainer([cb, Probe(cb, go, touch=True)], 4).fit(J.Net(), J.data())
    assert ei.value.step is not None
    names = os.listdir(ck) if ck.exists() else []
    assert "epoch=0-step=1.ckpt" not in names, names  # the failed save wrote no pointer
