"""Hostile input: forged objects and manifests, hostile keys, ref cycles, missing delta bases.

The codec's checksum detects corruption, not malice: an attacker recomputes
the xxh3 trailer. So the fuzzing here forges *valid-checksum* objects with
hostile headers and tables, and checks that decode/inspect raise only typed
errors, never crash or hang, and never allocate what an unchecked length
claims. ``TIERSTORE_FUZZ_EXAMPLES`` (read here) sets the examples per fuzz
test (default 600, four tests; the long run needs ``--timeout 0``: 100000 for the long run).
"""

from __future__ import annotations

import json
import os
import struct
import tracemalloc

import lz4.frame
import pytest
import torch
import xxhash
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consistency.manifest import parse_manifest
from tierstore import codec
from tierstore.codec import HEADER, MAGIC
from tierstore.errors import (
    CorruptObjectError, InvalidKeyError, InvalidValueError, ManifestError, NoValidCopyError, TierStoreError,
)
from tierstore.keys import ShardKey

FUZZ_EXAMPLES = int(os.environ.get("TIERSTORE_FUZZ_EXAMPLES", "600"))
FUZZ = settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))
TYPED = (CorruptObjectError, InvalidValueError)
BIG = [0, 1, 63, 64, 2**31 - 1, 2**32 - 1, 2**40, 2**60, 2**63 - 1, 2**64 - 1]


def forge(flags: int, table: bytes, data: bytes, *, table_len: int | None = None, data_len: int | None = None,
          raw_len: int | None = None, version: int = 1) -> bytes:
    """An object with any header fields and a *correct* trailer over them."""
    head = HEADER.pack(MAGIC, version, flags, len(table) if table_len is None else table_len % 2**32,
                       len(data) if data_len is None else data_len, len(data) if raw_len is None else raw_len)
    body = head + table + data
    return body + xxhash.xxh3_128(body).digest()


def pad(table: bytes) -> bytes:
    return table + b" " * (-len(table) % 64)


def check_decode(blob: bytes) -> None:
    """decode and inspect raise only typed errors; Python-side allocation stays bounded by the blob."""
    tracemalloc.start()
    try:
        for fn in (codec.inspect, codec.decode, lambda b: codec.decode(b, copy=False)):
            try:
                fn(blob)
            except TYPED:
                pass
        _cur, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * len(blob) + (4 << 20), f"{peak} bytes allocated decoding a {len(blob)}-byte object"


# -- the codec ----------------------------------------------------------------------------------------

row = st.fixed_dictionaries({
    "name": st.one_of(st.text(max_size=8), st.integers(), st.none()),
    "dtype": st.one_of(st.sampled_from(sorted(codec.DTYPES)), st.text(max_size=6)),
    "shape": st.one_of(st.lists(st.one_of(st.integers(-2, 5), st.sampled_from(BIG)), max_size=4), st.integers()),
    "offset": st.one_of(st.integers(-64, 256), st.sampled_from(BIG)),
    "nbytes": st.one_of(st.integers(-1, 256), st.sampled_from(BIG)),
})
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=5))


@FUZZ
@given(rows=st.lists(row, max_size=4), meta=st.dictionaries(st.text(max_size=4), json_leaf, max_size=3),
       data=st.binary(max_size=512), flags=st.sampled_from([0, 1, 2, 3, 0xFFFF]),
       raw_len=st.one_of(st.none(), st.sampled_from(BIG)), data_len=st.one_of(st.none(), st.sampled_from(BIG)),
       table_len=st.one_of(st.none(), st.sampled_from(BIG)), version=st.sampled_from([1, 1, 1, 0, 2]))
def test_forged_objects_fail_typed(rows, meta, data, flags, raw_len, data_len, table_len, version):
    table = pad(json.dumps({"tensors": rows, "meta": meta}).encode())
    if flags & 1 and data:
        data = lz4.frame.compress(data, store_size=True)
    elif flags == 2 and data:
        data = zstandard.ZstdCompressor(write_content_size=True).compress(data)
    check_decode(forge(flags, table, data, table_len=table_len, data_len=data_len, raw_len=raw_len,
                       version=version))


