"""The per-object costs cut for states of many small tensors (issue 30): what they must not break.

A host-tier segment keeps, with its mapping, the typed tensor views a writer made over it (where each tensor's
bytes go, a "geometry"); the next reservation of the same segment with the same geometry, and a restore that
reads an object of that geometry from it, use them instead of making new ones. The attacks: a segment reused
by objects of other layouts of the same size (a wrong view would write or read the wrong bytes), a byte
flipped in a segment whose views are kept (the deferred restore must still catch it), an aborted reservation
(its views must go with it). Also: the one-regex check of object names agrees with the per-segment rules, and
reservation names stay unique across a fork, and what the host tier preallocates fits the first save.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.base import validate_object_name
from backends.host import HostBackend
from tests._tiers import live_path
from tierstore.errors import InvalidKeyError
from tierstore.keys import ShardKey


def _ident(res) -> tuple[int, int]:
    return res._ident


def test_a_reused_segment_keeps_its_views_per_key_and_an_abort_forgets_them(shm_root):
    b = HostBackend(shm_root / "node", recycle_grace_s=0.0)
    made: list[int] = []

    def make(buf):
        made.append(len(buf))
        return [torch.frombuffer(buf, dtype=torch.uint8, count=8)]

    res = b.reserve("m/a/1/0", 4096)
    first = res.views("g1", make)
    assert made == [4096]
    res.buffer[:4] = b"abcd"
    res.commit()
    ident = _ident(res)
    assert b.delete("m/a/1/0")  # into the pool, mapping kept
    again = b.reserve("m/b/2/0", 4096)
    assert _ident(again) == ident, "the pooled segment was not reused (the test needs it)"
    assert again.views("g1", make) is first and made == [4096]  # kept: not made again
    other = again.views("g2", make)  # another geometry: made, and kept instead
    assert other is not first and made == [4096, 4096]
    again.abort()  # the segment is freed: its views are forgotten with its mapping
    assert ident not in b._pool._views
    b.close()


def _layouts(i: int) -> dict[str, torch.Tensor]:
    """Objects of the same encoded size whose tensors lie elsewhere in turn (other shapes and offsets), so that
    one object's segment is reused by another layout."""
    g = torch.Generator().manual_seed(i)
    shapes = [
        {"a": (torch.float32, (64, 16)), "b": (torch.int64, (128,)), "c": (torch.bfloat16, (512,))},
        {"a": (torch.float32, (16, 32)), "b": (torch.int64, (384,)), "c": (torch.bfloat16, (512,))},
        {"a": (torch.float32, (8, 64)), "b": (torch.int64, (256,)), "c": (torch.bfloat16, (1024,))},
    ][i % 3]
    out = {}
    for name, (dtype, shape) in shapes.items():
        n = 1
        for d in shape:
            n *= d
        raw = torch.randint(0, 256, (n * torch.empty(0, dtype=dtype).element_size(),), generator=g,
                            dtype=torch.uint8)
        out[name] = raw.view(dtype).view(shape).clone()
    return out


def test_segments_reused_across_layouts_write_and_restore_every_byte(store):
    """Rounds of objects whose layouts rotate over the same segments: every read (the verified ``get`` and the
    deferred restore into live tensors, which uses kept views) returns exactly what was written."""
    pool = store.host._pool
    seen: dict[tuple[int, int], set] = {}
    asked = pool.views

    def views(ident, mapping, key, make):  # records which geometries each segment was asked for
        seen.setdefault(ident, set()).add(key)
        return asked(ident, mapping, key, make)

    pool.views = views
    for rnd in range(6):
        keys = [ShardKey("kv", f"l{j}", rnd + 1, 0) for j in range(4)]
        want = [_layouts(rnd + j) for j in range(4)]
        for k, w in zip(keys, want):
            store.put(k, w)
        for k, w in zip(keys, want):
            got = store.get(k)
            assert all(torch.equal(got.tensors[n].view(torch.uint8), w[n].view(torch.uint8)) for n in w)
        outs = [{n: torch.zeros_like(t) for n, t in w.items()} for w in want]
        shards, v = store.get_many_deferred(keys, outs=outs)
        assert all(s is not None for s in shards)
        assert v.wait(timeout=60) == []
        for o, w in zip(outs, want):
            for n in w:
                assert torch.equal(o[n].view(torch.uint8), w[n].view(torch.uint8)), (rnd, n)
        for k in keys:
            store.delete(k)
    assert any(len(keys) >= 2 for keys in seen.values()), ("no segment was reused by another layout", {i: len(k) for i, k in seen.items()}, pool.entries())


def test_a_flipped_byte_in_a_segment_with_kept_views_fails_the_deferred_restore(store):
    key = ShardKey("kv", "w", 1, 0)
    w = {"a": torch.randn(4096), "b": torch.randn(64, 64)}
    store.put(key, w)
    store.flush()  # durable first: the flip below is the host copy's alone
    outs = [{n: torch.zeros_like(t) for n, t in w.items()}]
    _, v = store.get_many_deferred([key], outs=outs)  # the views are kept from here on, if not from the put
    assert v.wait(timeout=60) == []
    path = live_path(store.host.root, store, key)
    size = path.stat().st_size
    with open(path, "r+b") as f:  # in place: the same file, so the same kept mapping and views
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0x10]))
    _, v = store.get_many_deferred([key], outs=[{n: torch.zeros_like(t) for n, t in w.items()}])
    failures = v.wait(timeout=60)
    assert len(failures) == 1 and failures[0].reason.startswith(("checksum", "corrupt")), failures


