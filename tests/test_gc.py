"""Garbage collection: retention, reachability through delta chains and refs, aborted steps, in-flight steps."""

from __future__ import annotations

import threading

import pytest
import torch

from consistency.gc import Retention
from consistency.manifest import durable_manifest_name
from tests._tiers import copies
from tests.test_twophase import M, save_step, shard
from tierstore import ShardKey
from tierstore.codec import decode
from tierstore.delta import xor_delta
from tierstore.readpath import resolve


def everywhere(store, key: ShardKey) -> dict[str, bool]:
    return {"index": store.info(key) is not None, "host": bool(copies(store.host, key)),
            "durable": bool(copies(store.durable, key))}


def gone(store, key: ShardKey) -> bool:
    return not any(everywhere(store, key).values())


def present(store, key: ShardKey) -> bool:
    return all(everywhere(store, key).values())


def step_keys(step: int, world: int = 2, layers=("a", "b")) -> list[ShardKey]:
    return [ShardKey(M, ly, step, r) for ly in layers for r in range(world)]


def saved(store, steps, world: int = 2) -> None:
    """Save ``steps``, each migrated before the next (the durable tier keeps up)."""
    for s in steps:
        save_step(store, s, world)
        store.flush()


def test_keep_last_k_and_every_mth_durable(store):
    saved(store, range(1, 7))
    report = store.gc(M, Retention(keep_last=2, keep_durable_every=3), dry_run=False)
    assert report.kept_steps == [3, 5, 6] and report.dropped_steps == [1, 2, 4]
    assert report.durable_only == [3] and sorted(report.released) == sorted(map(str, step_keys(3)))
    for s in (1, 2, 4):
        assert all(gone(store, k) for k in step_keys(s))
        assert not store.durable.exists(durable_manifest_name(M, s))
        assert store.steps.state(M, s) is None and store.steps.manifest(M, s) is None
    for s in (5, 6):
        assert all(present(store, k) for k in step_keys(s))
        assert store.durable.exists(durable_manifest_name(M, s))
    # step 3 is kept by the durable tier only: its memory copies went, its durable copies and records stay
    assert all(everywhere(store, k) == {"index": True, "host": False, "durable": True} for k in step_keys(3))
    assert store.durable.exists(durable_manifest_name(M, 3)) and store.steps.state(M, 3) == "durable"
    assert all("host" not in store.info(k).tiers for k in step_keys(3))
    got = store.resolve(M, step=3)  # still restorable, from the durable tier
    for (layer, r), info in got.objects.items():
        assert torch.equal(store.get(info.key).tensors["w"], shard(layer, 3, r)["w"])
    assert store.resolve(M).step == 6
    assert len(report.deleted) == 12 and report.bytes_freed > 0


def test_the_newest_durable_step_stays_while_newer_steps_are_memory_only(store):
    saved(store, [1, 2])
    gate = threading.Event()
    store.rewire(before_migrate=lambda key: gate.wait(30) if key.step >= 3 else None)
    save_step(store, 3, 2)
    save_step(store, 4, 2)  # committed, migration held up: the durable tier lags two steps
    try:
        report = store.gc(M, Retention(keep_last=1), dry_run=False)
        assert report.kept_steps == [2, 4] and report.durable_only == [2]
        assert 3 not in report.dropped_steps and report.dropped_steps == [1]  # 3 may still become durable
        assert sorted(report.deferred) == sorted(map(str, step_keys(3)))
        assert all(everywhere(store, k) == {"index": True, "host": False, "durable": True} for k in step_keys(2))
        # a node loss now (every memory copy gone): what the durable tier alone holds restores step 2
        res = resolve(store.steps, [store.durable], M)
        assert res.step == 2 and sorted(res.skipped) == [3, 4]
        for (layer, r), info in res.objects.items():
            assert torch.equal(decode(store.durable.get(info.name)).tensors["w"], shard(layer, 2, r)["w"])
    finally:
        gate.set()
    store.flush()


