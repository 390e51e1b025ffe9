"""The device tier of the store: snapshots land in reused device buffers, drain to the host tier in
``finish()``, and a rollback reads the newest copy back from them.

Most tests run the real code path on ``device_tier="cpu"`` (buffers in this
process's memory); the ones marked ``cuda`` run it on a GPU and skip without one.
"""

from __future__ import annotations

import pytest
import torch

import tierstore
from tests._tiers import copies
from tierstore import ShardKey, codec
from tierstore.config import StoreConfig
from tierstore.errors import ConfigError, FencedError, RestoreMismatchError

K = ShardKey("gpt", "block0", 3, 0)
NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (a CUDA device and torch built with it)")


def _tensors(seed: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g).to(torch.bfloat16),
         "step": torch.tensor(seed), "mask": torch.rand(10, generator=g) > 0.5,
         "t": torch.randn(8, 9, generator=g).t()}  # non-contiguous
    return {n: v.to(device) for n, v in t.items()}


def _equal(got, want) -> bool:
    return got.keys() == want.keys() and all(
        got[n].dtype == want[n].dtype and torch.equal(got[n].cpu(), want[n].cpu()) for n in want)


def _open(tmp_path, redis_url, shm_root, **kw):
    return tierstore.open(tmp_path / "home", redis=redis_url, durable=f"file://{tmp_path / 'durable'}",
                          host_root=str(shm_root / "node0"), node_id="node0", **kw)


@pytest.fixture
def dstore(tmp_path, redis_url, shm_root):
    s = _open(tmp_path, redis_url, shm_root, device_tier="cpu")
    yield s
    s.close()


def _host_copy(store, key: ShardKey) -> codec.Shard:
    """The host tier's copy of ``key``, decoded and verified (not through the store's read path)."""
    blob = store.host.get(store.info(key).name)
    return codec.decode(bytes(blob))


def test_put_lands_in_device_buffers_and_drains_an_identical_host_copy(dstore):
    t = _tensors()
    info = dstore.put(K, t, {"note": "x", "pair": (1, 2)})
    assert dstore.device_tier.staged == 1 and dstore.device_tier.fallbacks == 0
    host = _host_copy(dstore, K)
    assert _equal(host.tensors, t) and info.checksum == codec.checksum(dstore.host.get(info.name))
    shard = dstore.get(K)
    assert dstore.device_tier.reads == 1
    assert _equal(shard.tensors, t)
    assert shard.metadata == {"note": "x", "pair": [1, 2]}  # as the host copy reads (JSON), internal entry gone
    assert all(v.device.type == "cpu" for v in shard.tensors.values())
    shard.tensors["w"].add_(1)  # the caller owns what get returned: the device copy is not changed
    assert _equal(dstore.get(K).tensors, t)


def test_snapshot_returns_before_the_host_copy_and_the_source_may_change_at_once(dstore):
    t = _tensors()
    want = {n: v.clone() for n, v in t.items()}
    pending = dstore.snapshot(K, t)
    assert pending.staged is not None and pending.reservation is None  # nothing reserved in the host tier yet
    assert copies(dstore.host, K) == [] and dstore.info(K) is None
    for v in t.values():  # the trainer's next update, right after the snapshot returned
        v.zero_() if v.dtype != torch.bool else v.logical_not_()
    pending.finish()
    assert _equal(_host_copy(dstore, K).tensors, want)
    assert _equal(dstore.get(K).tensors, want)


def test_finish_async_drains_in_the_background(dstore):
    keys = [ShardKey("gpt", f"l{i}", 1, 0) for i in range(4)]
    pendings = [dstore.snapshot(k, _tensors(i)) for i, k in enumerate(keys)]
    infos = dstore.finish_async(pendings).result(timeout=60)
    assert [i.key for i in infos] == keys
    for i, k in enumerate(keys):
        assert _equal(_host_copy(dstore, k).tensors, _tensors(i))


def test_rollback_reads_the_device_copy_even_with_the_host_copy_gone(dstore):
    t = _tensors()
    dstore.put(K, t)
    dstore.flush()
    name = dstore.info(K).name
    assert dstore.host.delete(name) and dstore.durable.delete(name)  # no tier holds it any more
    out = {n: torch.zeros_like(v) for n, v in t.items()}
    shard = dstore.get(K, out=out)
    assert all(shard.tensors[n] is out[n] for n in t) and _equal(out, t)