@FUZZ
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 8), compress=st.sampled_from(["never", "always", "lz4", "zstd"]))
def test_mutated_valid_objects_fail_typed_or_decode(seed, n, compress):
    """Flip bytes of a real object and recompute the trailer: typed error or a self-consistent decode."""
    import random

    rnd = random.Random(seed)
    blob = bytearray(codec.encode({"a": torch.arange(40, dtype=torch.float32), "b": torch.ones(3, 5)},
                                  {"k": [1, 2]}, compress=compress))
    for _ in range(n):
        blob[rnd.randrange(len(blob) - 16)] = rnd.randrange(256)
    body = bytes(blob[:-16])
    check_decode(body + xxhash.xxh3_128(body).digest())


@pytest.mark.parametrize("field", ["data_len", "raw_len", "table_len"])
def test_header_claiming_2_to_60_bytes_fails_fast(field):
    table = pad(json.dumps({"tensors": [], "meta": {}}).encode())
    kw = {field: 2**60}
    for flags in (0, 1, 2):
        with pytest.raises(CorruptObjectError):
            codec.decode(forge(flags, table, b"x" * 64, **kw))
        check_decode(forge(flags, table, b"x" * 64, **kw))


def test_table_claiming_a_huge_tensor_fails_before_allocating():
    rows = [{"name": "w", "dtype": "float32", "shape": [2**30, 2**28], "offset": 0, "nbytes": 2**60}]
    blob = forge(0, pad(json.dumps({"tensors": rows, "meta": {}}).encode()), b"\0" * 128)
    with pytest.raises(CorruptObjectError, match="outside"):
        codec.decode(blob)
    check_decode(blob)


def test_lz4_frame_declaring_a_huge_size_fails_before_allocating():
    frame = bytearray(lz4.frame.compress(b"\0" * 1024, store_size=True))
    info = lz4.frame.get_frame_info(bytes(frame))
    assert info["content_size"] == 1024
    # rewrite the frame's content size (8 bytes after the 6-byte header start) to 2^40
    frame[6:14] = struct.pack("<Q", 2**40)
    frame[14] = (xxhash.xxh32(bytes(frame[4:14])).intdigest() >> 8) & 0xFF
    rows = [{"name": "w", "dtype": "uint8", "shape": [1024], "offset": 0, "nbytes": 1024}]
    blob = forge(1, pad(json.dumps({"tensors": rows, "meta": {}}).encode()), bytes(frame), raw_len=1024)
    with pytest.raises(CorruptObjectError):
        codec.decode(blob)
    check_decode(blob)


