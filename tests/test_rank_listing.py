"""Retention lists one rank's objects, not the world's, and only where that cannot lose anything.

After each save the Checkpointer's retention (``tierstore.train.writing.retain``) considers this rank's
objects. It used to list every rank's (``ts:{m}:objs``) and follow what every rank's steps in flight read:
work per rank that grows with the world, at every save. It now reads the rank listing
(``ts:{m}:byrank``, :meth:`~consistency.objects.ObjectIndex.list_rank_objects`), and protects what its own
steps in flight read, which is enough while every link is rank-local (a ref within its step, a delta on its
own rank's copy that is not a ref). A record that links otherwise marks the model (``ts:{m}:xlinks``), and
retention then lists every rank's objects again. Tried here against the real Redis server:

- the rank listing is the model's listing of that rank, through records, re-records, batched deletes and
  retired copies, for ranks whose numbers share a prefix (1, 10, 11);
- each way of linking out of a rank marks the model, and the Checkpointer's own links do not;
- an index written before the rank listing (or by a writer that keeps none) is rebuilt with its mark;
- retention of one rank keeps its copy that another rank's step in flight reads through a delta across
  ranks (with the mark ignored, that copy is deleted: the mutant fails), and reads no other rank's listing
  where every link is rank-local;
- an index rebuilt from delta chains stays unmarked (the rebuild records oldest first);
- a plan for one rank (its part of each kept step's complete set) decides for that rank's objects exactly
  what the plan over every rank decides.
"""

from __future__ import annotations

import pytest

from consistency.gc import Retention
from tests.test_gc import gone, present, put_delta, saved
from tests.test_twophase import M, shard
from tierstore import ShardKey
from tierstore.train.writing import retain


def by_rank(store, rank: int) -> list[ShardKey]:
    return [k for k in store.index.list_objects(M) if k.rank == rank]


def marked(store) -> bool:
    return not store.index.list_rank_objects(M, 0)[1]


def record(store, key: ShardKey, kind: str = "full", **links) -> None:
    store.index.record_object(key, kind=kind, size=1, checksum="c", tiers=["host"], **links)


def test_the_rank_listing_is_the_models_listing_of_that_rank(store, monkeypatch):
    rebuilt = []
    rebuild = store.index._byrank_rebuild
    monkeypatch.setattr(type(store.index), "_byrank_rebuild", property(
        lambda self: lambda **kw: rebuilt.append(kw) or rebuild(**kw)))
    ranks = (0, 1, 10, 11)  # "1/..." must not list 10's or 11's
    for step in (1, 2):
        for r in ranks:
            for layer in ("a", "b"):
                record(store, ShardKey(M, layer, step, r))
    record(store, ShardKey(M, "a", 1, 10))  # recorded again: one member still
    for r in (*ranks, 2):
        assert store.index.list_rank_objects(M, r) == (by_rank(store, r), True)
    assert len(store.index.list_rank_objects(M, 1)[0]) == 4 and store.index.list_rank_objects(M, 2)[0] == []
    store.index.delete_objects([(ShardKey(M, "a", 1, 1), None), (ShardKey(M, "b", 2, 10), None)])
    store.index.retire_copies(M, 2, [(ShardKey(M, "a", 2, 11), str(ShardKey(M, "a", 2, 11)))])
    for r in ranks:
        listed, local = store.index.list_rank_objects(M, r)
        assert listed == by_rank(store, r) and local
    assert ShardKey(M, "a", 1, 1) not in store.index.list_rank_objects(M, 1)[0]
    assert ShardKey(M, "a", 2, 11) not in store.index.list_rank_objects(M, 11)[0]
    assert rebuilt == [], "every script that changes the model's listing changes the rank listing with it"


A1, A2 = ShardKey(M, "a", 1, 0), ShardKey(M, "a", 2, 0)


@pytest.mark.parametrize("how", ["ref to another step", "delta on another rank", "delta on a ref",
                                 "delta on a copy not recorded", "a ref over a copy that was not one",
                                 "ref to another model"])