def _reference_name_ok(name: str) -> bool:
    """The rules as documented: 1..1024 chars of "/"-separated segments of [A-Za-z0-9._-]+, none "." and
    none holding ".."."""
    if not name or len(name) > 1024:
        return False
    return all(re.fullmatch(r"[A-Za-z0-9._-]+", s) and s != "." and ".." not in s for s in name.split("/"))


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet="ab./-_ \n\x00é", max_size=14))
def test_the_one_regex_name_check_agrees_with_the_segment_rules(name):
    try:
        validate_object_name(name)
        ok = True
    except InvalidKeyError:
        ok = False
    assert ok == _reference_name_ok(name), name


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_reservation_names_stay_unique_in_a_forked_child(shm_root):
    b = HostBackend(shm_root / "node", recycle_grace_s=0.0)
    mine = {b._tmp_path() for _ in range(3)}
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the same backend object, copied by the fork
        try:
            os.write(w, "\n".join(b._tmp_path() for _ in range(3)).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        theirs = set(f.read().split("\n"))
    os.waitpid(pid, 0)
    assert len(mine) == 3 and len(theirs) == 3 and not mine & theirs
    assert all(f"{pid}." in n for n in theirs) and all(f"{os.getpid()}." in n for n in mine)
    b.close()


def test_snapshot_nbytes_is_what_a_snapshot_takes(store):
    g = {"w": torch.randn(33, 7), "b": torch.zeros(5, dtype=torch.int64)}
    meta = {"layer": "fc1", "shape": [33, 7]}
    want = store.snapshot_nbytes(g, meta)
    rec = store.put(ShardKey("kv", "fc1", 1, 0), g, meta)
    assert rec.size == want


def test_the_checkpointer_preallocates_exactly_what_its_first_save_takes(store):
    """Its pre-faulted segments are taken by the first save, none made fresh (they were sized without the
    store's own metadata, so the first saves faulted new pages in while the preallocated ones sat unused)."""
    from collections import Counter

    from torch import nn

    from tierstore.train.checkpointer import Checkpointer

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 8))
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(4, 64)).sum().backward()
    opt.step()
    ck = Checkpointer(store, "prealloc", m, opt, keep_last=2)
    before = Counter(e.size for e in store.host._pool.entries())
    assert before, "nothing was preallocated"
    ck.save(1)
    assert ck.wait() == "committed"
    after = Counter(e.size for e in store.host._pool.entries())
    taken = before - after
    keys = store.index.list_objects("prealloc", step=1)
    sizes = Counter(rec.size for rec in store.index.get_objects(keys) if rec is not None and rec.kind == "full")
    assert sizes and taken == sizes, (taken, sizes)
    ck.close()


def test_the_checkpointer_preallocates_every_generation_retention_cycles_through(tmp_path, redis_url, shm_root):
    """At a save's copy the host tier holds the ``keep_last`` + 1 last committed steps (the oldest is retired at
    that save's finish, before its vote) and the new one. With two generations preallocated, the third save of a
    ``keep_last=1`` run faulted a whole generation in (1.3 s at 1,000 layers, against 0.12 s for the others):
    every save's objects must lie in segments the constructor preallocated."""
    import tierstore
    from torch import nn

    from tierstore.train.checkpointer import Checkpointer

    store = tierstore.open(tmp_path / "home", redis=redis_url, durable="none", host_root=str(shm_root / "gens"),
                           node_id="gens")
    try:
        m = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 16), nn.Linear(16, 8))
        ck = Checkpointer(store, "gens", m, torch.optim.SGD(m.parameters(), lr=0.1), keep_last=1)
        pool = store.host._pool.dir
        made = {os.stat(pool / e.name).st_ino for e in store.host._pool.entries()}
        for step in range(1, 8):
            ck.save(step)
            assert ck.wait() == "committed"
            keys = store.list("gens", step=step)
            assert keys
            fresh = [k for k in keys if os.stat(live_path(store.host.root, store, k)).st_ino not in made]
            assert not fresh, f"save {step} made fresh segments for {fresh}"
        ck.close()
    finally:
        store.close()


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("eager", [False, True])
def test_a_verification_on_several_threads_names_exactly_the_bad_copies(threads, eager):
    from tierstore import codec
    from tierstore.store.deferred import Verification

    blobs = [bytearray(codec.encode({"t": torch.full((4096,), float(i))})) for i in range(9)]
    sums = [codec.checksum(bytes(b)) for b in blobs]
    for bad in (2, 7):
        blobs[bad][len(blobs[bad]) // 2] ^= 0x01  # the data: only the hash can tell
    v = Verification(eager=eager, threads=threads)
    for i, (b, c) in enumerate(zip(blobs, sums)):
        v.add(ShardKey("kv", f"l{i}", 1, 0), "host", f"n{i}", c, bytes(b))
    failures = v.wait(timeout=60)
    assert sorted(f.name for f in failures) == ["n2", "n7"]
    assert v.verified == 7 and v.bytes == sum(len(b) for b in blobs) and v.t_done is not None
