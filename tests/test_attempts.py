"""One writer per step (consistency/attempts.py) over the real Redis-protocol server: a claimed step refuses a
second writer before it writes, an attempt past its timeout (or of an older epoch) is taken over, and the
writes and votes of a taken-over attempt (a zombie) never count in the new one. Time is injected."""

from __future__ import annotations

import uuid

import pytest
import torch

from consistency.twophase import StepProtocol
from tests.test_twophase import Clock
from tierstore import ShardKey
from tierstore.errors import FencedError, StepBusyError, StepCommittedError


def _model() -> str:
    return f"att{uuid.uuid4().hex[:8]}"


def _put(store, m: str, step: int, rank: int, value: float, token: str | None):
    return store.put(ShardKey(m, "a", step, rank), {"w": torch.full((4,), value)}, attempt=token)


def test_a_claimed_step_refuses_another_writer_before_it_writes(store):
    m, clock = _model(), Clock()
    sp = StepProtocol(store.index, store.durable, step_timeout_s=60, clock=clock)
    assert sp.claim(m, 1, 2, "tok-a").attempt == 1
    assert sp.claim(m, 1, 2, "tok-a").attempt == 1  # the same writer again: idempotent
    clock.t += 10
    with pytest.raises(StepBusyError, match=r"attempt 1, 2 voters, began 10\.0 s ago; it times out in 50\.0 s") as ei:
        sp.claim(m, 1, 2, "tok-b")
    assert (ei.value.model, ei.value.step, ei.value.attempt, ei.value.world) == (m, 1, 1, 2)
    # a writer that did not claim the step cannot write into it or vote for it, with or without a token
    for token in ("tok-b", None):
        with pytest.raises(StepBusyError, match="held by attempt 1 of another writer"):
            _put(store, m, 1, 0, 9.0, token)
        with pytest.raises(StepBusyError):
            sp.vote(m, 1, 0, [], attempt=token)
    assert store.list(m) == []  # the refused copies were removed, nothing is indexed
    infos = [_put(store, m, 1, r, float(r), "tok-a") for r in range(2)]
    assert sp.vote(m, 1, 0, [infos[0]], attempt="tok-a") == "preparing"
    assert sp.vote(m, 1, 1, [infos[1]], attempt="tok-a") == "committed"
    with pytest.raises(StepCommittedError, match="immutable"):
        sp.claim(m, 1, 2, "tok-b")
    assert sp.records(m, [1])[0].state == "committed"


def test_an_attempt_past_its_timeout_is_taken_over_and_its_zombie_counts_for_nothing(store):
    m, clock = _model(), Clock()
    sp = StepProtocol(store.index, store.durable, step_timeout_s=600, clock=clock)
    sp.claim(m, 5, 2, "old", timeout_s=5)
    old0 = _put(store, m, 5, 0, 1.0, "old")
    assert sp.vote(m, 5, 0, [old0], attempt="old") == "preparing"  # rank 1 of the old attempt stalls
    clock.t += 4.9
    with pytest.raises(StepBusyError):
        sp.claim(m, 5, 2, "new")  # not yet: a live writer is never taken over before its timeout
    clock.t += 1
    c = sp.claim(m, 5, 2, "new")
    assert (c.attempt, c.previous_state, c.retried) == (2, "aborted", True)
    assert c.previous == "timed out: it began 5.9 s before, its timeout is 5 s"
    # the stalled rank of the old attempt wakes up: its write and its votes are refused, typed
    with pytest.raises(StepBusyError, match="held by attempt 2 of another writer"):
        _put(store, m, 5, 1, 1.0, "old")
    with pytest.raises(StepBusyError):
        sp.vote(m, 5, 1, [], attempt="old")
    with pytest.raises(StepBusyError):
        sp.vote(m, 5, 0, [], ok=False, attempt="old")  # nor can its negative vote abort the new attempt
    new = [_put(store, m, 5, r, 2.0 + r, "new") for r in range(2)]
    assert sp.vote(m, 5, 0, [new[0]], attempt="new") == "preparing"
    assert sp.vote(m, 5, 1, [new[1]], attempt="new") == "committed"
    (rec,) = sp.records(m, [5])
    assert rec.attempt == 2 and rec.state == "committed"
    names = {o["key"]: o["name"] for r in sp.manifest(m, 5)["ranks"].values() for o in r["objects"]}
    for r in range(2):
        key = ShardKey(m, "a", 5, r)
        assert names[str(key)] == new[r].name == store.info(key).name
        assert torch.equal(store.get(key)["w"], torch.full((4,), 2.0 + r))
    with pytest.raises(StepBusyError):
        sp.vote(m, 5, 1, [], attempt="old")  # a late vote of the old attempt is not told "committed"
    assert store.list(m, step=5) == [ShardKey(m, "a", 5, 0), ShardKey(m, "a", 5, 1)]


def test_an_aborted_attempt_is_begun_again_and_says_why(store):
    m = _model()
    sp = StepProtocol(store.index, store.durable)
    sp.claim(m, 2, 1, "first")
    assert sp.vote(m, 2, 0, [], ok=False, reason="disk full", attempt="first") == "aborted"
    c = sp.claim(m, 2, 1, "second")
    assert (c.attempt, c.previous) == (2, "negative vote of rank 0: disk full")
    assert sp.vote(m, 2, 0, [_put(store, m, 2, 0, 3.0, "second")], attempt="second") == "committed"


def test_a_newer_epoch_takes_over_at_once_and_an_older_one_is_fenced(store):
    m = _model()
    sp = StepProtocol(store.index, store.durable)
    e1 = sp.open_epoch(m)
    sp.claim(m, 3, 1, "inc1", epoch=e1)
    with pytest.raises(StepBusyError):
        sp.claim(m, 3, 1, "other")  # no epoch: no evidence that the attempt of epoch e1 is dead
    e2 = sp.open_epoch(m)
    c = sp.claim(m, 3, 1, "inc2", epoch=e2)
    assert c.attempt == 2 and c.previous == f"fenced: it is of epoch {e1}, the new writer of epoch {e2}"
    with pytest.raises(FencedError):
        sp.claim(m, 4, 1, "inc1", epoch=e1)
    with pytest.raises(FencedError):  # the old incarnation's writes are fenced by its epoch too
        store.put(ShardKey(m, "a", 3, 0), {"w": torch.ones(1)}, epoch=e1, attempt="inc1")


def test_unclaimed_steps_behave_as_before(store):
    """Writers that never claim (the Checkpointer) are not affected: begin, put and vote without a token."""
    m = _model()
    store.begin_step(m, 1, 1)
    assert store.vote(m, 1, 0, [store.put(ShardKey(m, "a", 1, 0), {"w": torch.ones(2)})]) == "committed"
    with pytest.raises(StepBusyError, match="no attempt of this writer"):
        _put(store, m, 9, 0, 1.0, "never-claimed")  # a token for a step nobody claimed
