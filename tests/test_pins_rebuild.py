"""Pins survive an index rebuild: each pin is recorded in the durable tier too (consistency.steprecords.pin), and
rebuild_index restores the pins of the steps it rebuilds, so a retention pass run before a framework's next save
cannot collect a step a checkpoint still names."""

from __future__ import annotations

import logging
import time

import tierstore
from consistency.gc import Retention
from consistency.manifest import durable_manifest_name, durable_pin_name, durable_pin_prefix
from tests.test_gc import gone, saved, step_keys
from tests.test_twophase import M, save_step, shard
from tierstore.errors import AccessDeniedError
from tierstore.interop.pointer import Pointer, unpin_gone, write_pointer
from tierstore.testing.faults import FaultPlan, FaultRule, install


def pin_records(store) -> list[str]:
    return list(store.durable.list(durable_pin_prefix(M)))


def lose_index(store) -> None:
    store.index._r.flushall()
    assert store.steps.pins(M) == {} and store.steps.steps(M) == []


def reads_back_bitwise(store, step: int) -> None:
    res = store.resolve(M, step=step)
    assert res.step == step
    for (layer, rank), info in res.objects.items():
        got = store.get(info.key)
        want = shard(layer, res.layers[layer], rank)
        assert set(got.tensors) == set(want)
        for n, t in want.items():
            assert got.tensors[n].dtype == t.dtype and got.tensors[n].numpy().tobytes() == t.numpy().tobytes()


def test_pins_survive_a_lost_index_and_keep_their_steps_through_retention(store):
    saved(store, range(1, 6))
    store.steps.pin(M, "/run/epoch=0-step=1.ckpt", 1)
    store.steps.pin(M, "/run/epoch=0-step=3.ckpt", 3)
    assert sorted(pin_records(store)) == sorted([durable_pin_name(M, "/run/epoch=0-step=1.ckpt", 1),
                                                 durable_pin_name(M, "/run/epoch=0-step=3.ckpt", 3)])
    lose_index(store)
    report = store.rebuild_index()
    assert report.restored == {M: [1, 2, 3, 4, 5]}
    assert report.pins == {M: 2} and report.pins_ignored == {}
    assert report.to_json()["pins"] == {M: 2}
    assert store.steps.pins(M) == {"/run/epoch=0-step=1.ckpt": 1, "/run/epoch=0-step=3.ckpt": 3}
    gc = store.gc(M, Retention(keep_last=1), dry_run=False)
    assert gc.kept_steps == [1, 3, 5] and gc.dropped_steps == [2, 4]
    for s in (2, 4):  # unpinned: collected from every tier
        assert all(gone(store, k) for k in step_keys(s))
        assert not store.durable.exists(durable_manifest_name(M, s))
    for s in (1, 3):
        reads_back_bitwise(store, s)
    assert store.steps.durable_pin_failures == 0


def test_a_moved_pin_is_only_at_its_new_step_after_a_rebuild(store):
    saved(store, range(1, 5))
    store.steps.pin(M, "/run/last.ckpt", 1)
    store.steps.pin(M, "/run/last.ckpt", 3)
    assert pin_records(store) == [durable_pin_name(M, "/run/last.ckpt", 3)]  # the superseded record went
    lose_index(store)
    report = store.rebuild_index(M)
    assert report.pins == {M: 1}
    assert store.steps.pinned(M) == {"/run/last.ckpt": [3]}
    gc = store.gc(M, Retention(keep_last=1), dry_run=False)
    assert gc.kept_steps == [3, 4] and gc.dropped_steps == [1, 2]
    assert all(gone(store, k) for k in step_keys(1))
    reads_back_bitwise(store, 3)


def test_a_crash_while_a_pin_moves_keeps_both_steps_until_the_pointer_settles_it(store, tmp_path, monkeypatch):
    saved(store, range(1, 6))
    run = tmp_path / "run"
    path = str(run / "last.ckpt")
    store.steps.pin(M, path, 1)
    write_pointer(path, Pointer(M, 1, path, "lightning", 0.0, {"pin": path}))
    with monkeypatch.context() as m:  # the process dies between writing the new record and deleting the old one
        m.setattr(store.steps, "_drop_pin_records", lambda *a, **k: None)
        store.steps.pin(M, path, 3)  # ... and before the pointer was rewritten: it still names step 1
    assert sorted(pin_records(store)) == sorted([durable_pin_name(M, path, 1), durable_pin_name(M, path, 3)])
    lose_index(store)
    report = store.rebuild_index(M)
    assert report.pins == {M: 2}
    assert store.steps.pinned(M) == {path: [3, 1]} and store.steps.pins(M) == {path: 3}
    gc = store.gc(M, Retention(keep_last=1), dry_run=False)
    assert gc.kept_steps == [1, 3, 5] and gc.dropped_steps == [2, 4]  # both kept: keeping more is safe
    reads_back_bitwise(store, 1)
    reads_back_bitwise(store, 3)
    # the next save's check of the run directory: the pointer names step 1, so the label keeps step 1 only
    assert unpin_gone(store, M, str(run)) == []
    assert store.steps.pinned(M) == {path: [1]}
    assert pin_records(store) == [durable_pin_name(M, path, 1)]
    gc = store.gc(M, Retention(keep_last=1), dry_run=False)
    assert gc.kept_steps == [1, 5] and gc.dropped_steps == [3]
    reads_back_bitwise(store, 1)


