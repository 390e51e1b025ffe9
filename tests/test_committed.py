"""Committed means committed (issue 13): each test tries to lose, change or silently skip a committed step
the way a user or operator would, through the public API and the ``tierstore admin`` command.

One test (or a small group) per item of the issue: 1 gc of a layer-wise model, 3 long delta chains, 4 a
step saved twice, 5 a corrupt newest step, 6 a zombie paused between its epoch check and its publish.
Items 2, 9, 10 and 12 are in ``tests/test_committed_ops.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest
import torch

import tierstore
from consistency.manifest import durable_manifest_name
from tests._tiers import copies, flip_everywhere
from tests.test_twophase import M, save_step, shard
from tierstore import ShardKey
from tierstore.delta import xor_delta
from tierstore.errors import FencedError, NoValidCopyError, StepCommittedError
from tierstore.train.checkpointer import Checkpointer
from tierstore.train.policies import layerwise


def admin_cli(conn: list[str], *args: str) -> subprocess.CompletedProcess:
    """``tierstore admin`` in a subprocess, as an operator runs it."""
    return subprocess.run([sys.executable, "-m", "tierstore.cli", "admin", *conn, *args], capture_output=True,
                          text=True, timeout=120)


@pytest.fixture
def conn(tmp_path, redis_url, shm_root):
    """The ``tierstore admin`` connection options of the ``store`` fixture."""
    return ["--redis", redis_url, "--home", str(tmp_path / "home"), "--durable", f"file://{tmp_path / 'durable'}",
            "--host-root", str(shm_root / "node0")]


def delta_put(store, key: ShardKey, base: ShardKey, new: dict, old: dict, **kw):
    layout = {n: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)} for n, t in old.items()}
    return store.put(key, {n: xor_delta(new[n], old[n]) for n in old}, {"_delta": layout}, kind="delta", base=base,
                     **kw)


# -- item 1: gc by manifests is right for a layer-wise model ----------------------------------------------


def test_admin_gc_of_a_layerwise_model_keeps_what_restore_reads(store, conn):
    """Layers that did not change enough are not saved again: the kept steps read them from step 0."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    ck = Checkpointer(store, "lw", net, policy=layerwise(tau=0.01, max_staleness=10), keep_last=None)
    assert ck.restore() == (None, None)
    for step in range(5):
        with torch.no_grad():
            net[0].weight.add_(1.0)  # only layer 0 changes: layers 1 and 2 stay at their step-0 version
        ck.save(step)
        assert ck.wait() == "committed"
    ck.close()
    store.flush()
    want = {k: v.clone() for k, v in net.state_dict().items()}
    p = admin_cli(conn, "--json", "gc", "lw", "--yes", "--keep-last", "2")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["kept_steps"] == [3, 4]
    torch.manual_seed(1)
    net2 = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    ck2 = Checkpointer(store, "lw", net2, policy=layerwise(tau=0.01, max_staleness=10), keep_last=None)
    assert ck2.restore()[0] == 4
    ck2.close()
    assert all(torch.equal(net2.state_dict()[k], v) for k, v in want.items())
    m = store.steps.manifest("lw", 4)  # the manifest records the older versions it reads
    assert {ShardKey.parse(o["key"]).layer for o in m["inherited"]} == {"1", "2"}
    # and the kept chain still resolves after another gc
    assert admin_cli(conn, "gc", "lw", "--yes", "--keep-last", "1").returncode == 0
    assert store.resolve("lw", max_staleness=10).step == 4


