"""The vote path of the two-phase commit: why an aborted step aborted, several ranks' votes in one call, and a
waiter that must not take another attempt's decision for its own (consistency/twophase.py)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from consistency.twophase import REASON_CHARS, StepProtocol, Vote
from tierstore import ShardKey
from tierstore.errors import CommitError, StepAbortedError
from tierstore.testing.gpt import GPTConfig, make_model, train
from tierstore.train.checkpointer import Checkpointer
from tierstore.train.policies import exact

M = "vp"


def _put(store, layer: str, step: int, rank: int):
    return store.put(ShardKey(M, layer, step, rank), {"w": torch.full((4,), float(step * 10 + rank))})


def test_a_failed_save_says_why_the_step_aborted(store, monkeypatch):
    """A rank whose save fails votes no; the step's record, ``admin steps`` and the CommitError say why."""
    torch.manual_seed(0)
    model, opt = make_model(GPTConfig(d_model=16, n_layer=1, n_head=2, block=16), seed=0)
    ck = Checkpointer(store, M, model, opt, exact())
    ck.restore()
    train(model, opt, 0, 1, batch_size=2, on_step=lambda s, _l: ck.save(s))
    assert ck.wait() == "committed"

    def full_disk(*_a, **_k):
        raise OSError(28, "No space left on device (the host tier's segment)")

    monkeypatch.setattr(store, "_publish", full_disk)  # sealing the snapshot fails, in the background,
    monkeypatch.setattr(store, "_publish_batch", full_disk)  # one object or a batch of them (finish_many)
    train(model, opt, 1, 2, batch_size=2, on_step=lambda s, _l: ck.save(s))
    with pytest.raises(Exception) as ei:
        ck.wait()
    rec = store.steps.records(M, [1])[0]
    assert rec.state == "aborted"
    assert rec.reason.startswith("negative vote of rank 0: ") and "OSError" in rec.reason
    assert "No space left on device" in rec.reason
    assert "No space left on device" in str(ei.value)
    with pytest.raises(StepAbortedError) as ab:
        store.steps.require_committed(M, 1, timeout=1)
    assert "No space left on device" in str(ab.value) and ab.value.reason == rec.reason
    ck.close()


def test_the_reason_is_bounded_and_one_line(store):
    store.begin_step(M, 2, 2)
    huge = "ValueError('" + "x" * 20_000 + "\nsecond line')"
    assert store.vote(M, 2, 1, [], ok=False, extra={"error": huge}) == "aborted"
    why = store.steps.records(M, [2])[0].reason
    assert "\n" not in why and len(why) <= len("negative vote of rank 1: ") + REASON_CHARS
    assert why.startswith("negative vote of rank 1: ValueError('xxx") and why.endswith("...")
    # an explicit reason wins over extra; a vote with neither still names the rank
    store.begin_step(M, 3, 2)
    store.steps.vote(M, 3, 0, [], ok=False, reason="CommitError: peer lost", extra={"error": "other"})
    assert store.steps.records(M, [3])[0].reason == "negative vote of rank 0: CommitError: peer lost"
    store.begin_step(M, 4, 2)
    store.vote(M, 4, 1, [], ok=False)
    assert store.steps.records(M, [4])[0].reason == "negative vote of rank 1"


def test_vote_many_commits_as_single_votes_do(store):
    """A node's aggregator votes for its local ranks at once: the manifest is the one single votes make."""
    layout = {"layers": ["a", "b"]}
    for step, batched in ((1, False), (2, True)):
        store.begin_step(M, step, 4, layout=layout)
        votes = [Vote(r, [_put(store, ly, step, r) for ly in ("a", "b")], extra={"r": r}) for r in range(4)]
        if batched:
            assert store.steps.vote_many(M, step, votes[:3]) == "preparing"
            assert store.steps.vote_many(M, step, votes[3:]) == "committed"
        else:
            assert [store.steps.vote(M, step, v.rank, list(v.objects), extra=v.extra) for v in votes] == \
                ["preparing"] * 3 + ["committed"]
    m1, m2 = store.steps.manifest(M, 1), store.steps.manifest(M, 2)
    assert sorted(m2["ranks"]) == ["0", "1", "2", "3"] and m2["ranks"]["2"]["extra"] == {"r": 2}
    assert [o["key"] for o in m2["ranks"]["3"]["objects"]] == [f"{M}/a/2/3", f"{M}/b/2/3"]
    assert m1["inherited"] == m2["inherited"] == [] and m1["missing"] == m2["missing"] == []


