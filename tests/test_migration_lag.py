"""Migration runs at a lower priority and may fall behind the saves and retention.

When it lags, the newest committed step goes first and the steps between that have not started are
skipped (bounded lag); the lag is reported. A deleted object is not a failure.

A delete removes the tiers' copies before the index record, and the local
durable tier removes a directory when its last object goes; a migrator that
lags (background priority, loaded cores) then finds its source gone or its
target directory removed. Those are deletions, not failed migrations; an
object still recorded in the index that cannot be migrated still is.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from backends.memory import MemoryBackend
from tierstore import ShardKey
from tierstore.errors import MigrationError, TierUnavailableError
from tierstore.migration import Migrator, Skipped


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


class _Gated(MemoryBackend):
    """A durable tier whose puts wait for the test to open the gate (one object at a time)."""

    tier = "durable"

    def __init__(self):
        super().__init__()
        self.gate = threading.Semaphore(0)
        self.order: list[str] = []

    def put(self, name, data, *, if_absent=False):
        assert self.gate.acquire(timeout=30), "the test never opened the gate"
        self.order.append(name)
        super().put(name, data, if_absent=if_absent)


def test_a_lagging_migration_takes_the_newest_committed_step_and_skips_the_ones_between(store):
    """Steps 1..5 commit while the durable tier takes one object at a time: step 1 (started) is finished,
    then step 5, the newest committed; steps 2..4, never started, are skipped, and their callbacks say so."""
    target = _Gated()
    states = {}
    m = Migrator(store.host, target, store.index, name="lag-newest", decided=lambda model, s: states.get(s),
                 reach=lambda model, s, rank: [])
    outcomes: dict[int, list] = {}
    try:
        infos = {}
        for s in range(1, 6):
            infos[s] = [store.put(ShardKey("lagn", ly, s, 0), {"w": torch.full((64,), float(s))}) for ly in "ab"]
            for info in infos[s]:
                m.enqueue(info.key, info.checksum, info.name)
            states[s] = "committed"
            m.when_done([(i.key, i.name) for i in infos[s]], lambda f, s=s: outcomes.setdefault(s, f),
                        step=("lagn", s, 0))
            if s == 1:
                target.gate.release()  # step 1's first object goes: step 1 has started
                deadline = time.monotonic() + 30
                while not target.order and time.monotonic() < deadline:
                    time.sleep(0.01)
        for _ in range(3):  # step 1's second object, then step 5's two
            target.gate.release()
        m.flush()
        migrated_steps = [ShardKey.parse(n.rsplit(".", 1)[0]).step for n in target.order]
        assert migrated_steps == [1, 1, 5, 5]
        assert outcomes[1] == [] and outcomes[5] == []
        for s in (2, 3, 4):
            assert len(outcomes[s]) == 2 and all(isinstance(e, Skipped) for _k, e in outcomes[s])
            assert "step 5 was migrated first" in str(outcomes[s][0][1])
        assert m.skipped_steps == 3
    finally:
        for _ in range(8):
            target.gate.release()
        m.close()


def test_the_lag_is_reported_in_steps_and_seconds(store):
    from consistency.steprecords import durable_lag

    gate = threading.Event()
    store.rewire(before_migrate=lambda key: gate.wait(30) if key.step >= 2 else None)
    for s in (1, 2, 3):
        store.begin_step("lagr", s, 1)
        store.vote("lagr", s, 0, [store.put(ShardKey("lagr", "a", s, 0), {"w": torch.ones(8) * s})])
        if s == 1:
            store.flush()
    lag = durable_lag(store.steps.records("lagr"), store.index.server_time())
    assert (lag.newest_committed, lag.newest_durable, lag.steps) == (3, 1, 2) and lag.seconds >= 0
    gate.set()
    store.flush()
    lag = durable_lag(store.steps.records("lagr"), store.index.server_time())
    assert lag.newest_durable == 3 and lag.steps == 0 and lag.seconds == 0