def test_gc_keeps_the_base_and_logs_a_kept_replay_step_replays(store, conn):
    """A replay log step reads its base and the logs before it: gc keeps them (the manifest requires them)."""
    from tests.test_replay import _equal, _fresh, _train

    _, _, rc, states, _ = _train(store, "rp-gc", "adamw", 7, base_every=4)  # bases 0 and 4, logs 5 and 6
    rc.close()
    store.flush()
    assert store.steps.manifest("rp-gc", 6)["requires"] == [4, 5]
    p = admin_cli(conn, "--json", "gc", "rp-gc", "--yes", "--keep-last", "1")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["kept_steps"] == [4, 5, 6]
    model, _, rc2 = _fresh(store, "rp-gc", "adamw")
    step, _extra = rc2.restore()
    rep = rc2.report
    rc2.close()
    assert step == 6 and rep.base_step == 4 and rep.replayed == [5, 6] and not rep.fell_back
    assert _equal(model, states[6])


# -- item 3: chains longer than the reader's limit -----------------------------------------------------


def test_a_base_is_forced_before_the_readers_chain_limit(store):
    """differential(base_every=100) writes 80 deltas in a row: the store cuts the chain at max_delta_chain."""
    k = ShardKey(M, "a", 1, 0)
    data = {s: shard("a", s, 0) for s in range(1, 81)}
    store.begin_step(M, 1, 1, layout={"layers": ["a"]})
    store.vote(M, 1, 0, [store.put(k, data[1])])
    for s in range(2, 81):
        store.begin_step(M, s, 1, layout={"layers": ["a"]})
        info = delta_put(store, k.with_step(s), k.with_step(s - 1), data[s], data[s - 1])
        assert store.vote(M, s, 0, [info]) == "committed"
    res = store.resolve(M)
    assert res.step == 80 and res.skipped == {}  # no silent fall back to step 65
    assert store.info(k.with_step(66)).kind == "full"  # the 65th link became a base
    for s in (65, 66, 80):
        assert torch.equal(store.get(k.with_step(s)).tensors["w"], data[s]["w"])


def test_resolve_measures_each_chain_from_its_own_start(tmp_path, redis_url, shm_root):
    """A reader with a shorter limit than the writer skips steps it cannot read, naming the chain; a ref onto
    a delta at the limit is one link too many even when the delta was checked first."""
    opts = dict(redis=redis_url, durable="none", host_root=str(shm_root / "n"), node_id="n")
    writer = tierstore.open(tmp_path / "w", max_delta_chain=100, **opts)
    reader = tierstore.open(tmp_path / "r", max_delta_chain=4, **opts)
    try:
        a = ShardKey("chain", "a", 1, 0)
        data = {s: shard("a", s, 0) for s in range(1, 7)}
        writer.begin_step("chain", 1, 2, layout={"layers": ["a"]})
        writer.vote("chain", 1, 0, [writer.put(a, data[1])])
        writer.vote("chain", 1, 1, [writer.put(a.with_rank(1), {}, kind="ref", target=a)])
        for s in range(2, 7):  # rank 0: deltas; rank 1: a ref to rank 0's object of the step
            writer.begin_step("chain", s, 2, layout={"layers": ["a"]})
            writer.vote("chain", s, 0, [delta_put(writer, a.with_step(s), a.with_step(s - 1), data[s], data[s - 1])])
            writer.vote("chain", s, 1, [writer.put(a.with_step(s).with_rank(1), {}, kind="ref",
                                                   target=a.with_step(s))])
        res = reader.resolve("chain")
        # step 5: rank 0's delta is 4 links from its base (readable), rank 1's ref onto it is 5
        assert res.step == 4 and list(res.skipped) == [6, 5]
        assert "links" in res.skipped[5] and "chain/a/5/1" in res.skipped[5]
        for (layer, rank), info in res.objects.items():
            assert torch.equal(reader.get(info.key).tensors["w"], data[4]["w"])
    finally:
        writer.close()
        reader.close()


# -- item 4: a committed step is immutable; an aborted one can be saved again ----------------------------


