"""Tests of tierstore.codec: round trips, in-place restore, corruption and fuzzing."""

from __future__ import annotations

import io
import json
import os
import random
import struct

import lz4.frame
import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierstore import codec
from tierstore.codec import HEADER, HEADER2, MAGIC, TRAILER_SIZE, decode, encode
from tierstore.errors import CorruptObjectError, InvalidValueError, RestoreMismatchError

FUZZ_EXAMPLES = int(os.environ.get("TIERSTORE_FUZZ_EXAMPLES", "1500"))
DTYPE_NAMES = sorted(codec.DTYPES)


def bits(t: torch.Tensor) -> bytes:
    """The raw bit pattern of a tensor, row-major (compares NaNs and fp8 exactly)."""
    fresh = torch.empty(t.shape, dtype=t.dtype).copy_(t)
    return fresh.reshape(-1).view(torch.uint8).numpy().tobytes()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bits(a) == bits(b)


def make_tensor(dtype_name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    dtype = codec.DTYPES[dtype_name]
    n = 1
    for d in shape:
        n *= d
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=n * dtype.itemsize, dtype=np.uint8)
    if dtype == torch.bool:
        raw = raw & 1
    return torch.from_numpy(raw).view(dtype).reshape(shape)


@st.composite
def tensors_st(draw: st.DrawFn) -> torch.Tensor:
    dtype_name = draw(st.sampled_from(DTYPE_NAMES))
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=0, max_size=4)))
    t = make_tensor(dtype_name, shape, draw(st.integers(0, 2**32 - 1)))
    how = draw(st.sampled_from(["plain", "transpose", "slice", "expand"]))
    if how == "transpose" and t.dim() >= 2:
        t = t.transpose(0, t.dim() - 1)
    elif how == "slice" and t.dim() >= 1 and t.shape[0] > 1:
        t = t[::2]
    elif how == "expand" and t.dim() >= 1 and t.shape[0] == 1:
        t = t.expand(3, *t.shape[1:])
    return t


json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**53), 2**53), st.text(max_size=8),
                      st.floats(allow_nan=False, allow_infinity=False))
metadata_st = st.dictionaries(
    st.text(max_size=8),
    st.recursive(json_leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
                 max_leaves=6),
    max_size=4,
)
names_st = st.text(min_size=1, max_size=12)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(names_st, tensors_st(), max_size=5), metadata_st,
       st.sampled_from(["auto", "always", "never"]), st.booleans())
def test_roundtrip(tensors, metadata, compress, copy):
    blob = encode(tensors, metadata, compress=compress)
    shard = decode(blob, copy=copy)
    assert list(shard.tensors) == list(tensors)
    for name, t in tensors.items():
        assert same(shard.tensors[name], t), name
    assert shard.metadata == metadata
    info = codec.inspect(blob)
    assert info.nbytes == len(blob)
    data_start = len(blob) - TRAILER_SIZE - info.data_len  # version 2: the trailer covers what precedes the data
    assert info.checksum == codec.checksum(blob) == codec.verify(blob) == xxhash.xxh3_128(blob[:data_start]).hexdigest()
    assert info.compressed == bool(info.flags & (codec.FLAG_LZ4 | codec.FLAG_ZSTD))
    if compress == "always":
        assert info.compressed
    if compress == "never":
        assert not info.compressed and len(blob) == codec.plan(tensors, metadata).nbytes


def test_plan_write_seal_into_reused_buffer():
    w = torch.randn(16, 8)
    p = codec.plan({"w": w, "s": torch.tensor(3, dtype=torch.int64)}, {"step": 1})
    buf = bytearray(p.nbytes + 100)  # larger than needed; only [:nbytes] is written
    mv = memoryview(buf)
    for step in range(3):
        w.add_(1.0)
        p.write(mv)
        digest = p.seal(mv)
        blob = bytes(buf[: p.nbytes])
        assert digest == codec.checksum(blob) == codec.verify(blob)
        assert same(decode(blob).tensors["w"], w)
    assert blob == encode({"w": w, "s": torch.tensor(3)}, {"step": 1}, compress="never")


def test_copy_false_aliases_blob():
    t = torch.arange(100, dtype=torch.float32)
    blob = bytearray(encode({"t": t}, compress="never"))
    out = decode(blob, copy=False).tensors["t"]
    assert torch.equal(out, t)
    out[0] = 42.0  # writes into the blob: it was a view
    with pytest.raises(CorruptObjectError, match="checksum"):
        decode(blob)


