"""The tierstore object codec: a safe, self-describing wire format for one shard.

Layout of one encoded object, format version 2 (all integers little-endian)::

    header   64 bytes   HEADER2: magic b"TSOB", version u16 (2), flags u16,
                        table_len u32, data_len u64, raw_len u64,
                        chunk_size u32, n_chunks u32, zero padding
    table    table_len  JSON (utf-8, ASCII-escaped), space-padded to 64 bytes:
                        {"tensors": [{"name", "dtype", "shape", "offset",
                        "nbytes"}, ...], "meta": {...}}
    chunks   24 x n_chunks, zero-padded to 64 bytes: per chunk of the data
                        section, CHUNK: xxh3-128 of its stored bytes, their
                        length u32, their codec u32 (0 raw, else the header's)
    data     data_len   every tensor's raw bytes at its ``offset`` (a multiple
                        of 64) inside the uncompressed data section of
                        ``raw_len`` bytes, cut into chunks of ``chunk_size``
                        uncompressed bytes (a power of two; the writer takes
                        128 KiB), stored one after the other; with a flag (bit0 lz4,
                        bit1 zstd, at most one: :mod:`tierstore.codec.compression`)
                        each chunk is one frame of that codec where it is smaller
    trailer  16 bytes   xxh3-128 of header, table and chunk table

The trailer vouches for the tables and each chunk's digest for its bytes, so
any byte range is verified without the rest of the object
(:mod:`tierstore.codec.ranged`), and a whole object in one pass of the same
cost as one hash over it. Version 1 (still read, never written): the same
header without the chunk fields (HEADER), no chunk table, the data section
raw or one lz4/zstd frame, and a trailer over everything before it.

No pickle anywhere: a reader trusts nothing until the checksums matched, and
even then bounds every length and offset before it allocates or copies (the
checksum detects corruption, not malice).

Protocol of a save (the trainer waits only for step 2)::

    p = plan(tensors, metadata)     # validate, lay out; keeps tensor references
    p.write(buf)                    # one copy_ per tensor into buf[:p.nbytes]
    digest = p.seal(buf)            # xxh3-128 trailer, off the training path

A plan may be written many times (its tensors are read at ``write`` time), so
a trainer plans once and writes every step into a reused staging buffer.
:func:`encode` is the convenience that plans, writes, seals and compresses
where it pays; :func:`decode` is its inverse.

Reading an uncompressed object into tensors takes one pass: each chunk is
hashed and then copied to its tensors while it is still in the cache (see
:func:`decode`), so a corrupt object raises after some bytes were copied.
Reading byte ranges: :class:`RangedObject`.
"""

from tierstore.codec.compression import FLAG_LZ4, FLAG_ZSTD
from tierstore.codec.format import (
    ALIGN,
    CHUNK,
    CHUNK_SIZE,
    DTYPES,
    FORMAT_VERSION,
    HEADER,
    HEADER2,
    ITEMSIZE,
    MAGIC,
    TRAILER_SIZE,
    VERSIONS,
    BlobInfo,
    Shard,
    TensorInfo,
    compute_checksum,
    geometry_views,
)
from tierstore.codec.ranged import RangedObject, box_runs
from tierstore.codec.read import (
    EncodedObject,
    checksum,
    decode,
    inspect,
    open_object,
    verify,
)
from tierstore.codec.write import EncodePlan, encode, plan, reseal

__all__ = [
    "ALIGN",
    "CHUNK",
    "CHUNK_SIZE",
    "DTYPES",
    "FLAG_LZ4",
    "FLAG_ZSTD",
    "FORMAT_VERSION",
    "HEADER",
    "HEADER2",
    "ITEMSIZE",
    "MAGIC",
    "TRAILER_SIZE",
    "VERSIONS",
    "BlobInfo",
    "EncodePlan",
    "EncodedObject",
    "RangedObject",
    "Shard",
    "TensorInfo",
    "box_runs",
    "checksum",
    "compute_checksum",
    "decode",
    "encode",
    "geometry_views",
    "inspect",
    "open_object",
    "plan",
    "reseal",
    "verify",
]