def test_get_into_out_of_the_wrong_shape_copies_nothing(dstore):
    dstore.put(K, _tensors())
    out = {"w": torch.zeros(3, 3)}
    with pytest.raises(RestoreMismatchError):
        dstore.get(K, out=out)
    assert torch.equal(out["w"], torch.zeros(3, 3))


def test_a_failed_step_rolls_back_from_the_device_until_its_buffers_are_reused(dstore):
    """Step 3 is saved; step 4's snapshot is taken and its save fails (aborted): the rollback to step 3 is
    served from device memory. Once step 5's snapshot reuses step 3's buffers, a read of step 3 must come
    from the tiers, never from the reused buffers."""
    k4, k5 = ShardKey("gpt", "block0", 4, 0), ShardKey("gpt", "block0", 5, 0)
    t3 = _tensors(3)
    dstore.put(K, t3)
    dstore.snapshot(k4, _tensors(4)).abort()  # the failed step
    reads = dstore.device_tier.reads
    assert _equal(dstore.get(K).tensors, t3) and dstore.device_tier.reads == reads + 1
    p5 = dstore.snapshot(k5, _tensors(5))  # takes step 3's buffer set (step 4's is the newest: kept)
    assert p5.staged is not None
    reads = dstore.device_tier.reads
    assert _equal(dstore.get(K).tensors, t3) and dstore.device_tier.reads == reads  # read from the host tier
    p5.finish()
    assert _equal(dstore.get(k5).tensors, _tensors(5))


def test_a_copy_being_read_is_not_overwritten_by_the_next_snapshot(dstore):
    """A rollback pins the buffers it reads: a snapshot made meanwhile takes the host path instead."""
    k4, k5 = ShardKey("gpt", "block0", 4, 0), ShardKey("gpt", "block0", 5, 0)
    dstore.put(K, _tensors(3))
    dstore.snapshot(k4, _tensors(4)).abort()
    rec = dstore.info(K)
    entry = dstore.device_tier._published[rec.name]
    assert entry.snap.pin()  # a reader in the middle of its copy
    try:
        p5 = dstore.snapshot(k5, _tensors(5))
        assert p5.staged is None and p5.reservation is not None  # the host path
        assert dstore.device_tier.fallbacks == 1
        p5.finish()
    finally:
        entry.snap.unpin()
    assert _equal(dstore.get(K).tensors, _tensors(3))


def test_the_device_copy_is_used_only_while_the_index_names_it(dstore):
    dstore.put(K, _tensors(1))
    dstore.put(K, _tensors(2))  # the key written again (an uncommitted step): another copy, staged too
    assert _equal(dstore.get(K).tensors, _tensors(2))
    dstore.put(K, _tensors(3), compress="always")  # again, through the host path this time
    reads = dstore.device_tier.reads
    assert _equal(dstore.get(K).tensors, _tensors(3)) and dstore.device_tier.reads == reads
    assert dstore.delete(K)
    assert dstore.get(K) is None


def test_a_fenced_snapshot_is_never_served_and_frees_its_buffers(dstore):
    old = dstore.open_epoch("gpt")
    pending = dstore.snapshot(K, _tensors(1), epoch=old)
    dstore.open_epoch("gpt")  # a newer incarnation of the job fences the old writer
    with pytest.raises(FencedError):
        pending.finish()
    assert dstore.get(K) is None and copies(dstore.host, K) == []
    for step in (4, 5, 6):  # the buffer sets were released: later snapshots stage again
        p = dstore.snapshot(ShardKey("gpt", "block0", step, 0), _tensors(step))
        assert p.staged is not None
        p.abort()
    assert dstore.device_tier.fallbacks == 0


def test_deltas_refs_and_compressed_objects_take_the_host_path(dstore):
    base = _tensors(1)
    dstore.put(K, base)
    k2 = ShardKey("gpt", "block0", 4, 0)
    ref = dstore.snapshot(k2, {}, kind="ref", target=K)
    assert ref.staged is None
    ref.finish()
    assert _equal(dstore.get(k2).tensors, base)  # resolved through the ref to the device copy of K


