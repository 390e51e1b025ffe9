"""Destroy only on proof: a tier that does not answer is "unknown", never "lost".

A restore that meets a transient error asks again (with the migration's backoff) before it falls back; a
fall back past a step whose copies could not be read licenses nothing: the resumed trainer's save of that
step number supersedes it only on positive evidence (every tier that should hold a copy answered a miss or
a bad checksum), and even then the superseded copies are kept until the live line has a newer durable step.
"""

from __future__ import annotations

import pytest
import torch

from consistency.manifest import durable_manifest_name
from tests._tiers import copies, flip_everywhere
from tierstore.errors import NoValidCopyError, StepCommittedError, TierUnavailableError
from tierstore.testing.faults import FaultPlan, FaultRule, FaultyBackend, install
from tierstore.train.checkpointer import Checkpointer
from tierstore.train.gradlog import LOG_LAYER
from tierstore.train.policies import replay

M = "proof"


@pytest.fixture
def opener(one_node):
    """Stores on one index, host tier and durable directory (each call a new process's view)."""
    return one_node


def _net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))


def _train(store, steps, keep_last=None, **kw) -> dict[int, dict[str, torch.Tensor]]:
    """Save ``steps`` (each a distinct state, each durable before the next); the state saved per step."""
    net = _net(0)
    ck = Checkpointer(store, M, net, keep_last=keep_last, **kw)
    ck.restore()
    saved = {}
    for s in steps:
        with torch.no_grad():
            net[0].weight.add_(1.0)
        ck.save(s)
        assert ck.wait() == "committed"
        store.flush()
        saved[s] = {k: v.clone() for k, v in net.state_dict().items()}
    ck.close()
    return saved


def _memory_lost(store, step: int) -> None:
    """The node that held ``step``'s memory copies is gone: only the durable tier has them."""
    for key in store.list(M, step=step):
        rec = store.info(key)
        store.index.remove_tier(key, "host", name=rec.name)
        store.host.delete(rec.name)


def _same(net, want) -> bool:
    return all(torch.equal(v, want[k]) for k, v in net.state_dict().items())


def test_one_blip_of_the_durable_tier_during_restore_does_not_fall_back(opener):
    store = opener()
    saved = _train(store, [0, 1, 2])
    assert store.steps.state(M, 2) == "durable"
    _memory_lost(store, 2)
    reader = opener()
    plan = install(reader, FaultPlan([FaultRule("backend.get@durable", "exception", limit=1)]))
    net = _net(5)
    ck = Checkpointer(reader, M, net, keep_last=None)
    step, _ = ck.restore()
    assert plan.total_fired() == 1
    assert step == 2 and not ck.report.fell_back and _same(net, saved[2])
    ck.close()


def test_an_unreachable_durable_tier_licenses_no_supersede(opener, caplog):
    store = opener()
    saved = _train(store, [0, 1, 2])
    _memory_lost(store, 2)  # step 2 is in the durable tier only; step 1 also in memory
    down = opener()
    plan = install(down, FaultPlan([FaultRule("backend.get@durable", "exception")]))  # down for good
    net = _net(5)
    ck = Checkpointer(down, M, net, keep_last=None)
    step, _ = ck.restore()
    assert step == 1 and ck.report.fell_back and _same(net, saved[1])
    with caplog.at_level("WARNING"):
        with torch.no_grad():
            net[1].bias.fill_(3.0)
        ck.save(2)  # judged again: still no answer from the durable tier, so step 2 stays and this save is skipped
        assert ck.wait() == "skipped"
    assert any("not proven lost" in r.getMessage() for r in caplog.records)
    (rec,) = store.steps.records(M, [2])
    assert rec.state == "durable" and rec.attempt == 1
    assert store.durable.exists(durable_manifest_name(M, 2))
    ck.save(3)  # training goes on
    assert ck.wait() in ("committed", "durable")
    ck.close()
    plan.arm()  # the durable tier answers again: the intact step 2 restores, bitwise
    net2 = _net(6)
    ck2 = Checkpointer(opener(), M, net2, keep_last=None)
    assert ck2.restore(step=2)[0] == 2 and _same(net2, saved[2])
    ck2.close()


def test_a_step_proven_lost_is_superseded_and_its_copies_kept_until_a_newer_durable_step(opener, caplog):
    store = opener()
    _train(store, [0, 1, 2])
    old = {k: store.info(k).name for k in store.list(M, step=2)}
    for key in old:
        flip_everywhere(store, key)  # a bad checksum in every tier: positive evidence
    net = _net(5)
    ck = Checkpointer(opener(), M, net, keep_last=2)
    assert ck.restore()[0] == 1
    with caplog.at_level("WARNING"):
        ck.save(2)
        assert ck.wait() in ("committed", "durable")
    assert any("is lost: saved again" in r.getMessage() for r in caplog.records)
    (rec,) = store.steps.records(M, [2])
    assert rec.attempt == 2
    kept = {c.name for c in store.index.retired(M)}
    assert set(old.values()) <= kept  # the superseded copies are kept aside
    for key, name in old.items():  # (a copy the restore read and found corrupt was dropped: that is proof)
        assert name in copies(store.durable, key)
    ck.store.flush()
    assert store.steps.state(M, 2) == "durable"  # the new attempt; not newer than the superseded one
    ck.save(3)
    ck.wait()
    ck.store.flush()
    ck.save(4)  # retention after step 3 is durable: the superseded copies of step 2 may go now
    ck.wait()
    ck.close()
    assert store.index.retired(M) == []
    for key, name in old.items():
        assert name not in copies(store.host, key) and name not in copies(store.durable, key)


