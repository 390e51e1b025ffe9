"""Reading objects: :func:`decode` (one pass: verify and copy), :func:`inspect`, :func:`checksum`, :func:`verify`."""

from __future__ import annotations

import ctypes
import json
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from tierstore.codec.compression import FLAG_LZ4, FLAG_ZSTD, FLAGS
from tierstore.codec.compression import check_frame as _check_frame
from tierstore.codec.compression import decompress as _decompress
from tierstore.codec.compression import max_raw_len as _max_raw_len
from tierstore.codec.format import (
    ALIGN,
    DTYPES,
    FORMAT_VERSION,
    HEADER,
    ITEMSIZE,
    KNOWN_FLAGS,
    MAGIC,
    MAX_NAME_LEN,
    MAX_NDIM,
    MAX_TABLE_LEN,
    TRAILER_SIZE,
    BlobInfo,
    Shard,
    TensorInfo,
    align,
    typed_view,
)
from tierstore.errors import CorruptObjectError, InvalidValueError, RestoreMismatchError

if TYPE_CHECKING:
    import torch
else:  # torch is imported on first use (see tierstore.lazytorch)
    from tierstore.lazytorch import torch

__all__ = ["EncodedObject", "checksum", "decode", "inspect", "open_object", "verify"]

_CHUNK = 1 << 20  # verify-and-copy granularity: hashed, then copied while in the cache


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
    if flags & ~KNOWN_FLAGS or flags == FLAG_LZ4 | FLAG_ZSTD:
        raise CorruptObjectError(f"unknown flags 0x{flags:04x}", field="flags")
    if table_len > MAX_TABLE_LEN or table_len % ALIGN:
        raise CorruptObjectError(f"table_len {table_len} is not a multiple of 64 within 16 MiB", field="table_len")
    expected = HEADER.size + table_len + data_len + TRAILER_SIZE
    if expected != n:
        raise CorruptObjectError(
            f"object is {n} bytes but its header describes {expected} (truncated or padded)", field="data_len"
        )
    if flags:
        if raw_len > _max_raw_len(flags, data_len):
            raise CorruptObjectError(f"raw_len {raw_len} impossible for {data_len} compressed bytes", field="raw_len")
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


def _alias(data: Any, e: TensorInfo) -> torch.Tensor:
    """A tensor of ``e``'s dtype and shape aliasing ``data`` (from :func:`_torch_buffer`), no copy."""
    dtype = DTYPES[e.dtype]
    if e.nbytes == 0:
        return torch.empty(e.shape, dtype=dtype)
    return typed_view(data, dtype, e.nbytes, e.offset).view(e.shape)


def _byte_view(t: torch.Tensor) -> Any:
    """A writable byte buffer over ``t``'s memory if it is a plain contiguous CPU tensor, else ``None``.

    Valid while ``t`` is alive (the caller holds it).
    """
    if t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg() or t.numel() == 0:
        return None
    return memoryview((ctypes.c_ubyte * (t.numel() * t.element_size())).from_address(t.data_ptr())).cast("B")


def _verify_and_copy(
    mv: memoryview, data_start: int, infos: tuple[TensorInfo, ...], dests: dict[str, torch.Tensor]
) -> list[TensorInfo]:
    """Hash ``mv`` in chunks and copy each chunk into the byte views of ``dests`` while it is hot.

    Returns the entries whose destination has no byte view (device, strided):
    the caller copies those once the checksum matched.

    Raises:
        CorruptObjectError: the trailer does not match (after the copies).
    """
    end = len(mv) - TRAILER_SIZE
    pieces: list[tuple[int, int, memoryview]] = []  # (start, end) in mv, destination bytes
    later: list[TensorInfo] = []
    for e in sorted(infos, key=lambda e: e.offset):
        if not e.nbytes or e.name not in dests:
            continue
        view = _byte_view(dests[e.name])
        if view is None:
            later.append(e)
        else:
            pieces.append((data_start + e.offset, data_start + e.offset + e.nbytes, view))
    h = xxhash.xxh3_128(mv[:data_start])
    i = 0
    for pos in range(data_start, end, _CHUNK):
        stop = min(pos + _CHUNK, end)
        h.update(mv[pos:stop])
        while i < len(pieces) and pieces[i][0] < stop:  # copy what of this chunk belongs to a tensor
            start, last, view = pieces[i]
            a, b = max(start, pos), min(last, stop)
            view[a - start : b - start] = mv[a:b]
            if last > stop:
                break
            i += 1
    if h.digest() != mv[end:]:
        raise CorruptObjectError(
            f"checksum mismatch: stored {bytes(mv[end:]).hex()}, computed {h.hexdigest()}", field="checksum"
        )
    return later


