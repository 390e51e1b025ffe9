"""What retention records of the steps it retires (``tierstore admin steps`` reads it), on the real index."""

from __future__ import annotations

from consistency.gc import Retention, plan_retention, retire
from tests.test_gc import saved
from tests.test_twophase import M


def test_retired_steps_are_counted_once_when_every_rank_retires_them(store):
    """Each rank's writer carries out the same plan (its own objects); a step two ranks retire at once counts
    once, and the note names the windows of the pass."""
    saved(store, range(1, 7))
    plan = plan_retention(store.steps, M, Retention(keep_last=2))
    assert plan.retired == [1, 2, 3, 4]
    objects = store.index.list_objects(M)
    for rank in (0, 1):  # both planned before either dropped a record
        retire(store.steps, M, plan, [k for k in objects if k.rank == rank], delete=store._collect,
               release=store.release, drop=store._drop_copy)
    note = store.steps.retention_note(M)
    assert note is not None and note["retired"] == 4 and note["newest_retired"] == 4
    assert note["memory"] == [5, 6] and note["keep_last"] == 2
    store.gc(M, Retention(keep_last=1), dry_run=False)  # a later pass adds to the count
    note = store.steps.retention_note(M)
    assert note["retired"] == 5 and note["memory"] == [6] and note["keep_last"] == 1


def test_no_note_while_nothing_was_retired(store):
    saved(store, range(1, 3))
    store.gc(M, Retention(keep_last=2), dry_run=False)
    assert store.steps.retention_note(M) is None
