"""Migration runs at a lower priority and may fall behind retention: a deleted object is not a failure.

A delete removes the tiers' copies before the index record, and the local
durable tier removes a directory when its last object goes; a migrator that
lags (background priority, loaded cores) then finds its source gone or its
target directory removed. Those are deletions, not failed migrations; an
object still recorded in the index that cannot be migrated still is.
"""

from __future__ import annotations

import pytest
import torch

from backends.memory import MemoryBackend
from tierstore import ShardKey
from tierstore.errors import MigrationError, TierUnavailableError
from tierstore.migration import Migrator


class _DeletedWhilePut(MemoryBackend):
    """A target whose put fails the way localfs does when a concurrent delete removed the directory."""

    tier = "durable"

    def __init__(self, store, key, delete_first: bool):
        super().__init__()
        self.store = store
        self.key = key
        self.delete_first = delete_first

    def put(self, name, data, *, if_absent=False):
        super().put(name, data, if_absent=if_absent)  # written, then the delete lands
        if self.delete_first:
            self.store.delete(self.key)
        raise TierUnavailableError(f"durable put of {name!r}: No such file or directory", key=name)


@pytest.mark.parametrize("deleted", [True, False])
def test_object_deleted_while_migrating_is_not_a_failure(store, deleted):
    key = ShardKey("lag", "l0", 1, 0)
    info = store.put(key, {"w": torch.randn(64)})
    store.flush()  # the store's own migration is done; the one under test runs below
    target = _DeletedWhilePut(store, key, delete_first=deleted)
    m = Migrator(store.host, target, store.index, name="lag-test")
    try:
        m.enqueue(key, info.checksum, info.name)
        if deleted:
            m.flush()  # no error: the object is gone
            assert not target.exists(info.name)  # and no orphan copy was left behind
        else:
            with pytest.raises(MigrationError):
                m.flush()
    finally:
        m.close()


def test_source_gone_but_still_recorded_is_a_failure(store):
    key = ShardKey("lag", "l1", 1, 0)
    info = store.put(key, {"w": torch.randn(64)})
    store.flush()  # the store's own migration is done; the one under test runs below
    store.host.delete(info.name)  # evicted from the host tier before it migrated: lost, and said so
    m = Migrator(store.host, MemoryBackend(), store.index, name="lag-test2")
    try:
        m.enqueue(key, info.checksum, info.name)
        with pytest.raises(MigrationError, match="vanished"):
            m.flush()
    finally:
        m.close()