def test_dry_run_deletes_nothing(store):
    saved(store, range(1, 4))
    sizes = {str(k): store.info(k).size for s in (1, 2) for k in step_keys(s)}
    report = store.gc(M, Retention(keep_last=1))
    assert report.dry_run and sorted(report.deleted) == sorted(sizes) and report.bytes_freed == sum(sizes.values())
    assert report.dropped_steps == [1, 2] and report.kept_steps == [3]
    assert all(present(store, k) for s in (1, 2, 3) for k in step_keys(s))
    assert [s for s, _ in store.steps.steps(M)] == [1, 2, 3]
    assert all(store.durable.exists(durable_manifest_name(M, s)) for s in (1, 2, 3))


def test_retention_deletes_a_steps_objects_in_batches_not_one_round_trip_each(store, monkeypatch):
    """gc deletes the collected objects through the index's batch delete, in scripts of at most
    ``_DELETE_BATCH`` records: 8 objects in batches of 3 are 3 scripts, none deleted one by one."""
    import consistency.objects as objects

    saved(store, range(1, 4))  # steps 1 and 2 go under keep_last=1: 8 objects
    monkeypatch.setattr(objects, "_DELETE_BATCH", 3)
    scripts, singles = [], []
    many = store.index._delete_many
    monkeypatch.setattr(type(store.index), "_delete_many", property(
        lambda self: lambda **kw: scripts.append(len(kw["keys"]) - 2) or many(**kw)))  # less objs, byrank
    one = store.index.delete_object
    monkeypatch.setattr(store.index, "delete_object", lambda *a, **kw: singles.append(a) or one(*a, **kw))
    report = store.gc(M, Retention(keep_last=1), dry_run=False)
    assert report.dropped_steps == [1, 2] and len(report.deleted) == 8
    assert scripts == [3, 3, 2] and singles == []
    assert all(gone(store, k) for s in (1, 2) for k in step_keys(s))
    assert all(present(store, k) for k in step_keys(3))


def test_a_batched_delete_leaves_a_record_that_names_another_copy(store):
    """The batch delete removes a record only while it names the copy asked for, as the single one does: a
    record replaced meanwhile (it names a newer copy) stays, and so does that copy; an absent one is False."""
    saved(store, [1])
    a, b = step_keys(1)[:2]
    rec_a, rec_b = store.info(a), store.info(b)
    absent = ShardKey(M, "nope", 1, 0)
    got = store._collect([(a, rec_a.name), (b, rec_b.name + "-other"), (absent, "x")])
    assert got == [True, False, False]
    assert gone(store, a)
    assert present(store, b) and store.info(b).name == rec_b.name
    assert decode(store.host.get(rec_b.name)) is not None


def put_delta(store, key: ShardKey, base: ShardKey, new: dict, old: dict):
    layout = {n: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)} for n, t in old.items()}
    return store.put(key, {n: xor_delta(new[n], old[n]) for n in old}, {"_delta": layout}, kind="delta", base=base)


def _chains_and_refs(store) -> None:
    """Steps 1-3 of two ranks with delta chains and a ref across ranks (see the comment)."""
    # step 1: a full on both ranks; step 2: rank 0 delta on step 1, rank 1 a ref to rank 0's step-1 shard;
    # step 3: rank 0 delta on step 2, rank 1 delta on its own step 1. Layer b is full every step.
    infos = {}
    for s in (1, 2, 3):
        store.begin_step(M, s, 2)
        for r in range(2):
            k = ShardKey(M, "a", s, r)
            if s == 1:
                infos[k] = store.put(k, shard("a", s, r))
            elif r == 0:
                infos[k] = put_delta(store, k, k.with_step(s - 1), shard("a", s, r), shard("a", s - 1, r))
            elif s == 2:
                infos[k] = store.put(k, {}, kind="ref", target=ShardKey(M, "a", 1, 0))
            else:
                infos[k] = put_delta(store, k, k.with_step(1), shard("a", s, r), shard("a", 1, r))
            kb = ShardKey(M, "b", s, r)
            infos[kb] = store.put(kb, shard("b", s, r))
            assert store.vote(M, s, r, [infos[k], infos[kb]]) in ("preparing", "committed")


