"""The in-pass restore (``verify="in_pass"``: the read-only default on a node whose cores the ranks all use, every
resharding restore, the second restore after a failed verification): its step is chosen by the copies' trailers,
its module layers are read verified whole and aliased (no fresh tensors), and a copy bad in every tier makes every
rank resolve again with every copy hashed.

The attacks: a byte flipped in the only copy of the newest step (trailer intact: only a hash tells) must end in
the older step, bitwise, as a restore always did, on one process and on two gloo ranks where only one rank's copy
is bad (every rank must take the same path, or the collectives hang); the restored state must alias nothing of the
store (an in-place update after the restore must not reach a stored copy).
"""

from __future__ import annotations

import json
import logging
import sys

import pytest
import torch

import tierstore
from tests._ranks import run_ranks
from tests.test_restore_verify import _flip_key, _model, _same, _save_next_and_part, _snapshot, _step, _train_and_save
from tierstore import codec
from tierstore.train.checkpointer import Checkpointer


@pytest.fixture
def host_only(tmp_path, redis_url, shm_root):
    s = tierstore.open(tmp_path / "home", redis=redis_url, durable="none", host_root=str(shm_root / "n"))
    yield s
    s.close()


@pytest.mark.parametrize("read_only", [False, True], ids=["writer", "read-only"])
def test_a_bad_only_copy_of_the_newest_step_ends_in_the_older_step_bitwise(host_only, caplog, read_only):
    saved = _train_and_save(host_only, "bad", 3)
    _flip_key(host_only, next(k for k in host_only.list("bad", step=2) if k.layer != "_state"))
    m, opt = _model(9)
    ck = Checkpointer(host_only, "bad", m, *([] if read_only else [opt]))
    try:
        with caplog.at_level(logging.WARNING, logger="tierstore.train.restore_side"):
            got = ck.restore(read_only=read_only, verify="in_pass")
        assert got.step == 1  # the trailer-chosen step 2 failed its read on every tier: resolved again, hashed
        assert any("resolving again with every copy verified" in r.getMessage() for r in caplog.records)
        want = saved[1] if not read_only else {k: v for k, v in saved[1].items() if k.startswith("m.")}
        have = _snapshot(m, opt) if not read_only else {f"m.{k}": v for k, v in m.state_dict().items()}
        assert _same(have, want)
        assert ck.report.verify == "in_pass"
    finally:
        ck.close()


def test_without_a_bad_copy_the_step_is_resolved_once_from_the_trailers(host_only, monkeypatch):
    saved = _train_and_save(host_only, "good", 2)
    modes = []
    real = host_only.resolve

    def resolve(*a, **kw):
        modes.append(kw.get("verify", "auto"))
        return real(*a, **kw)

    monkeypatch.setattr(host_only, "resolve", resolve)
    m, opt = _model(9)
    ck = Checkpointer(host_only, "good", m, opt)
    try:
        assert ck.restore(verify="in_pass").step == 1
        assert modes == ["trailer"]  # every copy it read was hashed by the read itself, once
        assert _same(_snapshot(m, opt), saved[1])
    finally:
        ck.close()


def test_the_restored_state_aliases_nothing_of_the_store(host_only):
    """The in-pass read aliases the host copies; the load copies out of them. An in-place update of every
    restored tensor afterwards must leave every stored copy as it was: its checksum still the index's, and a
    second restore bitwise the saved state."""
    saved = _train_and_save(host_only, "alias", 2)
    m, opt = _model(9)
    ck = Checkpointer(host_only, "alias", m, opt)
    try:
        assert ck.restore(verify="in_pass").step == 1
        assert _same(_snapshot(m, opt), saved[1])
        with torch.no_grad():
            for p in m.parameters():
                p.add_(1.0)
            for st in opt.state.values():
                for v in st.values():
                    if isinstance(v, torch.Tensor) and v.is_floating_point():
                        v.mul_(3.0)
        _step(m, opt, 7)
    finally:
        ck.close()
    for key in host_only.list("alias", step=1):
        blob = host_only.host.get(host_only.info(key).name)
        try:
            assert codec.verify(blob) == host_only.info(key).checksum, key
        finally:
            if isinstance(blob, memoryview):
                blob.release()
    m2, opt2 = _model(11)
    ck2 = Checkpointer(host_only, "alias", m2, opt2)
    try:
        assert ck2.restore(verify="in_pass").step == 1
        assert _same(_snapshot(m2, opt2), saved[1])
    finally:
        ck2.close()


# ---- two real gloo ranks: rank 0's copy of the newest step is bad everywhere; both must restore the older step --


def worker(rank: int, port: int, home: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    store = tierstore.open(home=home, durable="none")
    saved = _train_and_save(store, "two", 2, seed=rank)
    dist.barrier()
    if rank == 0:
        _flip_key(store, next(k for k in store.list("two", step=1) if k.layer != "_state" and k.rank == 0))
    dist.barrier()
    m2, o2 = _model(5)
    ck2 = Checkpointer(store, "two", m2, o2)
    result = {"restored": ck2.restore(verify="in_pass").step}
    result["state"] = _same(_snapshot(m2, o2), saved[result["restored"]])
    _save_next_and_part(store, ck2, m2, o2, result, out, rank)


def test_two_gloo_ranks_one_bad_copy_every_rank_resolves_again_and_restores_the_older_step(tmp_path):
    job = run_ranks("tests.test_restore_in_pass",
                    lambda r, port: [str(r), str(port), str(tmp_path / "home"), str(tmp_path / "out")], torchrun=False)
    assert job.codes == [0, 0], job.tail()
    res = [json.loads((tmp_path / f"out.{r}.json").read_text()) for r in range(2)]
    for r in res:  # rank 1's copies were fine: it resolves again too (the ranks act alike)
        assert r == {"restored": 0, "state": True, "next": "committed"}, r


if __name__ == "__main__":
    a = sys.argv[1:]
    worker(int(a[0]), int(a[1]), a[2], a[3])