class _BlipOnLogs(FaultyBackend):
    """The durable tier, failing the first read of each gradient-log entry once (a throttled request)."""

    def __init__(self, inner):
        super().__init__(inner, FaultPlan())
        self.failed: set[str] = set()

    def get(self, name):
        if f"/{LOG_LAYER}/" in name and name not in self.failed:
            self.failed.add(name)
            raise TierUnavailableError(f"throttled: {name}", tier="durable", key=name)
        return self.inner.get(name)


def test_replay_restore_after_one_failed_log_read_neither_falls_back_nor_retires(opener):
    store = opener()
    net = _net(0)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ck = Checkpointer(store, M, net, opt, policy=replay(4), keep_last=None)
    ck.restore()
    x = torch.randn(4, 8)
    for s in range(4):
        opt.zero_grad()
        net(x).sum().backward()
        opt.step()
        ck.save(s)
        ck.wait()
        store.flush()
    ck.close()
    for s in range(4):
        _memory_lost(store, s)  # a node loss: every copy is in the durable tier only
    before = [(r.step, r.state) for r in store.steps.records(M)]
    assert before == [(s, "durable") for s in range(4)]
    want = {k: v.clone() for k, v in net.state_dict().items()}
    reader = opener()
    reader.rewire(tier=lambda b: _BlipOnLogs(b) if b.tier == "durable" else b)
    net2 = _net(5)
    opt2 = torch.optim.SGD(net2.parameters(), lr=0.1)
    ck2 = Checkpointer(reader, M, net2, opt2, policy=replay(4), keep_last=None)
    step, _ = ck2.restore()
    assert reader.durable.failed  # the log reads did fail once each
    assert step == 3 and _same(net2, want) and not ck2.report.fell_back
    assert [(r.step, r.state) for r in store.steps.records(M)] == before
    ck2.close()


def test_an_unreadable_restore_fails_typed_and_retires_nothing(opener):
    store = opener()
    _train(store, [0, 1])
    for s in (0, 1):
        _memory_lost(store, s)
    down = opener()
    install(down, FaultPlan([FaultRule("backend.get@durable", "exception")]))
    ck = Checkpointer(down, M, _net(5), keep_last=1)
    with pytest.raises(NoValidCopyError) as ei:
        ck.restore()
    assert ei.value.evidence == "unknown" and ei.value.lost == set()
    with pytest.raises(StepCommittedError):  # it restored nothing: no step number is licensed
        ck.save(1)
    ck.close()
    assert [(r.step, r.state) for r in store.steps.records(M)] == [(0, "durable"), (1, "durable")]


def test_a_lost_step_that_newer_lost_steps_read_is_saved_again_with_them(opener, caplog):
    """Differential after a node loss: steps 2 and 3 were committed in memory only and step 3's delta reads
    step 2's base. The resumed trainer (restored at 1) judges both at its first save: both are proven lost and
    superseded together, so step 3 no longer pins step 2's copies (the save of step 2 failed inside the save,
    then was skipped, before); steps 2 and 3 are saved again and restore bitwise."""
    import threading

    from tierstore.train.policies import differential

    store = opener()
    gate = threading.Event()
    net = _net(0)
    ck = Checkpointer(store, M, net, policy=differential(base_every=2, payoff=None), keep_last=None)
    ck.restore()
    try:
        for s in range(4):
            with torch.no_grad():
                net[0].weight.add_(1.0)
            ck.save(s)
            assert ck.wait() == "committed"
            if s == 1:  # 0 and 1 reach the durable tier; 2 and 3 never do (the node goes first)
                store.flush()
                store.rewire(before_migrate=lambda key: gate.wait(60) if key.step >= 2 else None)
        m3 = store.steps.manifest(M, 3)
        assert any(e["key"].split("/")[2] == "2" for e in m3.get("deps", [])), m3  # 3's deltas read step 2
        for s in (2, 3):
            _memory_lost(store, s)  # the node is lost: steps 2 and 3 had no other copy
        net2 = _net(1)
        ck2 = Checkpointer(opener(), M, net2, policy=differential(base_every=2, payoff=None), keep_last=None)
        assert ck2.restore()[0] == 1
        with caplog.at_level("WARNING"):
            with torch.no_grad():
                net2[0].weight.add_(1.0)
            ck2.save(2)
            assert ck2.wait() == "committed"  # step 3, which reads it, is proven lost too: both superseded together
        assert any("superseded" in r.getMessage() and "step 3" in r.getMessage() for r in caplog.records)
        with torch.no_grad():
            net2[0].weight.add_(1.0)
        ck2.save(3)  # step 3 is proven lost (no tier holds its copies): saved again
        assert ck2.wait() == "committed"
        want = {k: v.clone() for k, v in net2.state_dict().items()}
        ck2.close()
        net3 = _net(2)
        ck3 = Checkpointer(opener(), M, net3, keep_last=None)
        assert ck3.restore()[0] == 3 and _same(net3, want)
        ck3.close()
    finally:
        gate.set()
        try:
            ck.close()
        except Exception:  # noqa: BLE001 - the lost node's writer: fenced, its migrations fail
            pass