def test_decode_into_out_in_place():
    src = {"a": torch.randn(4, 5), "b": torch.arange(6, dtype=torch.int32), "c": torch.randn(3)}
    blob = encode(src, compress="never")
    a = torch.zeros(5, 4).t()  # non-contiguous target
    b = torch.zeros(6, dtype=torch.int32)
    ptr_a, ptr_b = a.data_ptr(), b.data_ptr()
    shard = decode(blob, out={"a": a, "b": b})
    assert shard.tensors["a"] is a and shard.tensors["b"] is b
    assert a.data_ptr() == ptr_a and b.data_ptr() == ptr_b
    assert torch.equal(a, src["a"]) and torch.equal(b, src["b"])
    assert same(shard.tensors["c"], src["c"])


@pytest.mark.parametrize("bad", [
    {"a": torch.zeros(5, 4)},                       # shape
    {"a": torch.zeros(4, 5, dtype=torch.float64)},  # dtype
    {"zz": torch.zeros(1)},                         # not stored (strict)
])
def test_out_mismatch_leaves_out_unchanged(bad):
    blob = encode({"a": torch.randn(4, 5), "b": torch.randn(3)})
    good = torch.full((3,), 7.0)
    out = {"b": good, **bad}
    before = {k: bits(v) for k, v in out.items()}
    with pytest.raises(RestoreMismatchError) as ei:
        decode(blob, out=out)
    assert list(bad)[0] in str(ei.value)
    assert {k: bits(v) for k, v in out.items()} == before


def test_out_not_stored_non_strict():
    blob = encode({"a": torch.ones(2)})
    extra = torch.zeros(3)
    shard = decode(blob, out={"extra": extra}, strict=False)
    assert list(shard.tensors) == ["a"] and torch.equal(extra, torch.zeros(3))


@pytest.mark.parametrize("value", [1.0, [1, 2], np.zeros(3), None, "x"])
def test_non_tensor_values_rejected(value):
    with pytest.raises(InvalidValueError, match="bad_entry"):
        codec.plan({"ok": torch.zeros(1), "bad_entry": value})


@pytest.mark.parametrize("tensors, metadata", [
    ({"": torch.zeros(1)}, None),
    ({"x" * 1025: torch.zeros(1)}, None),
    ({"q": torch.zeros(2, dtype=torch.complex128)}, None),
    ({"q": torch.zeros(2).to_sparse()}, None),
    ({"q": torch.zeros(1)}, {"x": object()}),
    ({"q": torch.zeros(1)}, {"x": float("nan")}),
    ({"q": torch.zeros(1)}, {1: 2}),
    ({"q": torch.zeros(1)}, {"big": "x" * (1 << 20)}),
    ({"q": torch.zeros(1)}, [1, 2]),
])
def test_invalid_inputs(tensors, metadata):
    with pytest.raises(InvalidValueError):
        encode(tensors, metadata)


def test_header_pack_unpack_roundtrip():
    fields = (MAGIC, 1, codec.FLAG_LZ4, 128, 2**40 + 3, 2**41 + 5)
    packed = HEADER.pack(*fields)
    assert len(packed) == 64 == HEADER.size and packed[28:] == bytes(36)
    assert HEADER.unpack(packed) == fields
    assert packed[:4] == b"TSOB" and struct.unpack_from("<H", packed, 4)[0] == 1
    fields2 = (MAGIC, codec.FORMAT_VERSION, codec.FLAG_LZ4, 128, 2**40 + 3, 2**41 + 5, 1 << 16, 2**32 - 1)
    packed2 = HEADER2.pack(*fields2)
    assert len(packed2) == 64 == HEADER2.size and packed2[36:] == bytes(28) and packed2[:28] == HEADER.pack(
        MAGIC, codec.FORMAT_VERSION, *fields2[2:6])[:28]
    assert HEADER2.unpack(packed2) == fields2
    blob = encode({"x": torch.zeros(3)}, compress="never")
    magic, version, flags, table_len, data_len, raw_len, chunk_size, n_chunks = HEADER2.unpack_from(blob)
    assert (magic, version, flags, chunk_size, n_chunks) == (MAGIC, 2, 0, codec.CHUNK_SIZE, 1)
    assert len(blob) == 64 + table_len + 64 + data_len + TRAILER_SIZE and raw_len == data_len  # one chunk row
    assert table_len % 64 == 0 and data_len % 64 == 0


