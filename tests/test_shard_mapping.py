"""``store.get`` returns a read-only mapping (``tierstore.Shard``); ``store[key]`` raises a typed KeyError."""

from __future__ import annotations

import pickle
from collections.abc import Mapping

import pytest
import torch

import tierstore
from tierstore import codec
from tierstore.errors import InvalidKeyError, ObjectNotFoundError, TierStoreError, UnknownError

K = tierstore.ShardKey("gpt", "block0", 3, 0)


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"weight": torch.randn(4, 3, generator=g), "bias": torch.randn(3, generator=g).to(torch.bfloat16),
            "step": torch.tensor(12345)}


def test_get_returns_a_read_only_mapping_with_metadata(store):
    t = _tensors()
    store.put(K, t, {"note": "x"})
    shard = store.get(K)
    assert isinstance(shard, tierstore.Shard) and isinstance(shard, Mapping)
    assert tierstore.Shard is codec.Shard and "Shard" in tierstore.__all__
    assert torch.equal(shard["weight"], t["weight"]) and shard["bias"].dtype == torch.bfloat16
    assert len(shard) == 3 and set(shard) == set(t) and "weight" in shard and "nope" not in shard
    assert sorted(shard.keys()) == sorted(t) and shard.get("nope") is None
    assert all(torch.equal(v, t[k]) for k, v in shard.items())
    assert shard.metadata == {"note": "x"}
    # the older attribute interface still works
    assert shard.tensors["weight"] is shard["weight"]
    with pytest.raises(KeyError):
        shard["nope"]


def test_shard_cannot_be_mutated_through_the_mapping():
    shard = codec.decode(codec.encode({"w": torch.ones(2)}))
    with pytest.raises(TypeError):
        shard["w"] = torch.zeros(2)  # type: ignore[index]
    with pytest.raises(TypeError):
        del shard["w"]  # type: ignore[attr-defined]
    for name in ("update", "pop", "setdefault", "clear", "popitem"):
        assert not hasattr(shard, name), name
    with pytest.raises(AttributeError):
        shard.other = 1  # type: ignore[attr-defined]  # __slots__: no stray attributes


def test_repr_shows_names_shapes_dtypes_never_values():
    secret = torch.full((2, 3), 0.123456789)
    shard = codec.Shard({"weight": secret, "n": torch.tensor(987654321)}, {"token": "s3cr3t"})
    r = repr(shard)
    assert "'weight': float32[2, 3]" in r and "'n': int64[]" in r and "token" in r
    assert "0.1234" not in r and "987654321" not in r and "s3cr3t" not in r and "tensor(" not in r
    many = codec.Shard({f"t{i}": torch.zeros(1) for i in range(40)}, {})
    assert "24 more" in repr(many) and "t39" not in repr(many)


def test_shard_pickles_and_compares_by_mapping():
    shard = codec.Shard({"w": torch.arange(3)}, {"a": 1})
    back = pickle.loads(pickle.dumps(shard))
    assert torch.equal(back["w"], shard["w"]) and back.metadata == {"a": 1}
    assert codec.Shard({}, {}) == {}  # Mapping equality; a missing metadata argument means {}


def test_missing_key_get_is_none_getitem_raises_typed_keyerror(store):
    missing = K.with_step(99)
    assert store.get(missing) is None
    with pytest.raises(ObjectNotFoundError) as ei:
        store[missing]
    e = ei.value
    assert isinstance(e, KeyError) and isinstance(e, TierStoreError) and isinstance(e, UnknownError)
    assert e.key == str(missing) and str(e) == f"no object stored under {missing}"  # not repr-quoted
    assert tierstore.ObjectNotFoundError is ObjectNotFoundError
    # dict-style code works: `except KeyError`
    try:
        store[str(missing)]
    except KeyError:
        pass
    store.put(K, _tensors())
    assert torch.equal(store[K]["weight"], _tensors()["weight"]) and torch.equal(store[str(K)]["step"],
                                                                                 torch.tensor(12345))
    assert K in store and str(K) in store and missing not in store


def test_getitem_malformed_key_is_not_a_miss(store):
    with pytest.raises(InvalidKeyError):
        store["not-a-key"]
    with pytest.raises(InvalidKeyError):
        _ = "gpt/../x/1/0" in store


def test_deleted_object_is_a_miss_again(store):
    store.put(K, _tensors())
    store.flush()  # store.delete does not wait for a migration in flight, which can copy the object back
    assert store.delete(K)
    assert store.get(K) is None
    with pytest.raises(ObjectNotFoundError):
        store[K]
