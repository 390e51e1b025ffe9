"""The object format's constants and record types (the layout is described in :mod:`tierstore.codec`)."""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import xxhash

from tierstore.codec.compression import FLAGS
from tierstore.lazytorch import LazyMapping

if TYPE_CHECKING:
    import torch
else:  # torch is imported on first use: verifying, inspecting and checksumming objects need no torch
    from tierstore.lazytorch import torch

__all__ = [
    "ALIGN",
    "CHUNK",
    "CHUNK_SIZE",
    "DTYPES",
    "FORMAT_VERSION",
    "HEADER",
    "HEADER2",
    "ITEMSIZE",
    "MAGIC",
    "MAX_METADATA_LEN",
    "MAX_NAME_LEN",
    "MAX_NDIM",
    "MAX_TABLE_LEN",
    "TRAILER_SIZE",
    "VERSIONS",
    "BlobInfo",
    "Shard",
    "TensorInfo",
    "compute_checksum",
    "geometry_views",
    "typed_view",
]

# Version 1: magic, version, flags, table_len, data_len, raw_len, reserved (zero) to 64 bytes. Its first 28
# bytes are every version's: a reader unpacks them with HEADER to learn the version.
HEADER = struct.Struct("<4sHHIQQ36x")
# Version 2 adds chunk_size (bytes, a power of two) and n_chunks: the data section in chunks, each with its digest.
HEADER2 = struct.Struct("<4sHHIQQII28x")
# One row of a version 2 chunk table: xxh3-128 of the chunk's stored bytes, their length, their codec (0: raw).
CHUNK = struct.Struct("<16sII")
MAGIC = b"TSOB"
FORMAT_VERSION = 2
VERSIONS = (1, 2)
TRAILER_SIZE = 16
ALIGN = 64
KNOWN_FLAGS = FLAGS

CHUNK_SIZE = 128 << 10  # what the writer cuts the data section into (a range read reads whole chunks)
MIN_CHUNK_READ = 1 << 12  # what a reader accepts (a hostile header is bounded by these)
MAX_CHUNK_READ = 1 << 24

MAX_TABLE_LEN = 16 << 20
MAX_METADATA_LEN = 1 << 20
MAX_NAME_LEN = 1024
MAX_NDIM = 64
assert HEADER.size == HEADER2.size == 64 and CHUNK.size == 24


def chunk_size_for(raw_len: int) -> int:
    """The chunk size the writer gives an object of ``raw_len`` data bytes: :data:`CHUNK_SIZE`.

    128 KiB: small enough that a range read rounds out by little, large enough that hashing chunk by
    chunk costs what one hash over the object does (measured: ``bench/bench_codec.py``).
    """
    return CHUNK_SIZE


def n_chunks(raw_len: int, chunk_size: int) -> int:
    return -(-raw_len // chunk_size)


def chunk_table_len(n: int) -> int:
    """Bytes of a chunk table of ``n`` rows (padded to 64)."""
    return align(n * CHUNK.size)


# The supported dtype names and their sizes in bytes, known without torch (reading a table needs no torch).
ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "uint16": 2, "uint32": 4, "uint64": 8,
}


def _build_dtypes() -> dict[str, torch.dtype]:
    return {n: getattr(torch, n) for n in ITEMSIZE if isinstance(getattr(torch, n, None), torch.dtype)}


DTYPES: Mapping[str, torch.dtype] = LazyMapping(_build_dtypes)
"""Supported dtype names and their torch dtypes (those this torch build has), built on first use."""
DTYPE_NAMES: Mapping[torch.dtype, str] = LazyMapping(lambda: {v: k for k, v in DTYPES.items()})


class Shard(Mapping[str, "torch.Tensor"]):
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
            dtype = DTYPE_NAMES.get(t.dtype, str(t.dtype).removeprefix("torch."))
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
    chunk_size: int = 0  # version 2: bytes per chunk of the data section (0 in version 1)
    n_chunks: int = 0


def align(n: int) -> int:
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




def geometry_views(buf: Any, geometry: Any) -> list[torch.Tensor | None]:
    """Typed tensors over ``buf`` for a geometry (``(start, nbytes, dtype name, shape)`` per tensor, in table
    order: where an object's tensors lie in it), ``None`` for an empty tensor; no copy."""
    return [typed_view(buf, DTYPES[dtype], nbytes, start).view(shape) if nbytes else None
            for start, nbytes, dtype, shape in geometry]


def typed_view(buf: Any, dtype: torch.dtype, nbytes: int, offset: int) -> torch.Tensor:
    """A flat tensor of ``dtype`` over ``buf[offset:offset + nbytes]``, no copy.

    Made by ``frombuffer`` with the dtype itself: a ``uint8`` tensor ``.view(dtype)``-ed
    makes torch 2.13's multi-threaded ``copy_`` take a path ~100x slower (measured:
    0.05 GB/s against 17-24 GB/s on 2 threads), which would be the whole save stall.
    """
    itemsize = dtype.itemsize
    try:
        return torch.frombuffer(buf, dtype=dtype, count=nbytes // itemsize, offset=offset)
    except (TypeError, ValueError, RuntimeError):  # a dtype frombuffer does not take
        return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset).view(dtype)
