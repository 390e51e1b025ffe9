"""The read path: resolve() picks the newest committed step that can be rebuilt, layer by layer."""

from __future__ import annotations

import pytest
import torch

from tests._tiers import live_name
from tests.test_twophase import M, save_step, shard
from tierstore import ShardKey
from tierstore.errors import NoValidCopyError


def check(store, res):
    for (layer, rank), info in res.objects.items():
        got = store.get(info.key)
        want = shard(layer, res.layers[layer], rank)
        assert all(torch.equal(got.tensors[n], t) for n, t in want.items()), info.key


def _lose(store, key: ShardKey) -> None:
    """Delete the copy of ``key`` from the host and the durable tier: gone everywhere."""
    name = live_name(store, key)
    store.host.delete(name)
    store.durable.delete(name)


def test_newest_committed_step_exactly(store):
    save_step(store, 1, 2)
    save_step(store, 2, 2)
    res = store.resolve(M)
    assert res.step == 2 and res.layers == {"a": 2, "b": 2} and res.world_size == 2 and res.state == "committed"
    assert res.extra == {0: {"rank": 0, "data_pos": 20}, 1: {"rank": 1, "data_pos": 20}}
    assert res.keys_for_rank(1) == {"a": ShardKey(M, "a", 2, 1), "b": ShardKey(M, "b", 2, 1)}
    check(store, res)


def test_aborted_and_preparing_steps_are_never_returned(store):
    save_step(store, 1, 2)
    save_step(store, 2, 2, ok=False)
    save_step(store, 3, 2, vote_ranks=[0])  # rank 1 never voted
    res = store.resolve(M)
    assert res.step == 1
    check(store, res)


def test_falls_back_to_an_older_step_when_a_shard_is_gone_everywhere(store):
    save_step(store, 1, 2)
    save_step(store, 2, 2)
    store.flush()
    _lose(store, ShardKey(M, "b", 2, 1))
    res = store.resolve(M)
    assert res.step == 1
    check(store, res)
    _lose(store, ShardKey(M, "a", 1, 0))
    with pytest.raises(NoValidCopyError) as ei:
        store.resolve(M)
    assert "gpt/b/2/1" in str(ei.value)


def test_reads_from_the_durable_tier_when_host_copies_are_gone(store):
    save_step(store, 1, 2)
    store.flush()
    for name in list(store.host.list("gpt/")):
        store.host.delete(name)
    res = store.resolve(M)
    assert res.step == 1 and res.state == "durable"
    check(store, res)


def test_staleness_bound_mixes_versions_per_layer(store):
    save_step(store, 1, 2)
    store.begin_step(M, 2, 2, layout={"layers": ["a", "b"]})
    for rank in range(2):  # step 2 saved only layer a (layer-wise policy)
        store.vote(M, 2, rank, [store.put(ShardKey(M, "a", 2, rank), shard("a", 2, rank))])
    res = store.resolve(M, max_staleness=0)  # exact: step 2 lacks b, so step 1, every layer from it
    assert res.step == 1 and res.layers == {"a": 1, "b": 1}
    res = store.resolve(M, max_staleness=1)
    assert res.step == 2 and res.layers == {"a": 2, "b": 1}
    check(store, res)


def test_no_committed_step(store):
    with pytest.raises(NoValidCopyError, match="no committed step"):
        store.resolve(M)


def test_copies_on_a_remote_tier_are_checked_at_once_with_the_same_verdicts(store, monkeypatch):
    """Where a step's copies are on a tier that is not this node's (the peer tier, S3), resolve checks them
    concurrently (a round trip each, not one after the other) and reaches the verdicts one by one gives:
    the newest step with a bad copy is skipped, the older one restores."""
    import threading
    import time

    save_step(store, 1, 2)
    save_step(store, 2, 2)
    store.flush()
    for name in list(store.host.list("gpt/")):
        if "/2/" in name:  # step 2's checks go to the durable tier (step 1's may not be durable: it was retired)
            store.host.delete(name)
    bad = live_name(store, ShardKey(M, "a", 2, 1))
    path = store.durable.root / bad
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # its trailer: what a trailer check reads
    path.write_bytes(bytes(raw))
    monkeypatch.setattr(store.durable, "local_reads", False)  # as S3 is: not this node's disks
    lock, live, most = threading.Lock(), [0], [0]
    tail = store.durable.tail

    def slow_tail(name, nbytes):
        with lock:
            live[0] += 1
            most[0] = max(most[0], live[0])
        try:
            time.sleep(0.05)  # a round trip
            return tail(name, nbytes)
        finally:
            with lock:
                live[0] -= 1

    monkeypatch.setattr(store.durable, "tail", slow_tail)
    res = store.resolve(M, verify="trailer")
    assert res.step == 1 and 2 in res.skipped and 2 in res.lost, res.skipped  # the bad trailer: positive evidence
    assert most[0] > 1, "the copies were checked one at a time"
    check(store, res)


