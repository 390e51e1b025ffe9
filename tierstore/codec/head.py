"""Parsing and bounding what precedes an object's data: the header (both versions), the table, the chunk table.

Every length and offset is checked against the object's size before anything
is allocated; nothing here is trusted until the caller verified the checksum
(:func:`verify_head`): the trailer over the whole object (version 1) or over
header, table and chunk table (version 2, whose chunks are then verified one
by one). :mod:`tierstore.codec.read` reads whole objects with these,
:mod:`tierstore.codec.ranged` byte ranges.
"""

from __future__ import annotations

import json
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import xxhash

from tierstore.codec.chunks import Chunks, check_geometry
from tierstore.codec.compression import FLAG_LZ4, FLAG_ZSTD
from tierstore.codec.compression import max_raw_len as _max_raw_len
from tierstore.codec.format import (
    ALIGN,
    HEADER,
    HEADER2,
    ITEMSIZE,
    KNOWN_FLAGS,
    MAGIC,
    MAX_NAME_LEN,
    MAX_NDIM,
    MAX_TABLE_LEN,
    TRAILER_SIZE,
    VERSIONS,
    TensorInfo,
    chunk_table_len,
)
from tierstore.errors import CorruptObjectError, InvalidValueError

__all__ = ["TABLE_CACHE_MAX", "Head", "bytes_view", "parse_chunks", "parse_head", "parse_table", "set_table_cache_max",
           "verify_head"]


@dataclass(frozen=True)
class Head:
    """A parsed header, bounded against the object's size (``size``).

    ``chunks_at``: where the chunk table starts (version 2; ``data_start`` in version 1, which has none).
    """

    version: int
    flags: int
    table_len: int
    data_len: int
    raw_len: int
    chunk_size: int
    n_chunks: int
    size: int

    @property
    def chunks_at(self) -> int:
        return HEADER.size + self.table_len

    @property
    def data_start(self) -> int:
        return self.chunks_at + (chunk_table_len(self.n_chunks) if self.version >= 2 else 0)

    @property
    def data_end(self) -> int:
        return self.data_start + self.data_len


def bytes_view(blob: Any) -> memoryview:
    try:
        mv = memoryview(blob)
    except TypeError as e:
        raise InvalidValueError(f"cannot decode a {type(blob).__name__}: not a buffer", entry="blob") from e
    if mv.format != "B" or mv.ndim != 1:
        try:
            mv = mv.cast("B")
        except TypeError as e:
            raise InvalidValueError("blob must be a contiguous byte buffer", entry="blob") from e
    return mv


def parse_head(head: Any, size: int) -> Head:
    """Check the first 64 bytes of an object of ``size`` bytes; see :class:`Head`.

    Raises:
        CorruptObjectError: a field that is impossible for the size, or a foreign object.
    """
    if size < HEADER.size + TRAILER_SIZE or len(head) < HEADER.size:
        raise CorruptObjectError(f"object of {size} bytes is shorter than header and trailer", size=size)
    magic, version, flags, table_len, data_len, raw_len = HEADER.unpack_from(head, 0)
    if magic != MAGIC:
        raise CorruptObjectError(f"bad magic {bytes(magic)!r}, not a tierstore object", field="magic")
    if version not in VERSIONS:
        raise CorruptObjectError(f"unknown format version {version}", field="version")
    chunk_size = count = 0
    if version >= 2:
        *_, chunk_size, count = HEADER2.unpack_from(head, 0)
    if flags & ~KNOWN_FLAGS or flags == FLAG_LZ4 | FLAG_ZSTD:
        raise CorruptObjectError(f"unknown flags 0x{flags:04x}", field="flags")
    if table_len > MAX_TABLE_LEN or table_len % ALIGN:
        raise CorruptObjectError(f"table_len {table_len} is not a multiple of 64 within 16 MiB", field="table_len")
    if flags:
        if raw_len > _max_raw_len(flags, data_len):
            raise CorruptObjectError(f"raw_len {raw_len} impossible for {data_len} compressed bytes", field="raw_len")
    elif raw_len != data_len:
        raise CorruptObjectError(f"raw_len {raw_len} != data_len {data_len} in an uncompressed object", field="raw_len")
    if version >= 2:
        check_geometry(chunk_size, count, raw_len)
    h = Head(version, flags, table_len, data_len, raw_len, chunk_size, count, size)
    expected = h.data_end + TRAILER_SIZE
    if expected != size:
        raise CorruptObjectError(
            f"object is {size} bytes but its header describes {expected} (truncated or padded)", field="data_len"
        )
    return h


def verify_head(h: Head, prefix: Any, trailer: Any) -> str:
    """Version 2: check the trailer against ``prefix`` (the object's first ``data_start`` bytes); its hex.

    Version 1's trailer covers the data too: pass the whole object before the trailer as ``prefix``.

    Raises:
        CorruptObjectError: a mismatch.
    """
    digest = xxhash.xxh3_128(prefix)
    if digest.digest() != trailer:
        raise CorruptObjectError(
            f"checksum mismatch: stored {bytes(trailer).hex()}, computed {digest.hexdigest()}", field="checksum"
        )
    return digest.hexdigest()


def parse_chunks(h: Head, table: Any) -> Chunks | None:
    """The chunk table of a version 2 object (``None`` for version 1)."""
    if h.version < 2:
        return None
    return Chunks(table, h.chunk_size, h.n_chunks, h.raw_len, h.data_len, h.flags)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


