"""Reading byte ranges of an object's tensors, each verified, without reading the rest of the object.

Protocol::

    obj = RangedObject(fetch, size, checksum=rec.checksum)   # header, table, chunk table; verified
    obj.tensors, obj.metadata                                 # trusted now
    t = obj.read_box("w", offsets=(128, 0), sizes=(64, 4096))  # that sub-box of the stored tensor, verified
    obj.bytes_read                                            # bytes fetched so far

``fetch(offset, length)`` returns the object's bytes ``[offset, offset +
length)`` (a backend's ranged get; fewer only past the end). Opening a
version 2 object fetches its first 4 KiB (the header and, usually, the
tables), the rest of the tables if longer, and the 16-byte trailer, and
checks the trailer over header, table and chunk table (and against
``checksum``, the index's, when given). A read then fetches only the chunks
that hold the requested bytes, in spans of consecutive chunks, and checks
each chunk's digest before any of its bytes are used; compressed chunks are
decompressed after their check. So a flipped byte in a range read raises
:class:`~tierstore.errors.CorruptObjectError` and nothing of it is returned.
A version 1 object has no chunk digests: it is fetched whole once and
verified whole (:mod:`tierstore.codec.read`), then ranges are served from it.

Bytes fetched for one box: the box's bytes rounded out to whole chunks (128
KiB as the writer cuts them), at most 16 MiB per fetch; the last 2 chunks
read stay verified in memory, so reads of neighbouring tensors that share a
chunk fetch it once. Memory: the fetched chunks of one
:meth:`RangedObject.read_runs` call, its result and the 2 kept chunks.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from tierstore.codec.chunks import Chunks
from tierstore.codec.format import DTYPES, HEADER, ITEMSIZE, TRAILER_SIZE, TensorInfo
from tierstore.codec.head import Head, parse_chunks, parse_head, parse_table, verify_head
from tierstore.codec.read import EncodedObject, _byte_view
from tierstore.errors import CorruptObjectError, InvalidValueError

if TYPE_CHECKING:
    import torch
else:  # torch is imported on first use (see tierstore.lazytorch)
    from tierstore.lazytorch import torch

__all__ = ["RangedObject", "box_runs"]

Fetch = Callable[[int, int], Any]

_FIRST = 4096  # the first fetch: the header and, for most objects, the table and chunk table
_SPAN = 16 << 20  # the most one fetch of chunks asks for
_KEEP = 2  # verified chunks kept for the next reads (neighbouring tensors share a chunk; reads come in table order)


def box_runs(shape: Sequence[int], offsets: Sequence[int], sizes: Sequence[int]) -> tuple[np.ndarray, int]:
    """The contiguous runs of a sub-box of a row-major tensor: ``(starts, length)`` in elements.

    Every run has the same length; ``starts`` ascend. An empty box has no runs.

    Raises:
        InvalidValueError: the box is not inside ``shape``.
    """
    nd = len(shape)
    if len(offsets) != nd or len(sizes) != nd:
        raise InvalidValueError(f"a box of {len(offsets)}/{len(sizes)} dims for a {nd}-dim tensor", entry="box")
    for o, s, d in zip(offsets, sizes, shape):
        if o < 0 or s < 0 or o + s > d:
            raise InvalidValueError(f"box offsets {list(offsets)} sizes {list(sizes)} outside shape {list(shape)}",
                                    entry="box")
    if nd == 0:
        return np.zeros(1, dtype=np.int64), 1
    if any(s == 0 for s in sizes):
        return np.zeros(0, dtype=np.int64), 0
    strides = [math.prod(shape[i + 1 :]) for i in range(nd)]
    k = nd - 1  # runs span dims k.. : every dim after k is whole
    while k > 0 and sizes[k] == shape[k]:
        k -= 1
    length = sizes[k] * strides[k]
    starts = np.full(1, offsets[k] * strides[k], dtype=np.int64)
    for d in range(k - 1, -1, -1):  # outer dims: every index of the box, row-major
        idx = (np.arange(offsets[d], offsets[d] + sizes[d], dtype=np.int64) * strides[d])[:, None]
        starts = (idx + starts[None, :]).reshape(-1)
    return starts, length


class RangedObject:
    """One object read by verified byte ranges; see the module docstring.

    Args:
        fetch: ``(offset, length) -> bytes`` of the object.
        size: the object's size in bytes.
        checksum: the checksum (hex) the object must have (the index's), if known.

    Raises:
        CorruptObjectError: a header or table that does not parse, a trailer
            that does not match what precedes the data, or another checksum
            than ``checksum``.
    """

    def __init__(self, fetch: Fetch, size: int, checksum: str | None = None) -> None:
        self._fetch = fetch
        self.size = size
        self.bytes_read = 0
        self._whole: Any = None  # version 1: the verified data section (uncompressed)
        self._kept: OrderedDict[int, Any] = OrderedDict()  # chunk index -> verified uncompressed bytes
        first = self._get(0, min(size, _FIRST))
        head = parse_head(first[: HEADER.size], size)
        self.version = head.version
        if head.version < 2:
            self._open_whole(first, head, checksum)
            return
        prefix = first if len(first) >= head.data_start else self._get(0, head.data_start)
        trailer = self._get(size - TRAILER_SIZE, TRAILER_SIZE)
        self.checksum = verify_head(head, memoryview(prefix)[: head.data_start], trailer)
        if checksum is not None and checksum != self.checksum:
            raise CorruptObjectError(f"checksum {self.checksum} differs from the expected {checksum}",
                                     field="checksum")
        mv = memoryview(prefix)
        self.tensors, self.metadata = parse_table(mv[HEADER.size : HEADER.size + head.table_len], head.raw_len)
        chunks = parse_chunks(head, mv[head.chunks_at : head.data_start])
        assert chunks is not None
        self._chunks: Chunks = chunks
        self._head: Head = head
        self._by_name = {e.name: e for e in self.tensors}

    def _get(self, offset: int, length: int) -> Any:
        got = self._fetch(offset, length)
        if got is None or len(got) != length:
            n = "nothing" if got is None else f"{len(got)} bytes"
            raise CorruptObjectError(f"a read of bytes {offset}..{offset + length} returned {n} (object changed or "
                                     "truncated)", field="size")
        self.bytes_read += length
        return got

    def _open_whole(self, first: Any, head: Head, checksum: str | None) -> None:
        blob = first if len(first) == self.size else self._get(0, self.size)
        obj = EncodedObject(blob)
        self.checksum = obj.verify()
        if checksum is not None and checksum != self.checksum:
            raise CorruptObjectError(f"checksum {self.checksum} differs from the expected {checksum}",
                                     field="checksum")
        self.tensors, self.metadata = obj.tensors, obj.metadata
        self._by_name = {e.name: e for e in self.tensors}
        shard = obj.decode(copy=False, verify=False)  # verified above; aliases blob (or its decompressed copy)
        self._whole = {n: t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
                       for n, t in shard.items()}

    def info(self, name: str) -> TensorInfo:
        e = self._by_name.get(name)
        if e is None:
            raise InvalidValueError(f"the object holds no tensor {name!r}", entry=name)
        return e

    def read_runs(self, name: str, starts: np.ndarray, length: int, into: memoryview | None = None) -> memoryview:
        """The bytes ``[s, s + length)`` of tensor ``name`` for each ``s`` of ``starts`` (ascending), concatenated.

        Args:
            into: a writable byte buffer of ``len(starts) * length`` bytes to fill (and return) instead of a new
                one; it is written only once every chunk the runs need has verified.

        Raises:
            CorruptObjectError: a chunk that does not match its digest (nothing is returned, ``into`` unchanged).
            InvalidValueError: no such tensor, runs outside it, or an ``into`` of another size.
        """
        e = self.info(name)
        n = len(starts)
        if into is not None and len(into) != n * length:
            raise InvalidValueError(f"into holds {len(into)} bytes, the runs {n * length}", entry=name)
        out = memoryview(bytearray(n * length)) if into is None else into
        if n == 0 or length == 0:
            return out
        if int(starts[0]) < 0 or int(starts[-1]) + length > e.nbytes or (n > 1 and np.any(np.diff(starts) < length)):
            raise InvalidValueError(f"runs outside tensor {name!r} or not ascending", entry=name)
        self._runs_writer(e, starts, length)(out)
        return out

    def _runs_writer(self, e: TensorInfo, starts: np.ndarray, length: int) -> Callable[[memoryview], None]:
        """Verify (fetch and check) every chunk the runs need, now; the returned ``write(dst)`` copies the runs'
        bytes from those verified chunks into ``dst`` (``len(starts) * length`` bytes), later or at once."""
        if self._whole is not None:
            src = self._whole[e.name].numpy()

            def take(dst: memoryview) -> None:
                idx = (starts[:, None] + np.arange(length, dtype=np.int64)[None, :]).reshape(-1)
                np.take(src, idx, out=np.frombuffer(dst, dtype=np.uint8))
            return take
        chunks = self._loaded(e, starts, length)
        c = self._chunks.size
        begin = e.offset

        def write(dst: memoryview) -> None:
            pos = 0
            for s in starts.tolist():
                a = begin + s
                b = a + length
                while a < b:
                    i = a // c
                    take = min(b, (i + 1) * c) - a
                    dst[pos : pos + take] = chunks[i][a - i * c : a - i * c + take]
                    pos += take
                    a += take
        return write

    def box_writer(self, name: str, offsets: Sequence[int], sizes: Sequence[int]) -> Callable[[torch.Tensor], None]:
        """Verify the chunks that hold a sub-box of tensor ``name`` now, copy it later: ``write(out)`` fills
        ``out`` (the box's shape and dtype) from the verified chunks, with no further check and nothing that can
        fail on the stored bytes. The verified chunks stay referenced until ``write`` is dropped (a host-tier
        copy's are views of its mapping: no new memory).

        Raises:
            CorruptObjectError: a chunk that does not match its digest (raised here, not by ``write``).
            InvalidValueError: no such tensor, or a box outside it.
        """
        e = self.info(name)
        dtype = DTYPES[e.dtype]
        sizes = [int(s) for s in sizes]
        starts, length = box_runs(e.shape, [int(o) for o in offsets], sizes)
        item = ITEMSIZE[e.dtype]
        nbytes = len(starts) * length * item
        runs = self._runs_writer(e, starts * item, length * item) if nbytes else None

        def write(out: torch.Tensor) -> None:
            if list(out.shape) != sizes or out.dtype != dtype:
                raise InvalidValueError(f"out is {out.dtype} {list(out.shape)}, the box {dtype} {sizes}", entry=name)
            if runs is None:
                return
            view = _byte_view(out)
            if view is not None:
                with torch.no_grad():
                    runs(view)
                return
            tmp = torch.empty(sizes, dtype=dtype)
            tmp_view = _byte_view(tmp)
            assert tmp_view is not None  # a new contiguous tensor
            runs(tmp_view)
            with torch.no_grad():
                out.copy_(tmp)
        return write

    def _loaded(self, e: TensorInfo, starts: np.ndarray, length: int) -> dict[int, Any]:
        """The verified, uncompressed chunks that hold the runs, by index."""
        c = self._chunks.size
        first = (e.offset + starts) // c
        last = (e.offset + starts + length - 1) // c
        need = np.unique(np.concatenate([np.arange(a, b + 1) for a, b in zip(first.tolist(), last.tolist())])
                         if len(starts) < 4096 else _span_union(first, last))
        out: dict[int, Any] = {}
        todo = []
        for i in need.tolist():
            if i in self._kept:
                self._kept.move_to_end(i)
                out[i] = self._kept[i]
            else:
                todo.append(i)
        spans = _consecutive(todo)
        ch = self._chunks
        data_start = self._head.data_start
        for i, j in spans:
            while i < j:  # at most _SPAN stored bytes per fetch
                k = i + 1
                while k < j and ch.starts[k + 1] - ch.starts[i] <= _SPAN:
                    k += 1
                blob = memoryview(self._get(data_start + ch.starts[i], ch.starts[k] - ch.starts[i]))
                for m in range(i, k):
                    stored = blob[ch.starts[m] - ch.starts[i] : ch.starts[m + 1] - ch.starts[i]]
                    ch.check(m, stored)
                    out[m] = ch.unpack(m, stored)
                i = k
        for i in todo[-_KEEP:]:
            self._kept[i] = bytes(out[i])  # a copy: a view would keep its whole fetched span alive
            if len(self._kept) > _KEEP:
                self._kept.popitem(last=False)
        return out

    def read_box(self, name: str, offsets: Sequence[int], sizes: Sequence[int],
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """The sub-box ``offsets``/``sizes`` of stored tensor ``name``, verified: a new tensor, or copied into ``out``.

        Raises:
            CorruptObjectError: a chunk that does not match its digest (``out`` is then unchanged).
            InvalidValueError: a box outside the tensor, or an ``out`` of another shape or dtype.
        """
        e = self.info(name)
        dtype = DTYPES[e.dtype]
        sizes = [int(s) for s in sizes]
        if out is not None and (list(out.shape) != sizes or out.dtype != dtype):
            raise InvalidValueError(f"out is {out.dtype} {list(out.shape)}, the box {dtype} {sizes}", entry=name)
        starts, length = box_runs(e.shape, [int(o) for o in offsets], sizes)
        item = ITEMSIZE[e.dtype]
        view = _byte_view(out) if out is not None else None
        if out is not None and view is not None:  # straight into out's memory, once every chunk verified
            with torch.no_grad():
                self.read_runs(name, starts * item, length * item, into=view)
            return out
        raw = self.read_runs(name, starts * item, length * item)
        t = torch.frombuffer(raw, dtype=torch.uint8) if len(raw) else torch.empty(0, dtype=torch.uint8)
        got = t.view(dtype).reshape(sizes)
        if out is None:
            return got
        with torch.no_grad():
            out.copy_(got)
        return out


def _span_union(first: np.ndarray, last: np.ndarray) -> np.ndarray:
    """Every integer of the ranges ``[first[i], last[i]]`` (many runs: without a Python loop per run)."""
    marks = np.zeros(int(last.max()) + 2, dtype=np.int64)
    np.add.at(marks, first, 1)
    np.add.at(marks, last + 1, -1)
    return np.nonzero(np.cumsum(marks)[:-1] > 0)[0]


def _consecutive(idx: list[int]) -> list[tuple[int, int]]:
    """``[i, j)`` spans of consecutive integers of the ascending ``idx``."""
    spans: list[tuple[int, int]] = []
    for i in idx:
        if spans and spans[-1][1] == i:
            spans[-1] = (spans[-1][0], i + 1)
        else:
            spans.append((i, i + 1))
    return spans