class EncodedObject:
    """An object opened for reading: header and table parsed and bounded, the checksum not yet verified.

    Protocol: ``obj = open_object(blob)``; read ``obj.metadata``, ``obj.tensors``
    or ``obj.stored_checksum`` (unverified); then ``obj.decode(...)``, which
    verifies (see :func:`decode`). ``blob`` must stay alive and unchanged
    meanwhile.
    """

    def __init__(self, blob: Any) -> None:
        self._mv = _bytes_view(blob)
        self.flags, self.table_len, _data_len, self.raw_len = _parse_header(self._mv)
        self.tensors, self.metadata = _parse_table(self._mv[HEADER.size : HEADER.size + self.table_len],
                                                   self.raw_len)

    @property
    def stored_checksum(self) -> str:
        """The trailer, as 32 hex chars (not verified)."""
        return bytes(self._mv[len(self._mv) - TRAILER_SIZE :]).hex()

    def decode(
        self,
        *,
        out: Mapping[str, torch.Tensor] | None = None,
        copy: bool = True,
        strict: bool = True,
        verify: bool = True,
    ) -> Shard:
        """Verify and decode the object; see :func:`decode`."""
        mv, flags, table_len, raw_len = self._mv, self.flags, self.table_len, self.raw_len
        infos, meta = self.tensors, self.metadata
        one_pass = verify and copy and not flags
        if verify and not one_pass:
            _verify_trailer(mv)
        targets = dict(out) if out is not None else {}
        by_name = {e.name: e for e in infos}
        for name, t in targets.items():
            e = by_name.get(name)
            if e is None:
                if strict:
                    raise RestoreMismatchError(f"restore target {name!r} is not in the stored object", name=name)
                continue
            if not isinstance(t, torch.Tensor):
                raise RestoreMismatchError(f"restore target {name!r} is not a tensor", name=name)
            if t.dtype != DTYPES[e.dtype] or tuple(t.shape) != e.shape:
                raise RestoreMismatchError(
                    f"tensor {name!r}: stored {e.dtype}{list(e.shape)}, target {t.dtype}{list(t.shape)}",
                    name=name, stored_dtype=e.dtype, stored_shape=e.shape,
                )
        data_start = HEADER.size + table_len
        data = mv[data_start : len(mv) - TRAILER_SIZE]
        tensors: dict[str, torch.Tensor] = {}
        if one_pass:
            dests = {e.name: targets[e.name] if e.name in targets else torch.empty(e.shape, dtype=DTYPES[e.dtype])
                     for e in infos}
            with torch.no_grad():
                later = _verify_and_copy(mv, data_start, infos, dests)
                if later:
                    tdata = _torch_buffer(data)
                    for e in later:
                        dests[e.name].copy_(_alias(tdata, e))
            return Shard(tensors={e.name: dests[e.name] for e in infos}, metadata=meta)
        if flags:
            # the layout the encoder writes: the data section ends with the last tensor (aligned), so the
            # decompressed size is what the table's tensors need, checked before anything is allocated
            _check_frame(flags, data, raw_len)
            needed = align(max((e.offset + e.nbytes for e in infos), default=0))
            if raw_len != needed:
                raise CorruptObjectError(f"raw_len {raw_len} is not the {needed} bytes the table's tensors span",
                                         field="raw_len")
            data = memoryview(_decompress(flags, data, raw_len))
        tdata = _torch_buffer(data) if (targets or not copy) else None
        with torch.no_grad():
            for e in infos:
                target = targets.get(e.name)
                if target is not None:
                    if e.nbytes:
                        target.copy_(_alias(tdata, e))
                    tensors[e.name] = target
                elif not copy:
                    tensors[e.name] = _alias(tdata, e)
                else:
                    new = torch.empty(e.shape, dtype=DTYPES[e.dtype])
                    if e.nbytes:
                        dst = new.reshape(-1).view(torch.uint8).numpy()
                        dst[:] = np.frombuffer(data, dtype=np.uint8, count=e.nbytes, offset=e.offset)
                    tensors[e.name] = new
        return Shard(tensors=tensors, metadata=meta)


def open_object(blob: Any) -> EncodedObject:
    """Parse and bound ``blob``'s header and table (no checksum pass); see :class:`EncodedObject`.

    Raises:
        CorruptObjectError: a malformed header or table.
    """
    return EncodedObject(blob)


def decode(
    blob: Any,
    *,
    out: Mapping[str, torch.Tensor] | None = None,
    copy: bool = True,
    strict: bool = True,
    verify: bool = True,
) -> Shard:
    """Verify and decode an object.

    The header, every length and the table's shapes, dtypes and offsets are
    checked before anything is allocated or copied. The checksum covers the
    whole object: for a compressed object, or with ``copy=False``, it is
    checked before any tensor byte is read; for an uncompressed object read
    with copies (into ``out`` or new tensors) it is computed in the same pass
    as the copies (1 MiB chunks, each hashed and then copied while in the
    cache), so it is checked when the copies are done.

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
            and ``field`` name what is wrong. When it is raised by the
            checksum of a one-pass read, the tensors of ``out`` may already
            hold some of the object's (corrupt) bytes: they are not to be
            trusted, and the caller must overwrite them (the store reads the
            next tier's copy into them) or fail.
        RestoreMismatchError: an ``out`` tensor does not match (``name`` field);
            nothing was copied.
    """
    return EncodedObject(blob).decode(out=out, copy=copy, strict=strict, verify=verify)


def inspect(blob: Any, *, verify: bool = True) -> BlobInfo:
    """Verify ``blob`` (header, checksum, table) and describe it without decoding data.

    ``verify=False`` skips the checksum pass (see :func:`decode`).
    """
    obj = EncodedObject(blob)
    mv = obj._mv
    digest = _verify_trailer(mv) if verify else obj.stored_checksum
    return BlobInfo(
        version=FORMAT_VERSION, flags=obj.flags, compressed=bool(obj.flags & FLAGS), table_len=obj.table_len,
        data_len=len(mv) - HEADER.size - obj.table_len - TRAILER_SIZE, raw_len=obj.raw_len, nbytes=len(mv),
        checksum=digest, metadata=obj.metadata, tensors=obj.tensors,
    )


def checksum(blob: Any) -> str:
    """Return the stored trailer checksum (hex) after checking the header only (cheap)."""
    mv = _bytes_view(blob)
    _parse_header(mv)
    return bytes(mv[len(mv) - TRAILER_SIZE :]).hex()


def verify(blob: Any) -> str:
    """Fully verify ``blob`` (header, checksum, table bounds); return its checksum hex."""
    mv = _bytes_view(blob)
    _flags, table_len, _data_len, raw_len = _parse_header(mv)
    digest = _verify_trailer(mv)
    _parse_table(mv[HEADER.size : HEADER.size + table_len], raw_len)
    return digest
