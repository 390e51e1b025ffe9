"""The tierstore object codec: a safe, self-describing wire format for one shard.

Layout of one encoded object (all integers little-endian)::

    header   64 bytes   HEADER: magic b"TSOB", version u16, flags u16,
                        table_len u32, data_len u64, raw_len u64, zero padding
    table    table_len  JSON (utf-8, ASCII-escaped), space-padded to 64 bytes:
                        {"tensors": [{"name", "dtype", "shape", "offset",
                        "nbytes"}, ...], "meta": {...}}
    data     data_len   every tensor's raw bytes at its ``offset`` (a multiple
                        of 64) inside the uncompressed data section of
                        ``raw_len`` bytes; lz4-frame compressed when flags bit0
    trailer  16 bytes   xxh3-128 digest of everything before it

No pickle anywhere: a reader trusts nothing until the checksum over the whole
object matched, and even then bounds every length and offset before it
allocates or copies (the checksum detects corruption, not malice).

Protocol of a save (the trainer waits only for step 2)::

    p = plan(tensors, metadata)     # validate, lay out; keeps tensor references
    p.write(buf)                    # one copy_ per tensor into buf[:p.nbytes]
    digest = p.seal(buf)            # xxh3-128 trailer, off the training path

A plan may be written many times (its tensors are read at ``write`` time), so
a trainer plans once and writes every step into a reused staging buffer.
:func:`encode` is the convenience that plans, writes, seals and compresses
where it pays; :func:`decode` is its inverse.
"""

from __future__ import annotations

import ctypes
import json
import math
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import lz4.frame
import numpy as np
import xxhash

from tierstore.errors import CorruptObjectError, InvalidValueError, RestoreMismatchError
from tierstore.lazytorch import LazyMapping

if TYPE_CHECKING:
    import torch
else:  # torch is imported on first use: verifying, inspecting and checksumming objects need no torch
    from tierstore.lazytorch import torch

__all__ = [
    "ALIGN",
    "DTYPES",
    "FLAG_LZ4",
    "FORMAT_VERSION",
    "HEADER",
    "MAGIC",
    "TRAILER_SIZE",
    "BlobInfo",
    "EncodePlan",
    "Shard",
    "TensorInfo",
    "checksum",
    "compute_checksum",
    "decode",
    "encode",
    "inspect",
    "plan",
    "verify",
]

# magic, version, flags, table_len, data_len, raw_len, reserved (zero) to 64 bytes.
HEADER = struct.Struct("<4sHHIQQ36x")
MAGIC = b"TSOB"
FORMAT_VERSION = 1
TRAILER_SIZE = 16
ALIGN = 64
FLAG_LZ4 = 0x1
_KNOWN_FLAGS = FLAG_LZ4

MAX_TABLE_LEN = 16 << 20
MAX_METADATA_LEN = 1 << 20
MAX_NAME_LEN = 1024
MAX_NDIM = 64
# lz4 cannot expand more than ~255x; a larger raw_len is a forged header.
_LZ4_MAX_RATIO = 256
_SAMPLE_SLICES = 3
_SAMPLE_BYTES = 64 << 10
_PAYS_RATIO = 0.8

assert HEADER.size == 64


# The supported dtype names and their sizes in bytes, known without torch (reading a table needs no torch).
_ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "uint16": 2, "uint32": 4, "uint64": 8,
}


def _build_dtypes() -> dict[str, torch.dtype]:
    return {n: getattr(torch, n) for n in _ITEMSIZE if isinstance(getattr(torch, n, None), torch.dtype)}


DTYPES: Mapping[str, torch.dtype] = LazyMapping(_build_dtypes)
"""Supported dtype names and their torch dtypes (those this torch build has), built on first use."""
_DTYPE_NAMES: Mapping[torch.dtype, str] = LazyMapping(lambda: {v: k for k, v in DTYPES.items()})

