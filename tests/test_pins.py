"""Pins of a framework run's checkpoints (tierstore.interop.pointer): a pin goes only on positive evidence that
no checkpoint names its step any more."""

from __future__ import annotations

import os
import shutil

import torch

from tests.test_gc import saved
from tests.test_twophase import M
from tierstore.interop.pointer import Pointer, pin, pinned_by, unpin_gone, write_pointer


def _ptr(path, step: int, model: str = M) -> Pointer:
    return Pointer(model, step, str(path), "lightning", 0.0, {"pin": str(path)})


def test_a_pin_goes_only_when_its_pointer_is_gone_or_names_another_step(store, tmp_path):
    saved(store, range(1, 6))
    run = tmp_path / "ckpts"
    names = ["kept", "removed", "moved", "overwritten", "unreadable", "other-model"]
    for step, n in enumerate(names, start=1):
        path = run / f"{n}.ckpt"
        write_pointer(path, _ptr(path, min(step, 5)))
        pin(store, M, str(path), min(step, 5))
    os.remove(run / "removed.ckpt")  # the framework's rotation (or a crash between the file and the pin)
    write_pointer(run / "moved.ckpt", _ptr(run / "moved.ckpt", 5))  # re-saved: names another step
    torch.save({"state_dict": {}}, run / "overwritten.ckpt")  # the framework's own file now
    (run / "unreadable.ckpt").write_text('{"tierstore_pointer": 1, "model": ')  # a pointer cut short: not evidence
    write_pointer(run / "other-model.ckpt", _ptr(run / "other-model.ckpt", 5, model="gpt2"))
    dropped = unpin_gone(store, M, str(run))
    assert sorted(map(os.path.basename, dropped)) == ["moved.ckpt", "other-model.ckpt", "overwritten.ckpt",
                                                      "removed.ckpt"]
    assert store.steps.pins(M) == {str(run / "kept.ckpt"): 1, str(run / "unreadable.ckpt"): 5}


def test_a_run_directory_that_cannot_be_seen_drops_no_pin(store, tmp_path):
    saved(store, [1])
    run = tmp_path / "mounted"
    path = run / "last.ckpt"
    write_pointer(path, _ptr(path, 1))
    pin(store, M, str(path), 1)
    elsewhere = tmp_path / "elsewhere"
    write_pointer(elsewhere / "x.ckpt", _ptr(elsewhere / "x.ckpt", 1))
    pin(store, M, str(elsewhere / "x.ckpt"), 1)
    shutil.rmtree(run)  # an unmounted run directory: no evidence about its files
    assert unpin_gone(store, M, str(run)) == []
    assert unpin_gone(store, M, str(tmp_path / "other-run")) == []  # only the pins of that run directory
    assert set(store.steps.pins(M)) == {str(path), str(elsewhere / "x.ckpt")}


def test_a_pointer_is_pinned_by_its_own_path_only():
    p = _ptr("/run/a.ckpt", 1)
    assert pinned_by(p, "/run/a.ckpt") and not pinned_by(p, "/run/copy.ckpt")
    assert not pinned_by(Pointer(M, 1, "/run/a.ckpt", "lightning", 0.0, {}), "/run/a.ckpt")  # before pins