def test_checkpointer_rolls_back_a_failed_step_from_the_device_tier(dstore):
    from tierstore.testing.gpt import GPTConfig, make_model, train
    from tierstore.train.checkpointer import Checkpointer

    cfg = GPTConfig(d_model=16, n_layer=2, n_head=2, block=16)
    model, opt = make_model(cfg, seed=0)
    ck = Checkpointer(dstore, "roll", model, opt)
    assert ck.restore() == (None, None)
    saved = {}

    def on_step(step, _loss):
        ck.save(step)
        assert ck.wait() == "committed"
        saved[step] = {n: p.detach().clone() for n, p in model.state_dict().items()}

    train(model, opt, 0, 3, batch_size=2, on_step=on_step)
    train(model, opt, 3, 4, batch_size=2)  # step 3 "fails": its update is never saved
    assert dstore.device_tier.staged > 0
    reads = dstore.device_tier.reads
    step, _ = ck.restore()
    assert step == 2 and dstore.device_tier.reads > reads
    for n, p in model.state_dict().items():
        assert torch.equal(p, saved[2][n]), n
    ck.close()


def test_auto_on_cpu_tensors_keeps_the_host_path(tmp_path, redis_url, shm_root):
    s = _open(tmp_path, redis_url, shm_root)  # the default: device_tier="auto"
    try:
        assert s.config.device_tier == "auto"
        pending = s.snapshot(K, _tensors())
        assert pending.staged is None and pending.reservation is not None
        pending.finish()
        assert s.device_tier is not None and s.device_tier.staged == 0
        assert _equal(s.get(K).tensors, _tensors()) and s.device_tier.reads == 0
    finally:
        s.close()


def test_off_builds_no_device_tier(tmp_path, redis_url, shm_root):
    s = _open(tmp_path, redis_url, shm_root, device_tier="off")
    try:
        assert s.device_tier is None
        s.put(K, _tensors())
        assert _equal(s.get(K).tensors, _tensors())
    finally:
        s.close()


def test_device_tier_config_is_validated_and_read_from_the_environment():
    with pytest.raises(ConfigError):
        StoreConfig(device_tier="gpu")
    with pytest.raises(ConfigError):
        StoreConfig(device_tier="cuda:x")
    with pytest.raises(ConfigError):
        StoreConfig(device_capacity_bytes=0)
    cfg = StoreConfig.from_env({"TIERSTORE_DEVICE_TIER": "cuda:1", "TIERSTORE_DEVICE_CAPACITY": "1024"})
    assert cfg.device_tier == "cuda:1" and cfg.device_capacity_bytes == 1024
    assert StoreConfig.from_env({"TIERSTORE_DEVICE_TIER": "cpu"}, device_tier="off").device_tier == "off"


# -- on a GPU --------------------------------------------------------------------------------------------


@NEEDS_CUDA
@pytest.mark.cuda
def test_cuda_snapshot_is_staged_on_the_device_and_drains_the_pre_update_values(tmp_path, redis_url, shm_root):
    s = _open(tmp_path, redis_url, shm_root)  # auto
    try:
        t = _tensors(device="cuda")
        want = {n: v.clone() for n, v in t.items()}
        pending = s.snapshot(K, t)
        assert pending.staged is not None and pending.staged.tensors["w"].is_cuda
        for v in t.values():  # the next update, queued on the trainer's stream right after the snapshot
            v.zero_() if v.dtype != torch.bool else v.logical_not_()
        pending.finish()
        assert _equal(_host_copy(s, K).tensors, want)
        out = {n: torch.empty_like(v) for n, v in t.items()}  # a rollback into the model's CUDA tensors
        s.get(K, out=out)
        assert s.device_tier.reads == 1 and _equal(out, want)
        assert _equal(s.get(K).tensors, want)
    finally:
        s.close()


@NEEDS_CUDA
@pytest.mark.cuda
def test_cuda_checkpointer_rollback_from_the_device(tmp_path, redis_url, shm_root):
    from tierstore.testing.gpt import GPTConfig, make_model, train
    from tierstore.train.checkpointer import Checkpointer

    s = _open(tmp_path, redis_url, shm_root)
    try:
        model, opt = make_model(GPTConfig(d_model=16, n_layer=2, n_head=2, block=16), seed=0)
        model.cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        ck = Checkpointer(s, "cudaroll", model, opt)
        x = torch.randint(0, 64, (2, 16), device="cuda")
        for step in range(3):
            opt.zero_grad()
            model(x, x).backward()
            opt.step()
            ck.save(step)
            assert ck.wait() == "committed"
        want = {n: p.detach().clone() for n, p in model.state_dict().items()}
        opt.zero_grad()
        model(x, x).backward()
        opt.step()  # a step that fails before its save
        assert ck.restore()[0] == 2 and s.device_tier.reads > 0
        for n, p in model.state_dict().items():
            assert torch.equal(p, want[n]), n
        ck.close()
    finally:
        s.close()
    del train
