"""Races between a caller and the store's background work, forced in the unlucky order.

- ``store.delete(key)`` while the background migration of a fresh put of that key
  is copying it to the durable tier: the delete must win (no copy anywhere, no
  record, no failure reported by the delete or by ``flush``), whatever the order.
- the host tier's ``drain_pool`` (another process opening or closing the tier)
  while a writer claims a pooled segment for a reservation.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import torch

from tests._tiers import copies
from tierstore import ShardKey

K = ShardKey("gpt", "block0", 3, 0)


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 1024, generator=g)}


class _Delegate:
    """Everything of ``inner``, with a few methods overridden by subclasses."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def _nothing_left(store, key: ShardKey) -> list:
    left = []
    for tier in store.tiers:
        left += [(tier.tier, n) for n in copies(tier, key)]
    if store.info(key) is not None:
        left.append(("index", store.info(key)))
    return left


def test_delete_during_migration_in_the_unlucky_order_leaves_nothing(store):
    """The migration copies the object to the durable tier after the delete removed the durable copy and
    records it there before the delete removes the record: the copy the migration wrote must not survive."""
    migration_read = threading.Event()  # the migration holds its view of the host copy
    durable_deleted = threading.Event()  # the delete has removed (or found no) durable copy
    tier_added = threading.Event()  # the migration has recorded its durable copy (or tried to)

    class ReadHost(_Delegate):
        def get(self, name):  # only the migration reads in this test
            try:
                return self.inner.get(name)
            finally:
                migration_read.set()

    class GatedDurable(_Delegate):
        def put(self, name, data, **kw):  # the migration's write waits for the delete's pass over this tier
            durable_deleted.wait(5)
            return self.inner.put(name, data, **kw)

        def delete(self, name):
            try:
                return self.inner.delete(name)
            finally:
                durable_deleted.set()

    class GatedIndex(_Delegate):
        def add_tier(self, *a, **kw):
            try:
                return self.inner.add_tier(*a, **kw)
            finally:
                tier_added.set()

        def delete_object(self, *a, **kw):  # the delete's record removal waits for the migration's record
            tier_added.wait(2)
            return self.inner.delete_object(*a, **kw)

    gates = {"host": ReadHost, "durable": GatedDurable}
    store.rewire(tier=lambda t: gates[t.tier](t) if t.tier in gates else t, index=GatedIndex)
    store.put(K, _tensors())
    assert migration_read.wait(5)
    assert store.delete(K) is True
    store.flush()  # the migration's outcome: nothing to report (the object was deleted)
    assert store.get(K) is None
    assert _nothing_left(store, K) == []


def test_delete_racing_fresh_puts_never_fails_and_leaves_nothing(store):
    """Many put-then-delete pairs at random offsets from the migration: every delete reports the object
    existed, flush reports nothing, and no tier or index keeps a trace."""
    rng = random.Random(7)
    keys = [ShardKey("gpt", "block0", s, 0) for s in range(40)]
    for i, key in enumerate(keys):
        store.put(key, _tensors(i))
        time.sleep(rng.random() * 0.003)
        assert store.delete(key) is True, key
    store.flush()
    assert [k for k in keys if _nothing_left(store, k)] == []
    for key in keys:
        assert store.get(key) is None