class Shard(Mapping[str, torch.Tensor]):
    """A decoded object: a read-only mapping of names to tensors, plus its JSON metadata.

    ``shard["weight"]``, ``"weight" in shard``, ``len(shard)``, iteration and
    ``keys()/items()/values()/get()`` work as on a dict; there is no way to
    add, replace or remove a name through the shard. The tensors themselves
    are ordinary (writable) tensors owned by the caller.

    Attributes:
        tensors: the underlying ``dict`` of names to tensors (kept for callers
            that predate the mapping interface; prefer indexing the shard).
        metadata: the JSON metadata stored beside the tensors.

    The repr lists names, dtypes and shapes (and metadata keys), never values.
    """

    __slots__ = ("metadata", "tensors")
    _REPR_NAMES = 16

    def __init__(self, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> None:
        self.tensors = tensors
        self.metadata = {} if metadata is None else metadata

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __repr__(self) -> str:
        parts = []
        for name, t in list(self.tensors.items())[: self._REPR_NAMES]:
            dtype = _DTYPE_NAMES.get(t.dtype, str(t.dtype).removeprefix("torch."))
            where = "" if t.device.type == "cpu" else f" @{t.device}"
            parts.append(f"{name!r}: {dtype}{list(t.shape)}{where}")
        more = len(self.tensors) - self._REPR_NAMES
        if more > 0:
            parts.append(f"... {more} more")
        return f"Shard({{{', '.join(parts)}}}, metadata keys={sorted(self.metadata)!r})"


@dataclass(frozen=True)
class TensorInfo:
    """One row of an object's table; ``offset`` is inside the uncompressed data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class BlobInfo:
    """What :func:`inspect` reports about an encoded object."""

    version: int
    flags: int
    compressed: bool
    table_len: int
    data_len: int
    raw_len: int
    nbytes: int
    checksum: str
    metadata: dict
    tensors: tuple[TensorInfo, ...] = field(default_factory=tuple)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def compute_checksum(buffers: Iterable[Any]) -> str:
    """Return the xxh3-128 hex digest of the concatenation of ``buffers``.

    Args:
        buffers: objects supporting the buffer protocol, hashed in order without
            being joined.
    """
    h = xxhash.xxh3_128()
    for b in buffers:
        h.update(b)
    return h.hexdigest()


# ----------------------------------------------------------------------------- encode


def _check_metadata(metadata: dict | None) -> bytes:
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise InvalidValueError(f"metadata must be a dict, got {type(metadata).__name__}", entry="metadata")

    def keys_are_str(o: Any) -> bool:
        if isinstance(o, dict):
            return all(isinstance(k, str) and keys_are_str(v) for k, v in o.items())
        if isinstance(o, (list, tuple)):
            return all(keys_are_str(v) for v in o)
        return True

    try:
        text = json.dumps(metadata, allow_nan=False)
        ok = keys_are_str(metadata)
    except (TypeError, ValueError, RecursionError) as e:
        raise InvalidValueError(f"metadata is not JSON-serialisable: {e}", entry="metadata") from e
    if not ok:
        raise InvalidValueError("metadata dict keys must be str (JSON would rename them)", entry="metadata")
    if len(text) > MAX_METADATA_LEN:
        raise InvalidValueError(
            f"metadata is {len(text)} bytes as JSON, over the {MAX_METADATA_LEN} limit", entry="metadata"
        )
    return text.encode("ascii")


def _check_tensor(name: Any, t: Any) -> str:
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_LEN:
        raise InvalidValueError(
            f"tensor name {name!r} must be a non-empty str of at most {MAX_NAME_LEN} chars", entry=name
        )
    if not isinstance(t, torch.Tensor):
        raise InvalidValueError(f"value of {name!r} is a {type(t).__name__}, not a torch.Tensor", entry=name)
    if t.layout != torch.strided or t.is_nested or t.is_quantized or t.device.type == "meta":
        raise InvalidValueError(f"tensor {name!r} must be a dense strided tensor with data", entry=name)
    dtype = _DTYPE_NAMES.get(t.dtype)
    if dtype is None:
        raise InvalidValueError(f"tensor {name!r} has unsupported dtype {t.dtype}", entry=name)
    return dtype


class EncodePlan:
    """The layout of one object for a fixed set of tensors; see the module docstring.

    Attributes:
        nbytes: total encoded size of the uncompressed layout, trailer included.
        data_offset: where the data section starts in the encoded object.
        raw_len: size of the data section.
        entries: the table rows, in order.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], metadata: dict | None = None) -> None:
        meta_json = _check_metadata(metadata)
        self._tensors: list[torch.Tensor] = []
        rows: list[dict[str, Any]] = []
        offset = 0
        for name, t in tensors.items():
            dtype = _check_tensor(name, t)
            nbytes = t.numel() * t.element_size()
            rows.append({"name": name, "dtype": dtype, "shape": list(t.shape), "offset": offset, "nbytes": nbytes})
            self._tensors.append(t)
            offset = _align(offset + nbytes)
        self.raw_len = offset
        head = json.dumps({"tensors": rows}, separators=(",", ":"))[:-1].encode("ascii")
        table = head + b',"meta":' + meta_json + b"}"
        self._table = table + b" " * (_align(len(table)) - len(table))
        if len(self._table) > MAX_TABLE_LEN:
            raise InvalidValueError(f"table of {len(self._table)} bytes exceeds {MAX_TABLE_LEN}", entry="table")
        self.entries = tuple(
            TensorInfo(r["name"], r["dtype"], tuple(r["shape"]), r["offset"], r["nbytes"]) for r in rows
        )
        self._index = {e.name: i for i, e in enumerate(self.entries)}
        self.data_offset = HEADER.size + len(self._table)
        self.nbytes = self.data_offset + self.raw_len + TRAILER_SIZE
        self._header = HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(self._table), self.raw_len, self.raw_len)

    def _check_buf(self, buf: memoryview) -> memoryview:
        mv = memoryview(buf).cast("B") if not isinstance(buf, memoryview) or buf.format != "B" else buf
        if mv.readonly:
            raise InvalidValueError("encode buffer is read-only", entry="buf")
        if len(mv) < self.nbytes:
            raise InvalidValueError(f"encode buffer holds {len(mv)} bytes, plan needs {self.nbytes}", entry="buf")
        return mv

    def write_header(self, buf: memoryview) -> None:
        """Write the header and table into ``buf`` (the first ``data_offset`` bytes)."""
        mv = self._check_buf(buf)
        mv[: HEADER.size] = self._header
        mv[HEADER.size : self.data_offset] = self._table

    def write_tensor(self, buf: memoryview, name: str) -> None:
        """Copy the current contents of tensor ``name`` (and its zero padding) into ``buf``."""
        mv = self._check_buf(buf)
        i = self._index[name]
        e, t = self.entries[i], self._tensors[i]
        start = self.data_offset + e.offset
        end = start + e.nbytes
        pad_end = self.data_offset + (self.entries[i + 1].offset if i + 1 < len(self.entries) else self.raw_len)
        if e.nbytes:
            with torch.no_grad():
                _typed_view(mv, t.dtype, e.nbytes, start).view(t.shape).copy_(t)
        if pad_end > end:
            mv[end:pad_end] = bytes(pad_end - end)

    def write(self, buf: memoryview) -> None:
        """Write header, table and every tensor's bytes into ``buf[:nbytes]``: the stall.

        One copy per tensor, straight from the (possibly non-contiguous or
        device) tensor into ``buf``; the trailer is left to :meth:`seal`.
        """
        self.write_header(buf)
        for e in self.entries:
            self.write_tensor(buf, e.name)

    def seal(self, buf: memoryview) -> str:
        """Write the xxh3-128 trailer over ``buf[:nbytes - 16]``; return it as 32 hex chars."""
        mv = self._check_buf(buf)
        end = self.nbytes - TRAILER_SIZE
        h = xxhash.xxh3_128(mv[:end])
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


