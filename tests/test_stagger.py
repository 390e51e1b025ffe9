"""Pure-logic tests of the staggering functions (LayerCheck's smoothed I/O)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore.errors import ConfigError
from tierstore.train.stagger import (
    balanced_slots,
    forced_save,
    is_base_step,
    offset,
    shifted,
    slot_loads,
)


def test_offset_spreads_layers_over_the_period():
    assert [offset(i, 0, 4, 4) for i in range(4)] == [0, 1, 2, 3]
    assert [offset(i, 1, 4, 4) for i in range(4)] == [1, 2, 3, 0]
    assert [offset(i, 0, 10, 5) for i in range(5)] == [0, 2, 4, 6, 8]
    with pytest.raises(ConfigError):
        offset(5, 0, 4, 5 - 1)
    with pytest.raises(ConfigError):
        offset(0, 0, 0, 4)


def test_balanced_slots_even_out_unequal_layers():
    sizes = [100, 10, 50, 50, 40, 10]
    slots = balanced_slots(sizes, 3)
    assert sorted(slot_loads(sizes, slots, 3)) == [70, 90, 100]  # LPT; the bound is 100 + 87
    assert balanced_slots(sizes, 3) == slots  # deterministic


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 10_000), min_size=1, max_size=40), st.integers(1, 16))
def test_balanced_slots_bound(sizes, period):
    loads = slot_loads(sizes, balanced_slots(sizes, period), period)
    assert sum(loads) == sum(sizes)
    assert max(loads) <= sum(sizes) / period + max(sizes)


def test_is_base_step_and_rank_shift():
    assert [s for s in range(12) if is_base_step(s, 3, 5)] == [3, 8]
    assert shifted(1, 1, 10, 2) == 6 and shifted(1, 0, 10, 2) == 1


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 12), st.integers(0, 11), st.lists(st.booleans(), min_size=1, max_size=80), st.booleans())
def test_forced_save_keeps_the_staleness_bound(period, slot, voluntary, stagger_first):
    slot %= period
    last = None
    gaps = []
    for step, vol in enumerate(voluntary):
        due = forced_save(step, last, slot, period, stagger_first=stagger_first)
        if due or (vol and last is not None):
            if last is not None:
                gaps.append(step - last)
            last = step
    assert all(g <= period for g in gaps)


def test_quiet_layers_stay_on_their_slots():
    period, slots = 4, [0, 1, 2, 3]
    last = [0, 0, 0, 0]  # all saved at step 0 (the first save)
    per_step = []
    for step in range(1, 13):
        saved = [i for i in range(4) if forced_save(step, last[i], slots[i], period)]
        for i in saved:
            last[i] = step
        per_step.append(len(saved))
    assert per_step == [1] * 12  # one layer per step, never a burst
