"""Committed means restorable, after any node loss: a resumed job makes progress under every policy.

The crash loop of issue 28, item 1: ``differential(base_every=10)``, the default ``keep_last=3``; steps 0-3
durable, then the durable mount hangs, steps 4-11 commit in memory only, and the node is lost with them. The
resumed loop restores step 3; each save is then written (superseding what is proven lost) or skipped with a
warning, ``wait()`` never answers ``committed`` for a skipped save, and every step a save reported committed
restores bitwise. A second incarnation lost the same way gets past it too.

And a forced ``admin delete`` beside a live ``differential`` writer: a vote for a step whose deltas read
bases that are no longer in the index is refused (the step is aborted, naming the missing key), and the
next save writes full objects, so the job resumes from it.
"""

from __future__ import annotations

import threading

import pytest
import torch

from tierstore.train.checkpointer import Checkpointer
from tierstore.train.policies import compose, dedup, differential, exact, layerwise

M = "resume"


@pytest.fixture
def opener(one_node):
    """Stores on one index, host tier and durable directory (each call a new process's view)."""
    return one_node


def _net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))


def _step(net: torch.nn.Module, s: int) -> None:
    with torch.no_grad():
        for i, p in enumerate(net.parameters()):
            if i % 2 == s % 2:  # half the tensors change each step (so deltas pay, layer-wise skips some)
                p.add_(0.25 * (s + 1))


def _same(net, want) -> bool:
    return all(torch.equal(v, want[k]) for k, v in net.state_dict().items())


def _node_lost(store) -> None:
    """The node is gone with its memory: every host-tier copy of the model, recorded or not."""
    for key in store.list(M):
        rec = store.info(key)
        if rec is not None and "host" in rec.tiers:
            store.index.remove_tier(key, "host", name=rec.name)
            store.host.delete(rec.name)


def _restores(opener, step: int, want: dict, policy) -> None:
    net = _net(99)
    ck = Checkpointer(opener(), M, net, policy=policy, keep_last=None)
    try:
        got, _ = ck.restore(step=step, read_only=True)
        assert got == step and _same(net, want), f"step {step} was reported committed but does not restore"
    finally:
        ck.close()


def _incarnation(opener, policy, first: int, last: int, *, hang_after: int | None, caplog, gates=None,
                 check: bool = False) -> dict[int, dict]:
    """One incarnation of the loop of docs/training.md: restore, then save ``first..last``; with ``hang_after``,
    the durable tier stops taking puts of steps after it (the node is then lost by the caller). Returns the
    state of each step whose save answered committed. The hung puts go on once the caller sets the gates
    (after the node is lost)."""
    store = opener()
    gate = threading.Event()
    if gates is not None:
        gates.append(gate)
    net = _net(0)
    ck = Checkpointer(store, M, net, policy=policy)
    start, _ = ck.restore()  # any verified step: a step newer than the caller expected may have become durable
    committed: dict[int, dict] = {}
    for s in range(first if start is None else start + 1, last + 1):
        _step(net, s)
        ck.save(s)
        outcome = ck.wait()
        assert outcome in ("committed", "skipped"), outcome
        if outcome == "committed":
            committed[s] = {k: v.clone() for k, v in net.state_dict().items()}
            if check:  # before a later save's retention may retire it
                _restores(opener, s, committed[s], policy)
        if hang_after is not None and s <= hang_after:
            store.flush()
            if s == hang_after:
                store.rewire(before_migrate=lambda key: gate.wait(60) if key.step > hang_after else None)
    ck._pool.shutdown(wait=False)  # the node goes: nothing of it closes cleanly
    if gates is None:
        gate.set()
    return committed


def _lose(opener, gates) -> None:
    _node_lost(opener())
    for g in gates:
        g.set()


POLICIES = {
    "differential": lambda: differential(base_every=10, payoff=None),
    "differential+dedup": lambda: compose(differential(base_every=10, payoff=None), dedup()),
    "layerwise": lambda: layerwise(tau=0.0, max_staleness=4),
    "exact": exact,
}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_resumed_job_gets_past_a_node_loss(opener, caplog, name):
    policy = POLICIES[name]
    gates: list = []
    _incarnation(opener, policy(), 0, 11, hang_after=3, caplog=caplog, gates=gates)
    _lose(opener, gates)
    with caplog.at_level("WARNING"):
        second = _incarnation(opener, policy(), 4, 19, hang_after=None, caplog=caplog, check=True)
    assert max(second) == 19, f"the resumed job never committed its newest step: {sorted(second)}"
    # the resumed job wrote at least the steps past the lost line, and each skip said so
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(second) + len(skipped) >= 16 - 4, (sorted(second), skipped)