def test_delta_chains_and_refs_keep_what_they_reach(store):
    _chains_and_refs(store)
    store.flush()
    store.gc(M, Retention(keep_last=1), dry_run=False)
    for k in [ShardKey(M, "a", 1, 0), ShardKey(M, "a", 1, 1), ShardKey(M, "a", 2, 0), ShardKey(M, "a", 3, 0),
              ShardKey(M, "a", 3, 1), ShardKey(M, "b", 3, 0), ShardKey(M, "b", 3, 1)]:
        assert present(store, k), k
    for k in [ShardKey(M, "a", 2, 1), ShardKey(M, "b", 1, 0), ShardKey(M, "b", 2, 1)]:
        assert gone(store, k), k
    got = store.get(ShardKey(M, "a", 3, 0))
    assert torch.equal(got.tensors["w"], shard("a", 3, 0)["w"])
    res = store.resolve(M)
    assert res.step == 3
    for (layer, r), info in res.objects.items():
        assert torch.equal(store.get(info.key).tensors["w"], shard(layer, 3, r)["w"])
    # a second pass finds nothing more to delete: the kept chain is stable
    assert store.gc(M, Retention(keep_last=1), dry_run=False).deleted == []


def _index_closure(store, step: int) -> set:
    """What a restore of ``step`` reads, with every link followed through the index's records (as retention
    did before it trusted a closed complete set)."""
    from consistency.closure import closure, read_keys, required_steps

    roots = set()
    for s in required_steps(store.steps, M, [step]):
        roots |= read_keys(store.steps.manifest(M, s))
    return closure(store.index, roots)


def test_a_closed_complete_set_is_what_the_index_links_reach(store, monkeypatch):
    """Retention takes a committed manifest's complete set as closed, reading no object record: for delta chains
    and a ref across ranks it is exactly what following every link through the index reaches. A manifest from
    before complete sets (no ``inherited``, ``deps``, ``requires``, ``missing``) is followed through the index."""
    from consistency.closure import is_closed, reachable

    _chains_and_refs(store)
    store.flush()
    for step in (1, 2, 3):
        assert is_closed(store.steps.manifest(M, step))
        reads = []
        real = store.index.get_objects
        monkeypatch.setattr(store.index, "get_objects", lambda keys: reads.append(len(keys)) or real(keys))
        got = reachable(store.steps, M, [step])
        monkeypatch.undo()
        assert reads == [] and got == _index_closure(store, step), step
    assert ShardKey(M, "a", 1, 0) in reachable(store.steps, M, [2])  # rank 1's ref at step 2 reaches it

    real_manifest = store.steps.manifest

    def older(model, step):  # as a manifest written before complete sets: its own objects alone
        m = real_manifest(model, step)
        return m and {k: v for k, v in m.items() if k not in ("inherited", "deps", "requires", "missing")}

    monkeypatch.setattr(store.steps, "manifest", older)
    assert not is_closed(older(M, 3))
    assert reachable(store.steps, M, [3]) == _index_closure(store, 3) >= {ShardKey(M, "a", 1, 1),
                                                                          ShardKey(M, "a", 2, 0)}


def test_a_lagging_step_is_retired_once_its_migration_gave_up(store):
    saved(store, [1])
    gate = threading.Event()
    store.rewire(before_migrate=lambda key: gate.wait(30) if key.step == 2 else None)
    save_step(store, 2, 2)
    save_step(store, 3, 2)
    store.steps.mark_memory_only(M, 2, "not migrated: step 3 was migrated first")  # as the migrator says
    report = store.gc(M, Retention(keep_last=1), dry_run=True)
    assert 2 in report.dropped_steps and report.deferred == []
    gate.set()
    store.flush()


