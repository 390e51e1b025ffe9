"""Committed means committed (issue 13), operations side: each test tries to lose, change or silently skip a
committed step through the public API and ``tierstore admin`` the way an operator would.

Item 2 a lost index, 9 step numbers at both ends of their range, 10 a durable tier or index that fails for a
while during migration, 12 nested tensors. Items 1, 3, 4, 5 and 6 are in ``tests/test_committed.py``.
"""

from __future__ import annotations

import json

import pytest
import redis
import torch

import tierstore
from consistency.manifest import durable_manifest_name
from tests._tiers import live_name
from tests.test_committed import admin_cli, conn  # noqa: F401 - the fixture
from tests.test_twophase import M, save_step, shard
from tierstore import ShardKey
from tierstore.errors import (
    CommitError,
    FencedError,
    IndexLostError,
    InvalidKeyError,
    InvalidValueError,
    KeyExistsError,
    MigrationError,
)
from tierstore.keys import MAX_STEP
from tierstore.testing.faults import FaultPlan, FaultRule, install


def lose_index(url: str) -> None:
    """The index server restarted without persistence (or a new, empty index)."""
    redis.Redis.from_url(url).flushall()


def reopen(tmp_path, redis_url, shm_root, **kw):
    return tierstore.open(tmp_path / "home2", redis=redis_url, durable=f"file://{tmp_path / 'durable'}",
                          host_root=str(shm_root / "node0"), node_id="node0", **kw)


# -- item 2: a lost index is detected, and the epoch never goes backwards --------------------------------


def test_a_lost_index_refuses_to_start_fresh_until_rebuilt(store, conn, tmp_path, redis_url, shm_root):  # noqa: F811
    e1 = store.open_epoch(M)
    for s in (1, 2):
        save_step(store, s, 2, epoch=e1)
        store.flush()  # each durable before the next (a lagging migration skips the steps between)
    assert store.steps.state(M, 2) == "durable"
    lose_index(redis_url)
    fresh = reopen(tmp_path, redis_url, shm_root)
    try:
        for call in (lambda: fresh.resolve(M), lambda: fresh.open_epoch(M),
                     lambda: fresh.begin_step(M, 1, 2, layout={"layers": ["a", "b"]}),
                     # the live writer's next begin, with its epoch (which must not hide the loss)
                     lambda: fresh.begin_step(M, 3, 2, layout={"layers": ["a", "b"]}, epoch=e1)):
            with pytest.raises(IndexLostError) as ei:  # never "nothing committed: start fresh"
                call()
            assert f"rebuild-index {M} --yes" in str(ei.value) and ei.value.durable_steps == [1, 2]
        assert list(fresh.host.list(M + "/a/1/")) == list(store.host.list(M + "/a/1/"))  # nothing overwritten
        p = admin_cli(conn, "--json", "rebuild-index", M, "--yes")
        assert p.returncode == 0, p.stderr
        assert json.loads(p.stdout)["restored"] == {M: [1, 2]}
        res = fresh.resolve(M)
        assert res.step == 2
        for (layer, rank), info in res.objects.items():
            assert torch.equal(fresh.get(info.key).tensors["w"], shard(layer, 2, rank)["w"])
        assert fresh.open_epoch(M) > e1
    finally:
        fresh.close()


def test_a_lost_index_is_rebuilt_when_configured(store, tmp_path, redis_url, shm_root):
    save_step(store, 1, 2)
    store.flush()
    lose_index(redis_url)
    fresh = reopen(tmp_path, redis_url, shm_root, rebuild_index_on_loss=True)
    try:
        assert fresh.open_epoch(M) >= 1
        assert fresh.resolve(M).step == 1 and fresh.steps.state(M, 1) == "durable"
    finally:
        fresh.close()


@pytest.mark.parametrize("lost", ["the newest steps' records", "the step list"])
def test_an_index_that_lost_some_keys_is_never_taken_for_an_older_or_fresh_job(
        store, conn, tmp_path, redis_url, shm_root, lost):  # noqa: F811
    """An index that lost some keys of a model it still knows (an operator's ``DEL``, an evicting server, a
    failover that dropped writes): a restore neither resumes from an older step nor starts fresh. It raises
    ``IndexLostError`` naming the steps and ``rebuild-index``, and after the rebuild restores the newest
    durable step, bitwise."""
    from tierstore.train.checkpointer import Checkpointer

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    ck = Checkpointer(store, M, net, keep_last=2)
    ck.restore()
    want = {}
    for s in range(4):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(0.5)
        ck.save(s)
        assert ck.wait(durable=True) == "committed"
        want[s] = {k: v.clone() for k, v in net.state_dict().items()}
    ck.close()
    r = redis.Redis.from_url(redis_url)
    k = store.index._k  # the index's key layout (consistency owns it): what an operator's DEL would name
    if lost == "the step list":
        r.delete(k(M, "steps"))
    else:
        for s in (2, 3):
            r.delete(k(M, "step", s), k(M, "manifest", s))
            r.zrem(k(M, "steps"), s)
    fresh = reopen(tmp_path, redis_url, shm_root)
    try:
        net2 = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        resumed = Checkpointer(fresh, M, net2, keep_last=2)
        with pytest.raises(IndexLostError) as ei:
            resumed.restore()
        assert 3 in ei.value.missing_steps and f"rebuild-index {M} --yes" in str(ei.value), ei.value
        p = admin_cli(conn, "--json", "rebuild-index", M, "--yes")
        assert p.returncode == 0, p.stderr
        got, _ = resumed.restore()
        assert got == 3
        assert all(torch.equal(v, want[3][n]) for n, v in net2.state_dict().items())
        resumed.close()
    finally:
        fresh.close()