def test_deeply_nested_table_json_is_typed():
    table = pad(b'{"tensors": [], "meta": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    with pytest.raises(CorruptObjectError):
        codec.decode(forge(0, table, b""))


# -- the manifest parser ------------------------------------------------------------------------------

json_value = st.recursive(json_leaf, lambda c: st.one_of(st.lists(c, max_size=3),
                                                       st.dictionaries(st.text(max_size=6), c, max_size=3)),
                          max_leaves=6)
obj_entry = st.fixed_dictionaries({
    "key": st.one_of(st.sampled_from(["m/l/3/0", "m/l/2/0", "other/l/3/0", "m/../3/0", "m/l/3/x", ""]), json_leaf),
    "kind": st.one_of(st.sampled_from(["full", "delta", "ref", "pickle"]), json_leaf),
    "size": st.one_of(st.integers(-5, 2**70), json_leaf),
    "checksum": st.one_of(st.text(max_size=4), json_leaf),
    "base": st.one_of(st.none(), st.sampled_from(["m/l/2/0", "m/l/3/0", "m/l/4/0", "other/l/1/0", "bad"])),
    "target": st.one_of(st.none(), st.sampled_from(["m/l/3/0", "m/l/3/1", "m/l/9/0", "other/l/3/0"])),
})
manifest = st.fixed_dictionaries({
    "version": st.sampled_from([1, 1, 1, 2, "1", None]),
    "model": st.sampled_from(["m", "m", "other", 5]),
    "step": st.sampled_from([3, 3, -1, "3", 2**70]),
    "world": st.sampled_from([1, 2, 0, -1, 2**21, "2"]),
    "layout": st.one_of(st.none(), json_value),
    "ranks": st.dictionaries(st.sampled_from(["0", "1", "2", "-1", "x"]),
                             st.one_of(st.fixed_dictionaries({"objects": st.lists(obj_entry, max_size=3),
                                                              "extra": st.one_of(st.none(), json_value)}),
                                       json_value), max_size=3),
})


@FUZZ
@given(m=manifest, mode=st.sampled_from(["json", "dict", "bytes-cut"]), cut=st.integers(0, 400))
def test_manifest_parser_only_raises_manifest_error(m, mode, cut):
    text = json.dumps(m)
    raw = {"json": text, "dict": m, "bytes-cut": text.encode()[:cut]}[mode]
    try:
        out = parse_manifest(raw, model="m", step=3)
    except ManifestError:
        return
    # accepted: then it is consistent (only objects of model m, step 3)
    assert out["model"] == "m" and out["step"] == 3
    for vote in out["ranks"].values():
        for o in vote["objects"]:
            k = ShardKey.parse(o["key"])
            assert k.model == "m" and k.step == 3


@FUZZ
@given(raw=st.one_of(st.binary(max_size=300), json_value.map(json.dumps)))
def test_manifest_parser_on_arbitrary_bytes(raw):
    try:
        parse_manifest(raw)
    except ManifestError:
        pass


def test_deeply_nested_manifest_is_typed():
    with pytest.raises(ManifestError):
        parse_manifest("[" * 100_000 + "]" * 100_000)


def test_manifest_bool_step_is_refused():
    with pytest.raises(ManifestError):
        parse_manifest({"version": 1, "model": "m", "step": True, "world": 1, "ranks": {"0": {"objects": []}}})


def test_manifest_naming_objects_of_another_model_is_refused():
    m = {"version": 1, "model": "m", "step": 3, "world": 1,
         "ranks": {"0": {"objects": [{"key": "other/l/3/0", "kind": "full", "size": 1, "checksum": "x"}]}}}
    with pytest.raises(ManifestError, match="another model"):
        parse_manifest(m, model="m")
    m["ranks"]["0"]["objects"][0] = {"key": "m/l/3/0", "kind": "ref", "size": 1, "checksum": "x",
                                     "target": "other/l/3/0"}
    with pytest.raises(ManifestError, match="another model"):
        parse_manifest(m, model="m")
    with pytest.raises(ManifestError, match="model"):
        parse_manifest(dict(m, model="other"), model="m")


def test_resolve_refuses_a_manifest_of_another_model_in_the_index(store):
    """A hostile (or buggy) writer stores another model's objects under m's manifest key: typed refusal."""
    store.begin_step("m", 1, 1)
    info = store.put(ShardKey("m", "l", 1, 0), {"w": torch.ones(3)})
    assert store.vote("m", 1, 0, [info]) in ("committed", "durable")
    store.flush()  # the step is durable before the tampering (a tampered manifest is never made durable)
    raw = json.loads(store.index._r.get(store.index._k("m", "manifest", 1)))
    raw["ranks"]["0"]["objects"][0]["key"] = "other/l/1/0"
    store.index._r.set(store.index._k("m", "manifest", 1), json.dumps(raw))
    with pytest.raises(TierStoreError) as ei:
        store.resolve("m")
    assert isinstance(ei.value, (ManifestError, NoValidCopyError))


# -- hostile keys at every public entry ------------------------------------------------------------------

HOSTILE = ["../etc/passwd", "m/../../x/1/0", "/abs/l/1/0", "m/l\x00/1/0", "m/l\n/1/0", "m/l\x1b[2J/1/0",
           "m/" + "a" * 10_000 + "/1/0", "m/l/1/0/extra", "m/l/-1/0", "m/l/1/99999999999999999999", "m//1/0",
           "m/./1/0", "m/l/1", "", "m/l/01/0", "m/\u00e9/1/0", "m/l/1/0\r"]


@pytest.mark.parametrize("bad", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_keys_at_the_store(store, bad):
    t = {"w": torch.ones(2)}
    for call in (lambda: store.put(bad, t), lambda: store.get(bad), lambda: store.delete(bad),
                 lambda: store.exists(bad), lambda: store.info(bad)):
        with pytest.raises(InvalidKeyError):
            call()
    from tierstore.keys import validate_name

    for part in bad.split("/")[:2]:
        try:
            validate_name(part, "part")
            continue
        except InvalidKeyError:
            pass
        with pytest.raises(InvalidKeyError):
            store.list(part)
        with pytest.raises(InvalidKeyError):
            store.list("m", part)
    for path in (store.host.root,):
        assert not any(".." in p.name or "\n" in p.name for p in path.rglob("*"))


@pytest.fixture(params=["host", "localfs", "memory"])
def backend(request, tmp_path, shm_root):
    if request.param == "host":
        from backends.host import HostBackend
        b = HostBackend(shm_root / "h")
    elif request.param == "localfs":
        from backends.localfs import LocalFSBackend
        b = LocalFSBackend(tmp_path / "d", fsync=False)
    else:
        from backends.memory import MemoryBackend
        b = MemoryBackend()
    b.put("inside/ok", b"secret-inside")
    (tmp_path / "outside").write_bytes(b"outside")
    yield b
    b.close()


BACKEND_HOSTILE = ["../outside", "../../etc/passwd", "/etc/passwd", "a/../../b", "a\x00b", "a\nb", "", "a//b",
                   ".", "a/./b", "x" * 5000, "a/" * 600 + "b", "inside/ok/", "~tmp", 7, None, b"bytes"]


@pytest.mark.parametrize("bad", BACKEND_HOSTILE, ids=range(len(BACKEND_HOSTILE)))
def test_hostile_names_at_every_backend(backend, bad, tmp_path):
    for call in (lambda: backend.put(bad, b"x"), lambda: backend.get(bad), lambda: backend.delete(bad),
                 lambda: backend.exists(bad)):
        with pytest.raises((InvalidKeyError, TierStoreError)):
            call()
    assert (tmp_path / "outside").read_bytes() == b"outside"
    if isinstance(bad, str):
        names = list(backend.list(bad)) if not bad.startswith("inside") else []
        assert all(".." not in n and not n.startswith("/") for n in names)
    assert bytes(backend.get("inside/ok")) == b"secret-inside"


# -- refs in a cycle, a delta whose base is missing -----------------------------------------------------------


def test_ref_cycle_fails_typed(store):
    a, b = ShardKey("m", "l", 1, 0), ShardKey("m", "l", 1, 1)
    store.put(a, {}, kind="ref", target=b)
    store.put(b, {}, kind="ref", target=a)
    with pytest.raises(TierStoreError) as ei:
        store.get(a)
    assert isinstance(ei.value, (CorruptObjectError, NoValidCopyError)) and "m/l/1/" in str(ei.value)
    self_ref = ShardKey("m", "l", 2, 0)
    store.put(self_ref, {}, kind="ref", target=self_ref)
    with pytest.raises(TierStoreError):
        store.get(self_ref)


def test_delta_with_missing_base_names_the_base(store):
    key, base = ShardKey("m", "l", 5, 0), ShardKey("m", "l", 4, 0)
    store.put(key, {"w": torch.zeros(4, dtype=torch.int32)}, kind="delta", base=base)
    with pytest.raises(NoValidCopyError) as ei:
        store.get(key)
    assert str(base) in str(ei.value) and str(key) in str(ei.value)


def test_mutation_fuzzer_finds_only_typed_errors():
    """bench/fuzz.py (run with --n 200000 for the full count) on a CI-sized sample."""
    from bench.fuzz import main

    assert main(["--n", "5000", "--seed", "3"]) == 0


@pytest.mark.parametrize("depth", [900, 5000])
def test_a_deeply_nested_stored_state_document_is_typed(depth):
    """A stored state document (the JSON a step's vote carries) nested far deeper than any value ``encode``
    writes: ``decode`` refuses it with ``CorruptObjectError`` before its recursive walk, never a
    ``RecursionError``; a document as deep as the deepest value ``encode`` accepts still decodes."""
    from tierstore.errors import CorruptObjectError
    from tierstore.train.values import decode, encode

    doc: object = 0
    for _ in range(depth):
        doc = {"__tuple__": [doc]}
    with pytest.raises(CorruptObjectError, match="nested"):
        decode(doc, {})
    value: object = 0
    for _ in range(95):  # 190 levels: a dict and a tuple each
        value = {"k": (value,)}
    tensors: dict = {}
    assert decode(encode(value, tensors, "t", "state"), tensors) == value