def _small_blob(compress: str = "never") -> bytes:
    return encode({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.tensor([True, False])},
                  {"k": 1}, compress=compress)


@pytest.mark.parametrize("compress", ["never", "always"])
def test_every_single_byte_flip_detected(compress):
    blob = _small_blob(compress)
    for i in range(len(blob)):
        for mask in (0x01, 0x80, 0xFF):
            bad = bytearray(blob)
            bad[i] ^= mask
            with pytest.raises(CorruptObjectError):
                decode(bytes(bad))


def test_sampled_flips_in_every_section_of_a_large_object():
    blob = encode({f"t{i}": torch.randn(1000 + i) for i in range(20)}, {"m": "x" * 500}, compress="never")
    _, _, _, table_len, data_len, _ = HEADER.unpack_from(blob)
    sections = [(0, 64), (64, 64 + table_len), (64 + table_len, len(blob) - 16), (len(blob) - 16, len(blob))]
    rng = random.Random(0)
    for lo, hi in sections:
        for i in [lo, hi - 1] + [rng.randrange(lo, hi) for _ in range(25)]:
            bad = bytearray(blob)
            bad[i] ^= 1 << rng.randrange(8)
            with pytest.raises(CorruptObjectError):
                decode(bad)
            with pytest.raises(CorruptObjectError):
                codec.verify(bad)


@pytest.mark.parametrize("compress", ["never", "always"])
def test_every_truncation_detected(compress):
    blob = _small_blob(compress)
    for n in range(len(blob)):
        with pytest.raises(CorruptObjectError):
            decode(blob[:n])
        with pytest.raises(CorruptObjectError):
            codec.checksum(blob[:n])
    with pytest.raises(CorruptObjectError):
        decode(blob + b"\0")


def test_foreign_blobs_rejected():
    bio = io.BytesIO()
    torch.save({"w": torch.randn(10)}, bio)
    foreign = [b"", b"TSOB", os.urandom(10_000), bio.getvalue(), b"\0" * 4096, MAGIC + b"\x01\x00" * 100]
    for blob in foreign:
        with pytest.raises(CorruptObjectError):
            decode(blob)
        with pytest.raises(CorruptObjectError):
            codec.inspect(blob)


def _reseal(header_fields: tuple, table: bytes, data: bytes) -> bytes:
    body = HEADER.pack(*header_fields) + table + data
    return body + xxhash.xxh3_128(body).digest()


def _forge(rows: list, meta: object = None, raw_len: int | None = None, data: bytes | None = None,
           table_text: bytes | None = None) -> bytes:
    """An object with a valid checksum but a hand-made (possibly hostile) table."""
    text = table_text if table_text is not None else json.dumps({"tensors": rows, "meta": meta or {}}).encode()
    text += b" " * (-len(text) % 64)
    data = data if data is not None else bytes(128)
    raw = len(data) if raw_len is None else raw_len
    return _reseal((MAGIC, 1, 0, len(text), len(data), raw), text, data)


def row(**kw):
    r = {"name": "x", "dtype": "float32", "shape": [4], "offset": 0, "nbytes": 16}
    r.update(kw)
    return r


