"""Restore at the copy's speed, verified before any update (:mod:`tierstore.train.restoring`).

The copies are loaded into the module and optimizer first and hashed beside it; the attacks: a byte flipped
in the data of a host-tier copy (its trailer and table intact, so nothing but the hash can tell) must never
reach an optimizer update (the real ``optimizer.step()``), nor a save; an evaluator that asked for
``verify="before_return"`` (the default for read-only restores) reads verified values as soon as the restore
returns; with no valid copy left anywhere, every update and save is refused.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tierstore
from tests import _warm
from tests._tiers import live_path
from tierstore import codec
from tierstore.errors import ConfigError, NoValidCopyError, RestoreVerifyError
from tierstore.ports import free_port
from tierstore.train.checkpointer import Checkpointer, load

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _model(seed: int, device: str = "cpu") -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(device)
    return m, torch.optim.AdamW(m.parameters(), lr=0.01)


def _step(m: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    m(torch.randn(5, 8, generator=g).to(next(m.parameters()).device)).square().mean().backward()
    opt.step()


def _snapshot(m: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"m.{k}": v.detach().cpu().clone() for k, v in m.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            out[f"o.{i}.{k}"] = v.detach().cpu().clone() if isinstance(v, torch.Tensor) else torch.tensor(v)
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _train_and_save(store, name: str, steps: int, device: str = "cpu", seed: int = 0) -> dict[int, dict]:
    m, opt = _model(seed, device)
    ck = Checkpointer(store, name, m, opt, keep_last=None)
    saved = {}
    for s in range(steps):
        _step(m, opt, s)
        ck.save(s)
        assert ck.wait() == "committed"
        saved[s] = _snapshot(m, opt)
    ck.close()
    store.flush()
    return saved


def _part(store, out: str, rank: int, result: dict | None = None) -> None:
    """A rank worker's end: its ``result`` written to ``out.<rank>.json`` (if any), then every rank parts."""
    import json

    import torch.distributed as dist

    if result is not None:
        with open(f"{out}.{rank}.json", "w") as f:
            json.dump(result, f)
    dist.barrier()
    store.close()
    dist.destroy_process_group()


def _save_next_and_part(store, ck, m: nn.Module, opt: torch.optim.Optimizer, result: dict, out: str,
                        rank: int) -> None:
    """The step after a restore run and saved by ``ck`` (its verdict: ``result["next"]``), then :func:`_part`."""
    _step(m, opt, 2)
    ck.save(2)
    result["next"] = ck.wait()
    ck.close()
    _part(store, out, rank, result)


def _flip_key(store, key) -> None:
    """Flip one byte in the middle of the largest tensor's data in ``key``'s host copy (trailer and table
    intact: only the checksum over the whole copy can tell)."""
    path = live_path(store.host.root, store, key)
    obj = codec.open_object(path.read_bytes())
    e = max(obj.tensors, key=lambda t: t.nbytes)
    at = codec.HEADER.size + obj.table_len + e.offset + e.nbytes // 2
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x40]))


def _flip_data(store, name: str, step: int) -> str:
    """:func:`_flip_key` of a layer of ``step``; returns the copy's physical name."""
    key = next(k for k in store.list(name, step=step) if k.layer != "_state")
    _flip_key(store, key)
    return store.info(key).name


def _cpus(monkeypatch, n: int) -> None:
    """This process may run on ``n`` CPUs (what :func:`tierstore.store.deferred.cores_per_local_rank` reads,
    for :func:`tierstore.train.restoring.core_free`), one rank."""
    from tierstore.store import deferred

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(deferred.os, "sched_getaffinity", lambda pid: set(range(n)))


@pytest.mark.parametrize("cpus", [1, 4], ids=["every-core-busy", "a-core-free"])
def test_a_flipped_host_byte_never_reaches_an_update(store, monkeypatch, cpus):
    _cpus(monkeypatch, cpus)  # a core free: the hashing starts with the first copy, beside the loading
    saved = _train_and_save(store, "flip", 3)
    bad = _flip_data(store, "flip", 2)
    m, opt = _model(7)
    ck = Checkpointer(store, "flip", m, opt)
    try:
        assert ck.restore().step == 2  # loaded at the copy's speed; verified beside the first forward/backward
        assert ck.report.verify == "before_update"
        assert not _same(_snapshot(m, opt), saved[2])  # the flipped byte is in the state: only the gate protects
        g = torch.Generator().manual_seed(99)
        opt.zero_grad()
        m(torch.randn(5, 8, generator=g)).square().mean().backward()
        with pytest.raises(RestoreVerifyError) as err:
            opt.step()  # the real update: refused
        assert err.value.fields["step"] == 2 and err.value.fields["keys"]
        # no update ran, and the state holds the verified copy (the durable tier's), not the flipped byte
        assert _same(_snapshot(m, opt), saved[2])
        assert not store.host.exists(bad)  # proof of a bad copy: dropped, so a restarted process never meets it
        assert ck.report.fell_back and "failed verification" in ck.report.reason
        _step(m, opt, 3)  # the step run again: the update goes through
        ck.save(3)
        assert ck.wait() == "committed"
    finally:
        ck.close()
    m2, o2 = _model(8)
    ck2 = Checkpointer(store, "flip", m2, o2)
    assert ck2.restore(step=2, read_only=True).step == 2
    ck2.close()
    assert _same(_snapshot(m2, o2), saved[2])


