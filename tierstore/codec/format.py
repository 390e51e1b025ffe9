"""The object format's constants and record types (the layout is described in :mod:`tierstore.codec`)."""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from tierstore.codec.compression import FLAGS

__all__ = [
    "ALIGN",
    "DTYPES",
    "FORMAT_VERSION",
    "HEADER",
    "MAGIC",
    "MAX_METADATA_LEN",
    "MAX_NAME_LEN",
    "MAX_NDIM",
    "MAX_TABLE_LEN",
    "TRAILER_SIZE",
    "BlobInfo",
    "Shard",
    "TensorInfo",
    "compute_checksum",
]

# magic, version, flags, table_len, data_len, raw_len, reserved (zero) to 64 bytes.
HEADER = struct.Struct("<4sHHIQQ36x")
MAGIC = b"TSOB"
FORMAT_VERSION = 1
TRAILER_SIZE = 16
ALIGN = 64
KNOWN_FLAGS = FLAGS

MAX_TABLE_LEN = 16 << 20
MAX_METADATA_LEN = 1 << 20
MAX_NAME_LEN = 1024
MAX_NDIM = 64
assert HEADER.size == 64


def _build_dtypes() -> dict[str, torch.dtype]:
    names = [
        "float64", "float32", "float16", "bfloat16",
        "int64", "int32", "int16", "int8", "uint8", "bool", "complex64",
        "float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64",
    ]
    return {n: getattr(torch, n) for n in names if isinstance(getattr(torch, n, None), torch.dtype)}


DTYPES: dict[str, torch.dtype] = _build_dtypes()
"""Supported dtype names and their torch dtypes (those this torch build has)."""
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

@dataclass
class Shard:
    """A decoded object: named tensors plus the JSON metadata stored beside them."""

    tensors: dict[str, torch.Tensor]
    metadata: dict


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