#: :func:`parse_table`'s cache: tables parsed, by (table bytes, raw_len); a restore reads the same layouts again
TABLE_CACHE_MAX = 1024
_TABLE_CACHED_LEN = 16 << 10  # larger tables are parsed every time: the cache stays within 16 MiB
_TABLES: OrderedDict[tuple[bytes, int], tuple[tuple[TensorInfo, ...], dict]] = OrderedDict()
_TABLES_LOCK = threading.Lock()


def set_table_cache_max(n: int) -> None:
    """Set :data:`TABLE_CACHE_MAX` (process-wide; ``StoreConfig.table_cache`` of the store opened last sets
    it), dropping the least recently used tables beyond it; 0 turns the cache off."""
    global TABLE_CACHE_MAX
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"the table cache holds a count of tables >= 0, got {n!r}")
    with _TABLES_LOCK:
        TABLE_CACHE_MAX = n
        while len(_TABLES) > n:
            _TABLES.popitem(last=False)


def _copy_json(o: Any) -> Any:
    """A deep copy of a JSON value (dicts, lists, scalars), each caller's own to change."""
    if isinstance(o, dict):
        return {k: _copy_json(v) for k, v in o.items()}
    if isinstance(o, list):
        return [_copy_json(v) for v in o]
    return o


def parse_table(raw: memoryview, raw_len: int) -> tuple[tuple[TensorInfo, ...], dict]:
    """Parse and bound an object's table: its tensor rows (every check below) and its metadata.

    A table that was parsed and passed every check before, with the same ``raw_len``, is not parsed
    again: its rows come from a cache of at most :data:`TABLE_CACHE_MAX` tables (of at most 16 KiB
    each, least recently used out), keyed by the table's very bytes, so the result is the one parsing
    them gives; the metadata is a fresh copy per call (callers change it). A restore reads the same
    layouts step after step: the JSON parse and the checks were most of what opening an object cost.
    """
    data = bytes(raw)
    key = (data, raw_len)
    cacheable = len(data) <= _TABLE_CACHED_LEN and TABLE_CACHE_MAX > 0
    if cacheable:
        with _TABLES_LOCK:
            hit = _TABLES.get(key)
            if hit is not None:
                _TABLES.move_to_end(key)
        if hit is not None:
            return hit[0], _copy_json(hit[1])
    infos, meta = _parse_table(data, raw_len)
    if cacheable:
        with _TABLES_LOCK:
            _TABLES[key] = (infos, _copy_json(meta))
            while len(_TABLES) > TABLE_CACHE_MAX:
                _TABLES.popitem(last=False)
    return infos, meta


def _parse_table(data: bytes, raw_len: int) -> tuple[tuple[TensorInfo, ...], dict]:
    try:
        table = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise CorruptObjectError(f"table is not valid JSON: {e}", field="table") from e
    if not isinstance(table, dict) or set(table) != {"tensors", "meta"}:
        raise CorruptObjectError("table must be an object with exactly 'tensors' and 'meta'", field="table")
    rows, meta = table["tensors"], table["meta"]
    if not isinstance(rows, list) or not isinstance(meta, dict):
        raise CorruptObjectError("table 'tensors' must be a list and 'meta' an object", field="table")
    infos: list[TensorInfo] = []
    names: set[str] = set()
    for r in rows:
        if not isinstance(r, dict) or set(r) != {"name", "dtype", "shape", "offset", "nbytes"}:
            raise CorruptObjectError(f"malformed table row {str(r)[:80]}", field="table")
        name, dtype, shape, offset, nbytes = r["name"], r["dtype"], r["shape"], r["offset"], r["nbytes"]
        if not isinstance(name, str) or not name or len(name) > MAX_NAME_LEN or name in names:
            raise CorruptObjectError(f"bad or duplicate tensor name {str(name)[:80]!r}", field="name")
        names.add(name)
        if dtype not in ITEMSIZE:
            raise CorruptObjectError(f"tensor {name!r}: unknown dtype {str(dtype)[:40]!r}", field="dtype", name=name)
        if (not isinstance(shape, list) or len(shape) > MAX_NDIM
                or not all(_is_int(d) and d >= 0 for d in shape)):
            raise CorruptObjectError(f"tensor {name!r}: bad shape {str(shape)[:80]}", field="shape", name=name)
        if not (_is_int(offset) and _is_int(nbytes) and offset >= 0 and offset % ALIGN == 0):
            raise CorruptObjectError(f"tensor {name!r}: bad offset/nbytes", field="offset", name=name)
        if math.prod(shape) * ITEMSIZE[dtype] != nbytes:
            raise CorruptObjectError(
                f"tensor {name!r}: shape {shape} x {dtype} != {nbytes} bytes", field="nbytes", name=name
            )
        if offset + nbytes > raw_len:
            raise CorruptObjectError(
                f"tensor {name!r}: bytes [{offset}, {offset + nbytes}) outside the {raw_len}-byte data section",
                field="offset", name=name,
            )
        infos.append(TensorInfo(name, dtype, tuple(shape), offset, nbytes))
    end = 0
    for row in sorted(infos, key=lambda r: r.offset):
        if row.nbytes and row.offset < end:
            raise CorruptObjectError(f"tensor {row.name!r} overlaps the tensor before it", field="offset",
                                     name=row.name)
        end = max(end, row.offset + row.nbytes)
    return tuple(infos), meta
