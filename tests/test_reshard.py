"""Ranged reads through the store, and resharding restores within one process (ranks as Checkpointers).

The store's cases run on the real index server and a local durable tier. The Checkpointer's cases save a
ZeRO-1 style checkpoint (replicated parameters, AdamW partitioned across 2 ranks) with two Checkpointers
of ``world_size=2`` in this process, then restore it on 1 and on 3 ranks: bitwise, each rank reading the
optimizer state its new partition holds. Real processes and FSDP2: ``tests/test_reshard_dist.py``.
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

import pytest
import torch

import tierstore
from tests import _reshard as R
from tests._tiers import flip_everywhere, live_path
from tests.conftest import remove_host_root
from tierstore.delta import xor_delta
from tierstore.embedded import stop_server
from tierstore.errors import NoValidCopyError, RestoreMismatchError
from tierstore.keys import ShardKey
from tierstore.train.checkpointer import Checkpointer, load

# -- the store ------------------------------------------------------------------------------------


def _objects(store):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(600, 130, generator=g)
    b = a + 1e-3 * torch.randn(600, 130, generator=g)
    k0, k1, kr = ShardKey("m", "l", 0, 0), ShardKey("m", "l", 1, 0), ShardKey("m", "l", 1, 1)
    store.put(k0, {"w": a, "s": torch.tensor(2.0)}, {"x": 1})
    store.put(k1, {"w": xor_delta(b, a)}, {"x": 2, "_delta": {"w": {"shape": [600, 130], "dtype": "float32"}}},
              kind="delta", base=k0)
    store.put(kr, {}, {}, kind="ref", target=k1)
    return {k0: a, k1: b, kr: b}


def test_open_ranged_reads_boxes_of_full_delta_and_ref_objects(store):
    for key, want in _objects(store).items():
        shard = store.open_ranged(key)
        assert shard.tensors == {"w": ("float32", (600, 130)), "s": ("float32", ())}
        assert shard.metadata == store.get(key).metadata  # what a whole read gives, internal entries removed
        for off, size in [((0, 0), (600, 130)), ((150, 0), (150, 130)), ((599, 129), (1, 1)), ((10, 60), (300, 7))]:
            box = shard.read_box("w", off, size)
            assert torch.equal(box, want[off[0]: off[0] + size[0], off[1]: off[1] + size[1]]), (key, off, size)
        assert shard.read_box("s", (), ()).item() == 2.0
    assert store.open_ranged(ShardKey("m", "l", 9, 0)) is None


def test_a_quarter_of_a_tensor_reads_about_a_quarter_of_its_object(store):
    key = ShardKey("m", "big", 0, 0)
    w = torch.randn(2048, 512)  # 4 MiB
    store.put(key, {"w": w})
    shard = store.open_ranged(key)
    got = shard.read_box("w", (512, 0), (512, 512))
    assert torch.equal(got, w[512:1024])
    assert shard.bytes_read < w.numel() * 4 / 4 + 2 * (128 << 10) + 8192


def test_a_bad_chunk_in_the_host_copy_is_read_from_the_durable_copy(store, caplog):
    key = ShardKey("m", "big", 0, 0)
    w = torch.randn(2048, 512)
    store.put(key, {"w": w})
    store.flush()  # the durable copy exists
    p = live_path(store.host.root, store, key)
    raw = bytearray(p.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # in the data section, in one chunk
    p.write_bytes(bytes(raw))
    shard = store.open_ranged(key)  # header and tables are fine: opened in the host tier
    assert torch.equal(shard.read_box("w", (0, 0), (512, 512)), w[:512])  # chunks that verify: from the host
    assert shard.failures == []
    with caplog.at_level(logging.WARNING):
        assert torch.equal(shard.read_box("w", (0, 0), (2048, 512)), w)  # the bad chunk: from the durable copy
    assert len(shard.failures) == 1 and "host" in shard.failures[0] and "checksum mismatch" in shard.failures[0]
    assert "trying the next tier" in caplog.text


def test_no_valid_copy_in_any_tier_fails_typed_and_leaves_out_alone(store):
    key = ShardKey("m", "big", 0, 0)
    store.put(key, {"w": torch.randn(2048, 512)})
    store.flush()
    flip_everywhere(store, key)
    shard = store.open_ranged(key)
    out = torch.zeros(2048, 512)
    with pytest.raises(NoValidCopyError) as ei:
        shard.read_box("w", (0, 0), (2048, 512), out=out)
    assert "host" in str(ei.value) and "durable" in str(ei.value) and ei.value.key == str(key)
    assert torch.count_nonzero(out) == 0



def test_a_box_writer_verifies_now_and_copies_later(store):
    """``box_writer`` checks every chunk of the box when called (a bad host chunk read from the durable copy
    then); its ``write`` copies the verified bytes into any tensor of the box, contiguous or not."""
    key = ShardKey("m", "big", 0, 0)
    w = torch.randn(2048, 512)
    store.put(key, {"w": w})
    store.flush()
    p = live_path(store.host.root, store, key)
    raw = bytearray(p.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    p.write_bytes(bytes(raw))
    shard = store.open_ranged(key)
    write = shard.box_writer("w", (0, 0), (2048, 512))
    assert len(shard.failures) == 1 and "host" in shard.failures[0]  # met by the call, not by the write
    out = torch.zeros(2048, 512)
    write(out)
    assert torch.equal(out, w)
    strided = torch.zeros(512, 1024)[:, 3:515]  # a box written into a non-contiguous view
    shard.box_writer("w", (100, 0), (512, 512))(strided)
    assert torch.equal(strided, w[100:612])


def test_a_box_writer_without_a_valid_copy_fails_when_called(store):
    key = ShardKey("m", "big", 0, 0)
    store.put(key, {"w": torch.randn(2048, 512)})
    store.flush()
    flip_everywhere(store, key)
    shard = store.open_ranged(key)
    assert shard.box_writer("w", (0, 0), (64, 512)) is not None  # the flipped chunk is not in this box
    with pytest.raises(NoValidCopyError):
        shard.box_writer("w", (0, 0), (2048, 512))

# -- the Checkpointer: ranks of one process --------------------------------------------------------


def _zero_checkpoint(store, name: str = "z") -> dict[str, torch.Tensor]:
    """Two ranks (Checkpointers of world_size=2 in this process) save 2 ZeRO-1 style steps; the full state."""
    models = [R.make(seed=1) for _ in range(2)]
    opts = [R.adamw(m, (r, 2)) for r, m in enumerate(models)]
    cks = [Checkpointer(store, name, m, o, rank=r, world_size=2) for r, (m, o) in enumerate(zip(models, opts))]
    for step in range(2):
        for m, o in zip(models, opts):
            m(*R.batch(step, 0)).backward()  # the same data: the averaged gradient of a real job
            o.step()
            o.zero_grad(set_to_none=True)
        with torch.no_grad():  # the owners' broadcast
            params = [list(m.parameters()) for m in models]
            for i in range(len(params[0])):
                params[1 - i % 2][i].copy_(params[i % 2][i])
        for ck in cks:
            ck.save(step)
    assert [ck.wait() for ck in cks] == ["committed", "committed"]
    for ck in cks:
        ck.close()
    return {**R.full_state(models[0], opts[0]), **R.full_state(models[1], opts[1])}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A store (its own host tier, for the module) holding the ZeRO-1 style checkpoint ``z``; its full state."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    shm = base / f"tierstore-test-reshard-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    home = tmp_path_factory.mktemp("reshard") / "home"
    try:
        with tierstore.open(home=home, host_root=str(shm)) as s:
            yield s, _zero_checkpoint(s)
    finally:
        stop_server(home)  # a module's home: the per-test cleanup stops only the servers of a test's tmp_path
        remove_host_root(shm)  # and its lock file beside it


@pytest.fixture
def zstore(saved):
    return saved[0]


@pytest.fixture
def ref(saved):
    return saved[1]


def test_rank_partitioned_optimizer_state_restores_on_one_rank(zstore, ref):
    model = R.make(seed=9)
    opt = R.adamw(model)
    ck = Checkpointer(zstore, "z", model, opt)
    assert ck.restore().step == 1
    assert ck.report.resharded and ck.report.bytes_read > 0
    assert R.differences(R.full_state(model, opt), ref) == []
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    ck.close()


def test_rank_partitioned_optimizer_state_restores_on_three_ranks(zstore, ref):
    held = set()
    for r in range(3):
        model = R.make(seed=9)
        opt = R.adamw(model, (r, 3))
        ck = Checkpointer(zstore, "z", model, opt, rank=r, world_size=3)
        assert ck.restore(read_only=True).step == 1
        got = R.full_state(model, opt)
        mine = {n for n in got if n.startswith("optim/")}
        assert mine and R.differences(got, {n: t for n, t in ref.items() if not n.startswith("optim/") or n in mine}) == []
        held |= mine
        ck.close()
    assert held == {n for n in ref if n.startswith("optim/")}


def test_a_parameter_in_another_param_group_is_refused(zstore):
    model = R.make(seed=9)
    opt = torch.optim.AdamW([{"params": list(model.parameters())[::2]}, {"params": list(model.parameters())[1::2]}])
    before = {n: t.clone() for n, t in model.state_dict().items()}
    with pytest.raises(RestoreMismatchError, match=r"param group 0 holds 'blocks\.0\.ln1\.weight', which the "
                                                   r"checkpoint has in group 1"):
        Checkpointer(zstore, "z", model, opt).restore(read_only=True)
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items()) and not opt.state


def test_a_sharded_checkpoint_restores_into_plain_modules_at_the_same_world_size(store, tmp_path):
    """FSDP2 saved by as many ranks as the plain restore has (here 1; 2 FSDP2 ranks into 2 DDP ranks is the same
    path): the saved placements make it a resharded read, not a refusal (the target alone looks "the same")."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        model = R.make(seed=0)
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        opt = R.adamw(model)
        model(*R.batch(0, 0)).backward()
        opt.step()
        ck = Checkpointer(store, "f1", model, opt)
        ck.save(0)
        assert ck.wait() == "committed"
        ck.close()
        want = R.full_state(model, opt)
    finally:
        dist.destroy_process_group()
    plain = R.make(seed=5)
    popt = R.adamw(plain)
    ck = Checkpointer(store, "f1", plain, popt)  # a writer: verified before its first update
    assert ck.restore().step == 0 and ck.report.resharded
    assert R.differences(R.full_state(plain, popt), want) == []
    ck.close()
    evaluator = R.make(seed=6)  # read-only: verified before it returns
    assert load(store, "f1", {"model": evaluator}).step == 0
    assert R.differences(R.full_state(evaluator, None), {n: t for n, t in want.items()
                                                         if not n.startswith("optim/")}) == []