def test_the_epoch_never_goes_backwards_after_an_index_loss(store, tmp_path, redis_url, shm_root):
    e1 = store.open_epoch(M)
    save_step(store, 1, 2, epoch=e1)
    store.flush()
    e2 = store.open_epoch(M)  # a second incarnation restored, then died before committing anything
    lose_index(redis_url)
    assert store.rebuild_index(M).restored == {M: [1]}
    e3 = store.open_epoch(M)
    assert e3 > e2
    with pytest.raises(FencedError):  # the second incarnation, a zombie now, stays fenced
        store.put(ShardKey(M, "a", 2, 0), shard("a", 2, 0), epoch=e2)


def test_a_differing_durable_manifest_is_never_swallowed(store):
    save_step(store, 1, 2)
    store.flush()
    save_step(store, 2, 2)
    store.flush()
    name = durable_manifest_name(M, 1)
    kept = store.durable.get(name)
    gone = live_name(store, ShardKey(M, "b", 1, 1))
    store.durable.delete(gone)  # the rebuild cannot restore step 1 ...
    lose_index(store.index.url)
    assert store.rebuild_index(M).restored == {M: [2]}
    # ... so it records step 1 aborted ("not rebuilt"), and a new incarnation saves it again, with other objects
    (rec,) = store.steps.records(M, [1])
    assert rec.state == "aborted"
    save_step(store, 1, 2, epoch=store.open_epoch(M))
    with pytest.raises(MigrationError):
        store.flush()
    assert store.durable.get(name) == kept  # the durable manifest is not replaced
    (rec,) = store.steps.records(M, [1])
    assert rec.state == "committed" and "different durable manifest" in (rec.memory_only or "")
    with pytest.raises(KeyExistsError):
        store.steps.maybe_durable(M, 1)


# -- item 9: steps are exact integers end to end ----------------------------------------------------------


def test_steps_at_both_ends_of_their_range(store):
    for s in (0, 1, MAX_STEP - 1, MAX_STEP):
        save_step(store, s, 1, layers=("a",))
    res = store.resolve(M)
    assert res.step == MAX_STEP and [s for s, _ in store.steps.steps(M)] == [0, 1, MAX_STEP - 1, MAX_STEP]
    assert torch.equal(store.get(ShardKey(M, "a", MAX_STEP, 0)).tensors["w"], shard("a", MAX_STEP, 0)["w"])
    assert store.list(M, step=MAX_STEP - 1) == [ShardKey(M, "a", MAX_STEP - 1, 0)]
    for bad in (MAX_STEP + 1, 2**53 + 2, 2**63 - 1):
        with pytest.raises(CommitError):
            store.begin_step(M, bad, 1)
        with pytest.raises(InvalidKeyError):
            ShardKey(M, "a", bad, 0)
        with pytest.raises(InvalidKeyError):
            store.list(M, step=bad)
    assert store.resolve(M).step == MAX_STEP


# -- item 10: migration retries, and reports what stays in memory ----------------------------------------


def test_migration_retries_after_a_transient_durable_failure(tmp_path, redis_url, shm_root):
    s = tierstore.open(tmp_path / "h", redis=redis_url, durable=f"file://{tmp_path / 'd'}",
                       host_root=str(shm_root / "n"), node_id="n")
    try:
        plan = install(s, FaultPlan([FaultRule("backend.put@durable", "exception", 1.0, limit=3),
                                     FaultRule("migration", "exception", 1.0, after=6, limit=2)], seed=1))
        save_step(s, 1, 2)
        s.flush()
        save_step(s, 2, 2)
        s.flush()  # the durable tier failed 3 times and the migration twice: retried, nothing reported
        assert plan.total_fired() == 5
        assert [st for _, st in s.steps.steps(M)] == ["durable", "durable"]
        assert all(r.memory_only is None for r in s.steps.records(M))
    finally:
        s.close()


def test_a_step_that_stays_in_memory_is_reported(tmp_path, redis_url, shm_root):
    home = tmp_path / "h"
    opts = dict(redis=redis_url, durable=f"file://{tmp_path / 'd'}", host_root=str(shm_root / "n"), node_id="n")
    s = tierstore.open(home, migration_retries=2, migration_backoff_s=0.01, **opts)
    try:
        install(s, FaultPlan([FaultRule("backend.put@durable", "exception", 1.0)], seed=1))  # down for good
        save_step(s, 1, 2)
        with pytest.raises(MigrationError):
            s.flush()
        assert s.steps.state(M, 1) == "committed"
    finally:
        s.close()
    p = admin_cli(["--redis", redis_url, "--home", str(home), "--durable", f"file://{tmp_path / 'd'}"],
                  "--json", "steps", M)
    assert p.returncode == 0, p.stderr
    (row,) = [json.loads(line) for line in p.stdout.splitlines()]  # --json steps: one record per line
    assert row["state"] == "committed" and "failed to migrate" in row["memory_only"]


# -- item 12: nested tensors ------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_nested_tensors_get_a_typed_error(store):
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with pytest.raises(InvalidValueError) as ei:
        store.put(ShardKey(M, "a", 1, 0), {"w": nested})
    assert ei.value.entry == "w"
    assert store.list(M) == [] and list(store.host.list(M)) == []