def test_without_corruption_the_first_update_goes_through_and_resumes_bitwise(store):
    saved = _train_and_save(store, "clean", 2)
    m, opt = _model(5)
    ck = Checkpointer(store, "clean", m, opt)
    try:
        assert ck.restore().step == 1
        assert _same(_snapshot(m, opt), saved[1])
        _step(m, opt, 2)  # waits for the verification, which passes
        assert ck.report.verified_s is not None and not ck.report.fell_back
        ref_m, ref_opt = _model(0)
        ref = Checkpointer(store, "clean", ref_m, ref_opt)
        ref.restore(step=1, read_only=True, verify="before_return")
        ref.close()
        _step(ref_m, ref_opt, 2)
        assert _same(_snapshot(m, opt), _snapshot(ref_m, ref_opt))
    finally:
        ck.close()


def test_an_evaluator_that_asked_before_return_reads_verified_values(store):
    saved = _train_and_save(store, "eval", 2)
    _flip_data(store, "eval", 1)
    m, opt = _model(3)
    assert load(store, "eval", {"model": m, "optim": opt}).step == 1  # read-only: verified before it returns
    assert _same(_snapshot(m, opt), saved[1])  # read right away, no optimizer step: verified values
    _flip_data(store, "eval", 0)
    m, opt = _model(4)
    ck = Checkpointer(store, "eval", m, opt)
    try:
        got = ck.restore(step=0, verify="before_return")  # a writer can ask for it too
        assert got.step == 0 and _same(_snapshot(m, opt), saved[0]) and ck.report.fell_back
    finally:
        ck.close()


def test_a_save_right_after_a_restore_never_saves_unverified_bytes(store):
    _train_and_save(store, "save-first", 2)
    _flip_data(store, "save-first", 1)
    m, opt = _model(6)
    ck = Checkpointer(store, "save-first", m, opt)
    try:
        ck.restore()
        with pytest.raises(RestoreVerifyError):
            ck.save(2)  # waits for the verification like an update does
        assert store.steps.state("save-first", 2) is None  # nothing of step 2 begun
        ck.save(2)  # the state is the verified one now
        assert ck.wait() == "committed"
    finally:
        ck.close()


def test_with_no_valid_copy_of_the_newest_step_the_update_is_refused_and_an_older_step_loaded(
        tmp_path, redis_url, shm_root):
    s = tierstore.open(tmp_path / "home", redis=redis_url, durable="none", host_root=str(shm_root / "n"))
    try:
        saved = _train_and_save(s, "host-only", 3)
        _flip_data(s, "host-only", 2)  # the only copy of that object
        m, opt = _model(9)
        ck = Checkpointer(s, "host-only", m, opt)
        assert ck.restore().step == 2
        with pytest.raises(RestoreVerifyError) as err:
            _step(m, opt, 3)
        assert err.value.fields["step"] == 1  # the newest step that verifies
        assert _same(_snapshot(m, opt), saved[1])
        ck.close()
    finally:
        s.close()


def test_when_nothing_verifies_every_update_and_save_is_refused_until_a_restore_succeeds(
        tmp_path, redis_url, shm_root):
    s = tierstore.open(tmp_path / "home", redis=redis_url, durable="none", host_root=str(shm_root / "n"))
    try:
        _train_and_save(s, "none-left", 1)
        _flip_data(s, "none-left", 0)
        m, opt = _model(9)
        ck = Checkpointer(s, "none-left", m, opt)
        assert ck.restore().step == 0
        for _ in range(2):
            with pytest.raises(NoValidCopyError):
                _step(m, opt, 1)
        with pytest.raises(NoValidCopyError):
            ck.save(1)
        assert s.steps.state("none-left", 1) is None
        ck.close()
    finally:
        s.close()


def test_an_unknown_verify_mode_is_a_config_error(store):
    m, opt = _model(0)
    ck = Checkpointer(store, "cfg", m, opt)
    with pytest.raises(ConfigError):
        ck.restore(verify="later")
    ck.close()


