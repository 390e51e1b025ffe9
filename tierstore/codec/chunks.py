"""Version 2's chunk table: the data section in chunks, each with the digest of its stored bytes.

The data section of a version 2 object is cut into chunks of ``chunk_size``
uncompressed bytes (the last one shorter). Chunk ``i`` covers the
uncompressed bytes ``[i * chunk_size, (i + 1) * chunk_size)``; it is stored
raw or, in a compressed object, as one frame of the header's codec
(:mod:`tierstore.codec.compression`) where that is smaller. The table holds
one :data:`~tierstore.codec.format.CHUNK` row per chunk (xxh3-128 of the
stored bytes, their length, their codec), and the stored chunks follow each
other in the data section. The trailer is xxh3-128 of everything before
the data (header, table, chunk table), so a reader that checked it may
trust the table and then verify any chunk on its own: a byte range is read
and verified without the rest of the object.

This module parses and checks a chunk table (:class:`Chunks`) and verifies
and unpacks single chunks; the layout decisions are in
:mod:`tierstore.codec.format`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import xxhash

from tierstore.codec.compression import decompress as _decompress
from tierstore.codec.compression import max_raw_len as _max_raw_len
from tierstore.codec.format import CHUNK, MAX_CHUNK_READ, MIN_CHUNK_READ, chunk_table_len, n_chunks
from tierstore.errors import CorruptObjectError

__all__ = ["ROW", "Chunks", "check_geometry"]

_digest = xxhash.xxh3_128_digest
ROW = np.dtype([("digest", "V16"), ("stored", "<u4"), ("flag", "<u4")])
assert ROW.itemsize == CHUNK.size


def check_geometry(chunk_size: int, count: int, raw_len: int) -> None:
    """Check a version 2 header's chunk fields against its ``raw_len``.

    Raises:
        CorruptObjectError: a chunk size that is not a power of two within
            4 KiB..16 MiB, or a chunk count that does not cut ``raw_len``.
    """
    if not MIN_CHUNK_READ <= chunk_size <= MAX_CHUNK_READ or chunk_size & (chunk_size - 1):
        raise CorruptObjectError(f"chunk size {chunk_size} is not a power of two in 4 KiB..16 MiB",
                                 field="chunk_size")
    if count != n_chunks(raw_len, chunk_size):
        raise CorruptObjectError(f"{count} chunks do not cut a {raw_len}-byte data section into {chunk_size}-byte "
                                 "chunks", field="n_chunks")


_RAW_COLUMNS: dict[tuple[int, int, int], bytes] = {}  # (chunk_size, count, raw_len) -> the (stored, flag) columns


def _is_raw(table: memoryview, chunk_size: int, count: int, raw_len: int) -> bool:
    """Whether every row of ``table`` says: stored raw, at its full size (``chunk_size``, the last the rest)."""
    key = (chunk_size, count, raw_len)
    want = _RAW_COLUMNS.get(key)
    if want is None:
        cols = np.zeros((count, 2), dtype="<u4")
        cols[:, 0] = chunk_size
        cols[-1, 0] = raw_len - (count - 1) * chunk_size
        want = cols.tobytes()
        if len(_RAW_COLUMNS) >= 4096:
            _RAW_COLUMNS.clear()
        _RAW_COLUMNS[key] = want
    got = np.frombuffer(table, dtype="<u4", count=count * 6).reshape(count, 6)[:, 4:]
    return got.tobytes() == want


class Chunks:
    """A parsed, bounded chunk table (it is trusted only once the object's trailer matched).

    Attributes:
        size: uncompressed bytes per chunk.
        count: number of chunks.
        raw_len: uncompressed bytes of the data section.
        starts: ``count + 1`` offsets of the stored chunks inside the data section.
    """

    __slots__ = ("_digests", "_flags", "_starts", "_table", "count", "raw_len", "size")

    def __init__(self, table: Any, chunk_size: int, count: int, raw_len: int, data_len: int, header_flags: int):
        mv = memoryview(table)
        if len(mv) != chunk_table_len(count):
            raise CorruptObjectError(f"chunk table of {len(mv)} bytes for {count} chunks", field="chunks")
        self._table = mv
        self.size, self.count, self.raw_len = chunk_size, count, raw_len
        self._digests: list[bytes] | None = None
        if not header_flags and raw_len == data_len and count and _is_raw(mv, chunk_size, count, raw_len):
            # an uncompressed object (every save's): every chunk raw, of its full size; the offsets follow
            # from the header alone, the digests are listed when a chunk is first checked
            self._starts: list[int] = [*range(0, (count - 1) * chunk_size + 1, chunk_size), raw_len]
            self._flags: list[int] = [0] * count
            return
        rows = np.frombuffer(mv, dtype=ROW, count=count)
        stored, flags = rows["stored"].astype(np.int64), rows["flag"].astype(np.int64)
        raw = np.full(count, chunk_size, dtype=np.int64)
        if count:
            raw[-1] = raw_len - (count - 1) * chunk_size
        plain = flags == 0
        bad = np.nonzero(plain & (stored != raw))[0]
        if len(bad):
            i = int(bad[0])
            raise CorruptObjectError(f"raw chunk {i} stores {int(stored[i])} bytes, not {int(raw[i])}", field="chunks")
        bad = np.nonzero(~plain & (flags != header_flags))[0]
        if len(bad):
            i = int(bad[0])
            raise CorruptObjectError(f"chunk {i} has codec {int(flags[i]):#x}, the header {header_flags:#x}",
                                     field="chunks")
        if header_flags:
            base = _max_raw_len(header_flags, 0)
            limit = (_max_raw_len(header_flags, 1) - base) * stored + base  # linear in the compressed length
            packed = ~plain & ((stored == 0) | (raw > limit))
            bad = np.nonzero(packed)[0]
            if len(bad):
                i = int(bad[0])
                raise CorruptObjectError(f"chunk {i}: {int(stored[i])} compressed bytes cannot hold {int(raw[i])}",
                                         field="chunks")
        total = int(stored.sum())
        if total != data_len:
            raise CorruptObjectError(f"the chunks store {total} bytes, the data section holds {data_len}",
                                     field="chunks")
        self._starts = [0, *np.cumsum(stored).tolist()]
        self._flags = flags.tolist()

    @property
    def starts(self) -> list[int]:
        """``count + 1`` offsets of the stored chunks inside the data section."""
        return self._starts

    @property
    def flags(self) -> list[int]:
        """Each chunk's codec flag (0: stored raw)."""
        return self._flags

    @property
    def digests(self) -> list[bytes]:
        """Each chunk's xxh3-128 digest of its stored bytes."""
        if self._digests is None:
            raw = np.frombuffer(self._table, dtype=ROW, count=self.count)["digest"].tobytes()
            self._digests = [raw[o : o + 16] for o in range(0, 16 * self.count, 16)]
        return self._digests

    def raw_size(self, i: int) -> int:
        """Uncompressed bytes of chunk ``i``."""
        return min(self.size, self.raw_len - i * self.size)

    def stored_len(self, i: int) -> int:
        return self.starts[i + 1] - self.starts[i]

    def check(self, i: int, stored: Any) -> None:
        """Raise :class:`CorruptObjectError` unless ``stored`` are chunk ``i``'s bytes."""
        if _digest(stored) != self.digests[i]:
            raise self.mismatch(i)

    def mismatch(self, i: int) -> CorruptObjectError:
        return CorruptObjectError(f"checksum mismatch in chunk {i} (bytes {self.starts[i]}..{self.starts[i + 1]} "
                                  "of the data section)", field="checksum", chunk=i)

    def verify(self, data: memoryview) -> None:
        """Check every chunk of the data section ``data`` (the stored bytes)."""
        digest, digests, starts = _digest, self.digests, self.starts
        for i in range(self.count):
            if digest(data[starts[i] : starts[i + 1]]) != digests[i]:
                raise self.mismatch(i)

    def unpack(self, i: int, stored: Any) -> Any:
        """Chunk ``i``'s uncompressed bytes from its verified ``stored`` bytes."""
        flag = self.flags[i]
        if not flag:
            return stored
        return memoryview(_decompress(flag, memoryview(stored), self.raw_size(i)))

    def covering(self, first: int, last: int) -> tuple[int, int]:
        """Chunks ``[i, j)`` that hold uncompressed bytes ``[first, last)`` (``last > first``)."""
        return first // self.size, (last - 1) // self.size + 1