def test_aborted_step_objects_are_collected_whatever_their_migration(store):
    save_step(store, 1, 2, ok=False)
    store.flush()
    for k in step_keys(1):
        store.index.remove_tier(k, "durable")  # as if still queued for migration
    report = store.gc(M, Retention(keep_last=1), dry_run=False)
    assert sorted(report.deleted) == sorted(map(str, step_keys(1))) and report.deferred == []
    assert all(gone(store, k) for k in step_keys(1))


def test_keep_last_below_one_is_refused():
    from tierstore.errors import ConfigError

    for bad in ({"keep_last": 0}, {"keep_durable": 0}, {"keep_durable_every": -1}):
        with pytest.raises(ConfigError):
            Retention(**bad)


def test_aborted_steps_are_removed_from_every_tier(store):
    save_step(store, 1, 2)
    save_step(store, 2, 2, ok=False)
    store.flush()
    assert all(present(store, k) for k in step_keys(2))
    report = store.gc(M, Retention(keep_last=5), dry_run=False)
    assert report.dropped_steps == [2]
    assert all(gone(store, k) for k in step_keys(2)) and all(present(store, k) for k in step_keys(1))
    assert store.steps.state(M, 2) == "aborted"  # the decision stays: a late vote cannot re-open it
    assert store.vote(M, 2, 0, []) == "aborted"


def test_aborted_tombstones_stay_bounded_by_the_windows(store):
    """A long run with many aborted steps does not keep a record of each for ever: a tombstone older than every
    kept step, with a kept step of its epoch newer than it, goes with its objects; a newer one stays (a late
    vote is still answered ``aborted``); a vote for a step whose record went opens nothing (typed)."""
    from tierstore.errors import CommitError

    for s in range(1, 13):
        save_step(store, s, 2, ok=s % 3 != 0)  # steps 3, 6, 9, 12 aborted
        store.flush()
    store.gc(M, Retention(keep_last=2), dry_run=False)  # keeps 10, 11
    listed = dict(store.steps.steps(M))
    assert listed == {10: "durable", 11: "durable", 12: "aborted"}, listed
    assert all(gone(store, k) for s in (3, 6, 9, 12) for k in step_keys(s))
    assert store.vote(M, 12, 0, []) == "aborted"
    with pytest.raises(CommitError):
        store.vote(M, 9, 0, [])  # a vote never opens a step: nothing is re-created
    assert store.steps.state(M, 9) is None
    assert store.resolve(M, step=11) is not None


def test_a_tombstone_stays_while_no_kept_step_of_its_epoch_is_newer(store):
    """The proof a tombstone may go is a kept step of its own (or a newer) epoch after it: a new incarnation
    that fell back to step 1 and has committed nothing yet keeps its aborted step 2's record, though the
    older incarnation's step 3 is kept (the new incarnation's ranks may still begin 2)."""
    for s in (1, 3):
        save_step(store, s, 2, epoch=1)
        store.flush()
    store.begin_step(M, 2, 2, epoch=2)
    store.vote(M, 2, 0, [], ok=False, epoch=2)
    store.gc(M, Retention(keep_last=1), dry_run=False)
    assert store.steps.state(M, 2) == "aborted"
    assert store.steps.begin(M, 2, 2, epoch=2) == "aborted"  # the same incarnation cannot open it again


def test_collecting_an_aborted_step_leaves_a_new_attempt_of_it_alone(store):
    """Retention planned on an aborted step; before it acts, a newer incarnation begins that step number
    again: its records (the new attempt's votes) are not collected, and it commits."""
    from consistency.gc import plan_retention, retire

    save_step(store, 1, 2, epoch=1)
    save_step(store, 2, 2, epoch=1, ok=False)
    save_step(store, 3, 2, epoch=1)
    store.flush()
    plan = plan_retention(store.steps, M, Retention(keep_last=1))
    assert 2 in plan.expired
    assert store.steps.begin(M, 2, 2, epoch=2) == "preparing"  # a newer incarnation saves number 2 again
    infos = [store.put(ShardKey(M, ly, 2, 0), shard(ly, 2, 0), epoch=2) for ly in ("a", "b")]
    assert store.vote(M, 2, 0, infos, epoch=2) == "preparing"
    retire(store.steps, M, plan, [], delete=lambda *a: None, release=lambda *a: True, drop=lambda *a: None)
    assert store.steps.state(M, 2) == "preparing" and store.steps.records(M, [2])[0].votes == 1
    infos = [store.put(ShardKey(M, ly, 2, 1), shard(ly, 2, 1), epoch=2) for ly in ("a", "b")]
    assert store.vote(M, 2, 1, infos, epoch=2) == "committed"


