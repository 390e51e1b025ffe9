"""Garbage collection: retention, reachability through delta chains and refs, aborted steps, in-flight steps."""

from __future__ import annotations

import threading

import torch

from consistency.gc import Retention
from consistency.manifest import durable_manifest_name
from tests.test_twophase import M, save_step, shard
from tierstore import ShardKey
from tierstore.delta import xor_delta


def everywhere(store, key: ShardKey) -> dict[str, bool]:
    return {"index": store.info(key) is not None, "host": store.host.exists(str(key)),
            "durable": store.durable.exists(str(key))}


def gone(store, key: ShardKey) -> bool:
    return not any(everywhere(store, key).values())


def present(store, key: ShardKey) -> bool:
    return all(everywhere(store, key).values())


def step_keys(step: int, world: int = 2, layers=("a", "b")) -> list[ShardKey]:
    return [ShardKey(M, ly, step, r) for ly in layers for r in range(world)]


def test_keep_last_k_and_every_mth_durable(store):
    for s in range(1, 7):
        save_step(store, s, 2)
    store.flush()
    report = store.gc(M, Retention(keep_last=2, keep_durable_every=3), dry_run=False)
    assert report.kept_steps == [3, 5, 6] and report.dropped_steps == [1, 2, 4]
    for s in (1, 2, 4):
        assert all(gone(store, k) for k in step_keys(s))
        assert not store.durable.exists(durable_manifest_name(M, s))
        assert store.steps.state(M, s) is None and store.steps.manifest(M, s) is None
    for s in (3, 5, 6):
        assert all(present(store, k) for k in step_keys(s))
        assert store.durable.exists(durable_manifest_name(M, s))
    assert store.resolve(M).step == 6
    assert len(report.deleted) == 12 and report.bytes_freed > 0


def test_dry_run_deletes_nothing(store):
    for s in range(1, 4):
        save_step(store, s, 2)
    store.flush()
    sizes = {str(k): store.info(k).size for s in (1, 2) for k in step_keys(s)}
    report = store.gc(M, Retention(keep_last=1))
    assert report.dry_run and sorted(report.deleted) == sorted(sizes) and report.bytes_freed == sum(sizes.values())
    assert all(present(store, k) for s in (1, 2, 3) for k in step_keys(s))
    assert [s for s, _ in store.steps.steps(M)] == [1, 2, 3]


def put_delta(store, key: ShardKey, base: ShardKey, new: dict, old: dict):
    layout = {n: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)} for n, t in old.items()}
    return store.put(key, {n: xor_delta(new[n], old[n]) for n in old}, {"_delta": layout}, kind="delta", base=base)


def test_delta_chains_and_refs_keep_what_they_reach(store):
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


def test_objects_waiting_for_migration_are_deferred(store):
    save_step(store, 1, 2, ok=False)
    store.flush()
    for k in step_keys(1):
        store.index.remove_tier(k, "durable")  # as if still queued for migration
    report = store.gc(M, Retention(keep_last=1), dry_run=False)
    assert report.deleted == [] and sorted(report.deferred) == sorted(map(str, step_keys(1)))
    for k in step_keys(1):
        store.index.add_tier(k, "durable")
    assert len(store.gc(M, Retention(keep_last=1), dry_run=False).deleted) == 4
    assert all(gone(store, k) for k in step_keys(1))


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
