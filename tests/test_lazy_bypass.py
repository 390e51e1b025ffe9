"""Lazy snapshots never commit values that differ from ``save()``, even through writes the version counter does not
see: ``p.data.clamp_()`` (a WGAN critic's weight clipping right after ``save()``), a numpy view
(``t.numpy()[...] = x``) and ``untyped_storage()``. Each shares the parameter's storage but not its version counter.

Each case makes the background copy start only once the trainer reached ``optimizer.step()``
(:class:`tests.test_lazy_snapshot._CopyAfterStepStarts`), so the write after ``save()`` lands before the copy reads
the parameters: on a Checkpointer that trusts the version counters every step commits the written values. Here every
committed step holds the state of its ``save()`` bit for bit (and a restore gives the last one), the first step is
voted down with :class:`~tierstore.errors.SnapshotChangedError` naming the tensors (the fingerprint taken at
``save()`` differs from the tensors after the copy), and the tensors are copied at ``save()`` from then on, so the
later steps commit. ``lazy_check="full"`` catches a write of one element that a 64-element sample misses.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import tierstore
from tests.test_lazy_d2h import fake_copies  # noqa: F401  # a fixture: DeviceCopies' stand-in on the CPU
from tests.test_lazy_snapshot import _bits, _CopyAfterStepStarts, _reference
from tierstore.errors import ConfigError, SnapshotChangedError
from tierstore.train.checkpointer import Checkpointer

DIM = 16


def _clamp(model: nn.Module) -> None:
    for p in model.parameters():  # WGAN's weight clipping
        p.data.clamp_(-0.01, 0.01)


def _numpy(model: nn.Module) -> None:
    for p in model.parameters():
        p.detach().numpy()[...] = 0.25


def _storage(model: nn.Module) -> None:
    for p in model.parameters():
        p.untyped_storage().fill_(0)  # every byte 0: 0.0


WRITES: dict[str, Callable[[nn.Module], None]] = {"data-clamp": _clamp, "numpy-view": _numpy,
                                                  "untyped-storage": _storage}


def _net(device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, 1)).to(device)


def _step(model: nn.Module, opt: torch.optim.Optimizer, s: int) -> None:
    g = torch.Generator().manual_seed(s)
    opt.zero_grad(set_to_none=True)
    x = torch.randn(8, DIM, generator=g).to(next(model.parameters()).device)
    model(x).pow(2).mean().backward()
    opt.step()


def _check_step(store, name: str, step: int, ref: dict) -> int:
    compared = 0
    for key in store.list(name, step=step):
        got = store.get(key)
        for n, t in got.tensors.items():
            assert _bits(t, ref[key.layer][n]), f"step {step} {key.layer} {n}: not the state at save()"
            compared += 1
    return compared


def _run(store, monkeypatch, name: str, write: Callable[[nn.Module], None], steps: int = 4, device: str = "cpu"):
    """Train and save lazily, ``write`` right after each ``save()``; return the references and the errors."""
    model = _net(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ck = Checkpointer(store, name, model, opt, lazy=True, keep_last=None)
    gate = _CopyAfterStepStarts(ck, monkeypatch)
    refs, errors = {}, {}
    try:
        for s in range(steps):
            _step(model, opt, s)
            refs[s] = _reference(ck)
            gate.reached.clear()  # armed: this save's copy starts at the next optimizer.step()
            ck.save(s)
            write(model)  # after save(), before the copy: the version counters do not move
            _step(model, opt, 100 + s)  # the copy runs behind this update's pre-hook
            try:
                ck.wait()
            except SnapshotChangedError as e:
                errors[s] = e
    finally:
        gate.remove()
        ck.close()
    return model, refs, errors, ck


CASES = [(how, "cpu") for how in WRITES] + [
    ("data-clamp", "cuda-path-on-cpu"),  # the CUDA code path (second take at the gate) with DeviceCopies' stand-in
] + [
    pytest.param(how, "cuda", marks=[pytest.mark.cuda,
                                     pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])
    for how in ("data-clamp", "untyped-storage")  # a numpy view is of CPU tensors only
]


@pytest.mark.parametrize(("how", "device"), CASES)
def test_a_write_that_bypasses_the_version_counter_is_never_committed(store, monkeypatch, request, how, device):
    name = f"bypass-{how}-{device}"
    if device == "cuda-path-on-cpu":
        log = request.getfixturevalue("fake_copies")
        device = "cpu"
    _model, refs, errors, ck = _run(store, monkeypatch, name, WRITES[how], device=device)
    states = dict(store.steps.steps(name))
    committed = [s for s in refs if states.get(s) in ("committed", "durable")]
    for s in committed:  # what is committed is the state of its save(), bitwise
        assert _check_step(store, name, s, refs[s]) > 0
    for s in set(refs) - set(committed):
        assert states.get(s) == "aborted" and s in errors, (s, states.get(s))
    # the first step was caught (the sample spans every parameter), named; then the parameters are copied at
    # save() and every later step commits
    assert 0 in errors and states[0] == "aborted"
    names = errors[0].fields["tensors"]
    assert {"param/0.weight", "param/2.weight"} <= set(names), names
    assert "untyped_storage()" in str(errors[0]) and ".data" in str(errors[0])
    assert committed == [1, 2, 3], states
    assert ck.stats.changed_in_forward == 1
    if request.node.callspec.params["device"] == "cuda-path-on-cpu":
        assert log.count("enqueued") == 4 and log.count("order_update") >= 4, log  # that path was taken
    # the user's view: a restore gives the state of the last save()
    m2 = _net()
    ck2 = Checkpointer(store, name, m2, torch.optim.Adam(m2.parameters(), lr=0.01))
    try:
        assert ck2.restore(read_only=True).step == 3
        for ln, ts in ck2.view.collect().layers.items():
            for n, t in ts.items():
                assert _bits(t, refs[3][ln][n]), f"restored {ln} {n} is not the state at the last save()"
    finally:
        ck2.close()


def _one_element(model: nn.Module) -> None:
    w = next(model.parameters())
    w.detach().numpy().reshape(-1)[1] += 1.0  # one of 256 elements: a 64-element sample sees it 1 time in 4


def test_full_check_catches_a_write_of_one_element(tmp_path, redis_url, shm_root, monkeypatch):
    s = tierstore.open(tmp_path / "home", redis=redis_url, durable=f"file://{tmp_path / 'durable'}",
                       host_root=str(shm_root / "node0"), node_id="node0", lazy_check="full")
    try:
        name = "bypass-full"
        _model, refs, errors, _ck = _run(s, monkeypatch, name, _one_element, steps=2)
        states = dict(s.steps.steps(name))
        assert states[0] == "aborted" and errors[0].fields["tensors"] == ["param/0.weight"]
        assert states[1] in ("committed", "durable")
        assert _check_step(s, name, 1, refs[1]) > 0
    finally:
        s.close()


def test_lazy_check_is_validated():
    with pytest.raises(ConfigError, match="lazy_check must be"):
        tierstore.StoreConfig(lazy_check="sometimes")
    with pytest.raises(ConfigError, match="lazy_check_samples must be a positive int"):
        tierstore.StoreConfig(lazy_check_samples=0)


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("how", sorted(WRITES))
def test_replay_never_commits_a_log_its_replay_cannot_reach(store, how, lazy):
    """``replay``: a write through ``.data`` (or a numpy view, ``untyped_storage()``) between ``save()`` and the
    next update is a change a gradient log cannot replay, and the version counter does not see it. Every step
    reported committed restores (read-only, by replay) to the parameters of its ``save()``, bitwise: the step
    after such a write is a base, and a write before the save's digest fails the save typed."""
    from tierstore.train.policies import replay

    name = f"bypass-replay-{how}-{lazy}"
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ck = Checkpointer(store, name, model, opt, policy=replay(8), lazy=lazy, keep_last=None)
    saved: dict[int, dict[str, torch.Tensor]] = {}
    outcomes: dict[int, str] = {}
    try:
        for s in range(8):
            _step(model, opt, s)
            at_save = {n: p.detach().clone() for n, p in model.named_parameters()}
            try:
                ck.save(s)
                if s in (2, 5):
                    WRITES[how](model)
                outcomes[s] = ck.wait()
            except SnapshotChangedError:
                outcomes[s] = "changed"
            if outcomes[s] == "committed":
                saved[s] = at_save
    finally:
        ck.close()
    assert saved, outcomes
    for s, want in saved.items():
        probe = _net()
        got = Checkpointer(store, name, probe, torch.optim.SGD(probe.parameters(), lr=0.1, momentum=0.9),
                           policy=replay(8), keep_last=None, preallocate=False)
        try:
            assert got.restore(step=s, read_only=True).step == s, (s, outcomes)
        finally:
            got.close()
        for n, p in probe.named_parameters():
            assert _bits(p.detach(), want[n]), (s, n, outcomes)
    kinds = {s: (store.steps.manifest(name, s) or {}).get("layout", {}).get("replay") for s in saved}
    assert any(k == "log" for k in kinds.values()), kinds  # the writes did not turn every step into a base
