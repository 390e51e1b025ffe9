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


def test_a_large_layout_is_built_once_and_the_cache_stays_within_its_bound(monkeypatch):
    """An object of thousands of tensors (a table of hundreds of KiB) is planned from the cached layout on the next
    save, not rebuilt; the cache drops the least recently used layouts to stay within its bytes."""
    from tierstore.codec import write

    monkeypatch.setattr(write, "_LAYOUTS", type(write._LAYOUTS)())
    monkeypatch.setattr(write, "_LAYOUTS_BYTES", [0])
    built: list[int] = []
    real = write._Layout.__init__

    def counting(self, meta_json, sig):
        built.append(len(sig))
        real(self, meta_json, sig)

    monkeypatch.setattr(write._Layout, "__init__", counting)
    tensors = {f"layers.{i}.weight": torch.zeros(4) for i in range(4000)}
    first = write.EncodePlan(tensors)
    assert len(first._table) > 16 << 10  # larger than the old per-table limit
    write.EncodePlan(tensors)
    assert built == [4000]
    size = write._layout_bytes(next(iter(write._LAYOUTS.values())))
    monkeypatch.setattr(write, "_LAYOUTS_MAX_BYTES", 4 * size)  # four of them
    for n in range(1, 6):  # five other layouts of the same size: the oldest go
        write.EncodePlan({f"layers.{i}.weight": torch.zeros(4 + n) for i in range(4000)})
    assert write._LAYOUTS_BYTES[0] <= write._LAYOUTS_MAX_BYTES and len(write._LAYOUTS) == 4
    assert write._LAYOUTS_BYTES[0] == sum(write._layout_bytes(v) for v in write._LAYOUTS.values())
    write.EncodePlan(tensors)  # dropped: built again
    assert built.count(4000) == 7
