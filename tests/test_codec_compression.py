"""The codec's zstd path beside lz4, old objects, and the one-pass verify-and-copy read.

Adversarial cases forge objects with a *valid* trailer (an attacker recomputes
xxh3), so only the codec's own checks stand between them and the allocator.
"""

from __future__ import annotations

import json
import struct
import tracemalloc

import pytest
import torch
import xxhash
import zstandard

from tierstore import codec
from tierstore.codec import HEADER, MAGIC, compression
from tierstore.delta import xor_delta
from tierstore.errors import CorruptObjectError

# Encoded by the codec before zstd existed (branch restructure, 66480d5): {"w": arange(24).reshape(4, 6),
# "z": zeros(64, int16)}, metadata {"step": 7}; uncompressed, then lz4 ("always").
OLD_RAW = bytes.fromhex(
    "54534f4201000000c0000000000100000000000000010000000000000000000000000000000000000000000000000000000000"
    "000000000000000000000000007b2274656e736f7273223a5b7b226e616d65223a2277222c226474797065223a22666c6f6174"
    "3332222c227368617065223a5b342c365d2c226f6666736574223a302c226e6279746573223a39367d2c7b226e616d65223a22"
    "7a222c226474797065223a22696e743136222c227368617065223a5b36345d2c226f6666736574223a3132382c226e62797465"
    "73223a3132387d5d2c226d657461223a7b2273746570223a20377d7d2020202020202020202020202020202020202020202020"
    "20000000000000803f0000004000004040000080400000a0400000c0400000e040000000410000104100002041000030410000"
    "4041000050410000604100007041000080410000884100009041000098410000a0410000a8410000b0410000b8410000000000"
    "000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000"
    "000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000"
    "000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000"
    "00005442ee7ca93ce53d2ced34cdee088ff7"
)
OLD_LZ4 = bytes.fromhex(
    "54534f4201000100c0000000830000000000000000010000000000000000000000000000000000000000000000000000000000"
    "000000000000000000000000007b2274656e736f7273223a5b7b226e616d65223a2277222c226474797065223a22666c6f6174"
    "3332222c227368617065223a5b342c365d2c226f6666736574223a302c226e6279746573223a39367d2c7b226e616d65223a22"
    "7a222c226474797065223a22696e743136222c227368617065223a5b36345d2c226f6666736574223a3132382c226e62797465"
    "73223a3132387d5d2c226d657461223a7b2273746570223a20377d7d2020202020202020202020202020202020202020202020"
    "2004224d1868400001000000000000af6c00000011000100f14b803f0000004000004040000080400000a0400000c0400000e0"
    "400000004100001041000020410000304100004041000050410000604100007041000080410000884100009041000098410000"
    "a0410000a8410000b0410000b8415f000f02008350000000000000000000e47dc1c477f87fe4014c2695d8969739"
)
OLD_TENSORS = {"w": torch.arange(24, dtype=torch.float32).reshape(4, 6), "z": torch.zeros(64, dtype=torch.int16)}


def _pad(table: bytes) -> bytes:
    return table + b" " * (-len(table) % 64)


def _forge(flags: int, rows: list, data: bytes, raw_len: int) -> bytes:
    table = _pad(json.dumps({"tensors": rows, "meta": {}}).encode())
    body = HEADER.pack(MAGIC, 1, flags, len(table), len(data), raw_len) + table + data
    return body + xxhash.xxh3_128(body).digest()


def _bounded(blob: bytes) -> None:
    """decode raises a typed error, and allocates nothing near what a forged length claims."""
    tracemalloc.start()
    try:
        with pytest.raises(CorruptObjectError):
            codec.decode(blob)
        _cur, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * len(blob) + (4 << 20), peak


@pytest.mark.parametrize("blob", [OLD_RAW, OLD_LZ4], ids=["raw", "lz4"])
def test_objects_written_before_zstd_still_decode(blob):
    shard = codec.decode(blob)
    assert shard.metadata == {"step": 7}
    for name, t in OLD_TENSORS.items():
        assert torch.equal(shard.tensors[name], t)
    out = {n: torch.full_like(t, 9) for n, t in OLD_TENSORS.items()}
    codec.decode(blob, out=out)
    assert all(torch.equal(out[n], t) for n, t in OLD_TENSORS.items())


def _delta_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(1 << 16, generator=g)
    w1 = w0 - 1e-4 * torch.randn(1 << 16, generator=g).sign()
    return {"w": xor_delta(w1, w0)}


@pytest.mark.parametrize("mode", ["zstd", "lz4", "always", "auto"])
def test_round_trip_per_codec(mode):
    tensors = {**_delta_tensors(), "b": torch.arange(10, dtype=torch.int64), "e": torch.empty(0)}
    blob = codec.encode(tensors, {"k": mode}, compress=mode)
    info = codec.inspect(blob)
    expected = {"zstd": codec.FLAG_ZSTD, "lz4": codec.FLAG_LZ4}.get(mode, codec.FLAG_ZSTD)
    assert info.flags == expected and info.compressed
    for copy in (True, False):
        shard = codec.decode(blob, copy=copy)
        assert all(torch.equal(shard.tensors[n], t) for n, t in tensors.items())
    out = {n: torch.zeros_like(t) for n, t in tensors.items()}
    codec.decode(blob, out=out)
    assert all(torch.equal(out[n], t) for n, t in tensors.items())