def test_vote_many_is_all_or_nothing(store):
    store.begin_step(M, 5, 3)
    with pytest.raises(CommitError):  # rank 7 is outside the world: nothing of the call is recorded
        store.steps.vote_many(M, 5, [Vote(0, [_put(store, "a", 5, 0)]), Vote(7, [])])
    assert store.steps.records(M, [5])[0].votes == 0
    with pytest.raises(CommitError):
        store.steps.vote_many(M, 5, [Vote(1, []), Vote(1, [])])  # one rank twice
    with pytest.raises(CommitError):
        store.steps.vote_many(M, 5, [])
    # a negative vote in a batch aborts the step with that rank's reason; the others are not recorded
    assert store.steps.vote_many(M, 5, [Vote(0, []), Vote(2, [], ok=False, reason="OSError: EIO")]) == "aborted"
    rec = store.steps.records(M, [5])[0]
    assert rec.reason == "negative vote of rank 2: OSError: EIO" and rec.votes == 0


def test_a_layer_no_rank_saved_is_inherited_and_a_delta_base_is_a_dep(store):
    """The deciding vote no longer decodes votes: the summaries must still find inherited layers and deps."""
    layout = {"layers": ["a", "b"]}
    store.begin_step(M, 10, 1, layout=layout)
    a10, b10 = _put(store, "a", 10, 0), _put(store, "b", 10, 0)
    assert store.vote(M, 10, 0, [a10, b10]) == "committed"
    store.begin_step(M, 11, 1, layout=layout)
    ref = store.put(ShardKey(M, "a", 11, 0), {}, kind="ref", target=ShardKey(M, "a", 10, 0))
    assert store.vote(M, 11, 0, [ref]) == "committed"  # b inherited from 10, a's target a dep
    m = store.steps.manifest(M, 11)
    assert [o["key"] for o in m["inherited"]] == [f"{M}/b/10/0"]
    assert [o["key"] for o in m["deps"]] == [f"{M}/a/10/0"] and m["missing"] == []


def test_wait_does_not_take_an_older_attempts_decision(store):
    """An attempt aborted, a newer epoch begins the step again: a waiter of the new attempt must not return on
    the old attempt's decision even if it sees it late, and returns on the new one's."""
    sp = StepProtocol(store.index, store.durable)
    e1 = store.open_epoch(M)
    sp.begin(M, 20, 2, epoch=e1)
    assert sp.vote(M, 20, 0, [], ok=False, epoch=e1) == "aborted"
    e2 = store.open_epoch(M)
    sp.begin(M, 20, 2, epoch=e2)
    got: list[str] = []
    t = threading.Thread(target=lambda: got.append(sp.wait(M, 20, timeout=10)))
    t.start()
    time.sleep(0.3)
    # the old attempt's decision, as a late duplicate on the decided channel
    old_started = "1.0"
    store.index._r.publish(store.index._k(M, "decided"), f"20 aborted {old_started}")
    time.sleep(0.3)
    assert got == [] and sp.state(M, 20) == "preparing"
    assert sp.vote(M, 20, 0, [_put(store, "a", 20, 0)], epoch=e2) == "preparing"
    assert sp.vote(M, 20, 1, [_put(store, "a", 20, 1)], epoch=e2) == "committed"
    t.join(10)
    assert got == ["committed"]


def test_waiters_return_on_the_decision_in_the_same_thread_again(store):
    """The subscription is kept per thread between waits: stale events of earlier steps are not decisions."""
    for step in (30, 31, 32):
        store.begin_step(M, step, 2)
        assert store.vote(M, step, 0, [_put(store, "a", step, 0)]) == "preparing"
        done: list[str] = []
        t = threading.Thread(target=lambda s=step: done.append(store.vote(M, s, 1, [_put(store, "a", s, 1)])))
        t.start()
        assert store.steps.wait(M, step, timeout=10) == "committed"
        t.join(10)
        assert done == ["committed"]
