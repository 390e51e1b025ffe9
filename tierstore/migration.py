"""Background migration of host-tier objects to the durable tier.

The tier manager enqueues each object after it is published in the host
tier. Worker threads read it in place from shared memory (no copy into the
trainer's heap), verify its checksum, write it to the durable tier and record
the new placement in the index. The queue is bounded: a full queue blocks the
enqueuing thread (back-pressure), so memory stays bounded whatever the rate.

Each object is migrated under the physical name of its copy (unique to the
write that made it), so a retry or a late migration can only ever write that
same copy. A transient failure (the durable tier or the index unreachable:
:class:`TierUnavailableError`) is retried with exponential backoff, up to
``retries`` times; other failures (access denied, a full medium, a corrupt
host copy) are not. Errors that remain are never dropped: each is recorded
on the object in the index (``migration_error``), kept here, and raised by
:meth:`Migrator.flush`; the tier manager's callback records the step as
staying in memory only. Callbacks registered with :meth:`Migrator.when_done`
run once every object of a group has migrated or given up (the tier manager
uses them to mark steps durable, or memory-only).
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
    FencedError,
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
    pending: dict[str, ShardKey]  # physical name -> key, still migrating
    callback: Callable[[list[tuple[ShardKey, BaseException]]], None]
    failures: list[tuple[ShardKey, BaseException]]
    first: ShardKey | None = None


class Migrator:
    """Moves objects from ``source`` (host tier) to ``target`` (durable tier).

    Workers run ``nice`` nicer than the thread that builds the Migrator
    (:mod:`tierstore.background`).

    Protocol: :meth:`enqueue` after an object is published and indexed;
    :meth:`when_done` to learn when a set of objects has migrated;
    :meth:`flush` to wait for everything queued so far; :meth:`close` at the end.
    """

    def __init__(self, source: Backend, target: Backend, index: Index, *, maxsize: int = 1024, workers: int = 1,
                 name: str = "migrate", retries: int = 5, backoff_s: float = 0.05, backoff_max_s: float = 5.0,
                 sleep: Callable[[float], None] = time.sleep, nice: int = 0):
        self.source = source
        self.target = target
        self.before_each: Callable[[ShardKey], None] | None = None  # called before each object migrates
        self.index = index
        self.retries = retries
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.sleep = sleep
        self.retried = 0  # retries made so far (all objects)
        self._q: queue.Queue[tuple[ShardKey, str, str] | None] = queue.Queue(maxsize=maxsize)
        self._lock = threading.Lock()
        self._errors: list[tuple[ShardKey, BaseException]] = []
        self._done: set[str] = set()  # physical names migrated
        self._failed: dict[str, BaseException] = {}  # physical names that gave up
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

    def enqueue(self, key: ShardKey, checksum: str, name: str | None = None) -> None:
        """Queue the copy ``name`` of ``key`` (default: the plain key) for migration."""
        self._q.put((key, checksum, name or str(key)))

    def when_done(
        self, copies: Iterable[tuple[ShardKey, str]], callback: Callable[[list[tuple[ShardKey, BaseException]]], None]
    ) -> None:
        """Call ``callback(failures)`` once every copy ``(key, physical name)`` has migrated (or given up).

        Copies are told apart by their physical name: a key written again is another copy.
        """
        copies = list(copies)
        group = _Group({name: key for key, name in copies}, callback, [], copies[0][0] if copies else None)
        with self._lock:
            for name, key in list(group.pending.items()):
                if name in self._done:
                    del group.pending[name]
                elif name in self._failed:
                    del group.pending[name]
                    group.failures.append((key, self._failed[name]))
            if group.pending:
                self._groups.append(group)
                return
        self._fire(group)

    def _fire(self, group: _Group) -> None:
        """Run a group's callback; retry it like a migration when the index is unreachable."""
        attempt = 0
        while True:
            try:
                group.callback(group.failures)
                return
            except FencedError as e:  # a zombie's migration counts for nothing: said, not raised by flush()
                log.warning("the migrated mark of a fenced writer was refused (%s: %s)", type(e).__name__, e)
                return
            except TierUnavailableError as e:
                if attempt < self.retries:
                    attempt += 1
                    self.retried += 1
                    self.sleep(min(self.backoff_max_s, self.backoff_s * (2 ** (attempt - 1))))
                    continue
                err: Exception = e
            except Exception as e:  # noqa: BLE001 - a callback's failure must not kill the worker
                err = e
            log.error("migration callback failed: %s", err)
            if group.first is not None:  # flush() reports it
                with self._lock:
                    self._errors.append((group.first, err))
            return

    def _finish(self, key: ShardKey, name: str, error: BaseException | None) -> None:
        ready = []
        with self._lock:
            if error is None:
                self._done.add(name)
            else:
                self._errors.append((key, error))
                self._failed[name] = error
            for g in self._groups:
                if name in g.pending:
                    del g.pending[name]
                    if error is not None:
                        g.failures.append((key, error))
                    if not g.pending:
                        ready.append(g)
            self._groups = [g for g in self._groups if g.pending]
            if len(self._done) > 100_000:
                self._done.clear()  # bounded memory (names are never reused: only old ones are forgotten)
            if len(self._failed) > 10_000:
                self._failed.clear()
        for g in ready:
            self._fire(g)

    def _migrate(self, key: ShardKey, checksum: str, name: str) -> None:
        if self.before_each is not None:
            self.before_each(key)
        blob = self.source.get(name)
        if blob is None:
            if self._gone(key, name):  # deleted (garbage-collected) or replaced by a newer write before its turn
                self._forget_target(key, name)  # an earlier try may have written it before the delete
                return
            raise TierUnavailableError(f"{key} vanished from the {self.source.tier} tier before migration",
                                       key=str(key))
        size = len(blob)
        try:
            stored = codec.verify(blob)
            if stored != checksum:
                raise CorruptObjectError(f"{key}: host copy has checksum {stored}, index says {checksum}")
            self.target.put(name, blob)  # the name is this write's alone: a retry rewrites the same copy
        finally:
            if isinstance(blob, memoryview):
                blob.release()
        if not self.index.add_tier(key, self.target.tier, name=name):
            try:  # the record went or names another copy: this one is garbage in the target tier
                self.target.delete(name)
            except TierStoreError as e:
                log.warning("could not delete superseded %s from the %s tier: %s", name, self.target.tier, e)
            return
        self.bytes_migrated += size

    def _migrate_with_retries(self, key: ShardKey, checksum: str, name: str) -> None:
        """Migrate one object; retry transient failures with exponential backoff (``retries`` times)."""
        attempt = 0
        while True:
            try:
                self._migrate(key, checksum, name)
                return
            except TierUnavailableError as e:  # the target or the index unreachable: transient
                if attempt >= self.retries:
                    raise
                delay = min(self.backoff_max_s, self.backoff_s * (2 ** attempt))
                attempt += 1
                self.retried += 1
                log.info("migration of %s failed (%s); retry %d of %d in %.2f s", key, e, attempt, self.retries, delay)
                self.sleep(delay)

    def _gone(self, key: ShardKey, name: str) -> bool:
        """Whether the copy ``name`` of ``key`` is gone: deleted, or replaced by a newer write. A delete
        removes the tiers' copies before the index record, so a migration that found its source gone (or
        its target directory removed) gives it a moment."""
        try:
            for pause in (*_DELETE_SETTLE_S, None):
                rec = self.index.get_object(key)
                if rec is None or rec.name != name:
                    return True
                if pause is not None:
                    time.sleep(pause)
        except TierStoreError as e:  # the index cannot say: the migration's own error stands
            log.debug("could not tell whether %s was deleted: %s", key, e)
        return False

    def _forget_target(self, key: ShardKey, name: str) -> None:
        try:  # a copy written after the delete removed the target's would be an orphan
            self.target.delete(name)
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
                key, checksum, name = item
                error: Exception | None = None
                try:
                    self._migrate_with_retries(key, checksum, name)
                except Exception as e:  # noqa: BLE001 - a worker thread records every failure; flush() raises it
                    error = e
                if isinstance(error, TierStoreError) and self._gone(key, name):
                    # deleted while it migrated (e.g. its durable directory went with it): not a failure
                    log.debug("%s was deleted while migrating (%s)", key, error)
                    self._forget_target(key, name)
                    error = None
                if error is not None:
                    log.warning("migration of %s failed: %s", key, error)
                    try:
                        self.index.set_object_field(key, "migration_error", str(error)[:500])
                    except TierStoreError:
                        pass
                self._finish(key, name, error)
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