@pytest.mark.parametrize("blob", [
    _forge([row(shape=[2**40, 2**40], nbytes=2**82)]),
    _forge([row(offset=128)]),
    _forge([row(offset=120, shape=[2], nbytes=8)]),
    _forge([row(offset=-64)]),
    _forge([row(offset=1)]),
    _forge([row(shape=[-4], nbytes=-16)]),
    _forge([row(shape=[4.0])]),
    _forge([row(shape=[True, 4], nbytes=16)]),
    _forge([row(nbytes=15)]),
    _forge([row(dtype="object")]),
    _forge([row(dtype="complex128", nbytes=64)]),
    _forge([row(), row()]),
    _forge([row(), row(name="y", offset=0)]),
    _forge([row(name="")]),
    _forge([row(extra=1)]),
    _forge([row(shape=[1] * 65, nbytes=4)]),
    _forge(["x"]),
    _forge([row()], meta=[1]),
    _forge([row()], raw_len=64),
    _forge([], table_text=b"[" * 100_000 + b"]" * 100_000),
    _forge([], table_text=b'{"tensors": [], "meta": {}, "x": 1}'),
    _forge([], table_text=b"\xff\xfe not utf8"),
    _forge([], table_text=b'{"tensors": [], "meta": NaN}'),
    _reseal((MAGIC, 1, 0, 64, 64, 64), b"{}" + b" " * 62, bytes(64)),
    _reseal((MAGIC, 3, 0, 64, 64, 64), b" " * 64, bytes(64)),
    _reseal((MAGIC, 1, 2, 64, 64, 64), b" " * 64, bytes(64)),
    _reseal((MAGIC, 1, 1, 64, 64, 2**60), b'{"tensors":[],"meta":{}}' + b" " * 40, bytes(64)),
    _reseal((MAGIC, 1, 1, 64, 64, 64), b'{"tensors":[],"meta":{}}' + b" " * 40, bytes(64)),
    _reseal((MAGIC, 1, 0, 60, 64, 64), b" " * 60, bytes(64)),
])
def test_forged_objects_with_valid_checksum_rejected(blob):
    with pytest.raises(CorruptObjectError):
        decode(blob)


def test_forged_lz4_frame_size_rejected_before_allocation():
    """A frame declaring a huge content size must not make lz4 allocate it."""
    table = b'{"tensors":[],"meta":{}}' + b" " * 40
    frame = bytearray(lz4.frame.compress(bytes(64), store_size=True))
    frame[6:14] = struct.pack("<Q", 1 << 40)
    frame[14] = (xxhash.xxh32(bytes(frame[4:14])).intdigest() >> 8) & 0xFF
    frame += bytes(-len(frame) % 64)
    blob = _reseal((MAGIC, 1, codec.FLAG_LZ4, 64, len(frame), 64), table, bytes(frame))
    with pytest.raises(CorruptObjectError, match="declares"):
        decode(blob)


def _decode_only_corrupt(blob: bytes) -> None:
    try:
        decode(blob)
    except CorruptObjectError:
        pass


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.binary(max_size=512), st.binary(max_size=64).map(lambda b: MAGIC + b"\x01\x00" + b)))
def test_fuzz_random_bytes(blob):
    with pytest.raises(CorruptObjectError):
        decode(blob)


_VALID = [_small_blob("never"), _small_blob("always"), encode({"e": torch.empty(0), "s": torch.tensor(1.5)})]


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(range(len(_VALID))), st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255),
       st.sampled_from(["set", "insert", "delete"])), min_size=1, max_size=4), st.booleans())
def test_fuzz_mutated_valid_blobs(which, edits, reseal):
    """Mutations, optionally re-sealed with a valid checksum: decode succeeds or raises CorruptObjectError."""
    blob = bytearray(_VALID[which])
    for pos, value, op in edits:
        i = pos % (len(blob) + 1)
        if op == "insert":
            blob[i:i] = bytes([value])
        elif op == "delete" and i < len(blob):
            del blob[i]
        elif i < len(blob):
            blob[i] = value
    if reseal and len(blob) >= TRAILER_SIZE:
        _decode_only_corrupt(codec.reseal(blob))
    elif bytes(blob) != _VALID[which]:
        with pytest.raises(CorruptObjectError):
            decode(bytes(blob))


def test_compression_only_when_it_pays():
    dense = {"w": torch.randn(256, 1024)}
    assert not codec.inspect(encode(dense)).compressed
    sparse = {"w": torch.zeros(256, 1024)}
    blob = encode(sparse)
    assert codec.inspect(blob).compressed and len(blob) < 10_000
    assert torch.equal(decode(blob).tensors["w"], sparse["w"])
    with pytest.raises(InvalidValueError):
        encode(dense, compress="sometimes")


def test_compute_checksum_incremental():
    parts = [b"abc", bytearray(b"def"), memoryview(b"ghi")]
    assert codec.compute_checksum(parts) == xxhash.xxh3_128(b"abcdefghi").hexdigest()
    assert len(codec.compute_checksum([])) == 32


def test_dtype_table_and_constants():
    for name in ["float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
                 "bool", "complex64"]:
        assert codec.DTYPES[name] == getattr(torch, name)
    assert codec.MAGIC == b"TSOB" and codec.FORMAT_VERSION == 2 and codec.TRAILER_SIZE == 16
