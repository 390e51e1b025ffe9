"""Opening an object parses its table once per layout (``tierstore.codec.head.parse_table``'s cache), with the
result parsing gives: the same rows, a metadata dict of the caller's own, every bound still checked."""

from __future__ import annotations

import json

import pytest
import torch

from tierstore import codec
from tierstore.codec import head
from tierstore.codec.format import HEADER
from tierstore.errors import CorruptObjectError


@pytest.fixture
def loads(monkeypatch):
    """Counts the JSON parses of tables (the real ``json.loads``); the cache starts empty."""
    monkeypatch.setattr(head, "_TABLES", type(head._TABLES)())
    calls: list[int] = []
    real = json.loads

    def counting(text, *a, **k):
        calls.append(len(text))
        return real(text, *a, **k)

    monkeypatch.setattr(head.json, "loads", counting)
    return calls


def _blob(meta: dict | None = None) -> bytes:
    return codec.encode({"w": torch.arange(12.0).reshape(3, 4), "s": torch.tensor(7)}, meta or {"a": {"b": [1]}},
                        compress="never")


def test_a_layout_is_parsed_once_and_each_caller_gets_its_own_metadata(loads):
    blob = _blob()
    first = codec.open_object(blob)
    first.metadata["a"]["b"].append(2)  # a caller changes what it got (the store pops its internal key)
    second = codec.open_object(_blob())  # another object of the same layout and metadata
    assert len(loads) == 1
    assert second.metadata == {"a": {"b": [1]}}
    assert second.tensors == first.tensors
    shard = second.decode()
    assert torch.equal(shard.tensors["w"], torch.arange(12.0).reshape(3, 4)) and int(shard.tensors["s"]) == 7
    codec.open_object(_blob({"a": {"b": [3]}}))  # other metadata: another table
    assert len(loads) == 2


def test_the_bounds_are_checked_against_each_objects_raw_len(loads):
    obj = codec.open_object(_blob())
    table = obj._mv[HEADER.size : HEADER.size + obj.table_len]
    assert head.parse_table(table, obj.raw_len)[0] == obj.tensors
    with pytest.raises(CorruptObjectError, match="outside"):
        head.parse_table(table, obj.raw_len - 64)  # same bytes, a data section too short for them
    assert len(loads) == 2


def test_a_bad_table_is_never_cached(loads):
    obj = codec.open_object(_blob())
    bad = bytes(obj._mv[HEADER.size : HEADER.size + obj.table_len]).replace(b'"dtype":"float32"', b'"dtype":"float99"')
    for _ in range(2):
        with pytest.raises(CorruptObjectError, match="dtype"):
            head.parse_table(memoryview(bad), obj.raw_len)
    assert len(loads) == 3


def test_a_cache_of_zero_parses_every_time(loads, monkeypatch):
    monkeypatch.setattr(head, "TABLE_CACHE_MAX", 0)
    for _ in range(3):
        codec.open_object(_blob())
    assert len(loads) == 3 and not head._TABLES


def test_the_store_config_sets_the_cache_size(loads, monkeypatch, tmp_path, redis_url, shm_root):
    import tierstore
    from tierstore.config import StoreConfig
    from tierstore.errors import ConfigError

    monkeypatch.setattr(head, "TABLE_CACHE_MAX", head.TABLE_CACHE_MAX)  # restored after the test
    store = tierstore.open(tmp_path, redis=redis_url, host_root=str(shm_root), durable="none", table_cache=0)
    try:
        assert head.TABLE_CACHE_MAX == 0
        for _ in range(3):
            codec.open_object(_blob())
        assert len(loads) == 3 and not head._TABLES
    finally:
        store.close()
    with pytest.raises(ConfigError, match="table_cache"):
        StoreConfig(table_cache=-1)
