"""Reading objects: :func:`decode` (one pass: verify and copy), :func:`inspect`, :func:`checksum`, :func:`verify`."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from tierstore.codec.chunks import Chunks
from tierstore.codec.compression import FLAGS
from tierstore.codec.compression import check_frame as _check_frame
from tierstore.codec.compression import decompress as _decompress
from tierstore.codec.format import (
    DTYPES,
    HEADER,
    TRAILER_SIZE,
    BlobInfo,
    Shard,
    TensorInfo,
    align,
    typed_view,
)
from tierstore.codec.head import Head, bytes_view, parse_chunks, parse_head, parse_table, verify_head
from tierstore.errors import CorruptObjectError, RestoreMismatchError

if TYPE_CHECKING:
    import torch
else:  # torch is imported on first use (see tierstore.lazytorch)
    from tierstore.lazytorch import torch

__all__ = ["EncodedObject", "checksum", "decode", "inspect", "open_object", "verify"]

_CHUNK = 1 << 20  # verify-and-copy granularity: hashed (version 2: chunk by chunk), then copied while in the cache


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


def _v1_spans(mv: memoryview, h: Head) -> Iterator[tuple[int, int]]:
    """Version 1: yield 1 MiB ``(start, stop)`` spans of the data section as one running hash takes them in;
    the trailer is compared after the last span.

    Raises:
        CorruptObjectError: a mismatch (after every span was yielded).
    """
    start, end = h.data_start, h.data_end
    digest = xxhash.xxh3_128(mv[:start])
    for pos in range(start, end, _CHUNK):
        stop = min(pos + _CHUNK, end)
        digest.update(mv[pos:stop])
        yield pos, stop
    if digest.digest() != mv[end:]:
        raise CorruptObjectError(
            f"checksum mismatch: stored {bytes(mv[end:]).hex()}, computed {digest.hexdigest()}", field="checksum"
        )


def _verify_all(mv: memoryview, h: Head, chunks: Chunks | None) -> str:
    """Verify the whole object; return its checksum (the trailer) as hex."""
    if chunks is None:
        for _span in _v1_spans(mv, h):
            pass
    else:
        verify_head(h, mv[: h.data_start], mv[h.data_end :])
        chunks.verify(mv[h.data_start : h.data_end])
    return bytes(mv[h.data_end:]).hex()


def _verify_and_copy(
    mv: memoryview, h: Head, chunks: Chunks | None, infos: tuple[TensorInfo, ...], dests: dict[str, torch.Tensor]
) -> list[TensorInfo]:
    """Verify ``mv`` span by span and copy each verified span into the byte views of ``dests`` while it is hot.

    Returns the entries whose destination has no byte view (device, strided):
    the caller copies those once the checksum matched.

    Raises:
        CorruptObjectError: a span does not match (version 1: after the copies).
    """
    data_start = h.data_start
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
    i, n = 0, len(pieces)
    spans = _v1_spans(mv, h) if chunks is None else _chunk_spans(mv, h, chunks)
    for pos, stop in spans:
        while i < n and pieces[i][0] < stop:  # copy what of this span belongs to a tensor
            start, last, view = pieces[i]
            a, b = max(start, pos), min(last, stop)
            view[a - start : b - start] = mv[a:b]
            if last > stop:
                break
            i += 1
    return later


def _chunk_spans(mv: memoryview, h: Head, chunks: Chunks) -> Iterator[tuple[int, int]]:
    """Version 2's spans for :func:`_verify_and_copy`: the trailer first, then about 1 MiB of chunks at a time,
    once each of them verified (still in the cache for the copy; as few copy steps as version 1's)."""
    start = h.data_start
    verify_head(h, mv[:start], mv[h.data_end :])
    digest, digests, starts, count = xxhash.xxh3_128_digest, chunks.digests, chunks.starts, chunks.count
    group = max(1, _CHUNK // chunks.size)
    for first in range(0, count, group):
        last = min(first + group, count)
        for i in range(first, last):
            if digest(mv[start + starts[i] : start + starts[i + 1]]) != digests[i]:
                raise chunks.mismatch(i)
        yield start + starts[first], start + starts[last]


def _unpack_chunks(chunks: Chunks, data: memoryview) -> bytearray:
    """The uncompressed data section of a compressed version 2 object, chunk by chunk."""
    raw = bytearray(chunks.raw_len)
    for i in range(chunks.count):
        piece = chunks.unpack(i, data[chunks.starts[i] : chunks.starts[i + 1]])
        raw[i * chunks.size : i * chunks.size + len(piece)] = piece
    return raw


class EncodedObject:
    """An object opened for reading: header and tables parsed and bounded, the checksum not yet verified.

    Protocol: ``obj = open_object(blob)``; read ``obj.metadata``, ``obj.tensors``
    or ``obj.stored_checksum`` (unverified); then ``obj.decode(...)``, which
    verifies (see :func:`decode`). ``blob`` must stay alive and unchanged
    meanwhile. Objects of format versions 1 and 2 are read.
    """

    def __init__(self, blob: Any) -> None:
        self._mv = bytes_view(blob)
        self.head = parse_head(self._mv[: HEADER.size], len(self._mv))
        self.flags, self.table_len, self.raw_len = self.head.flags, self.head.table_len, self.head.raw_len
        self.tensors, self.metadata = parse_table(self._mv[HEADER.size : HEADER.size + self.table_len],
                                                  self.raw_len)
        self.chunks = parse_chunks(self.head, self._mv[self.head.chunks_at : self.head.data_start])

    @property
    def geometry(self) -> tuple[tuple[int, int, str, tuple[int, ...]], ...]:
        """Where the tensors lie in the blob, ``(start, nbytes, dtype, shape)`` each, in table order (the
        writer's :attr:`tierstore.codec.EncodePlan.geometry` of the same layout); for an uncompressed object."""
        start = self.head.data_start
        return tuple((start + e.offset, e.nbytes, e.dtype, e.shape) for e in self.tensors)

    @property
    def stored_checksum(self) -> str:
        """The trailer, as 32 hex chars (not verified)."""
        return bytes(self._mv[len(self._mv) - TRAILER_SIZE :]).hex()

    def verify(self) -> str:
        """Verify the whole object; return its checksum (hex)."""
        return _verify_all(self._mv, self.head, self.chunks)

    def decode(
        self,
        *,
        out: Mapping[str, torch.Tensor] | None = None,
        copy: bool = True,
        strict: bool = True,
        verify: bool = True,
        sources: list[torch.Tensor | None] | None = None,
    ) -> Shard:
        """Verify and decode the object; see :func:`decode`.

        ``sources``: typed views over the blob's memory at :attr:`geometry` (a tier's kept ones), read instead
        of views made here; for an uncompressed object only, the caller keeping the blob alive and unchanged.
        """
        mv, flags, raw_len, h = self._mv, self.flags, self.raw_len, self.head
        infos, meta = self.tensors, self.metadata
        one_pass = verify and copy and not flags
        if verify and not one_pass:
            _verify_all(mv, h, self.chunks)
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
        data = mv[h.data_start : h.data_end]
        tensors: dict[str, torch.Tensor] = {}
        if one_pass:
            dests = {e.name: targets[e.name] if e.name in targets else torch.empty(e.shape, dtype=DTYPES[e.dtype])
                     for e in infos}
            with torch.no_grad():
                later = _verify_and_copy(mv, h, self.chunks, infos, dests)
                if later:
                    tdata = _torch_buffer(data)
                    for e in later:
                        dests[e.name].copy_(_alias(tdata, e))
            return Shard(tensors={e.name: dests[e.name] for e in infos}, metadata=meta)
        if flags:
            # the layout the encoder writes: the data section ends with the last tensor (aligned), so the
            # decompressed size is what the table's tensors need, checked before anything is allocated
            if self.chunks is None:
                _check_frame(flags, data, raw_len)
            needed = align(max((e.offset + e.nbytes for e in infos), default=0))
            if raw_len != needed:
                raise CorruptObjectError(f"raw_len {raw_len} is not the {needed} bytes the table's tensors span",
                                         field="raw_len")
            data = memoryview(_decompress(flags, data, raw_len) if self.chunks is None
                              else _unpack_chunks(self.chunks, data))
        if sources is not None and (flags or len(sources) != len(infos)):
            sources = None  # not this object's layout: views are made here
        tdata = _torch_buffer(data) if ((targets and sources is None) or not copy) else None
        with torch.no_grad():
            for i, e in enumerate(infos):
                target = targets.get(e.name)
                if target is not None:
                    if e.nbytes:
                        src = sources[i] if sources is not None else None
                        target.copy_(src if src is not None else _alias(tdata, e))
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
    """Parse and bound ``blob``'s header and tables (no checksum pass); see :class:`EncodedObject`.

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
    """Verify and decode an object (format version 1 or 2).

    The header, every length and the table's shapes, dtypes and offsets are
    checked before anything is allocated or copied. The checksum covers the
    whole object: for a compressed object, or with ``copy=False``, it is
    checked before any tensor byte is read; for an uncompressed object read
    with copies (into ``out`` or new tensors) it is computed in the same pass
    as the copies (chunk by chunk, each hashed and then copied while in the
    cache), so a bad chunk raises when some copies are done.

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
    h = obj.head
    digest = obj.verify() if verify else obj.stored_checksum
    return BlobInfo(
        version=h.version, flags=obj.flags, compressed=bool(obj.flags & FLAGS), table_len=obj.table_len,
        data_len=h.data_len, raw_len=obj.raw_len, nbytes=h.size, checksum=digest, metadata=obj.metadata,
        tensors=obj.tensors, chunk_size=h.chunk_size, n_chunks=h.n_chunks,
    )


def checksum(blob: Any) -> str:
    """Return the stored trailer checksum (hex) after checking the header only (cheap)."""
    mv = bytes_view(blob)
    parse_head(mv[: HEADER.size], len(mv))
    return bytes(mv[len(mv) - TRAILER_SIZE :]).hex()


def verify(blob: Any) -> str:
    """Fully verify ``blob`` (header, checksum, tables' bounds); return its checksum hex."""
    mv = bytes_view(blob)
    h = parse_head(mv[: HEADER.size], len(mv))
    chunks = parse_chunks(h, mv[h.chunks_at : h.data_start])
    digest = _verify_all(mv, h, chunks)
    parse_table(mv[HEADER.size : HEADER.size + h.table_len], h.raw_len)
    return digest