def test_the_store_reads_at_copy_speed_and_verifies_beside(store):
    """get_many_deferred: the copies land in the targets, the verification reports the flipped one."""
    _train_and_save(store, "raw", 1)
    keys = sorted(k for k in store.list("raw", step=0) if k.layer != "_state")
    outs = [{n: torch.empty_like(t) for n, t in store.get(k).items()} for k in keys]
    shards, v = store.get_many_deferred(keys, outs=outs)
    assert v.wait() == [] and v.verified == len(keys)
    assert all(shards[i][n] is outs[i][n] for i in range(len(keys)) for n in outs[i])
    _flip_data(store, "raw", 0)
    shards, v = store.get_many_deferred(keys, outs=outs)
    (f,) = v.wait()
    assert f.tier == "host" and "checksum" in f.reason and f.key in keys
    assert v.drop_bad_copies(store) == 1
    good = store.get(f.key)  # the verified path: the durable tier's copy
    assert good is not None


@cuda
@pytest.mark.cuda
def test_cuda_a_flipped_host_byte_never_reaches_an_update(store):
    """The same attack with the module and optimizer on the GPU (host-to-device copies from the host tier)."""
    saved = _train_and_save(store, "cuda-flip", 2, "cuda")
    _flip_data(store, "cuda-flip", 1)
    m, opt = _model(7, "cuda")
    ck = Checkpointer(store, "cuda-flip", m, opt)
    try:
        assert ck.restore().step == 1
        assert not _same(_snapshot(m, opt), saved[1])
        x = torch.randn(5, 8, device="cuda")
        opt.zero_grad()
        m(x).square().mean().backward()
        with pytest.raises(RestoreVerifyError):
            opt.step()
        assert _same(_snapshot(m, opt), saved[1])
        _step(m, opt, 2)
    finally:
        ck.close()


# ---- two real gloo ranks: one rank's bad copy, every rank refuses its update and restores again ----------------


def worker(rank: int, port: int, home: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    store = tierstore.open(home=home)
    m, opt = _model(0)
    ck = Checkpointer(store, "two", m, opt, keep_last=None)
    for s in range(2):
        _step(m, opt, s)
        ck.save(s)
        assert ck.wait() == "committed"
    saved = _snapshot(m, opt)
    ck.close()
    store.flush()
    dist.barrier()
    if rank == 0:
        _flip_key(store, next(k for k in store.list("two", step=1) if k.layer != "_state" and k.rank == 0))
    dist.barrier()
    m2, o2 = _model(5)
    ck2 = Checkpointer(store, "two", m2, o2)
    result = {"restored": ck2.restore().step}
    o2.zero_grad()
    m2(torch.randn(5, 8)).square().mean().backward()
    try:
        o2.step()
        result["refused"] = False
    except RestoreVerifyError as e:
        result["refused"] = True
        result["again"] = e.fields["step"]
    result["verified_state"] = _same(_snapshot(m2, o2), saved)
    _save_next_and_part(store, ck2, m2, o2, result, out, rank)  # the step run again goes through on both ranks


def test_two_gloo_ranks_one_bad_copy_every_rank_refuses_the_update(tmp_path):
    import json
    import os
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    procs = [_warm.popen([sys.executable, "-m", "tests.test_restore_verify", str(r), str(port),
                               str(tmp_path / "home"), str(tmp_path / "out")], cwd=root, env=env)
             for r in range(2)]
    assert [p.wait(timeout=240) for p in procs] == [0, 0]
    res = [json.loads((tmp_path / f"out.{r}.json").read_text()) for r in range(2)]
    for r in res:  # rank 1's copies were fine: it refuses its update too (the ranks act alike) and reloads
        assert r == {"restored": 1, "refused": True, "again": 1, "verified_state": True, "next": "committed"}, r


if __name__ == "__main__":
    import sys

    a = sys.argv[1:]
    worker(int(a[0]), int(a[1]), a[2], a[3])


@pytest.mark.parametrize("cpus,mode", [(1, "in_pass"), (2, "before_return"), (4, "before_return")])
def test_a_read_only_restore_verifies_beside_the_copies_where_a_core_is_free(store, monkeypatch, cpus, mode):
    _cpus(monkeypatch, cpus)
    saved = _train_and_save(store, "free", 2)
    weights = {k: v for k, v in saved[1].items() if k.startswith("m.")}
    m, _opt = _model(7)
    ck = Checkpointer(store, "free", m)
    try:
        assert ck.restore(read_only=True).step == 1
        assert ck.report.verify == mode  # the default: beside the copies where a core is free, else in the pass
        _flip_data(store, "free", 1)
        m2, _ = _model(8)
        ck2 = Checkpointer(store, "free", m2)
        try:
            assert ck2.restore(read_only=True).step == 1
            # verified before it returned, either way: the flipped copy was not loaded, the durable one was
            assert _same({f"m.{k}": v for k, v in m2.state_dict().items()}, weights)
        finally:
            ck2.close()
    finally:
        ck.close()
