"""Writing objects: :class:`EncodePlan` (the snapshot copy), :func:`plan` and :func:`encode`."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from tierstore.codec.chunks import ROW as _ROW
from tierstore.codec.compression import FLAG_LZ4, NAMES, PAYS_RATIO
from tierstore.codec.compression import choose as _choose
from tierstore.codec.compression import compress as _compress
from tierstore.codec.format import (
    ALIGN,
    CHUNK,
    DTYPE_NAMES,
    FORMAT_VERSION,
    HEADER,
    HEADER2,
    MAGIC,
    MAX_METADATA_LEN,
    MAX_NAME_LEN,
    MAX_TABLE_LEN,
    TRAILER_SIZE,
    TensorInfo,
    align,
    chunk_size_for,
    chunk_table_len,
    geometry_views,
    n_chunks,
    typed_view,
)
from tierstore.errors import InvalidValueError

if TYPE_CHECKING:
    import torch
else:  # torch is imported on first use (see tierstore.lazytorch)
    from tierstore.lazytorch import torch

__all__ = ["EncodePlan", "encode", "plan", "reseal"]

_ZEROS = bytes(ALIGN)  # the longest padding after a tensor
_digest = xxhash.xxh3_128_digest


def _raw_chunk_table(raw_len: int, chunk_size: int) -> bytes:
    """The chunk table of an uncompressed data section, digests left zero (:meth:`EncodePlan.seal` fills them)."""
    count = n_chunks(raw_len, chunk_size)
    table = bytearray(chunk_table_len(count))
    rows = np.frombuffer(table, dtype=_ROW, count=count)
    rows["stored"] = chunk_size
    if count:
        rows["stored"][-1] = raw_len - (count - 1) * chunk_size
    return bytes(table)


def _keys_are_str(o: Any) -> bool:
    """Whether every dict in ``o`` (nested in dicts, lists and tuples) has only str keys."""
    stack = [o]
    while stack:
        o = stack.pop()
        if isinstance(o, dict):
            for k, v in o.items():
                if not isinstance(k, str):
                    return False
                if isinstance(v, (dict, list, tuple)):
                    stack.append(v)
        elif isinstance(o, (list, tuple)):
            stack.extend(v for v in o if isinstance(v, (dict, list, tuple)))
    return True


def _check_metadata(metadata: dict | None) -> bytes:
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise InvalidValueError(f"metadata must be a dict, got {type(metadata).__name__}", entry="metadata")
    try:
        text = json.dumps(metadata, allow_nan=False)  # first: it raises on a circular or over-deep value
    except (TypeError, ValueError, RecursionError) as e:
        raise InvalidValueError(f"metadata is not JSON-serialisable: {e}", entry="metadata") from e
    if not _keys_are_str(metadata):
        raise InvalidValueError("metadata dict keys must be str (JSON would rename them)", entry="metadata")
    if len(text) > MAX_METADATA_LEN:
        raise InvalidValueError(
            f"metadata is {len(text)} bytes as JSON, over the {MAX_METADATA_LEN} limit", entry="metadata"
        )
    return text.encode("ascii")


_TORCH: dict[str, Any] = {}  # torch's names this module checks against, resolved at the first check


def _torch_names() -> dict[str, Any]:
    if not _TORCH:
        _TORCH.update(Tensor=torch.Tensor, strided=torch.strided, dtype_names=dict(DTYPE_NAMES.items()))
    return _TORCH


def _check_tensor(name: Any, t: Any) -> str:
    names = _TORCH or _torch_names()
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_LEN:
        raise InvalidValueError(
            f"tensor name {name!r} must be a non-empty str of at most {MAX_NAME_LEN} chars", entry=name
        )
    if not isinstance(t, names["Tensor"]):
        raise InvalidValueError(f"value of {name!r} is a {type(t).__name__}, not a torch.Tensor", entry=name)
    if t.layout != names["strided"] or t.is_nested or t.is_quantized or t.is_meta:
        raise InvalidValueError(f"tensor {name!r} must be a dense strided tensor with data", entry=name)
    dtype = names["dtype_names"].get(t.dtype)
    if dtype is None:
        raise InvalidValueError(f"tensor {name!r} has unsupported dtype {t.dtype}", entry=name)
    return dtype


class _Layout:
    """Where everything of an object goes, for one (metadata, names, dtypes, shapes): shared by plans."""

    def __init__(self, meta_json: bytes, sig: tuple[tuple[str, str, tuple[int, ...], int], ...]) -> None:
        rows: list[dict[str, Any]] = []
        offset = 0
        for name, dtype, shape, nbytes in sig:
            rows.append({"name": name, "dtype": dtype, "shape": list(shape), "offset": offset, "nbytes": nbytes})
            offset = align(offset + nbytes)
        self.raw_len = offset
        head = json.dumps({"tensors": rows}, separators=(",", ":"))[:-1].encode("ascii")
        table = head + b',"meta":' + meta_json + b"}"
        self.table = table + b" " * (align(len(table)) - len(table))
        if len(self.table) > MAX_TABLE_LEN:
            raise InvalidValueError(f"table of {len(self.table)} bytes exceeds {MAX_TABLE_LEN}", entry="table")
        self.entries = tuple(
            TensorInfo(r["name"], r["dtype"], tuple(r["shape"]), r["offset"], r["nbytes"]) for r in rows
        )
        self.index = {e.name: i for i, e in enumerate(self.entries)}
        self.chunk_size = chunk_size_for(self.raw_len)
        self.n_chunks = n_chunks(self.raw_len, self.chunk_size)
        self.chunks_offset = HEADER.size + len(self.table)
        self.chunk_table = _raw_chunk_table(self.raw_len, self.chunk_size)
        self.data_offset = self.chunks_offset + len(self.chunk_table)
        self.nbytes = self.data_offset + self.raw_len + TRAILER_SIZE
        self.header = HEADER2.pack(MAGIC, FORMAT_VERSION, 0, len(self.table), self.raw_len, self.raw_len,
                                   self.chunk_size, self.n_chunks)
        self.slots: list[tuple[int, int, int]] = []  # (start, nbytes, zero padding after) per tensor
        for i, e in enumerate(self.entries):
            start = self.data_offset + e.offset
            pad_end = self.data_offset + (self.entries[i + 1].offset if i + 1 < len(self.entries) else self.raw_len)
            self.slots.append((start, e.nbytes, pad_end - start - e.nbytes))
        # where the tensors' bytes go, as typed views would be made over a buffer: layouts that differ only in
        # names or metadata (one layer's and the next's) often share it, and a reused segment keeps its views
        self.geometry = tuple((start, e.nbytes, e.dtype, e.shape) for (start, _n, _p), e in zip(self.slots, self.entries))


_LAYOUTS: OrderedDict[tuple, _Layout] = OrderedDict()
_LAYOUTS_MAX = 1024  # a trainer saves the same layers with the same metadata every step
# the tables kept, in bytes (tables and chunk tables; the rows and keys beside them take a few times that): an
# object of thousands of tensors has a table of hundreds of KiB, and building it again each step was most of its
# save's stall; the least recently used go first, and a layout over a quarter of the bound is not kept
_LAYOUTS_MAX_BYTES = 8 << 20
_LAYOUTS_BYTES = [0]
_LAYOUTS_LOCK = threading.Lock()


def _layout_bytes(layout: _Layout) -> int:
    return len(layout.table) + len(layout.chunk_table)


def _layout(meta_json: bytes, sig: tuple[tuple[str, str, tuple[int, ...], int], ...]) -> _Layout:
    key = (meta_json, sig)
    with _LAYOUTS_LOCK:
        layout = _LAYOUTS.get(key)
        if layout is not None:
            _LAYOUTS.move_to_end(key)
            return layout
    layout = _Layout(meta_json, sig)
    size = _layout_bytes(layout)
    if size > _LAYOUTS_MAX_BYTES // 4:
        return layout
    with _LAYOUTS_LOCK:
        if key not in _LAYOUTS:
            _LAYOUTS[key] = layout
            _LAYOUTS_BYTES[0] += size
        while len(_LAYOUTS) > _LAYOUTS_MAX or _LAYOUTS_BYTES[0] > _LAYOUTS_MAX_BYTES:
            _, old = _LAYOUTS.popitem(last=False)
            _LAYOUTS_BYTES[0] -= _layout_bytes(old)
    return layout


class EncodePlan:
    """The layout of one object for a fixed set of tensors; see the module docstring.

    Attributes:
        nbytes: total encoded size of the uncompressed layout, trailer included.
        data_offset: where the data section starts in the encoded object.
        raw_len: size of the data section.
        chunk_size: bytes per chunk of the data section (each gets its digest at :meth:`seal`).
        entries: the table rows, in order.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], metadata: dict | None = None) -> None:
        meta_json = _check_metadata(metadata)
        self._tensors: list[torch.Tensor] = []
        sig = []
        for name, t in tensors.items():
            sig.append((name, _check_tensor(name, t), tuple(t.shape), t.numel() * t.element_size()))
            self._tensors.append(t)
        layout = _layout(meta_json, tuple(sig))
        self.raw_len = layout.raw_len
        self._table = layout.table
        self.entries = layout.entries
        self._index = layout.index
        self.data_offset = layout.data_offset
        self.chunk_size = layout.chunk_size
        self._chunks_offset = layout.chunks_offset
        self._chunk_table = layout.chunk_table
        self.nbytes = layout.nbytes
        self._header = layout.header
        self.geometry = layout.geometry
        # per tensor: where its bytes go and the zero padding after them (precomputed: write() is the stall)
        self._slots = [(t, *slot) for t, slot in zip(self._tensors, layout.slots)]

    def _check_buf(self, buf: memoryview) -> memoryview:
        mv = memoryview(buf).cast("B") if not isinstance(buf, memoryview) or buf.format != "B" else buf
        if mv.readonly:
            raise InvalidValueError("encode buffer is read-only", entry="buf")
        if len(mv) < self.nbytes:
            raise InvalidValueError(f"encode buffer holds {len(mv)} bytes, plan needs {self.nbytes}", entry="buf")
        return mv

    def write_header(self, buf: memoryview) -> None:
        """Write the header, table and chunk table (digests to come) into ``buf`` (the first ``data_offset`` bytes)."""
        mv = self._check_buf(buf)
        self._write_head(mv)

    def _write_head(self, mv: memoryview) -> None:
        mv[: HEADER.size] = self._header
        mv[HEADER.size : self._chunks_offset] = self._table
        mv[self._chunks_offset : self.data_offset] = self._chunk_table

    @staticmethod
    def _write_slot(mv: memoryview, t: torch.Tensor, start: int, nbytes: int, pad: int,
                    non_blocking: bool = False, dest: torch.Tensor | None = None) -> None:
        if nbytes:
            if dest is None:
                dest = typed_view(mv, t.dtype, nbytes, start).view(t.shape)
            dest.copy_(t, non_blocking=non_blocking)
        if pad:
            end = start + nbytes
            mv[end : end + pad] = _ZEROS[:pad]

    def dest_views(self, buf: memoryview) -> list[torch.Tensor | None]:
        """Typed tensors over ``buf`` where each tensor's bytes go (``None`` for an empty one), in table order.

        They depend only on :attr:`geometry`: a caller that writes this geometry into the same memory again
        (a reused segment) may keep them and pass them to :meth:`write` (making them is about a third of the
        cost of a small tensor's copy).
        """
        return geometry_views(self._check_buf(buf), self.geometry)

    def write_tensor(self, buf: memoryview, name: str) -> None:
        """Copy the current contents of tensor ``name`` (and its zero padding) into ``buf``."""
        mv = self._check_buf(buf)
        with torch.no_grad():
            self._write_slot(mv, *self._slots[self._index[name]])

    def write(self, buf: memoryview, *, non_blocking: bool = False,
              dests: list[torch.Tensor | None] | None = None) -> None:
        """Write header, table and every tensor's bytes into ``buf[:nbytes]``: the stall.

        One copy per tensor, straight from the (possibly non-contiguous or
        device) tensor into ``buf``; the trailer is left to :meth:`seal`.
        ``non_blocking``: device tensors are copied asynchronously on the
        current stream (the caller waits for it before sealing or reading ``buf``).
        ``dests``: :meth:`dest_views` of ``buf`` (made here when not given).
        """
        mv = self._check_buf(buf)
        self._write_head(mv)
        if dests is not None and len(dests) != len(self._slots):
            raise InvalidValueError(f"{len(dests)} destination views for {len(self._slots)} tensors", entry="dests")
        with torch.no_grad():
            if dests is None:
                for slot in self._slots:
                    self._write_slot(mv, *slot, non_blocking)
            else:
                for slot, dest in zip(self._slots, dests):
                    self._write_slot(mv, *slot, non_blocking, dest)

    def seal(self, buf: memoryview) -> str:
        """Write each chunk's digest, then the trailer (xxh3-128 of everything before the data); return it as hex.

        One pass over the data section, as one xxh3-128 over the whole object would be.
        """
        mv = self._check_buf(buf)
        start, end, size = self.data_offset, self.data_offset + self.raw_len, self.chunk_size
        digest = _digest
        digests = b"".join([digest(mv[pos : pos + size if pos + size < end else end])
                            for pos in range(start, end, size)])
        if digests:
            rows = np.frombuffer(mv[self._chunks_offset : start], dtype=_ROW, count=len(digests) // 16)
            rows["digest"] = np.frombuffer(digests, dtype="V16")
        h = xxhash.xxh3_128(mv[:start])
        mv[end : self.nbytes] = h.digest()
        return h.hexdigest()


def plan(tensors: Mapping[str, torch.Tensor], metadata: dict | None = None) -> EncodePlan:
    """Validate ``tensors`` and ``metadata`` and lay out their encoded object.

    Raises:
        InvalidValueError: a bad name, a non-tensor value, an unsupported dtype,
            or metadata that is not JSON-serialisable within 1 MiB; ``entry``
            names the culprit.
    """
    if not isinstance(tensors, Mapping):
        raise InvalidValueError(f"tensors must be a mapping, got {type(tensors).__name__}", entry="tensors")
    return EncodePlan(tensors, metadata)


_COMPRESS_MODES = ("auto", "always", "never", *NAMES)


def _compressed(p: EncodePlan, data: memoryview, flag: int, *, force: bool) -> bytes | None:
    """The object with each chunk compressed by ``flag`` (stored raw where that is not smaller); ``None`` when
    not ``force`` and the data section does not shrink below :data:`PAYS_RATIO`."""
    size, count = p.chunk_size, n_chunks(p.raw_len, p.chunk_size)
    table = bytearray(chunk_table_len(count))
    pieces: list[Any] = []
    stored = 0
    for i in range(count):
        raw = data[i * size : (i + 1) * size]
        comp = _compress(flag, raw)
        piece, piece_flag = (comp, flag) if len(comp) < len(raw) else (raw, 0)
        CHUNK.pack_into(table, i * CHUNK.size, _digest(piece), len(piece), piece_flag)
        pieces.append(piece)
        stored += len(piece)
        if not force and stored >= PAYS_RATIO * p.raw_len:
            return None
    head = HEADER2.pack(MAGIC, FORMAT_VERSION, flag, len(p._table), stored, p.raw_len, size, count)
    h = xxhash.xxh3_128(head)
    h.update(p._table)
    h.update(table)
    return b"".join((head, p._table, table, *pieces, h.digest()))


def encode(
    tensors: Mapping[str, torch.Tensor], metadata: dict | None = None, *, compress: str = "auto"
) -> bytes:
    """Encode ``tensors`` and ``metadata`` into one object.

    Args:
        compress: ``"never"``; ``"auto"``: compress with the codec that 3 sampled
            64 KiB slices show pays (:func:`tierstore.compression.choose`), and keep
            the result only if the whole section shrinks below 0.8; ``"always"``:
            the codec the samples prefer (lz4 where none pays), kept whatever the
            ratio; ``"lz4"`` / ``"zstd"``: that codec, kept whatever the ratio.

    Returns:
        The encoded object as bytes.
    """
    if compress not in _COMPRESS_MODES:
        raise InvalidValueError(f"compress must be one of {_COMPRESS_MODES}, not {compress!r}", entry="compress")
    p = plan(tensors, metadata)
    buf = bytearray(p.nbytes)
    mv = memoryview(buf)
    p.write(mv)
    data = mv[p.data_offset : p.data_offset + p.raw_len]
    flag: int | None = None
    if compress in NAMES:
        flag = NAMES[compress]
    elif compress == "always":
        flag = _choose(data) or FLAG_LZ4
    elif compress == "auto" and p.raw_len:
        flag = _choose(data)
    if flag is not None:
        blob = _compressed(p, data, flag, force=compress != "auto")
        if blob is not None:
            return blob
    del data
    p.seal(mv)
    del mv
    return bytes(buf)


def reseal(blob: Any) -> bytes:
    """``blob`` with its checksums recomputed after a deliberate change (fuzzing, forging hostile objects).

    Version 2: each chunk's digest, over the stored lengths its row gives
    (as far as they lie inside the object), then the trailer over what
    precedes the data. Anything else (version 1, a header that does not
    parse): the trailer over everything before it. Nothing is checked: the
    result is what a reader must refuse or decode safely.
    """
    b = bytearray(blob)
    if len(b) < TRAILER_SIZE:
        return bytes(b)
    end = len(b) - TRAILER_SIZE
    if len(b) >= HEADER2.size and bytes(b[:4]) == MAGIC and int.from_bytes(b[4:6], "little") >= 2:
        _m, _v, _f, table_len, _data, _raw, _size, count = HEADER2.unpack_from(b)
        rows = HEADER.size + table_len
        data = min(rows + chunk_table_len(count), end)
        if data > rows:
            pos = data
            for i in range(count):
                at = rows + i * CHUNK.size
                if at + CHUNK.size > data:
                    break
                _d, stored, _flag = CHUNK.unpack_from(b, at)
                stop = min(pos + stored, end)
                b[at : at + 16] = _digest(bytes(b[pos:stop]))
                pos = stop
            b[end:] = xxhash.xxh3_128_digest(bytes(b[:data]))
            return bytes(b)
    b[end:] = xxhash.xxh3_128_digest(bytes(b[:end]))
    return bytes(b)
