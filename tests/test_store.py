"""TierStore over real services: put/get, fallback, crash survival, bad input."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import tierstore
from tests import _warm
from tests._tiers import copies, live_name, live_path
from tierstore import ShardKey
from tierstore.errors import (
    InvalidKeyError,
    InvalidValueError,
    NoValidCopyError,
    RestoreMismatchError,
)

K = ShardKey("gpt", "block0", 3, 0)


def tensors():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g).half(),
            "step": torch.tensor(7), "mask": torch.rand(10, generator=g) > 0.5}


def test_put_get_round_trip(store):
    t = tensors()
    info = store.put(K, t, {"note": "x"})
    assert info.kind == "full" and info.size > 0 and len(info.checksum) == 32
    shard = store.get(K)
    assert shard.metadata == {"note": "x"}
    for name in t:
        assert torch.equal(shard.tensors[name], t[name]) and shard.tensors[name].dtype == t[name].dtype
    assert store.exists(K) and store.list("gpt") == [K]
    assert store.list("gpt", layer="block0", step=3) == [K] and store.list("gpt", step=4) == []


def test_get_into_preallocated(store):
    t = tensors()
    store.put(K, t)
    out = {name: torch.empty_like(v) for name, v in t.items()}
    store.get(K, out=out)
    assert all(torch.equal(out[n], t[n]) for n in t)


def test_get_into_wrong_shape_raises_and_leaves_target(store):
    store.put(K, tensors())
    out = {"w": torch.zeros(3, 3)}
    with pytest.raises(RestoreMismatchError) as ei:
        store.get(K, out=out)
    assert "w" in str(ei.value)
    assert torch.equal(out["w"], torch.zeros(3, 3))


def test_miss_is_none(store):
    assert store.get(K) is None and not store.exists(K) and store.delete(K) is False


@pytest.mark.parametrize("key", ["gpt/block0/3", "gpt/../x/1/0", ("a",), 42, "gpt/bl ock/1/0"])
def test_bad_keys(store, key):
    with pytest.raises(InvalidKeyError):
        store.put(key, tensors())
    with pytest.raises(InvalidKeyError):
        store.get(key)


@pytest.mark.parametrize("value", [{"w": [1, 2, 3]}, {"w": "x"}, [torch.zeros(2)], {3: torch.zeros(1)}])
def test_non_tensor_values(store, value):
    with pytest.raises(InvalidValueError):
        store.put(K, value)
    assert store.list("gpt") == [] and list(store.host.list()) == []  # nothing half-written


def test_delete_removes_everywhere(store):
    store.put(K, tensors())
    store.flush()
    assert copies(store.host, K) and copies(store.durable, K)
    assert store.delete(K)
    assert store.get(K) is None and not copies(store.host, K) and not copies(store.durable, K)


def test_migrates_to_durable_and_falls_back_when_host_copy_corrupt(store):
    t = tensors()
    store.put(K, t)
    store.flush()
    assert set(store.info(K).tiers) == {"host", "durable"}
    path = live_path(store.host.root, store, K)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    shard = store.get(K)
    assert torch.equal(shard.tensors["w"], t["w"])


def test_no_valid_copy_names_the_shard(store):
    store.put(K, tensors())
    store.flush()
    for root in (Path(store.host.root), Path(store.durable.root)):
        p = live_path(root, store, K)
        p.write_bytes(p.read_bytes()[:-5])
    with pytest.raises(NoValidCopyError) as ei:
        store.get(K)
    assert str(K) in str(ei.value)


def test_falls_back_when_host_copy_missing(store):
    t = tensors()
    store.put(K, t)
    store.flush()
    store.host.delete(live_name(store, K))
    assert torch.equal(store.get(K).tensors["w"], t["w"])


def test_delta_and_ref_objects_resolve(store):
    t0 = tensors()
    t1 = {k: (v + 1 if v.is_floating_point() else v) for k, v in t0.items()}
    from tierstore.delta import xor_delta

    base = store.put(K, t0)
    k1 = K.with_step(4)
    deltas = {n: xor_delta(t1[n], t0[n]) for n in t0}
    layout = {n: {"dtype": str(t0[n].dtype).removeprefix("torch."), "shape": list(t0[n].shape)} for n in t0}
    store.put(k1, deltas, {"_delta": layout}, kind="delta", base=base.key)
    got = store.get(k1)
    assert all(torch.equal(got.tensors[n], t1[n]) for n in t0)
    ref = K.with_rank(1).with_step(4)
    store.put(ref, {}, kind="ref", target=k1)
    assert torch.equal(store.get(ref).tensors["w"], t1["w"])
    raw = store.get(k1, raw=True)
    assert raw.tensors["w"].dtype == torch.uint8


WRITER = """
import sys, torch, tierstore
s = tierstore.open(sys.argv[1], redis=sys.argv[2], durable="none", host_root=sys.argv[3], node_id="node0")
g = torch.Generator().manual_seed(1)
s.put(tierstore.ShardKey("gpt", "block0", 9, 0), {"w": torch.randn(256, 256, generator=g)})
print("PUT-RETURNED", flush=True)
import time; time.sleep(60)
"""


def test_object_survives_writer_sigkill(tmp_path, redis_url, shm_root):
    proc = _warm.popen([sys.executable, "-c", textwrap.dedent(WRITER), str(tmp_path / "h"), redis_url,
                             str(shm_root / "node0")], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    try:
        assert proc.stdout.readline().strip() == "PUT-RETURNED"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    s = tierstore.open(tmp_path / "h2", redis=redis_url, durable="none", host_root=str(shm_root / "node0"),
                       node_id="node0")
    try:
        g = torch.Generator().manual_seed(1)
        shard = s.get(ShardKey("gpt", "block0", 9, 0))
        assert torch.equal(shard.tensors["w"], torch.randn(256, 256, generator=g))
    finally:
        s.close()


def test_index_server_gone_is_typed(tmp_path, shm_root):
    from tierstore.errors import TierUnavailableError
    from tests.redis_server import free_port

    with pytest.raises(TierUnavailableError) as ei:
        tierstore.open(tmp_path, redis=f"redis://127.0.0.1:{free_port()}", host_root=str(shm_root))
    assert "cannot be reached" in str(ei.value)


def test_redis_auth(tmp_path, shm_root):
    from tests.redis_server import RedisProcess
    from tierstore.errors import AccessDeniedError

    rp = RedisProcess(tmp_path / "r", password="s3cret-pw")
    (tmp_path / "r").mkdir()
    rp.start()
    try:
        s = tierstore.open(tmp_path / "h", redis=rp.url, durable="none", host_root=str(shm_root / "n"))
        s.put(K, tensors())
        s.close()
        with pytest.raises(AccessDeniedError) as ei:
            tierstore.open(tmp_path / "h", redis=f"redis://:wrong@127.0.0.1:{rp.port}/0", host_root=str(shm_root))
        assert "wrong" not in str(ei.value) and "s3cret" not in str(ei.value)
    finally:
        rp.stop()


def test_delta_objects_are_compressed_full_objects_are_not(store):
    from tierstore.delta import xor_delta

    g = torch.Generator().manual_seed(5)
    w0 = torch.randn(256, 256, generator=g)
    w1 = w0 - 1e-4 * torch.randn(256, 256, generator=g)  # a small optimizer update
    full = store.put(K, {"w": w0})
    assert full.size >= w0.numel() * 4
    layout = {"w": {"dtype": "float32", "shape": [256, 256]}}
    d = store.put(K.with_step(4), {"w": xor_delta(w1, w0)}, {"_delta": layout}, kind="delta", base=K)
    assert d.size < 0.9 * full.size
    assert torch.equal(store.get(K.with_step(4)).tensors["w"], w1)