def test_a_second_loss_after_a_resume_is_no_crash_loop(opener, caplog):
    policy = POLICIES["differential"]
    gates: list = []
    _incarnation(opener, policy(), 0, 11, hang_after=3, caplog=caplog, gates=gates)
    _lose(opener, gates)
    _incarnation(opener, policy(), 4, 13, hang_after=5, caplog=caplog, gates=gates)  # loses 6.. again
    _lose(opener, gates)
    third = _incarnation(opener, policy(), 6, 16, hang_after=None, caplog=caplog, check=True)
    assert max(third) == 16


def test_wait_never_answers_committed_for_a_skipped_save(opener, caplog):
    """A step committed by the lost incarnation that still verifies is kept and its save skipped: wait() says
    "skipped" (it answered "committed" for the earlier incarnation's step before)."""
    from tests._tiers import copies  # noqa: F401 - the helpers' module must import (fixtures share it)
    from tierstore.testing.faults import FaultPlan, FaultRule, install

    store = opener()
    net = _net(0)
    ck = Checkpointer(store, M, net, keep_last=None)
    ck.restore()
    for s in range(3):
        _step(net, s)
        ck.save(s)
        assert ck.wait() == "committed"
        store.flush()
    ck.close()
    # step 2 is durable only; the durable tier then does not answer: the restore falls back to 1
    for key in store.list(M, step=2):
        rec = store.info(key)
        store.index.remove_tier(key, "host", name=rec.name)
        store.host.delete(rec.name)
    down = opener()
    install(down, FaultPlan([FaultRule("backend.get@durable", "exception")]))
    net2 = _net(5)
    ck2 = Checkpointer(down, M, net2, keep_last=None)
    assert ck2.restore()[0] == 1
    with caplog.at_level("WARNING"):
        ck2.save(2)
        assert ck2.wait() == "skipped"
    assert any("skipped" in r.getMessage() and "step 2" in r.getMessage() for r in caplog.records)
    ck2.save(3)
    assert ck2.wait() == "committed"
    ck2.close()


@pytest.mark.parametrize("name", ["differential", "differential+dedup", "layerwise"])
def test_forced_delete_beside_a_live_writer(opener, caplog, name):
    """``admin delete MODEL --yes --force`` while a trainer runs: the saves whose deltas (or inherited layers)
    read deleted objects are refused at the vote (aborted, naming what is gone), never reported committed; the
    next save writes full objects, commits, and the job resumes from it."""
    policy = POLICIES[name]
    store = opener()
    net = _net(0)
    ck = Checkpointer(store, M, net, policy=policy())
    ck.restore()
    for s in range(4):
        _step(net, s)
        ck.save(s)
        assert ck.wait() == "committed"
    store.flush()  # no migration in flight: one could write a durable manifest after the delete (see the docs)
    store.delete_model(M, force=True)
    outcomes = {}
    with caplog.at_level("WARNING"):
        for s in range(4, 9):
            _step(net, s)
            ck.save(s)
            outcomes[s] = ck.wait()
            if outcomes[s] == "committed":
                _restores(opener, s, {k: v.clone() for k, v in net.state_dict().items()}, policy())
    assert outcomes[8] == "committed", outcomes
    if name != "layerwise" or outcomes[4] == "aborted":
        assert any("cannot commit" in r.getMessage() or "incomplete" in r.getMessage() for r in caplog.records)
    want = {k: v.clone() for k, v in net.state_dict().items()}
    ck.close()
    net2 = _net(7)
    ck2 = Checkpointer(opener(), M, net2, policy=policy())
    assert ck2.restore()[0] == 8 and _same(net2, want)
    ck2.close()


def test_a_vote_whose_closure_is_not_in_the_index_is_refused_typed(opener):
    """At the protocol: the deciding vote of a step whose delta reads a base the index does not hold (or whose
    declared layer has no version) aborts it with the reason, and raises IncompleteStepError; nothing is
    pinned, and the step number can be saved again."""
    from tierstore.errors import IncompleteStepError

    store = opener()
    steps = store.steps
    steps.begin(M, 5, 1, layout={"layers": ["a"]})
    delta = {"key": f"{M}/a/5/0", "kind": "delta", "size": 1, "checksum": "00", "base": f"{M}/a/2/0"}
    with pytest.raises(IncompleteStepError, match=f"{M}/a/2/0") as e:
        steps.vote(M, 5, 0, [delta])
    assert "incomplete" in e.value.fields["reason"]
    (rec,) = steps.records(M, [5])
    assert rec.state == "aborted" and "incomplete" in (rec.reason or "")
    assert steps.manifest(M, 5) is None
    # a layer of the layout that no rank saved and no earlier committed step holds
    steps.begin(M, 6, 1, layout={"layers": ["a", "b"]})
    full = {"key": f"{M}/a/6/0", "kind": "full", "size": 1, "checksum": "00"}
    with pytest.raises(IncompleteStepError, match="b"):
        steps.vote(M, 6, 0, [full])
    # complete: it commits
    steps.begin(M, 7, 1, layout={"layers": ["a"]})
    assert steps.vote(M, 7, 0, [{**full, "key": f"{M}/a/7/0"}]) == "committed"