def test_saving_a_committed_step_again_is_refused_before_anything_is_written(store):
    save_step(store, 5, 2)
    before = {k: store.get(k).tensors["w"].clone() for k in store.list(M, step=5)}
    held = sorted(store.host.list(M))
    with pytest.raises(StepCommittedError) as ei:  # an off-by-one after a restore
        store.begin_step(M, 5, 2, layout={"layers": ["a", "b"]})
    assert ei.value.step == 5 and "already committed" in str(ei.value)
    assert sorted(store.host.list(M)) == held  # nothing was written
    with pytest.raises(StepCommittedError):  # nor can a writer that skips begin replace an object
        store.put(ShardKey(M, "a", 5, 0), shard("a", 99, 0))
    assert store.wait_step(M, 5, timeout=5) in ("committed", "durable")
    for k, t in before.items():
        assert torch.equal(store.get(k).tensors["w"], t)
    assert sorted(store.host.list(M)) == held


def test_an_aborted_step_is_saved_again_under_a_new_attempt(store):
    e1 = store.open_epoch(M)
    save_step(store, 1, 2, epoch=e1)
    save_step(store, 2, 2, epoch=e1, ok=False)  # a crash, a timeout: step 2 aborted
    assert store.steps.state(M, 2) == "aborted"
    e2 = store.open_epoch(M)  # the restarted job
    assert store.resolve(M).step == 1
    assert save_step(store, 2, 2, epoch=e2)[-1] == "committed"
    (rec,) = store.steps.records(M, [2])
    assert rec.state in ("committed", "durable") and rec.attempt == 2 and rec.epoch == e2
    res = store.resolve(M)
    assert res.step == 2
    for (layer, rank), info in res.objects.items():
        assert torch.equal(store.get(info.key).tensors["w"], shard(layer, 2, rank)["w"])
    assert store.vote(M, 2, 0, [], ok=False, epoch=e2) in ("committed", "durable")  # a late no changes nothing


# -- item 5: restore verifies what it resolved and falls back per step -----------------------------------


def test_a_corrupt_newest_step_falls_back_with_a_warning(store, caplog):
    save_step(store, 1, 2)
    save_step(store, 2, 2)
    store.flush()
    bad = ShardKey(M, "b", 2, 1)
    flip_everywhere(store, bad)  # one byte flipped in every tier
    with caplog.at_level("WARNING"):
        res = store.resolve(M)
    assert res.step == 1 and list(res.skipped) == [2] and str(bad) in res.skipped[2]
    assert any("step 2 skipped" in r.getMessage() for r in caplog.records)
    for (layer, rank), info in res.objects.items():
        assert torch.equal(store.get(info.key).tensors["w"], shard(layer, 1, rank)["w"])
    with pytest.raises(NoValidCopyError) as ei:  # a named step does not fall back
        store.resolve(M, step=2)
    assert str(bad) in str(ei.value)
    assert store.resolve(M, step=1).step == 1
    with pytest.raises(NoValidCopyError, match="not committed"):
        store.resolve(M, step=3)