def test_a_lost_step_on_a_remote_tier_is_passed_over_without_checking_every_copy(store, monkeypatch):
    """A step whose copies are gone from every tier is passed over at its first problem: the concurrent checks
    not begun are dropped (each copy of a lost step costs a miss in every tier), and the verdict, the reason
    given, is the one asking one by one gives."""
    import threading
    import time

    from tierstore import readpath

    layers = ("a", "b", "c", "d")
    save_step(store, 1, 8, layers=layers)
    save_step(store, 2, 8, layers=layers)  # 32 objects
    store.flush()
    for name in list(store.host.list("gpt/")):
        if "/2/" in name:
            store.host.delete(name)
    for name in list(store.durable.list("gpt/")):
        if "/2/" in name:
            store.durable.delete(name)  # step 2 is lost: no copy anywhere
    monkeypatch.setattr(store.durable, "local_reads", False)  # as S3 is: not this node's disks
    lock, asked = threading.Lock(), []
    tail = store.durable.tail

    def slow_tail(name, nbytes):
        with lock:
            asked.append(name)
        time.sleep(0.05)  # a round trip
        return tail(name, nbytes)

    monkeypatch.setattr(store.durable, "tail", slow_tail)
    res = store.resolve(M, verify="trailer")
    assert res.step == 1 and 2 in res.lost, res.skipped
    of_step2 = [n for n in asked if "/2/" in n]
    assert 0 < len(of_step2) <= 2 * readpath.PREFETCH_THREADS < 32, of_step2
    check(store, res)

    monkeypatch.setattr(readpath._Verifier, "prefetch", lambda self, entries: None)  # one by one, in order
    assert store.resolve(M, verify="trailer").skipped == res.skipped


def test_a_share_checks_its_saved_ranks_copies_alone(store, monkeypatch):
    """``part=(i, n)``: the caller checks the copies of saved ranks ``s % n == i`` (one share of a collective
    restore's checks): a lost copy of rank 1 is no problem of rank 0's share and is rank 1's; the layers are
    judged whole either way. Without ``part`` every copy is checked."""
    save_step(store, 1, 2)
    save_step(store, 2, 2)
    store.flush()
    _lose(store, ShardKey(M, "b", 2, 1))
    checked: list[str] = []
    tail, get = store.host.tail, store.host.get
    monkeypatch.setattr(store.host, "tail", lambda name, n: (checked.append(name), tail(name, n))[1])
    monkeypatch.setattr(store.host, "get", lambda name: (checked.append(name), get(name))[1])
    res0 = store.resolve(M, part=(0, 2))
    assert res0.step == 2 and set(res0.objects) == {(ly, r) for ly in "ab" for r in (0, 1)}  # every rank's objects
    assert checked and all(ShardKey.parse(n.split(".")[0]).rank == 0 for n in checked), checked
    assert store.resolve(M, part=(1, 2)).step == 1
    assert store.resolve(M, part=(0, 1)).step == 1 and store.resolve(M).step == 1
    with pytest.raises(ValueError, match="part"):
        store.resolve(M, part=(2, 2))


def test_at_most_leaves_out_the_newer_steps(store):
    save_step(store, 1, 2)
    save_step(store, 2, 2)
    assert store.resolve(M, at_most=1).step == 1
    assert store.resolve(M, at_most=5).step == 2
    with pytest.raises(NoValidCopyError) as ei:
        store.resolve(M, at_most=0)
    assert "reason" in ei.value.fields  # not "nothing committed": a fresh job is another answer
