"""Background migration of host-tier objects to the durable tier.

The tier manager enqueues each object after it is published in the host
tier. Worker threads read it in place from shared memory (no copy into the
trainer's heap), verify its checksum, write it to the durable tier and record
the new placement in the index. The queue is bounded: a full queue blocks the
enqueuing thread (back-pressure), so memory stays bounded whatever the rate.

Errors are never dropped: each is recorded on the object in the index
(``migration_error``), kept here, and raised by :meth:`Migrator.flush`.
Callbacks registered with :meth:`Migrator.when_done` run once every object
of a group has migrated (the tier manager uses them to mark steps durable).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from backends.base import Backend
from consistency.index import Index
from tierstore import codec
from tierstore.background import lower_priority
from tierstore.errors import (
    CorruptObjectError,
    MigrationError,
    TierStoreError,
    TierUnavailableError,
)
from tierstore.keys import ShardKey

__all__ = ["Migrator"]

log = logging.getLogger(__name__)

_DELETE_SETTLE_S = (0.05, 0.2, 0.5)  # pauses between index checks for an object gone from the host tier


@dataclass
class _Group:
    pending: set[ShardKey]
    callback: Callable[[list[tuple[ShardKey, BaseException]]], None]
    failures: list[tuple[ShardKey, BaseException]]


class Migrator:
    """Moves objects from ``source`` (host tier) to ``target`` (durable tier).

    Workers run ``nice`` nicer than the thread that builds the Migrator
    (:mod:`tierstore.background`).

    Protocol: :meth:`enqueue` after an object is published and indexed;
    :meth:`when_done` to learn when a set of objects has migrated;
    :meth:`flush` to wait for everything queued so far; :meth:`close` at the end.
    """

    def __init__(self, source: Backend, target: Backend, index: Index, *, maxsize: int = 1024, workers: int = 1,
                 name: str = "migrate", nice: int = 0):
        self.source = source
        self.target = target
        self.before_each: Callable[[ShardKey], None] | None = None  # called before each object migrates
        self.index = index
        self._q: queue.Queue[tuple[ShardKey, str] | None] = queue.Queue(maxsize=maxsize)
        self._lock = threading.Lock()
        self._errors: list[tuple[ShardKey, BaseException]] = []
        self._done: set[ShardKey] = set()
        self._groups: list[_Group] = []
        self.nice = nice
        self.bytes_migrated = 0
        started = threading.Barrier(workers + 1)
        self._threads = [
            threading.Thread(target=self._run, args=(started,), name=f"tierstore-{name}-{i}", daemon=True)
            for i in range(workers)
        ]
        for t in self._threads:
            t.start()
        started.wait()  # every worker runs at its background priority before the first enqueue

    def enqueue(self, key: ShardKey, checksum: str) -> None:
        self._q.put((key, checksum))

    def when_done(
        self, keys: Iterable[ShardKey], callback: Callable[[list[tuple[ShardKey, BaseException]]], None]
    ) -> None:
        """Call ``callback(failures)`` once every key has been migrated (or has failed)."""
        group = _Group(set(keys), callback, [])
        with self._lock:
            failed = {k: e for k, e in self._errors}
            for k in list(group.pending):
                if k in self._done:
                    group.pending.discard(k)
                elif k in failed:
                    group.pending.discard(k)
                    group.failures.append((k, failed[k]))
            if group.pending:
                self._groups.append(group)
                return
        self._fire(group)

    def _fire(self, group: _Group) -> None:
        try:
            group.callback(group.failures)
        except Exception:  # a callback's failure must not kill the worker
            log.exception("migration callback failed")

    def _finish(self, key: ShardKey, error: BaseException | None) -> None:
        ready = []
        with self._lock:
            if error is None:
                self._done.add(key)
            else:
                self._errors.append((key, error))
            for g in self._groups:
                if key in g.pending:
                    g.pending.discard(key)
                    if error is not None:
                        g.failures.append((key, error))
                    if not g.pending:
                        ready.append(g)
            self._groups = [g for g in self._groups if g.pending]
            if len(self._done) > 100_000:
                self._done.clear()  # bounded memory; groups registered later re-check the index
        for g in ready:
            self._fire(g)

    def _migrate(self, key: ShardKey, checksum: str) -> None:
        if self.before_each is not None:
            self.before_each(key)
        name = str(key)
        blob = self.source.get(name)
        if blob is None:
            if self._deleted(key):
                return  # deleted (garbage-collected) before its turn: nothing left to migrate
            raise TierUnavailableError(f"{key} vanished from the host tier before migration", key=str(key))
        size = len(blob)
        try:
            stored = codec.verify(blob)
            if stored != checksum:
                raise CorruptObjectError(f"{key}: host copy has checksum {stored}, index says {checksum}")
            self.target.put(name, blob)
        finally:
            if isinstance(blob, memoryview):
                blob.release()
        self.index.add_tier(key, self.target.tier)
        self.bytes_migrated += size

    def _deleted(self, key: ShardKey) -> bool:
        """Whether ``key`` was deleted. A delete removes the tiers' copies before the index record, so a
        migration that found its source gone (or its target directory removed) gives it a moment."""
        try:
            for pause in (*_DELETE_SETTLE_S, None):
                if self.index.get_object(key) is None:
                    return True
                if pause is not None:
                    time.sleep(pause)
        except TierStoreError as e:  # the index cannot say: the migration's own error stands
            log.debug("could not tell whether %s was deleted: %s", key, e)
        return False

    def _forget_target(self, key: ShardKey) -> None:
        try:  # a copy written after the delete removed the target's would be an orphan
            self.target.delete(str(key))
        except Exception as e:  # noqa: BLE001 - best effort: the worker must outlive any tier's failure
            log.debug("could not remove the target copy of deleted %s: %s", key, e)

    def _run(self, started: threading.Barrier) -> None:
        lower_priority(self.nice)
        started.wait()
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                key, checksum = item
                error: Exception | None = None
                try:
                    self._migrate(key, checksum)
                except Exception as e:  # noqa: BLE001 - a worker thread records every failure; flush() raises it
                    error = e
                if isinstance(error, TierStoreError) and self._deleted(key):
                    # deleted while it migrated (e.g. its durable directory went with it): not a failure
                    log.debug("%s was deleted while migrating (%s)", key, error)
                    self._forget_target(key)
                    error = None
                if error is not None:
                    log.warning("migration of %s failed: %s", key, error)
                    try:
                        self.index.set_object_field(key, "migration_error", str(error)[:500])
                    except TierStoreError:
                        pass
                self._finish(key, error)
            finally:
                self._q.task_done()

    def flush(self) -> None:
        """Wait until everything queued so far has migrated; raise :class:`MigrationError` on failures."""
        self._q.join()
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            names = ", ".join(str(k) for k, _ in errors[:5])
            raise MigrationError(
                f"{len(errors)} object(s) failed to reach the {self.target.tier} tier: {names}: {errors[0][1]}",
                failures=errors,
            ) from errors[0][1]

    def close(self) -> None:
        for _ in self._threads:
            self._q.put(None)
        for t in self._threads:
            t.join(timeout=30)
