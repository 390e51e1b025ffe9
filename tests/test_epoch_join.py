"""The Checkpointer's index operations: joining an incarnation's epoch, and rank progress (consistency/twophase.py)."""

from __future__ import annotations

import threading

import pytest

from tierstore.errors import FencedError


def test_ranks_of_one_incarnation_share_one_new_epoch(store):
    st = store.steps
    base = store.index.epoch("j")
    got: list[int] = []
    threads = [threading.Thread(target=lambda: got.append(st.join_epoch("j", "inc-a", base))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # one epoch for the whole incarnation, newer than the one it started from. Not always base + 1: ranks that
    # probe at once may each reserve a candidate (base + 1, base + 2, ...) before the first raises the index, and
    # whichever raises it first is the one every rank joins; a skipped number fences nothing more
    assert len(got) == 8 and len(set(got)) == 1 and got[0] > base, got
    assert store.index.epoch("j") == got[0]


def test_older_incarnations_are_fenced_whatever_the_order(store):
    st = store.steps
    a = st.join_epoch("k", "inc-a", 0)
    b = st.join_epoch("k", "inc-b", a)  # the next incarnation saw a's epoch when it started
    assert b == a + 1
    with pytest.raises(FencedError):
        st.join_epoch("k", "inc-a", 0)  # a rank of a (a zombie) joining late
    with pytest.raises(FencedError):
        st.join_epoch("k", "inc-z", a)  # one that started with b but never joined before b raised it
    assert st.join_epoch("k", "inc-b", a) == b
    assert store.open_epoch("k") == b + 1  # an explicit new epoch fences b too
    with pytest.raises(FencedError):
        st.join_epoch("k", "inc-b", a)


def test_progress_is_recorded_per_rank(store):
    st = store.steps
    assert st.progress("p") == {}
    st.note_progress("p", 0, 5, 3)
    st.note_progress("p", 1, 4, None)
    st.note_progress("p", 0, 6, 3)
    assert st.progress("p") == {0: (3, 6), 1: (-1, 4)}