def test_a_failing_durable_write_still_sets_the_index_pin_and_is_visible(store, monkeypatch, caplog):
    saved(store, range(1, 4))
    real = store.durable.put

    def put(name, data, **kw):
        if "/_pins/" in name:
            raise AccessDeniedError(f"denied: {name}")
        return real(name, data, **kw)

    monkeypatch.setattr(store.durable, "put", put)
    with caplog.at_level(logging.WARNING, logger="consistency.steprecords"):
        store.steps.pin(M, "/run/best.ckpt", 1)  # does not raise
    assert store.steps.pins(M) == {"/run/best.ckpt": 1}  # the index pin is set
    assert store.steps.durable_pin_failures == 1
    assert "/run/best.ckpt" in store.steps.last_durable_pin_failure and "denied" in store.steps.last_durable_pin_failure
    assert any("was not written" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    assert pin_records(store) == []
    gc = store.gc(M, Retention(keep_last=1), dry_run=False)
    assert gc.kept_steps == [1, 3] and gc.dropped_steps == [2]  # the index pin keeps its step
    reads_back_bitwise(store, 1)


def test_an_unpin_deletes_the_records_and_the_step_goes_after_a_rebuild(store):
    saved(store, range(1, 4))
    store.steps.pin(M, "/run/a.ckpt", 1)
    store.steps.unpin(M, ["/run/a.ckpt"])
    assert pin_records(store) == []
    lose_index(store)
    report = store.rebuild_index(M)
    assert report.pins == {} and store.steps.pins(M) == {}
    gc = store.gc(M, Retention(keep_last=1), dry_run=False)
    assert gc.dropped_steps == [1, 2] and all(gone(store, k) for k in step_keys(1))


def test_a_pin_record_of_a_step_that_is_not_durable_is_ignored_and_reported(store):
    saved(store, range(1, 4))
    store.steps.pin(M, "/run/a.ckpt", 2)
    store.steps.pin(M, "/run/b.ckpt", 3)
    store.durable.delete(durable_manifest_name(M, 2))  # step 2 is no longer durable
    store.durable.put(f"{durable_pin_prefix(M)}junk.pin", b'{"version": 1, "model": "gpt"}')
    lose_index(store)
    report = store.rebuild_index(M)
    assert report.restored == {M: [1, 3]} and report.pins == {M: 1}
    assert "not durable" in report.pins_ignored[durable_pin_name(M, "/run/a.ckpt", 2)]
    assert "not a pin" in report.pins_ignored[f"{durable_pin_prefix(M)}junk.pin"]
    assert store.steps.pins(M) == {"/run/b.ckpt": 3}


def test_without_a_durable_tier_pins_are_index_only(tmp_path, redis_url, shm_root):
    s = tierstore.open(tmp_path / "mem", redis=redis_url, durable="none", host_root=str(shm_root / "n"),
                       node_id="n")
    try:
        save_step(s, 1, 2)
        s.steps.pin(M, "/run/a.ckpt", 1)
        assert s.steps.pins(M) == {"/run/a.ckpt": 1} and s.steps.durable_pin_failures == 0
        s.steps.unpin(M, ["/run/a.ckpt"])
        assert s.steps.pins(M) == {}
    finally:
        s.close()


def test_a_hung_durable_tier_holds_a_pin_no_longer_than_its_deadline_and_the_records_follow_in_order(store, caplog):
    saved(store, range(1, 4))
    plan = install(store, FaultPlan([FaultRule("backend.put@durable", "hang", delay_s=60.0)]))  # a stuck mount
    store.steps.pin_record_timeout_s = 0.5
    path = "/run/last.ckpt"
    with caplog.at_level(logging.WARNING, logger="consistency.steprecords"):
        t0 = time.monotonic()
        store.steps.pin(M, path, 1)  # its record's put hangs (up to 60 s): the pin returns at its deadline
        first = time.monotonic() - t0
        t0 = time.monotonic()
        store.steps.pin(M, path, 3)  # the label moves while the first record still hangs: bounded too
        second = time.monotonic() - t0
    assert 0.5 <= first < 5 and second < 5, (first, second)
    assert store.steps.pins(M) == {path: 3}  # the index pins stand
    assert store.steps.durable_pin_failures == 2 and "not written" in store.steps.last_durable_pin_failure
    assert any("did not answer within 0.5 s" in r.getMessage() and r.levelno == logging.WARNING
               for r in caplog.records)
    assert pin_records(store) == []
    plan.arm()  # the mount recovers: the hung put goes on, then the next record, in the order of the pins
    deadline = time.monotonic() + 20
    while pin_records(store) != [durable_pin_name(M, path, 3)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pin_records(store) == [durable_pin_name(M, path, 3)]  # step 1's record written, then superseded
    assert store.steps.durable_pin_failures == 2  # the late writes are not counted again
    lose_index(store)
    assert store.rebuild_index(M).pins == {M: 1} and store.steps.pins(M) == {path: 3}
