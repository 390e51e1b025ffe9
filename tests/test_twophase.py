"""The two-phase commit of a step, over the real Redis-protocol server: votes, timeouts, fencing, durability."""

from __future__ import annotations

import json

import pytest
import torch

from consistency.manifest import MANIFEST_VERSION, durable_manifest_name, parse_manifest
from consistency.twophase import StepProtocol
from tierstore import ShardKey
from tierstore.errors import CommitError, FencedError, ManifestError, StepAbortedError

M = "gpt"


def shard(layer: str, step: int, rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(hash((layer, step, rank)) & 0xFFFF_FFFF)
    return {"w": torch.randn(16, 8, generator=g), "m": torch.randn(8, generator=g)}


def save_step(store, step: int, world: int, *, epoch=None, layers=("a", "b"), vote_ranks=None, ok=True):
    store.begin_step(M, step, world, layout={"layers": list(layers), "dp": world}, epoch=epoch)
    states = []
    for rank in (range(world) if vote_ranks is None else vote_ranks):
        infos = [store.put(ShardKey(M, ly, step, rank), shard(ly, step, rank), epoch=epoch) for ly in layers]
        states.append(store.vote(M, step, rank, infos, extra={"rank": rank, "data_pos": step * 10}, ok=ok,
                                 epoch=epoch))
    return states


class Clock:
    def __init__(self, t: float = 1_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_last_vote_commits_and_writes_the_manifest(store):
    states = save_step(store, 1, 3)
    assert states == ["preparing", "preparing", "committed"]
    assert store.wait_step(M, 1, timeout=5) == "committed"
    m = store.steps.manifest(M, 1)
    assert m["version"] == MANIFEST_VERSION and m["world"] == 3 and m["layout"] == {"layers": ["a", "b"], "dp": 3}
    assert sorted(m["ranks"]) == ["0", "1", "2"] and m["ranks"]["2"]["extra"] == {"rank": 2, "data_pos": 10}
    entry = m["ranks"]["1"]["objects"][0]
    assert entry["key"] == "gpt/a/1/1" and entry["kind"] == "full" and len(entry["checksum"]) == 32
    assert entry["checksum"] == store.info(ShardKey.parse(entry["key"])).checksum


def test_a_repeated_vote_counts_once(store):
    store.begin_step(M, 2, 2)
    info = store.put(ShardKey(M, "a", 2, 0), shard("a", 2, 0))
    assert store.vote(M, 2, 0, [info]) == "preparing"
    assert store.vote(M, 2, 0, [info]) == "preparing"
    assert store.steps.state(M, 2) == "preparing"


def test_negative_vote_aborts_and_later_votes_see_it(store):
    store.begin_step(M, 3, 2)
    assert store.vote(M, 3, 0, [], ok=False) == "aborted"
    assert store.vote(M, 3, 1, []) == "aborted"
    assert store.steps.manifest(M, 3) is None
    with pytest.raises(StepAbortedError):
        store.steps.require_committed(M, 3, timeout=1)


def test_timeout_aborts_with_an_injected_clock(store):
    clock = Clock()
    sp = StepProtocol(store.index, store.durable, step_timeout_s=30, clock=clock)
    sp.begin(M, 4, 2)
    assert sp.vote(M, 4, 0, []) == "preparing"
    clock.t += 29
    assert sp.abort_if_stale(M, 4) == "preparing"
    clock.t += 2
    assert sp.vote(M, 4, 1, []) == "aborted"  # the last vote arrived too late
    assert sp.wait(M, 4, timeout=1) == "aborted" and sp.manifest(M, 4) is None


def test_wait_aborts_a_stale_step_and_times_out_on_a_live_one(store):
    clock = Clock()
    sp = StepProtocol(store.index, step_timeout_s=10, clock=clock)
    sp.begin(M, 5, 2)
    with pytest.raises(CommitError, match="still preparing"):
        sp.wait(M, 5, timeout=0.01)
    clock.t += 11
    assert sp.wait(M, 5, timeout=1) == "aborted"


def test_bad_votes_are_refused(store):
    with pytest.raises(CommitError, match="never begun"):
        store.vote(M, 6, 0, [])
    store.begin_step(M, 6, 2)
    with pytest.raises(CommitError, match="outside the world"):
        store.vote(M, 6, 2, [])
    with pytest.raises(CommitError):
        store.vote(M, 6, -1, [])
    with pytest.raises(CommitError):
        store.begin_step(M, 7, 0)
    assert store.steps.state(M, 6) == "preparing"


def test_events_are_published(store):
    p = store.index._r.pubsub()
    p.subscribe(store.index._k(M, "events"))
    p.get_message(timeout=1)
    save_step(store, 8, 2)
    msg = None
    for _ in range(50):
        msg = p.get_message(timeout=0.1)
        if msg and msg["type"] == "message":
            break
    assert msg["data"] == b"8 committed"
    p.close()


def test_durable_after_migration_with_create_once_manifest(store):
    save_step(store, 1, 2)
    store.flush()
    assert store.wait_step(M, 1, timeout=5) == "durable"
    raw = store.durable.get(durable_manifest_name(M, 1))
    m = parse_manifest(raw, model=M, step=1)
    assert m["durable"] is True and m["deps"] == []
    assert all("durable" in o["tiers"] for v in m["ranks"].values() for o in v["objects"])
    assert all("durable" in store.info(ShardKey.parse(o["key"])).tiers for v in m["ranks"].values()
               for o in v["objects"])
    assert store.steps.maybe_durable(M, 1) is False  # already durable: not written twice


def test_durable_manifest_lists_delta_bases_as_deps(store):
    from tierstore.delta import xor_delta

    store.begin_step(M, 1, 1)
    base = store.put(ShardKey(M, "a", 1, 0), shard("a", 1, 0))
    store.vote(M, 1, 0, [base])
    store.begin_step(M, 2, 1)
    t0, t1 = shard("a", 1, 0), shard("a", 2, 0)
    d = store.put(ShardKey(M, "a", 2, 0), {n: xor_delta(t1[n], t0[n]) for n in t0},
                  {"_delta": {n: {"dtype": "float32", "shape": list(t0[n].shape)} for n in t0}},
                  kind="delta", base=base.key)
    store.vote(M, 2, 0, [d])
    store.flush()
    m = parse_manifest(store.durable.get(durable_manifest_name(M, 2)), model=M)
    assert [o["key"] for o in m["deps"]] == ["gpt/a/1/0"]


def test_fencing_rejects_puts_votes_and_migrations_of_an_older_epoch(store):
    e1 = store.open_epoch(M)
    save_step(store, 1, 2, epoch=e1)
    store.begin_step(M, 2, 2, epoch=e1)
    e2 = store.open_epoch(M)
    assert e2 == e1 + 1
    with pytest.raises(FencedError) as ei:
        store.put(ShardKey(M, "a", 2, 0), shard("a", 2, 0), epoch=e1)
    assert ei.value.epoch == e2
    assert store.get(ShardKey(M, "a", 2, 0)) is None and not store.host.exists("gpt/a/2/0")
    with pytest.raises(FencedError):
        store.vote(M, 2, 0, [], epoch=e1)
    with pytest.raises(FencedError):
        store.begin_step(M, 3, 2, epoch=e1)
    with pytest.raises(FencedError):
        store.steps.mark_migrated(M, 1, 0, [], epoch=e1)
    assert store.steps.state(M, 2) == "preparing"


def test_newer_epoch_restarts_a_step_an_older_one_left_preparing(store):
    e1 = store.open_epoch(M)
    store.begin_step(M, 5, 2, epoch=e1)
    store.vote(M, 5, 0, [store.put(ShardKey(M, "a", 5, 0), shard("a", 5, 0), epoch=e1)], epoch=e1)
    e2 = store.open_epoch(M)
    store.begin_step(M, 5, 2, epoch=e2)
    # the old incarnation's vote is gone: one vote of the new epoch does not commit
    assert store.vote(M, 5, 1, [store.put(ShardKey(M, "a", 5, 1), shard("a", 5, 1), epoch=e2)], epoch=e2) \
        == "preparing"


def test_zombie_rank_cannot_touch_the_restored_state(store, tmp_path, redis_url, shm_root):
    import tierstore

    e1 = store.open_epoch(M)
    save_step(store, 1, 2, epoch=e1)
    store.begin_step(M, 2, 2, epoch=e1)
    zombie = tierstore.open(tmp_path / "z", redis=redis_url, durable="none", host_root=str(shm_root / "node0"),
                            node_id="node0")
    try:
        e2 = store.open_epoch(M)  # the new incarnation restores
        res = store.resolve(M)
        assert res.step == 1 and e2 > e1
        # the zombie (still epoch e1) keeps going: overwrite step 1, finish step 2, start step 3
        with pytest.raises(FencedError):
            zombie.put(ShardKey(M, "a", 1, 0), {"w": torch.zeros(16, 8), "m": torch.zeros(8)}, epoch=e1)
        for rank in range(2):
            with pytest.raises(FencedError):
                zombie.put(ShardKey(M, "a", 2, rank), shard("a", 2, rank), epoch=e1)
            with pytest.raises(FencedError):
                zombie.vote(M, 2, rank, [], epoch=e1)
        with pytest.raises(FencedError):
            zombie.begin_step(M, 3, 2, epoch=e1)
        assert store.steps.state(M, 2) == "preparing" and store.steps.state(M, 3) is None
        res = store.resolve(M)
        assert res.step == 1
        for (layer, rank), info in res.objects.items():
            got = store.get(info.key)
            assert all(torch.equal(got.tensors[n], t) for n, t in shard(layer, 1, rank).items())
    finally:
        zombie.close()


def test_a_fenced_put_leaves_the_live_object_of_the_same_key(store):
    e1 = store.open_epoch(M)
    e2 = store.open_epoch(M)
    store.begin_step(M, 2, 2, epoch=e2)
    live = store.put(ShardKey(M, "a", 2, 1), shard("a", 2, 1), epoch=e2)
    with pytest.raises(FencedError):  # a zombie of epoch e1 writes the same key
        store.put(ShardKey(M, "a", 2, 1), {"w": torch.zeros(16, 8), "m": torch.zeros(8)}, epoch=e1)
    got = store.get(live.key)
    assert torch.equal(got.tensors["w"], shard("a", 2, 1)["w"]) and store.info(live.key).checksum == live.checksum


@pytest.mark.parametrize("mutate,match", [
    (lambda m: m.update(version=99), "unknown manifest version 99"),
    (lambda m: m.update(world=3), "ranks must be exactly"),
    (lambda m: m["ranks"]["0"]["objects"][0].update(kind="weird"), "unknown kind"),
    (lambda m: m["ranks"]["0"]["objects"][0].update(key="gpt/a/9/0"), "newer than the step"),
    (lambda m: m["ranks"]["0"]["objects"][0].update(key="other/a/1/0"), "another model"),
    (lambda m: m.update(deps=[dict(m["ranks"]["0"]["objects"][0])]), "not of an older step"),
])
def test_manifest_validation(store, mutate, match):
    save_step(store, 1, 2)
    m = store.steps.manifest(M, 1)
    mutate(m)
    with pytest.raises(ManifestError, match=match):
        parse_manifest(json.dumps(m), model=M)
    with pytest.raises(ManifestError):
        parse_manifest(b"\\x00not json")
