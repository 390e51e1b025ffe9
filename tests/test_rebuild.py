"""Index loss: FLUSHALL, rebuild from the durable manifests, restore the newest durable step bitwise."""

from __future__ import annotations

import pytest
import torch

import tierstore
from consistency.manifest import (
    durable_manifest_name,
    durable_manifest_prefix,
    durable_pin_model,
    durable_pin_name,
    parse_durable_manifest_name,
)
from tests.s3_server import s3_bucket, s3_env, s3_server  # noqa: F401 - fixtures
from tests.test_gc import put_delta
from tests._tiers import live_name
from tests.test_twophase import M, save_step, shard
from tierstore import ShardKey
from tierstore.errors import ConfigError, FencedError


def check(store, step):
    res = store.resolve(M)
    assert res.step == step and res.state == "durable"
    for (layer, rank), info in res.objects.items():
        got = store.get(info.key)
        assert all(torch.equal(got.tensors[n], t) for n, t in shard(layer, res.layers[layer], rank).items())
    return res


def memory_only_step(store, tmp_path, redis_url, step):
    """Commit ``step`` through a store without a durable tier: it stays in memory only."""
    mem = tierstore.open(tmp_path / "mem", redis=redis_url, durable="none", host_root=store.host.root,
                         node_id="node0")
    try:
        save_step(mem, step, 2)
    finally:
        mem.close()


def test_rebuild_restores_durable_steps_and_reports_memory_only_ones(store, tmp_path, redis_url):
    e = store.open_epoch(M)
    for s in (1, 2, 3):
        save_step(store, s, 2, epoch=e)
        store.flush()  # each durable before the next (a lagging migration skips the steps between)
    memory_only_step(store, tmp_path, redis_url, 4)
    assert store.resolve(M).step == 4
    store.index._r.flushall()
    report = store.rebuild_index()
    assert report.restored == {M: [1, 2, 3]} and report.lost_steps == {M: [4]} and report.skipped == {}
    assert report.objects == 12
    assert store.steps.steps(M) == [(1, "durable"), (2, "durable"), (3, "durable")]
    assert store.index.epoch(M) == e  # fencing survives: the old incarnation's epoch is not reusable
    assert store.open_epoch(M) == e + 1
    check(store, 3)
    info = store.info(ShardKey(M, "a", 3, 1))
    assert set(info.tiers) == {"durable", "host"}
    again = store.rebuild_index(M)  # idempotent
    assert again.restored == {M: [1, 2, 3]}
    check(store, 3)


def test_rebuild_from_s3_without_host_copies(tmp_path, redis_url, shm_root, s3_bucket):  # noqa: F811
    endpoint, bucket = s3_bucket
    s = tierstore.open(tmp_path / "h", redis=redis_url, durable=f"s3://{bucket}/p", s3_endpoint_url=endpoint,
                       host_root=str(shm_root / "n"), node_id="n")
    try:
        save_step(s, 1, 2)
        s.flush()
        save_step(s, 2, 2)
        s.flush()
        for name in list(s.host.list()):
            s.host.delete(name)
        s.index._r.flushall()
        report = s.rebuild_index(M)
        assert report.restored == {M: [1, 2]} and report.lost_steps == {}
        assert set(s.info(ShardKey(M, "b", 2, 0)).tiers) == {"durable"}
        check(s, 2)
    finally:
        s.close()


def test_rebuild_follows_delta_chains_through_deps(store):
    store.begin_step(M, 1, 1)
    k1 = ShardKey(M, "a", 1, 0)
    store.vote(M, 1, 0, [store.put(k1, shard("a", 1, 0))])
    store.begin_step(M, 2, 1)
    store.vote(M, 2, 0, [put_delta(store, k1.with_step(2), k1, shard("a", 2, 0), shard("a", 1, 0))])
    store.flush()
    store.durable.delete(durable_manifest_name(M, 1))  # as gc does once step 1 is dropped
    store.index._r.flushall()
    report = store.rebuild_index(M)
    assert report.restored == {M: [2]}
    assert store.info(k1).kind == "full"
    res = store.resolve(M)
    assert res.step == 2
    assert torch.equal(store.get(k1.with_step(2)).tensors["w"], shard("a", 2, 0)["w"])


def test_bad_or_incomplete_manifests_are_skipped(store):
    for s in (1, 2, 3):
        save_step(store, s, 2)
        store.flush()
    store.durable.put(durable_manifest_name(M, 3), b'{"version": 42}')
    store.durable.delete(live_name(store, ShardKey(M, "b", 2, 1)))
    store.index._r.flushall()
    report = store.rebuild_index(M)
    assert report.restored == {M: [1]}
    assert "version 42" in report.skipped[durable_manifest_name(M, 3)]
    assert "missing from the durable tier" in report.skipped[durable_manifest_name(M, 2)]
    # the manifests it could not use are recorded aborted, with why: the read path does not take them for
    # records the index lost (consistency.epochs.EpochLog.check_records), admin steps says why
    recs = {r.step: r for r in store.steps.records(M, [2, 3])}
    assert recs[2].state == recs[3].state == "aborted"
    check(store, 1)


def test_rebuild_raises_epoch_for_zombies(store):
    e = store.open_epoch(M)
    e = store.open_epoch(M)
    save_step(store, 1, 2, epoch=e)
    store.flush()
    store.index._r.flushall()
    store.rebuild_index(M)
    with pytest.raises(FencedError):
        store.put(ShardKey(M, "a", 2, 0), shard("a", 2, 0), epoch=e - 1)


def test_rebuild_needs_a_durable_tier(tmp_path, redis_url, shm_root):
    s = tierstore.open(tmp_path / "h", redis=redis_url, durable="none", host_root=str(shm_root / "x"))
    try:
        with pytest.raises(ConfigError):
            s.rebuild_index()
    finally:
        s.close()


def test_the_durable_record_names_are_recognised_by_their_owner():
    """Pure naming logic (consistency.manifest owns the layout): what rebuild and the epoch log recognise."""
    name = durable_manifest_name("gpt", 7)
    assert name.startswith(durable_manifest_prefix("gpt")) and parse_durable_manifest_name(name) == ("gpt", 7)
    assert parse_durable_manifest_name(durable_manifest_name("gpt", 10**13)) == ("gpt", 10**13)
    assert parse_durable_manifest_name("gpt/_manifest/7.json") == ("gpt", 7)  # any number of digits
    for other in ("gpt/_manifest/x.json", "gpt/_manifest/7.pin", "gpt/_manifest/a/7.json", "a/gpt/_manifest/7.json",
                  "gpt/_epoch/00000000000000000001.epoch", "gpt/layer/7", "gpt/_manifest/\u00b2.json",
                  "gpt/_superseded/000000000007.1.json", durable_pin_name("gpt", "/ckpt/a", 7)):
        assert parse_durable_manifest_name(other) is None, other
    assert durable_pin_model(durable_pin_name("gpt", "/ckpt/a", 7)) == "gpt"
    assert durable_pin_model(name) is None and durable_pin_model("gpt/_pins/x.json") is None