def test_in_flight_steps_and_what_they_reach_are_never_touched(store):
    save_step(store, 1, 2)
    save_step(store, 2, 2)
    save_step(store, 3, 2)
    # step 4 is being prepared: rank 0 wrote a delta on its step-1 shard of layer a and has not voted
    store.begin_step(M, 4, 2)
    k4 = ShardKey(M, "a", 4, 0)
    put_delta(store, k4, k4.with_step(1), shard("a", 4, 0), shard("a", 1, 0))
    orphan = ShardKey(M, "b", 5, 0)  # written before its step began
    store.put(orphan, shard("b", 5, 0))
    store.flush()
    store.gc(M, Retention(keep_last=1), dry_run=False)
    assert present(store, k4) and present(store, ShardKey(M, "a", 1, 0)) and present(store, orphan)
    assert gone(store, ShardKey(M, "b", 1, 0)) and gone(store, ShardKey(M, "a", 2, 0))
    assert torch.equal(store.get(k4).tensors["w"], shard("a", 4, 0)["w"])


def test_gc_concurrent_with_training(store):
    stop = threading.Event()
    errors = []

    def gc_loop():
        while not stop.is_set():
            try:
                store.gc(M, Retention(keep_last=2), dry_run=False)
            except Exception as e:  # noqa: BLE001 - collected for the assertion
                errors.append(e)

    t = threading.Thread(target=gc_loop)
    t.start()
    try:
        for s in range(1, 9):
            save_step(store, s, 2)
            res = store.resolve(M)
            assert res.step == s
            for (layer, r), info in res.objects.items():
                assert torch.equal(store.get(info.key).tensors["w"], shard(layer, s, r)["w"])
    finally:
        stop.set()
        t.join()
    assert errors == []
    store.flush()  # nothing gc deleted was still waiting for migration
    store.gc(M, Retention(keep_last=2), dry_run=False)
    assert [s for s, _ in store.steps.steps(M)] == [7, 8]


def test_gc_removes_what_an_interrupted_migration_left_in_the_durable_tier(store):
    """A migration killed mid-put leaves a temp file in a local durable directory: gc removes it once it is
    older than any put could take (an hour), and leaves a fresh one (a put in progress) alone."""
    import os
    import time

    saved(store, [1, 2])
    layer_dir = store.durable.root / M / "a" / "1"
    stale, fresh = layer_dir / ".tmp~0~deadbeef0001", layer_dir / ".tmp~1~deadbeef0002"
    for p in (stale, fresh):
        p.write_bytes(b"half an object")
    old = time.time() - 7200
    os.utime(stale, (old, old))
    report = store.gc(M, Retention(keep_last=2), dry_run=False)
    assert report.temp_removed == 1 and not stale.exists() and fresh.exists()