def test_training_resumed_past_an_unreadable_committed_step_saves_that_step_again(store, caplog):
    """The newest committed (here durable) step cannot be read, so restore falls back a step; the trainer
    resumes from there and saves the next step number, which was committed: the unreadable step is
    superseded (recorded aborted, with why) and the new save commits and becomes durable in its place.
    A step the restore could read stays immutable."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    ck = Checkpointer(store, "resume", net, keep_last=None)
    assert ck.restore() == (None, None)
    for step in range(3):
        with torch.no_grad():
            net[0].weight.add_(1.0)
        ck.save(step)
        ck.wait()
    store.flush()
    assert store.steps.state("resume", 2) == "durable"
    (bad, *_) = [info.key for info in store.resolve("resume", step=2).objects.values()]
    flip_everywhere(store, bad)

    net2 = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    ck2 = Checkpointer(store, "resume", net2, keep_last=None)
    with caplog.at_level("WARNING"):
        step, _ = ck2.restore()
        assert step == 1 and ck2.report.fell_back
        with pytest.raises(StepCommittedError):  # step 1 was read: it stays immutable
            ck2.save(1)
        with torch.no_grad():
            net2[1].bias.fill_(7.0)
        ck2.save(2)
        assert ck2.wait() in ("committed", "durable")
    assert any("saved again" in r.getMessage() for r in caplog.records)
    (rec,) = store.steps.records("resume", [2])
    assert rec.attempt == 2 and rec.state in ("committed", "durable")
    store.flush()
    assert store.steps.state("resume", 2) == "durable"
    want = {k: v.clone() for k, v in net2.state_dict().items()}

    net3 = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    ck3 = Checkpointer(store, "resume", net3, keep_last=None)
    assert ck3.restore()[0] == 2 and not ck3.report.fell_back
    for k, v in net3.state_dict().items():
        assert torch.equal(v, want[k]), k
    with pytest.raises(StepCommittedError):  # the new step 2 is as immutable as any
        ck3.save(2)
    for c in (ck, ck2, ck3):
        c.close()


def test_only_a_writer_that_fell_back_supersedes(store):
    """A read-only restore, a named-step restore and a restore of the newest step never make a committed
    step savable again; nor can an older epoch supersede the step of a newer one."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4))
    ck = Checkpointer(store, "keep", net, keep_last=None)
    ck.restore()
    for step in range(3):
        ck.save(step)
        ck.wait()
    store.flush()  # durable before the next incarnations fence this writer's migration marks
    assert store.steps.state("keep", 2) == "durable"
    for kwargs in ({"step": 1}, {"read_only": True}, {}):
        other = Checkpointer(store, "keep", torch.nn.Sequential(torch.nn.Linear(4, 4)), keep_last=None)
        other.restore(**kwargs)
        with pytest.raises(StepCommittedError):
            other.save(2)
        other.close()
    assert [r.attempt for r in store.steps.records("keep", [0, 1, 2])] == [1, 1, 1]
    e0 = store.steps.records("keep", [2])[0].epoch
    with pytest.raises(FencedError):  # the first incarnation is fenced by the later writers' restores
        store.steps.supersede("keep", 2, epoch=e0, reason="stale")
    assert store.steps.state("keep", 2) == "durable"  # and its durable manifest is still there
    assert store.durable.exists(durable_manifest_name("keep", 2))
    ck.close()


# -- item 6: a fenced zombie paused between its epoch check and its publish ----------------------------


def test_a_zombie_paused_before_its_publish_cannot_touch_the_live_step(tmp_path, redis_url, shm_root):
    opts = dict(redis=redis_url, durable="none", host_root=str(shm_root / "n"), node_id="n")
    zombie = tierstore.open(tmp_path / "z", **opts)
    live = tierstore.open(tmp_path / "l", **opts)
    key = ShardKey("zw", "a", 1, 0)
    try:
        e1 = zombie.open_epoch("zw")
        zombie.begin_step("zw", 1, 1, epoch=e1)
        pending = zombie.snapshot(key, shard("a", 666, 0), epoch=e1)
        checked, resume = threading.Event(), threading.Event()
        real = zombie.index.epoch

        def descheduled(model):  # the epoch check passes, then the process is descheduled
            value = real(model)
            checked.set()
            resume.wait(30)
            return value

        zombie.index.epoch = descheduled
        errors: list[BaseException] = []

        def finish():
            try:
                pending.finish()
            except BaseException as e:  # noqa: BLE001 - inspected below
                errors.append(e)

        t = threading.Thread(target=finish)
        t.start()
        assert checked.wait(30)
        e2 = live.open_epoch("zw")  # the new incarnation restores and commits step 1
        live.begin_step("zw", 1, 1, epoch=e2)
        assert live.vote("zw", 1, 0, [live.put(key, shard("a", 1, 0), epoch=e2)], epoch=e2) == "committed"
        resume.set()
        t.join(30)
        assert len(errors) == 1 and isinstance(errors[0], FencedError)
        assert torch.equal(live.get(key).tensors["w"], shard("a", 1, 0)["w"])
        assert live.resolve("zw").step == 1
        assert copies(live.host, key) == [live.info(key).name]  # the zombie's copy is gone, the live one stays
    finally:
        zombie.close()
        live.close()