def test_a_link_out_of_a_rank_marks_the_model(store, how):
    record(store, A1)
    record(store, ShardKey(M, "a", 1, 1))
    assert not marked(store)
    if how == "ref to another step":
        record(store, ShardKey(M, "a", 2, 1), "ref", target=A1)
    elif how == "delta on another rank":
        record(store, ShardKey(M, "a", 2, 1), "delta", base=A1)
    elif how == "delta on a ref":
        record(store, ShardKey(M, "b", 1, 1), "ref", target=ShardKey(M, "b", 1, 0))  # within its step: local
        assert not marked(store)
        record(store, ShardKey(M, "b", 2, 1), "delta", base=ShardKey(M, "b", 1, 1))
    elif how == "delta on a copy not recorded":
        record(store, A2, "delta", base=ShardKey(M, "z", 1, 0))
    elif how == "a ref over a copy that was not one":  # a delta on A1 recorded before now rests on a ref
        record(store, A1, "ref", target=ShardKey(M, "a", 1, 1))
    else:
        record(store, ShardKey(M, "a", 1, 2), "ref", target=ShardKey("other", "a", 1, 0))
    assert marked(store)
    assert store.index.list_rank_objects(M, 0)[0] == by_rank(store, 0)  # the listing itself is unchanged


def test_the_checkpointers_own_links_leave_the_model_unmarked(store):
    """A ref to another rank's copy of the same step (dedup), a delta on the rank's own full copy, and a
    delta on a delta: what ``write_layer`` records."""
    record(store, A1)
    record(store, ShardKey(M, "a", 1, 1), "ref", target=A1)
    record(store, A2, "delta", base=A1)
    record(store, ShardKey(M, "a", 3, 0), "delta", base=A2)
    record(store, ShardKey(M, "a", 3, 1), "ref", target=ShardKey(M, "a", 3, 0))
    record(store, A1)  # a full recorded again over a full
    assert not marked(store)


@pytest.mark.parametrize("link", ["local", "out of a rank"])
def test_an_index_without_the_rank_listing_is_rebuilt_with_its_mark(store, link):
    for r in (0, 1, 10):
        record(store, ShardKey(M, "a", 1, r))
        record(store, ShardKey(M, "a", 2, r), "delta", base=ShardKey(M, "a", 1, r))
    if link != "local":
        record(store, ShardKey(M, "b", 2, 1), "ref", target=ShardKey(M, "a", 1, 0))
    r = store.index._r  # as an index written before the rank listing existed: neither key
    r.delete(store.index._k(M, "byrank"), store.index._k(M, "xlinks"))
    listed, local = store.index.list_rank_objects(M, 1)
    assert listed == by_rank(store, 1) and local == (link == "local")
    assert r.zcard(store.index._k(M, "byrank")) == r.zcard(store.index._k(M, "objs")) == (7 if link != "local" else 6)
    # a writer that keeps no rank listing recorded one more: the counts differ, and the listing is rebuilt
    r.zadd(store.index._k(M, "objs"), {"c/3/1": 3})
    assert ShardKey(M, "c", 3, 1) in store.index.list_rank_objects(M, 1)[0]


def _three_steps_and_a_fourth_in_flight(store, cross: bool) -> ShardKey:
    """Steps 1-3 committed on 2 ranks (layers a and b, full copies); step 4 begun, and rank 1 has written
    its layer a as a delta on rank 0's step-1 copy (``cross``) or on its own. Returns that base."""
    saved(store, (1, 2, 3))  # each durable before the next
    store.begin_step(M, 4, 2)
    k = ShardKey(M, "a", 4, 1)
    base = ShardKey(M, "a", 1, 0 if cross else 1)
    put_delta(store, k, base, shard("a", 4, 1), shard("a", 1, base.rank))
    return base


def test_retention_of_a_rank_keeps_its_copy_another_ranks_step_in_flight_reads(store):
    base = _three_steps_and_a_fourth_in_flight(store, cross=True)
    assert marked(store)
    retain(store, M, 0, 1, 0, None)
    assert present(store, base), "rank 1's step in flight reads it"
    assert gone(store, ShardKey(M, "b", 1, 0)) and gone(store, ShardKey(M, "a", 2, 0))
    assert present(store, ShardKey(M, "a", 3, 0))
    assert present(store, ShardKey(M, "a", 1, 1)) and present(store, ShardKey(M, "a", 2, 1)), "another rank's"


