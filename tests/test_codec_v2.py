"""Format version 2 of the codec: chunk digests, per-chunk compression, ranged reads, and version 1 still read."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import xxhash

from tierstore import codec
from tierstore.codec import CHUNK, HEADER2, TRAILER_SIZE, RangedObject, box_runs
from tierstore.errors import CorruptObjectError, InvalidValueError

# Encoded by the version 1 codec (before chunks, commit 24da0bc): {"w": arange(12, float32).reshape(3, 4),
# "i": arange(5, int64)}, metadata {"step": 3}, uncompressed; and {"z": zeros(4096, int16)}, {"k": "v"}, zstd.
V1_RAW = bytes.fromhex(
    "54534f4201000000c000000080000000000000008000000000000000000000000000000000000000000000000000000000000000"
    "0000000000000000000000007b2274656e736f7273223a5b7b226e616d65223a2277222c226474797065223a22666c6f61743332"
    "222c227368617065223a5b332c345d2c226f6666736574223a302c226e6279746573223a34387d2c7b226e616d65223a2269222c"
    "226474797065223a22696e743634222c227368617065223a5b355d2c226f6666736574223a36342c226e6279746573223a34307d"
    "5d2c226d657461223a7b2273746570223a20337d7d20202020202020202020202020202020202020202020202020202000000000"
    "0000803f0000004000004040000080400000a0400000c0400000e040000000410000104100002041000030410000000000000000"
    "00000000000000000000000000000000010000000000000002000000000000000300000000000000040000000000000000000000"
    "000000000000000000000000000000000000000033b31f842bb2a2f7bf43691ef34d1e4c"
)
V1_ZSTD = bytes.fromhex(
    "54534f42010002008000000013000000000000000020000000000000000000000000000000000000000000000000000000000000"
    "0000000000000000000000007b2274656e736f7273223a5b7b226e616d65223a227a222c226474797065223a22696e743136222c"
    "227368617065223a5b343039365d2c226f6666736574223a302c226e6279746573223a383139327d5d2c226d657461223a7b226b"
    "223a202276227d7d2020202020202020202020202020202020202020202020202020202028b52ffd60001f4d00001000000100fb"
    "df032c91d2048eb579f6b41860fa5725e52400"
)


def _fetcher(blob: bytes, log: list | None = None):
    def fetch(offset: int, length: int) -> bytes:
        if log is not None:
            log.append((offset, length))
        return blob[offset : offset + length]
    return fetch


def _geometry(blob: bytes) -> tuple[int, int, int]:
    """(chunk table offset, data offset, chunks) of a version 2 object."""
    _m, _v, _f, table_len, data_len, _raw, _size, n = HEADER2.unpack_from(blob)
    chunks_at = 64 + table_len
    return chunks_at, len(blob) - TRAILER_SIZE - data_len, n


def test_version_1_objects_still_decode_and_read_by_ranges():
    info = codec.inspect(V1_RAW)
    assert info.version == 1 and info.n_chunks == 0 and codec.verify(V1_RAW) == info.checksum
    shard = codec.decode(V1_RAW)
    assert torch.equal(shard["w"], torch.arange(12, dtype=torch.float32).reshape(3, 4)) and shard.metadata == {"step": 3}
    obj = RangedObject(_fetcher(V1_RAW), len(V1_RAW), info.checksum)
    assert obj.version == 1 and obj.bytes_read == len(V1_RAW)  # no chunk digests: read whole once, verified whole
    assert torch.equal(obj.read_box("w", (1, 1), (2, 3)), shard["w"][1:3, 1:4])
    assert torch.equal(obj.read_box("i", (2,), (3,)), torch.arange(2, 5))
    z = RangedObject(_fetcher(V1_ZSTD), len(V1_ZSTD))
    assert torch.equal(z.read_box("z", (100,), (10,)), torch.zeros(10, dtype=torch.int16))
    bad = bytearray(V1_RAW)
    bad[len(bad) // 2] ^= 1
    with pytest.raises(CorruptObjectError):
        RangedObject(_fetcher(bytes(bad)), len(bad))


def test_the_layout_is_what_the_format_says():
    t = {"a": torch.randn(100_000), "b": torch.arange(7)}
    blob = codec.encode(t, {"m": 1}, compress="never")
    chunks_at, data_at, n = _geometry(blob)
    size = codec.CHUNK_SIZE
    assert n == -(-(len(blob) - TRAILER_SIZE - data_at) // size) and n > 2
    for i in range(n):
        digest, stored, flag = CHUNK.unpack_from(blob, chunks_at + i * CHUNK.size)
        piece = blob[data_at + i * size : min(data_at + (i + 1) * size, len(blob) - TRAILER_SIZE)]
        assert (digest, stored, flag) == (xxhash.xxh3_128_digest(piece), len(piece), 0)
    assert blob[-TRAILER_SIZE:] == xxhash.xxh3_128_digest(blob[:data_at])


@pytest.mark.parametrize("compress", ["never", "lz4", "zstd"])
def test_random_boxes_read_by_ranges_equal_slices(compress):
    g = torch.Generator().manual_seed(0)
    t = {"a": torch.randn(700, 300, generator=g), "b": torch.randint(0, 3, (40, 50, 30), dtype=torch.int16),
         "s": torch.tensor(3.5), "e": torch.empty(0, 4), "c": torch.zeros(90_000)}
    blob = codec.encode(t, {"m": 1}, compress=compress)
    obj = RangedObject(_fetcher(blob), len(blob), codec.checksum(blob))
    assert obj.metadata == {"m": 1} and {e.name for e in obj.tensors} == set(t)
    rng = random.Random(1)
    for _ in range(150):
        name = rng.choice(list(t))
        shape = t[name].shape
        offs = [rng.randrange(0, d) if d else 0 for d in shape]
        sizes = [rng.randrange(0, d - o + 1) for o, d in zip(offs, shape)]
        want = t[name][tuple(slice(o, o + s) for o, s in zip(offs, sizes))]
        assert torch.equal(obj.read_box(name, offs, sizes), want), (name, offs, sizes)
        out = torch.full(sizes, 7, dtype=t[name].dtype)
        assert obj.read_box(name, offs, sizes, out=out) is out and torch.equal(out, want)


def test_a_compressed_object_stores_incompressible_chunks_raw():
    t = {"z": torch.zeros(200_000), "r": torch.randn(200_000)}
    blob = codec.encode(t, compress="lz4")
    chunks_at, _data_at, n = _geometry(blob)
    flags = [CHUNK.unpack_from(blob, chunks_at + i * CHUNK.size)[2] for i in range(n)]
    assert codec.FLAG_LZ4 in flags and 0 in flags and codec.inspect(blob).compressed
    assert all(torch.equal(codec.decode(blob)[k], v) for k, v in t.items())


def test_a_range_read_fetches_only_the_chunks_it_needs():
    t = {"w": torch.randn(4096, 256)}  # 4 MiB
    blob = codec.encode(t, compress="never")
    log: list = []
    obj = RangedObject(_fetcher(blob, log), len(blob))
    opened = obj.bytes_read
    assert opened <= 4096 + 16 + 1024  # header, tables and trailer
    quarter = 1024 * 256 * 4
    got = obj.read_box("w", (1024, 0), (1024, 256))
    assert torch.equal(got, t["w"][1024:2048])
    assert obj.bytes_read - opened <= quarter + 2 * codec.CHUNK_SIZE
    # a column slice touches every row: every chunk, but each once
    before = obj.bytes_read
    obj.read_box("w", (0, 10), (4096, 3))
    assert obj.bytes_read - before <= len(blob)


def test_a_flipped_byte_fails_the_reads_of_its_chunk_only():
    t = {"w": torch.randn(8 * codec.CHUNK_SIZE // 4)}
    blob = bytearray(codec.encode(t, compress="never"))
    _chunks_at, data_at, n = _geometry(bytes(blob))
    assert n == 8
    blob[data_at + 5 * codec.CHUNK_SIZE + 123] ^= 0x04
    with pytest.raises(CorruptObjectError):
        codec.decode(bytes(blob))
    with pytest.raises(CorruptObjectError):
        codec.verify(bytes(blob))
    obj = RangedObject(_fetcher(bytes(blob)), len(blob))
    per = codec.CHUNK_SIZE // 4
    assert torch.equal(obj.read_box("w", (0,), (5 * per,)), t["w"][: 5 * per])  # chunks 0..4 verify alone
    out = torch.zeros(2 * per)
    with pytest.raises(CorruptObjectError, match="chunk 5"):
        obj.read_box("w", (4 * per,), (2 * per,), out=out)
    assert torch.count_nonzero(out) == 0  # nothing of a bad read lands in out
    assert torch.equal(obj.read_box("w", (6 * per,), (2 * per,)), t["w"][6 * per :])


def test_a_flip_in_the_tables_or_trailer_fails_the_open():
    blob = codec.encode({"w": torch.randn(1000)}, {"k": "v"}, compress="never")
    chunks_at, data_at, _n = _geometry(blob)
    for pos in (5, 40, 70, chunks_at + 3, data_at - 1, len(blob) - 1):
        bad = bytearray(blob)
        bad[pos] ^= 0x01
        with pytest.raises(CorruptObjectError):
            RangedObject(_fetcher(bytes(bad)), len(bad))
    with pytest.raises(CorruptObjectError, match="expected"):
        RangedObject(_fetcher(blob), len(blob), "0" * 32)
    with pytest.raises(CorruptObjectError):
        RangedObject(_fetcher(blob), len(blob) - 1)  # truncated (or another size than the index's)


def test_box_runs_cover_the_box_in_order():
    rng = random.Random(3)
    for _ in range(200):
        shape = [rng.randrange(1, 6) for _ in range(rng.randrange(0, 4))]
        offs = [rng.randrange(0, d) for d in shape]
        sizes = [rng.randrange(1, d - o + 1) for o, d in zip(offs, shape)]
        starts, length = box_runs(shape, offs, sizes)
        flat = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
        want = flat[tuple(slice(o, o + s) for o, s in zip(offs, sizes))].reshape(-1)
        got = (starts[:, None] + np.arange(length)[None, :]).reshape(-1)
        assert np.array_equal(got, want), (shape, offs, sizes)
    with pytest.raises(InvalidValueError):
        box_runs([4, 4], [3, 0], [2, 4])


def _tampered(blob: bytes, at: int, value: bytes) -> bytes:
    b = bytearray(blob)
    b[at : at + len(value)] = value
    return codec.reseal(b)  # every checksum valid again: only the codec's own checks stand


def test_forged_version_2_objects_fail_typed():
    raw = codec.encode({"w": torch.randn(100_000), "z": torch.zeros(50_000)}, compress="never")
    packed = codec.encode({"w": torch.randn(100_000), "z": torch.zeros(50_000)}, compress="lz4")
    chunks_at, _data_at, n = _geometry(raw)
    p_at, _, p_n = _geometry(packed)
    p_flags = [CHUNK.unpack_from(packed, p_at + i * CHUNK.size)[2] for i in range(p_n)]
    lz = p_flags.index(codec.FLAG_LZ4)
    forged = [
        _tampered(raw, 28, (3000).to_bytes(4, "little")),  # chunk size not a power of two
        _tampered(raw, 28, (1 << 30).to_bytes(4, "little")),  # beyond 16 MiB
        _tampered(raw, 32, (n + 1).to_bytes(4, "little")),  # a chunk count that does not cut raw_len
        _tampered(raw, chunks_at + 16, (7).to_bytes(4, "little")),  # a raw chunk of another length
        _tampered(raw, chunks_at + 20, (1).to_bytes(4, "little")),  # a codec in an uncompressed object
        _tampered(packed, p_at + lz * CHUNK.size + 20, (2).to_bytes(4, "little")),  # another codec than the header's
        _tampered(packed, p_at + lz * CHUNK.size + 16, (0).to_bytes(4, "little")),  # an empty compressed chunk
        _tampered(packed, p_at + lz * CHUNK.size + 16, (2**32 - 1).to_bytes(4, "little")),  # lengths past the end
    ]
    for blob in forged:
        for read in (codec.decode, codec.verify,
                     lambda b: RangedObject(_fetcher(b), len(b)).read_box("z", (0,), (50_000,))):
            with pytest.raises(CorruptObjectError):
                read(blob)