def test_a_forced_delete_keeps_the_live_writer_fenced_by_the_next_incarnation(opener, caplog):
    """A forced delete drops the model's epoch with its records; the live writer (the job's second incarnation)
    then saves on under its epoch and is lost with its node. The next incarnation must take a newer epoch than
    any writer of the model's steps: it fences the lost writer and can supersede that writer's lost steps,
    instead of meeting ``StepCommittedError`` at the first of them (found by tests/test_durable_statemachine.py
    under ``layerwise`` in CI)."""
    policy = POLICIES["exact"]
    first = Checkpointer(opener(), M, _net(0), policy=policy())
    first.restore()
    first.save(0)
    assert first.wait() == "committed"
    first._pool.shutdown(wait=False)  # a crash: the second incarnation takes over on the same node
    store = opener()
    net = _net(0)
    ck = Checkpointer(store, M, net, policy=policy())
    assert ck.restore()[0] == 0 and ck.epoch is not None and ck.epoch >= 2
    store.flush()
    opener().delete_model(M, force=True)
    gate = threading.Event()
    for s in range(1, 6):
        _step(net, s)
        ck.save(s)
        assert ck.wait() == "committed"
        store.flush() if s <= 3 else None
        if s == 3:  # steps 4 and 5 commit in memory only, then the node is lost with them
            store.rewire(before_migrate=lambda key: gate.wait(60) if key.step > 3 else None)
    ck._pool.shutdown(wait=False)
    _lose(opener, [gate])
    with caplog.at_level("WARNING"):
        got = _incarnation(opener, policy(), 4, 7, hang_after=None, caplog=caplog, check=True)
    assert sorted(got) == [4, 5, 6, 7], sorted(got)
    assert opener().steps.records(M, [5])[0].epoch > ck.epoch  # the lost writer's step 5, saved again, newer


def test_an_index_that_stops_answering_half_way_through_the_supersedes_leaves_no_step_unsaveable(opener, caplog):
    """The resumed job's first save supersedes the lost steps (those of 4-11 retention kept); the index stops
    answering after the first two supersedes (a partition): that save fails typed, and the retried save, with the link back, carries out
    the rest (the verdicts are not taken again), so every later save of a lost number is written, never
    refused with ``StepCommittedError`` (before: the verdicts were dropped with the failure, and the save of a
    lost step's number hit the still-committed step)."""
    from tierstore.errors import TierUnavailableError

    gates: list = []
    _incarnation(opener, exact(), 0, 11, hang_after=3, caplog=caplog, gates=gates)
    _lose(opener, gates)
    store = opener()
    net = _net(0)
    ck = Checkpointer(store, M, net, policy=exact())
    start, _ = ck.restore()
    assert start == 3
    lost = [s for s, st in store.steps.steps(M) if st in ("committed", "durable") and s > 3]
    assert len(lost) >= 3, lost  # the partition falls between them
    real = store.steps.supersede
    calls: list[int] = []

    def partitioned(model, step, **kw):
        calls.append(step)
        if len(calls) > 2:
            raise TierUnavailableError("injected: the index stopped answering (a partition)")
        return real(model, step, **kw)

    store.steps.supersede = partitioned
    try:
        _step(net, 4)
        with pytest.raises(TierUnavailableError):
            ck.save(4)
    finally:
        store.steps.supersede = real
    done = calls[:2]
    superseded: list[int] = []
    store.steps.supersede = lambda model, step, **kw: superseded.append(step) or real(model, step, **kw)
    try:
        for s in range(4, 14):
            if s > 4:
                _step(net, s)
            ck.save(s)
            assert ck.wait() == "committed", s
            _restores(opener, s, {k: v.clone() for k, v in net.state_dict().items()}, exact())
    finally:
        store.steps.supersede = real
        ck.close()
    assert sorted(done + superseded) == lost, (done, superseded)  # each lost step once