def test_retention_of_a_rank_reads_its_own_listing_where_links_are_rank_local(store, monkeypatch):
    base = _three_steps_and_a_fourth_in_flight(store, cross=False)
    assert not marked(store)
    listings = []
    whole = store.index.list_objects
    monkeypatch.setattr(store.index, "list_objects", lambda *a, **kw: listings.append(a) or whole(*a, **kw))
    retain(store, M, 1, 1, 0, None)
    assert listings == [], "retention listed every rank's objects"
    assert present(store, base), "its own step in flight reads it"
    assert gone(store, ShardKey(M, "a", 2, 1)) and gone(store, ShardKey(M, "b", 1, 1))
    assert present(store, ShardKey(M, "a", 1, 0)) and present(store, ShardKey(M, "a", 2, 0)), "another rank's"
    retain(store, M, 0, 1, 0, None)  # rank 0's pass: rank 1's delta on its own copy protects none of rank 0's
    assert gone(store, ShardKey(M, "a", 1, 0)) and gone(store, ShardKey(M, "a", 2, 0))
    assert present(store, base) and present(store, ShardKey(M, "a", 3, 0))
    store.gc(M, Retention(keep_last=1), dry_run=True)  # the admin's pass still lists every rank's
    assert listings


def test_an_index_rebuilt_from_delta_chains_stays_unmarked(store):
    """A rebuild records a step's objects and then the older copies its deltas rest on (``deps``): oldest
    first, so no delta is recorded before its base and retention keeps to one rank's listing after it."""
    for s in (1, 2, 3):
        store.begin_step(M, s, 2)
        for r in range(2):
            k = ShardKey(M, "a", s, r)
            info = store.put(k, shard("a", s, r)) if s == 1 else \
                put_delta(store, k, k.with_step(s - 1), shard("a", s, r), shard("a", s - 1, r))
            store.vote(M, s, r, [info])
        store.flush()
    store.gc(M, Retention(keep_last=1, keep_durable=1), dry_run=False)  # step 3 alone, reading 1 and 2
    assert [s for s, _ in store.steps.steps(M)] == [3] and not marked(store)
    store.index._r.flushall()
    assert store.rebuild_index(M).restored[M] == [3]
    assert not marked(store)
    assert sorted(k.step for k in store.index.list_rank_objects(M, 1)[0]) == [1, 2, 3]


@pytest.mark.parametrize("manifests", ["closed", "older, followed through the index"])
def test_a_plan_for_one_rank_keeps_what_the_whole_plan_keeps_of_it(store, monkeypatch, manifests):
    """A plan made for one rank (its keep sets of that rank alone, read from each kept step's complete set split
    by rank) keeps and deletes exactly the objects of that rank the plan over every rank does: on delta
    chains and a ref across ranks and steps, with closed complete sets, and with older manifests whose links
    the index holds (then the whole result is computed and filtered)."""
    import consistency.closure as closure_mod
    from consistency.gc import plan_retention
    from tests.test_gc import _chains_and_refs

    if manifests != "closed":
        monkeypatch.setattr(closure_mod, "is_closed", lambda m: False)
    _chains_and_refs(store)
    store.flush()
    objects = store.index.list_objects(M)
    whole = plan_retention(store.steps, M, Retention(keep_last=1), objects=objects)
    for rank in (0, 1):
        cache: dict = {}
        for _ in range(2):  # the second pass reads the split kept with the cached manifests
            mine = plan_retention(store.steps, M, Retention(keep_last=1), objects=objects, cache=cache, rank=rank)
            assert mine.keep_memory == {k for k in whole.keep_memory if k.rank == rank}
            assert mine.keep_durable == {k for k in whole.keep_durable if k.rank == rank}
            assert {k: mine.fate(k) for k in objects if k.rank == rank} == \
                {k: whole.fate(k) for k in objects if k.rank == rank}
    assert any(whole.fate(k) == "delete" for k in objects) and any(whole.fate(k) == "keep" for k in objects)