def test_choice_is_by_sample():
    delta = memoryview(_delta_tensors()["w"].numpy()).cast("B")
    assert compression.choose(delta) == compression.FLAG_ZSTD  # ~30% smaller than lz4 on XOR deltas
    assert compression.choose(delta, ("lz4",)) == compression.FLAG_LZ4
    dense = memoryview(torch.randn(1 << 16, generator=torch.Generator().manual_seed(1)).numpy()).cast("B")
    assert compression.choose(dense) is None
    assert not codec.inspect(codec.encode({"x": torch.randn(1 << 16)})).compressed


def _zstd_object(**frame_kw) -> tuple[list, bytes, int]:
    raw = bytes(range(256)) * 16
    rows = [{"name": "x", "dtype": "uint8", "shape": [len(raw)], "offset": 0, "nbytes": len(raw)}]
    frame = zstandard.ZstdCompressor(**{"write_content_size": True, **frame_kw}).compress(raw)
    return rows, frame, len(raw)


def test_zstd_reference_object_decodes():
    rows, frame, n = _zstd_object()
    assert bytes(codec.decode(_forge(codec.FLAG_ZSTD, rows, frame, n)).tensors["x"].numpy()) == bytes(range(256)) * 16


@pytest.mark.parametrize("cut", [1, 4, 9])
def test_truncated_zstd_frame_is_corrupt(cut):
    rows, frame, n = _zstd_object()
    _bounded(_forge(codec.FLAG_ZSTD, rows, frame[:-cut], n))


def test_zstd_frame_with_trailing_bytes_is_corrupt():
    rows, frame, n = _zstd_object()
    _bounded(_forge(codec.FLAG_ZSTD, rows, frame + b"\0" * 8, n))
    _bounded(_forge(codec.FLAG_ZSTD, rows, frame + frame, n))  # a second frame is not allowed either


def test_zstd_frame_without_content_size_is_corrupt():
    rows, frame, n = _zstd_object(write_content_size=False)
    _bounded(_forge(codec.FLAG_ZSTD, rows, frame, n))


def test_zstd_frame_declaring_a_huge_size_fails_before_allocating():
    """A frame whose header claims 2^40 bytes (recomputed trailer) must not make zstd allocate it."""
    rows, frame, n = _zstd_object()
    fhd = frame[4]
    assert fhd >> 6 == 1 and fhd & 0x20 and not fhd & 0x03  # single segment, 2-byte content size, no dict id
    forged = frame[:4] + bytes([(fhd & 0x3F) | 0xC0]) + struct.pack("<Q", 1 << 40) + frame[7:]
    assert zstandard.frame_content_size(bytes(forged)) == 1 << 40
    _bounded(_forge(codec.FLAG_ZSTD, rows, bytes(forged), n))
    big_rows = [{"name": "x", "dtype": "uint8", "shape": [1 << 40], "offset": 0, "nbytes": 1 << 40}]
    _bounded(_forge(codec.FLAG_ZSTD, big_rows, bytes(forged), 1 << 40))  # raw_len beyond any zstd ratio


def test_raw_len_must_be_what_the_table_spans():
    """A header raw_len larger than the tensors need is refused before decompressing (no bomb by header)."""
    rows, _frame, _n = _zstd_object()
    frame_big = zstandard.ZstdCompressor(write_content_size=True).compress(bytes(4 << 20))
    _bounded(_forge(codec.FLAG_ZSTD, rows, frame_big, 4 << 20))


def test_both_codec_flags_is_corrupt():
    rows, frame, n = _zstd_object()
    _bounded(_forge(codec.FLAG_ZSTD | codec.FLAG_LZ4, rows, frame, n))


# -- the one-pass read ------------------------------------------------------------------------------------


def _big() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"a": torch.randn(300_001, generator=g), "b": torch.randn(5, 1 << 17, generator=g),
            "c": torch.arange(7, dtype=torch.int8), "d": torch.empty(0, 3)}


def test_one_pass_read_spans_chunks_and_strided_targets():
    tensors = _big()
    blob = codec.encode(tensors, compress="never")
    assert len(blob) > 3 << 20  # several 1 MiB chunks, tensors straddling their edges
    strided = torch.zeros(1 << 17, 5).t()  # not contiguous: copied after the checksum
    out = {"a": torch.zeros(300_001), "b": strided, "d": torch.empty(0, 3)}
    shard = codec.decode(blob, out=out)
    assert shard.tensors["b"] is strided
    for n, t in tensors.items():
        assert torch.equal(shard.tensors[n], t), n


@pytest.mark.parametrize("where", [0.01, 0.5, 0.999])
def test_one_pass_read_detects_corruption_anywhere(where):
    tensors = _big()
    blob = bytearray(codec.encode(tensors, compress="never"))
    blob[int((len(blob) - 16) * where)] ^= 0x40
    out = {n: torch.zeros_like(t) for n, t in tensors.items()}
    with pytest.raises(CorruptObjectError, match="checksum"):
        codec.decode(bytes(blob), out=out)
    with pytest.raises(CorruptObjectError, match="checksum"):
        codec.decode(bytes(blob))
