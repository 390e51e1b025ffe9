"""The tierstore object codec: a safe, self-describing wire format for one shard.

Layout of one encoded object (all integers little-endian)::

    header   64 bytes   HEADER: magic b"TSOB", version u16, flags u16,
                        table_len u32, data_len u64, raw_len u64, zero padding
    table    table_len  JSON (utf-8, ASCII-escaped), space-padded to 64 bytes:
                        {"tensors": [{"name", "dtype", "shape", "offset",
                        "nbytes"}, ...], "meta": {...}}
    data     data_len   every tensor's raw bytes at its ``offset`` (a multiple
                        of 64) inside the uncompressed data section of
                        ``raw_len`` bytes; compressed when a flag says so:
                        bit0 an lz4 frame, bit1 a zstd frame (at most one;
                        :mod:`tierstore.compression`)
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

Reading an uncompressed object into tensors takes one pass: the object is
hashed in 1 MiB chunks and each chunk is copied to its tensors while it is
still in the cache (see :func:`decode`); the checksum is known to match only
at the end, so a corrupt object raises after some bytes were copied.
"""

from tierstore.codec.compression import FLAG_LZ4, FLAG_ZSTD
from tierstore.codec.format import (
    ALIGN,
    DTYPES,
    FORMAT_VERSION,
    HEADER,
    ITEMSIZE,
    MAGIC,
    TRAILER_SIZE,
    BlobInfo,
    Shard,
    TensorInfo,
    compute_checksum,
)
from tierstore.codec.read import (
    EncodedObject,
    checksum,
    decode,
    inspect,
    open_object,
    verify,
)
from tierstore.codec.write import EncodePlan, encode, plan

__all__ = [
    "ALIGN",
    "DTYPES",
    "FLAG_LZ4",
    "FLAG_ZSTD",
    "FORMAT_VERSION",
    "HEADER",
    "ITEMSIZE",
    "MAGIC",
    "TRAILER_SIZE",
    "BlobInfo",
    "EncodePlan",
    "EncodedObject",
    "Shard",
    "TensorInfo",
    "checksum",
    "compute_checksum",
    "decode",
    "encode",
    "inspect",
    "open_object",
    "plan",
    "verify",
]