def test_a_range_read_without_a_valid_copy_fails_typed(saved):
    """Resolve reads only trailers here, so the flipped chunk is first met by the range read, in every tier."""
    home = saved[0].config.home
    with tierstore.open(home=home, host_root=saved[0].host.root, restore_verify="trailer") as store:
        _zero_checkpoint(store, "zc")
        store.flush()
        flip_everywhere(store, ShardKey("zc", "blocks.0", 1, 0))
        model = R.make(seed=9)
        before = {n: t.clone() for n, t in model.state_dict().items()}
        with pytest.raises(NoValidCopyError, match=r"zc/blocks\.0/1/0"):
            load(store, "zc", {"model": model, "optim": R.adamw(model)}, step=1)
        assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())


def _stepped(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model of the checkpoint's shape whose AdamW has state already (other values than the checkpoint's)."""
    model = R.make(seed=seed)
    opt = R.adamw(model)
    model(*R.batch(7, 0)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def _state_memory(opt: torch.optim.Optimizer) -> dict[tuple[int, str], tuple[int, int]]:
    return {(id(p), k): (id(v), v.data_ptr()) for p, st in opt.state.items() for k, v in st.items()
            if isinstance(v, torch.Tensor)}


def test_a_resharded_restore_fills_the_optimizers_own_state_tensors(zstore, ref):
    """Pieces of two saved ranks assembled straight into the tensors the optimizer holds (no staging tensor, no
    new memory), bitwise."""
    model, opt = _stepped(seed=9)
    before = _state_memory(opt)
    ck = Checkpointer(zstore, "z", model, opt)
    assert ck.restore(read_only=True).step == 1 and ck.report.resharded
    assert R.differences(R.full_state(model, opt), ref) == []
    assert _state_memory(opt) == before
    ck.close()


def test_a_failed_resharded_restore_leaves_the_optimizer_state_alone(saved):
    """The last layer's object is bad in every tier: the layers before it were read (verified, not yet
    copied) when its read fails, and the optimizer's state, which the load writes in place, is untouched."""
    home = saved[0].config.home
    with tierstore.open(home=home, host_root=saved[0].host.root, restore_verify="trailer") as store:
        _zero_checkpoint(store, "zf")
        store.flush()
        flip_everywhere(store, ShardKey("zf", "head", 1, 0))
        model, opt = _stepped(seed=9)
        before = R.full_state(model, opt)
        memory = _state_memory(opt)
        with pytest.raises(NoValidCopyError, match=r"zf/head/1/0"):
            load(store, "zf", {"model": model, "optim": opt}, step=1)
        assert R.differences(R.full_state(model, opt), before) == []
        assert _state_memory(opt) == memory