def test_a_held_step_keeps_what_it_reads_from_a_retired_step(store):
    """A committed step whose migration is still running is held (not retired); what its restore reads must
    stay with it, even from a step that is retired. Found by tests/test_gc_live.py (layer-wise, gc beside a
    live trainer: a held step's inherited layer was deleted with its retired base step, and the held step no
    longer restored: "... is not in the index")."""
    layout = {"layers": ["a", "b"]}
    saved(store, range(1, 5))  # 1-4 durable
    gate = threading.Event()
    store.rewire(before_migrate=lambda key: gate.wait(30) if key.step >= 5 else None)
    try:
        save_step(store, 5, 1)
        store.steps.mark_memory_only(M, 5, "its migration gave up")  # not held: retired by keep_last=1
        store.begin_step(M, 6, 1, layout=layout)  # rank 0 writes a only: b is inherited from step 5
        assert store.vote(M, 6, 0, [store.put(ShardKey(M, "a", 6, 0), shard("a", 6, 0))]) == "committed"
        assert [o["key"] for o in store.steps.manifest(M, 6)["inherited"]] == [f"{M}/b/5/0"]
        save_step(store, 7, 1)
        report = store.gc(M, Retention(keep_last=1), dry_run=False)
        assert 5 in report.dropped_steps and 6 not in report.dropped_steps, report
        assert store.info(ShardKey(M, "b", 5, 0)) is not None, "a held step's inherited layer was deleted"
        got = store.resolve(M, step=6, max_staleness=1)  # b is step 5's
        assert torch.equal(store.get(got.objects[("b", 0)].key).tensors["w"], shard("b", 5, 0)["w"])
    finally:
        gate.set()


def test_a_pinned_step_survives_retention_in_the_durable_tier_until_unpinned(store):
    saved(store, range(1, 5))
    store.steps.pin(M, "/run/epoch=0-step=2.ckpt", 2)
    assert store.steps.pins(M) == {"/run/epoch=0-step=2.ckpt": 2}
    report = store.gc(M, Retention(keep_last=1), dry_run=False)
    assert report.kept_steps == [2, 4] and report.dropped_steps == [1, 3]
    assert report.durable_only == [2]  # host memory follows the window, not the number of checkpoints kept
    assert all(everywhere(store, k) == {"index": True, "host": False, "durable": True} for k in step_keys(2))
    got = store.resolve(M, step=2)
    for (layer, r), info in got.objects.items():
        assert torch.equal(store.get(info.key).tensors["w"], shard(layer, 2, r)["w"])
    store.steps.unpin(M, ["/run/epoch=0-step=2.ckpt", "/run/never-pinned.ckpt"])
    assert store.steps.pins(M) == {}
    report = store.gc(M, Retention(keep_last=1), dry_run=False)
    assert report.dropped_steps == [2] and report.kept_steps == [4]
    assert all(gone(store, k) for k in step_keys(2))


def test_pinning_a_label_again_moves_it_and_the_old_step_goes(store):
    saved(store, range(1, 4))
    store.steps.pin(M, "last", 1)
    store.steps.pin(M, "last", 3)
    assert store.steps.pins(M) == {"last": 3}
    report = store.gc(M, Retention(keep_last=1), dry_run=False)
    assert report.dropped_steps == [1, 2] and report.kept_steps == [3]


def test_a_pinned_step_not_yet_durable_stays_in_memory(store):
    saved(store, [1])
    gate = threading.Event()
    store.rewire(before_migrate=lambda key: gate.wait(30) if key.step >= 2 else None)
    save_step(store, 2, 2)
    save_step(store, 3, 2)  # committed, migration held up
    try:
        store.steps.pin(M, "best", 2)
        report = store.gc(M, Retention(keep_last=1), dry_run=False)
        assert 2 in report.kept_steps and 2 not in report.durable_only and 2 not in report.dropped_steps
        assert all(copies(store.host, k) for k in step_keys(2))  # its only copies are in memory: they stay
        res = store.resolve(M, step=2)
        assert res.step == 2
    finally:
        gate.set()
    store.flush()
    report = store.gc(M, Retention(keep_last=1), dry_run=False)
    assert report.durable_only == [2]  # durable now: its memory copies go, the pin keeps the durable ones


def test_a_pin_needs_a_label_and_a_step(store):
    from tierstore.errors import CommitError, InvalidKeyError

    saved(store, [1])
    with pytest.raises(InvalidKeyError, match="label"):
        store.steps.pin(M, "", 1)
    with pytest.raises(CommitError):
        store.steps.pin(M, "x", -1)
    assert store.steps.pins(M) == {}