def _sample_pays(data: memoryview) -> bool:
    n = len(data)
    if n <= _SAMPLE_SLICES * _SAMPLE_BYTES:
        starts = [0]
        size = n
    else:
        size = _SAMPLE_BYTES
        starts = [(n - size) * k // (_SAMPLE_SLICES - 1) for k in range(_SAMPLE_SLICES)]
    raw = comp = 0
    for s in starts:
        chunk = data[s : s + size]
        raw += len(chunk)
        comp += len(lz4.frame.compress(chunk, store_size=False))
    return raw > 0 and comp < _PAYS_RATIO * raw


def encode(
    tensors: Mapping[str, torch.Tensor], metadata: dict | None = None, *, compress: str = "auto"
) -> bytes:
    """Encode ``tensors`` and ``metadata`` into one object.

    Args:
        compress: ``"never"``; ``"always"`` (lz4 frame over the data section);
            or ``"auto"``: compress when 3 sampled 64 KiB slices shrink below 0.8
            of their size, and keep the result only if the whole section does.

    Returns:
        The encoded object as bytes.
    """
    if compress not in ("auto", "always", "never"):
        raise InvalidValueError(f"compress must be auto, always or never, not {compress!r}", entry="compress")
    p = plan(tensors, metadata)
    buf = bytearray(p.nbytes)
    mv = memoryview(buf)
    p.write(mv)
    data = mv[p.data_offset : p.data_offset + p.raw_len]
    if compress == "always" or (compress == "auto" and p.raw_len and _sample_pays(data)):
        comp = lz4.frame.compress(data, block_size=lz4.frame.BLOCKSIZE_MAX4MB, store_size=True)
        if compress == "always" or len(comp) < _PAYS_RATIO * p.raw_len:
            head = HEADER.pack(MAGIC, FORMAT_VERSION, FLAG_LZ4, len(p._table), len(comp), p.raw_len)
            h = xxhash.xxh3_128(head)
            h.update(p._table)
            h.update(comp)
            return b"".join((head, p._table, comp, h.digest()))
    del data
    p.seal(mv)
    del mv
    return bytes(buf)


# ----------------------------------------------------------------------------- decode


def _bytes_view(blob: Any) -> memoryview:
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


def _parse_header(mv: memoryview) -> tuple[int, int, int, int]:
    """Check the header against the blob's length; return flags, table_len, data_len, raw_len."""
    n = len(mv)
    if n < HEADER.size + TRAILER_SIZE:
        raise CorruptObjectError(f"object of {n} bytes is shorter than header and trailer", size=n)
    magic, version, flags, table_len, data_len, raw_len = HEADER.unpack_from(mv, 0)
    if magic != MAGIC:
        raise CorruptObjectError(f"bad magic {bytes(magic)!r}, not a tierstore object", field="magic")
    if version != FORMAT_VERSION:
        raise CorruptObjectError(f"unknown format version {version}", field="version")
    if flags & ~_KNOWN_FLAGS:
        raise CorruptObjectError(f"unknown flags 0x{flags:04x}", field="flags")
    if table_len > MAX_TABLE_LEN or table_len % ALIGN:
        raise CorruptObjectError(f"table_len {table_len} is not a multiple of 64 within 16 MiB", field="table_len")
    expected = HEADER.size + table_len + data_len + TRAILER_SIZE
    if expected != n:
        raise CorruptObjectError(
            f"object is {n} bytes but its header describes {expected} (truncated or padded)", field="data_len"
        )
    if flags & FLAG_LZ4:
        if raw_len > _LZ4_MAX_RATIO * data_len + ALIGN:
            raise CorruptObjectError(f"raw_len {raw_len} impossible for {data_len} lz4 bytes", field="raw_len")
    elif raw_len != data_len:
        raise CorruptObjectError(f"raw_len {raw_len} != data_len {data_len} in an uncompressed object", field="raw_len")
    return flags, table_len, data_len, raw_len


def _verify_trailer(mv: memoryview) -> str:
    end = len(mv) - TRAILER_SIZE
    h = xxhash.xxh3_128(mv[:end])
    if h.digest() != mv[end:]:
        raise CorruptObjectError(
            f"checksum mismatch: stored {bytes(mv[end:]).hex()}, computed {h.hexdigest()}", field="checksum"
        )
    return h.hexdigest()


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _parse_table(raw: memoryview, raw_len: int) -> tuple[tuple[TensorInfo, ...], dict]:
    try:
        table = json.loads(bytes(raw).decode("utf-8"))
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
        if dtype not in _ITEMSIZE:
            raise CorruptObjectError(f"tensor {name!r}: unknown dtype {str(dtype)[:40]!r}", field="dtype", name=name)
        if (not isinstance(shape, list) or len(shape) > MAX_NDIM
                or not all(_is_int(d) and d >= 0 for d in shape)):
            raise CorruptObjectError(f"tensor {name!r}: bad shape {str(shape)[:80]}", field="shape", name=name)
        if not (_is_int(offset) and _is_int(nbytes) and offset >= 0 and offset % ALIGN == 0):
            raise CorruptObjectError(f"tensor {name!r}: bad offset/nbytes", field="offset", name=name)
        if math.prod(shape) * _ITEMSIZE[dtype] != nbytes:
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
    for info in sorted(infos, key=lambda i: i.offset):
        if info.nbytes and info.offset < end:
            raise CorruptObjectError(f"tensor {info.name!r} overlaps the tensor before it", field="offset",
                                     name=info.name)
        end = max(end, info.offset + info.nbytes)
    return tuple(infos), meta


def _open(blob: Any, verify: bool = True) -> tuple[memoryview, int, int, int, str, tuple[TensorInfo, ...], dict]:
    mv = _bytes_view(blob)
    flags, table_len, _data_len, raw_len = _parse_header(mv)
    digest = _verify_trailer(mv) if verify else bytes(mv[len(mv) - TRAILER_SIZE :]).hex()
    infos, meta = _parse_table(mv[HEADER.size : HEADER.size + table_len], raw_len)
    return mv, flags, table_len, raw_len, digest, infos, meta


def _torch_buffer(data: memoryview) -> Any:
    """``data`` as a buffer torch.frombuffer takes without warning, still without a copy.

    torch wants writable buffers; for a read-only one (``bytes``) this returns a
    ctypes array over the same memory that keeps ``data`` alive. The aliasing
    contract is on :func:`decode`.
    """
    if not data.readonly or len(data) == 0:
        return data
    addr = np.frombuffer(data, dtype=np.uint8).ctypes.data
    arr = (ctypes.c_ubyte * len(data)).from_address(addr)
    arr._tierstore_keepalive = data  # type: ignore[attr-defined]
    return arr


def _typed_view(buf: Any, dtype: torch.dtype, nbytes: int, offset: int) -> torch.Tensor:
    """A flat tensor of ``dtype`` over ``buf[offset:offset + nbytes]``, no copy.

    Made by ``frombuffer`` with the dtype itself: a ``uint8`` tensor ``.view(dtype)``-ed
    makes torch 2.13's multi-threaded ``copy_`` take a path ~100x slower (measured:
    0.05 GB/s against 17-24 GB/s on 2 threads), which would be the whole save stall.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    try:
        return torch.frombuffer(buf, dtype=dtype, count=nbytes // itemsize, offset=offset)
    except (TypeError, ValueError, RuntimeError):  # a dtype frombuffer does not take
        return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset).view(dtype)


def _alias(data: Any, e: TensorInfo) -> torch.Tensor:
    """A tensor of ``e``'s dtype and shape aliasing ``data`` (from :func:`_torch_buffer`), no copy."""
    dtype = DTYPES[e.dtype]
    if e.nbytes == 0:
        return torch.empty(e.shape, dtype=dtype)
    return _typed_view(data, dtype, e.nbytes, e.offset).view(e.shape)


def decode(
    blob: Any,
    *,
    out: Mapping[str, torch.Tensor] | None = None,
    copy: bool = True,
    strict: bool = True,
    verify: bool = True,
) -> Shard:
    """Verify and decode an object.

    The header, every length and the checksum over the whole object are checked
    before any tensor byte is read; the table's shapes, dtypes and offsets are
    bounded before anything is allocated.

    Args:
        blob: the encoded object (bytes, bytearray, memoryview, mmap, ...).
        out: preallocated restore targets. Every stored tensor named in ``out``
            is copied into it in place (any device, any strides) and returned
            as that same tensor; the others come back as new tensors. All
            shapes and dtypes are checked before anything is copied.
        copy: with ``False`` the returned new tensors alias the blob's memory
            (uncompressed objects) or the decompressed buffer, with no copy:
            they are valid only while ``blob`` is alive and unchanged, and
            writing to them writes into ``blob`` (even a ``bytes`` one).
        strict: with ``True`` a name in ``out`` that the object does not hold
            raises; with ``False`` it is left untouched.
        verify: with ``False`` the checksum pass is skipped (lengths and the
            table are still checked): only for a blob the caller has just
            passed through :func:`verify` and that cannot have changed since.

    Raises:
        CorruptObjectError: truncated, corrupted or foreign bytes; the message
            and ``field`` name what is wrong.
        RestoreMismatchError: an ``out`` tensor does not match (``name`` field).
    """
    mv, flags, table_len, raw_len, _digest, infos, meta = _open(blob, verify)
    targets = dict(out) if out is not None else {}
    by_name = {info.name: info for info in infos}
    for name, t in targets.items():
        stored = by_name.get(name)
        if stored is None:
            if strict:
                raise RestoreMismatchError(f"restore target {name!r} is not in the stored object", name=name)
            continue
        if not isinstance(t, torch.Tensor):
            raise RestoreMismatchError(f"restore target {name!r} is not a tensor", name=name)
        if t.dtype != DTYPES[stored.dtype] or tuple(t.shape) != stored.shape:
            raise RestoreMismatchError(
                f"tensor {name!r}: stored {stored.dtype}{list(stored.shape)}, target {t.dtype}{list(t.shape)}",
                name=name, stored_dtype=stored.dtype, stored_shape=stored.shape,
            )
    data = mv[HEADER.size + table_len : len(mv) - TRAILER_SIZE]
    if flags & FLAG_LZ4:
        try:
            # lz4 preallocates the frame's declared content size: check it first.
            declared = lz4.frame.get_frame_info(data)["content_size"]
            if declared != raw_len:
                raise CorruptObjectError(
                    f"lz4 frame declares {declared} bytes, header raw_len {raw_len}", field="raw_len"
                )
            raw = lz4.frame.decompress(data, return_bytearray=True)
        except RuntimeError as err:
            raise CorruptObjectError(f"lz4 data section does not decompress: {err}", field="data") from err
        if len(raw) != raw_len:
            raise CorruptObjectError(f"data section decompresses to {len(raw)} bytes, not {raw_len}", field="raw_len")
        data = memoryview(raw)
    tensors: dict[str, torch.Tensor] = {}
    tdata = _torch_buffer(data) if (targets or not copy) else None
    with torch.no_grad():
        for info in infos:
            target = targets.get(info.name)
            if target is not None:
                if info.nbytes:
                    target.copy_(_alias(tdata, info))
                tensors[info.name] = target
            elif not copy:
                tensors[info.name] = _alias(tdata, info)
            else:
                new = torch.empty(info.shape, dtype=DTYPES[info.dtype])
                if info.nbytes:
                    dst = new.reshape(-1).view(torch.uint8).numpy()
                    dst[:] = np.frombuffer(data, dtype=np.uint8, count=info.nbytes, offset=info.offset)
                tensors[info.name] = new
    return Shard(tensors=tensors, metadata=meta)


def inspect(blob: Any, *, verify: bool = True) -> BlobInfo:
    """Verify ``blob`` (header, checksum, table) and describe it without decoding data.

    ``verify=False`` skips the checksum pass (see :func:`decode`).
    """
    mv, flags, table_len, raw_len, digest, infos, meta = _open(blob, verify)
    return BlobInfo(
        version=FORMAT_VERSION, flags=flags, compressed=bool(flags & FLAG_LZ4), table_len=table_len,
        data_len=len(mv) - HEADER.size - table_len - TRAILER_SIZE, raw_len=raw_len, nbytes=len(mv),
        checksum=digest, metadata=meta, tensors=infos,
    )


def checksum(blob: Any) -> str:
    """Return the stored trailer checksum (hex) after checking the header only (cheap)."""
    mv = _bytes_view(blob)
    _parse_header(mv)
    return bytes(mv[len(mv) - TRAILER_SIZE :]).hex()


def verify(blob: Any) -> str:
    """Fully verify ``blob`` (header, checksum, table bounds); return its checksum hex."""
    return _open(blob)[4]
