"""Finishing several snapshots records them in the index in batches (``StoreConfig.publish_batch``), with the
outcome finishing them one by one gives: in order, and on the first refusal those before it are published,
it and those after it are neither indexed nor left in the host tier (real Redis server, real host tier)."""

from __future__ import annotations

import pytest
import torch

import tierstore
from tierstore import ShardKey
from tierstore.config import StoreConfig
from tierstore.errors import ConfigError, FencedError, StepBusyError


def _open(tmp_path, redis_url, shm_root, **kw):
    return tierstore.open(tmp_path / "home", redis=redis_url, durable=f"file://{tmp_path / 'durable'}",
                          host_root=str(shm_root / "node0"), node_id="node0", **kw)


class _Calls:
    """Counts the index calls of one store (wrapping the real methods: the records still go to Redis)."""

    def __init__(self, index, monkeypatch) -> None:
        self.one = 0
        self.many: list[int] = []
        real_one, real_many = index.record_object, index.record_objects

        def one(*a, **k):
            self.one += 1
            return real_one(*a, **k)

        def many(entries):
            self.many.append(len(entries))
            return real_many(entries)

        monkeypatch.setattr(index, "record_object", one)
        monkeypatch.setattr(index, "record_objects", many)


def _tensors(i: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64,), float(i)), "b": torch.arange(i + 1, dtype=torch.float64)}


@pytest.mark.parametrize(("batch", "many", "one"), [(64, [7], 0), (3, [3, 3], 1), (1, [], 7)])
def test_finish_many_records_in_batches_of_publish_batch(tmp_path, redis_url, shm_root, monkeypatch,
                                                         batch, many, one):
    s = _open(tmp_path, redis_url, shm_root, publish_batch=batch)
    try:
        calls = _Calls(s.index, monkeypatch)
        keys = [ShardKey("m", f"l{i}", 1, 0) for i in range(7)]
        pend = [s.snapshot(k, _tensors(i)) for i, k in enumerate(keys)]
        infos = s.finish_many(pend)
        assert (calls.many, calls.one) == (many, one)
        assert [i.key for i in infos] == keys
        for i, k in enumerate(keys):
            rec = s.info(k)
            assert rec is not None and rec.name == pend[i].name and rec.checksum == infos[i].checksum
            got = s.get(k)
            assert all(torch.equal(got.tensors[n], t) for n, t in _tensors(i).items())
    finally:
        s.close()


def test_a_batch_replacing_records_drops_the_copies_they_named(tmp_path, redis_url, shm_root):
    s = _open(tmp_path, redis_url, shm_root)
    try:
        keys = [ShardKey("m", f"l{i}", 1, 0) for i in range(3)]
        first = s.finish_many([s.snapshot(k, _tensors(i)) for i, k in enumerate(keys)])
        second = s.finish_many([s.snapshot(k, _tensors(i + 10)) for i, k in enumerate(keys)])
        for a, b, k, i in zip(first, second, keys, range(3)):
            assert a.name != b.name and not s.host.exists(a.name) and s.host.exists(b.name)
            assert torch.equal(s.get(k).tensors["w"], _tensors(i + 10)["w"])
    finally:
        s.close()


@pytest.mark.parametrize("batch", [64, 1])
def test_a_refusal_in_a_batch_ends_it_as_one_by_one_would(tmp_path, redis_url, shm_root, batch):
    """The third object names an attempt that holds no claim of the step: the index refuses it
    (StepBusyError); the two before it are published, it and the one after it leave nothing behind."""
    s = _open(tmp_path, redis_url, shm_root, publish_batch=batch)
    try:
        keys = [ShardKey("m", f"l{i}", 1, 0) for i in range(4)]
        pend = [s.snapshot(k, _tensors(i), attempt="not-a-claim" if i == 2 else None) for i, k in enumerate(keys)]
        with pytest.raises(StepBusyError, match="l2/1/0"):
            s.finish_many(pend)
        for i in (0, 1):
            assert s.info(keys[i]) is not None and s.host.exists(pend[i].name)
            assert torch.equal(s.get(keys[i]).tensors["w"], _tensors(i)["w"])
        for i in (2, 3):
            assert s.info(keys[i]) is None and not s.host.exists(pend[i].name)
    finally:
        s.close()


def test_a_fenced_object_in_a_batch_is_refused_early_and_ends_it(tmp_path, redis_url, shm_root, monkeypatch):
    s = _open(tmp_path, redis_url, shm_root)
    try:
        calls = _Calls(s.index, monkeypatch)
        epoch = s.index.bump_epoch("m")
        keys = [ShardKey("m", f"l{i}", 1, 0) for i in range(3)]
        pend = [s.snapshot(k, _tensors(i), epoch=epoch if i != 1 else epoch - 1) for i, k in enumerate(keys)]
        with pytest.raises(FencedError):
            s.finish_async(pend).result(timeout=60)
        assert (calls.many, calls.one) == ([1], 0)  # the one before it, recorded in one call, then the error
        assert s.info(keys[0]) is not None and s.host.exists(pend[0].name)
        for i in (1, 2):
            assert s.info(keys[i]) is None and not s.host.exists(pend[i].name)
    finally:
        s.close()


@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_publish_batch_must_be_a_positive_int(bad):
    with pytest.raises(ConfigError, match="publish_batch"):
        StoreConfig(publish_batch=bad)


def test_a_checkpointer_save_records_its_layers_in_one_batch(tmp_path, redis_url, shm_root, monkeypatch):
    """The Checkpointer finishes a step's objects through ``finish_many``: a save of a 6-layer model is one index
    call for its records (was one per layer), and it restores bitwise."""
    from tierstore.train.checkpointer import Checkpointer

    s = _open(tmp_path, redis_url, shm_root)
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(6)])
        ck = Checkpointer(s, "ckb", net, keep_last=None)
        ck.restore()
        calls = _Calls(s.index, monkeypatch)
        ck.save(0)
        assert ck.wait() == "committed"
        assert calls.one == 0 and calls.many == [6], (calls.one, calls.many)
        want = {k: v.clone() for k, v in net.state_dict().items()}
        ck.close()
        torch.manual_seed(1)
        net2 = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(6)])
        ck2 = Checkpointer(s, "ckb", net2, keep_last=None)
        assert ck2.restore()[0] == 0
        assert all(torch.equal(v, want[k]) for k, v in net2.state_dict().items())
        ck2.close()
    finally:
        s.close()
