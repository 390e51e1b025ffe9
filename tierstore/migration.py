"""Background migration of host-tier objects to the durable tier, newest committed step first.

The tier manager enqueues each object after it is published in the host
tier (:meth:`Migrator.enqueue`), and, once the rank voted, says which copies
make up its part of the step (:meth:`Migrator.when_done`). Worker threads
read each object in place from shared memory (no copy into the trainer's
heap), verify its checksum, write it to the durable tier and record the new
placement in the index.

Work is grouped into *jobs*, one per (model, step, rank). **Bounded lag**: a
worker always takes the newest *committed* job first (``decided`` tells a
step's state); when it does, older jobs of the same model that have not
started are *skipped*: they are not migrated, except the objects the chosen
step's manifest still reaches (its delta bases, inherited layer versions,
ref targets: ``reach``), and their callbacks are told so (the tier manager
records such a step as staying in memory only, and why). A pinned step
(``kept``: a framework's checkpoint names it,
:meth:`consistency.steprecords.StepRecords.pin`) is never skipped: it migrates
after the newer one, since retention keeps it in memory until it is durable.
A started job is
always finished, so the durable tier is never more than about one step's
migration behind the newest committed step, however slow it is. With no
committed job waiting, the newest job is migrated ahead of its commit (the
migration runs beside the votes). A migrator without ``decided`` (the peer
replicator) works oldest first and skips nothing.

Each object is migrated under the physical name of its copy (unique to the
write that made it), so a retry or a late migration can only ever write that
same copy. A transient failure (the durable tier or the index unreachable:
:class:`TierUnavailableError`) is retried with exponential backoff, up to
``retries`` times; other failures (access denied, a full medium, a corrupt
host copy) are not. Errors that remain are never dropped: each is recorded
on the object in the index (``migration_error``), kept here, and raised by
:meth:`Migrator.flush`; the tier manager's callback records the step as
staying in memory only. A copy deleted before its turn (retention) is not a
failure. Memory is bounded: at most ``maxsize`` objects wait (an enqueue
beyond blocks: back-pressure); jobs hold names, not data.

**Every wait ends** (issue 28). A migration that makes no progress for
``stall_s`` (a durable tier whose put hangs: a stuck NFS or FUSE mount; an
index that stopped answering) is reported by a watchdog thread, once per
object: a warning naming the tier, the step and what it is blocked in, and
:meth:`Migrator.stalled`. :meth:`Migrator.flush` takes a ``timeout`` and
raises :class:`DurableTimeoutError` naming the steps still memory-only;
:meth:`Migrator.close` takes one too and abandons what did not finish in it
(the steps are returned: they stay memory-only). A worker stuck in a put
cannot be interrupted: it is a daemon thread, left to finish or die with the
process; what it writes afterwards is an orphan copy at worst (the index is
not told), never a torn one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from backends.base import Backend
from backends.retry import RetryPolicy
from consistency.index import Index
from tierstore import codec
from tierstore.background import lower_priority
from tierstore.errors import (
    CorruptObjectError,
    DurableTimeoutError,
    FencedError,
    MigrationError,
    TierStoreError,
    TierUnavailableError,
)
from tierstore.keys import ShardKey

__all__ = ["Migrator", "Skipped"]

log = logging.getLogger(__name__)

_DELETE_SETTLE_S = (0.05, 0.2, 0.5)  # pauses between index checks for an object gone from the host tier
_COMMITTED = ("committed", "durable")

Failures = list[tuple[ShardKey, BaseException]]


class Skipped(Exception):
    """Handed to a job's callback (in ``failures``) for copies not migrated because a newer step was first."""


@dataclass
class _Job:
    """One rank's part of one step: the copies still to migrate, and who waits for which copies."""

    model: str
    step: int
    rank: int
    pending: dict[str, tuple[ShardKey, str]] = field(default_factory=dict)  # name -> (key, checksum), not started
    running: set[str] = field(default_factory=set)
    wanted: dict[str, ShardKey] = field(default_factory=dict)  # the copies when_done waits for
    callbacks: list[Callable[[Failures], None]] = field(default_factory=list)
    fired: list[Callable[[Failures], None]] = field(default_factory=list)  # called once; again if reach adds
    started: bool = False
    skipped: str | None = None  # why it was skipped
    reached: bool = False  # the committed step's reach was added
    reach: set[str] = field(default_factory=set)  # the names of that reach

    @property
    def ident(self) -> tuple[str, int, int]:
        return self.model, self.step, self.rank

    @property
    def idle(self) -> bool:
        return not self.pending and not self.running and not self.callbacks and (self.reached or not self.wanted)


_Ready = tuple[list[Callable[[Failures], None]], Failures, "ShardKey | None"]


class Migrator:
    """Moves objects from ``source`` (host tier) to ``target`` (durable tier); see the module docstring.

    Workers run ``nice`` nicer than the thread that builds the Migrator
    (:mod:`tierstore.background`).

    Protocol: :meth:`enqueue` after an object is published and indexed;
    :meth:`when_done` after the rank's vote, to learn when its part of the step
    has migrated; :meth:`flush` to wait for everything queued so far;
    :meth:`close` at the end.

    Args:
        decided: ``decided(model, step)``: the step's state. With ``reach`` too, the newest committed step
            goes first and older unstarted ones are skipped; without, oldest first, nothing skipped.
        reach: ``reach(model, step, rank)``: ``(key, checksum, name)`` of the copies of ``rank`` that the
            committed ``step``'s manifest reaches and the durable tier does not hold yet.
        stall_s: an object whose migration has not finished after this many seconds is reported stalled
            (a warning naming the tier, step and what it is blocked in; :meth:`stalled`); ``None``: never.
        kept: ``kept(model)``: its pinned steps, never skipped (asked only where older jobs would be).
    """

    def __init__(self, source: Backend, target: Backend, index: Index, *, maxsize: int = 1024, workers: int = 1,
                 name: str = "migrate", retries: int = 5, backoff_s: float = 0.05, backoff_max_s: float = 5.0,
                 sleep: Callable[[float], None] = time.sleep, nice: int = 0,
                 decided: Callable[[str, int], str | None] | None = None,
                 reach: Callable[[str, int, int], list[tuple[ShardKey, str, str]]] | None = None,
                 stall_s: float | None = 10.0, kept: Callable[[str], set[int]] | None = None):
        self.source = source
        self.kept = kept
        self.target = target
        self.before_each: Callable[[ShardKey], None] | None = None  # called before each object migrates
        self.index = index
        self.policy = RetryPolicy(retries, backoff_s, backoff_max_s, sleep)
        self.decided = decided
        self.reach = reach
        self.maxsize = maxsize
        self.retried = 0  # retries made so far (all objects)
        self.skipped_steps = 0  # jobs skipped so far (bounded lag)
        self._cv = threading.Condition()
        self._jobs: dict[tuple[str, int, int], _Job] = {}
        self._outcome: dict[str, BaseException | None] = {}  # physical name -> None (migrated) or why not
        self._queued = 0  # copies pending in all jobs
        self._running = 0
        self._committed: set[tuple[str, int]] = set()  # steps known committed
        self._firing: dict[tuple[str, int], int] = {}  # steps whose callbacks run now (marking them migrated)
        self._errors: Failures = []
        self._closing = False
        self._abandoned = False  # close() ran out of its bound: workers stop taking work
        self.stall_s = stall_s
        self._began: dict[str, tuple[ShardKey, float]] = {}  # running name -> (key, monotonic start)
        self._phase: dict[str, str] = {}  # running name -> what its migration is doing now
        self._warned: set[str] = set()  # stalled names already reported
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
        self._watch: threading.Thread | None = None
        if stall_s is not None and stall_s > 0:
            # named apart from the workers (tierstore-<name>-<i>): it watches them, it moves no bytes
            self._watch = threading.Thread(target=self._watchdog, name=f"tierstore-watch-{name}", daemon=True)
            self._watch.start()

    # -- the tier manager's side ----------------------------------------------------------------
    def _job(self, model: str, step: int, rank: int) -> _Job:
        job = self._jobs.get((model, step, rank))
        if job is None:
            job = self._jobs[(model, step, rank)] = _Job(model, step, rank)
        return job

    def _busy(self, name: str) -> bool:
        return any(name in j.pending or name in j.running for j in self._jobs.values())

    def enqueue(self, key: ShardKey, checksum: str, name: str | None = None) -> None:
        """Queue the copy ``name`` of ``key`` (default: the plain key) for migration (blocks while full)."""
        name = name or str(key)
        with self._cv:
            while self._queued >= self.maxsize and not self._closing:
                self._cv.wait(0.5)
            job = self._job(key.model, key.step, key.rank)
            self._outcome.pop(name, None)
            if job.skipped is not None:  # a newer step went first: this one is not migrated
                self._outcome[name] = Skipped(job.skipped)
            elif not self._busy(name):
                job.pending[name] = (key, checksum)
                self._queued += 1
                self._cv.notify_all()

    def when_done(self, copies: Iterable[tuple[ShardKey, str]], callback: Callable[[Failures], None], *,
                  step: tuple[str, int, int] | None = None) -> None:
        """Call ``callback(failures)`` once every copy ``(key, physical name)`` has migrated, failed or been
        skipped (:class:`Skipped` in ``failures``).

        ``step``: the job, as ``(model, step, rank)`` (default: that of the first copy; needed when
        ``copies`` is empty). Copies are told apart by their physical name: a key written again is another
        copy.
        """
        copies = list(copies)
        if step is None and copies:
            k = copies[0][0]
            step = (k.model, k.step, k.rank)
        if step is None:
            callback([])
            return
        with self._cv:
            job = self._job(*step)
            for k, n in copies:
                job.wanted[n] = k
                if n not in self._outcome and not self._busy(n):
                    # never enqueued (or forgotten): nothing will migrate it here
                    self._outcome[n] = Skipped(job.skipped) if job.skipped else None
            job.callbacks.append(callback)
            ready = self._ready(job)
        if ready:
            self._fire(*ready)

    def migrating_steps(self, model: str) -> set[int]:
        """Steps of ``model`` this migrator has started and not finished (retention leaves them alone).

        A step counts until its callbacks returned: the callback marks it migrated and writes its durable
        manifest (a slow durable tier takes a while), and a retention pass in that window must not retire
        the step (it then never became durable: the starvation of issue 28, a save every few puts).
        """
        with self._cv:
            return {j.step for j in self._jobs.values() if j.model == model and j.started
                    and (j.pending or j.running)} | {s for (m, s) in self._firing if m == model}

    # -- scheduling ---------------------------------------------------------------------------------
    def _is_committed(self, job: _Job) -> bool:
        """Whether ``job``'s step is committed (remembered once it is); a step aborted or gone frees a job
        that only waited to learn it."""
        if (job.model, job.step) in self._committed:
            return True
        if self.decided is None:
            return False
        try:
            st = self.decided(job.model, job.step)
        except TierStoreError as e:  # the index unreachable: decide later
            log.debug("state of step %s of %s unknown: %s", job.step, job.model, e)
            return False
        if st in _COMMITTED:
            if len(self._committed) > 10_000:
                self._committed.clear()
            self._committed.add((job.model, job.step))
            return True
        if st != "preparing":
            job.reached = True  # never committed: nothing will reach through it
        return False

    def _unlocked(self, fn: Callable[[], object]) -> object:
        self._cv.release()
        try:
            return fn()
        finally:
            self._cv.acquire()

    def _next(self) -> tuple[_Job, str, ShardKey, str] | None:
        """The next copy to migrate (lock held; released while the index is asked).

        Started jobs first (a job begun is finished), then the newest committed job of each model (its
        reach added, older unstarted jobs skipped), then the newest job ahead of its commit.
        """
        if not any(j.pending for j in self._jobs.values()):
            return None
        if self.decided is None or self.reach is None:
            job = min((j for j in self._jobs.values() if j.pending), key=lambda j: (j.step, j.model, j.rank))
        else:
            chosen: set[str] = set()
            for j in sorted([j for j in self._jobs.values() if j.pending or (j.wanted and not j.reached)],
                            key=lambda j: -j.step):
                if j.model not in chosen and self._unlocked(lambda j=j: self._is_committed(j)):  # type: ignore[misc]
                    chosen.add(j.model)
                    self._skip_older(j)
            pend = [j for j in self._jobs.values() if j.pending]
            if not pend:
                return None
            started = [j for j in pend if j.started]
            if started:  # finish what was begun, oldest first
                job = min(started, key=lambda j: (j.step, j.rank))
            else:  # the newest committed job, else the newest ahead of its commit
                job = max(pend, key=lambda j: ((j.model, j.step) in self._committed, j.step, -j.rank))
        name, (key, checksum) = next(iter(job.pending.items()))
        del job.pending[name]
        job.running.add(name)
        job.started = True
        self._began[name] = (key, time.monotonic())
        self._phase[name] = "waiting to start"
        self._queued -= 1
        self._running += 1
        self._cv.notify_all()
        return job, name, key, checksum

    def _skip_older(self, chosen: _Job) -> None:
        """Add what committed ``chosen``'s step reaches to it, then skip the unstarted jobs of its model and
        rank older than it (lock held). Copies they share with that reach migrate as part of ``chosen``."""
        if not chosen.reached:
            try:
                reached = self._unlocked(lambda: self.reach(chosen.model, chosen.step, chosen.rank))  # type: ignore[misc]
            except TierStoreError as e:  # without the manifest nothing older is skipped this time
                log.debug("reach of step %s of %s unknown: %s", chosen.step, chosen.model, e)
                return
            chosen.reached = True
            for key, checksum, name in reached:  # type: ignore[attr-defined]
                chosen.reach.add(name)
                if self._outcome.get(name, Skipped()) is None:
                    continue  # migrated already
                chosen.wanted[name] = key  # the step is durable only with it: its callback waits for it too
                if not self._busy(name):
                    self._outcome.pop(name, None)
                    chosen.pending[name] = (key, checksum)
                    self._queued += 1
            if chosen.fired and any(n not in self._outcome for n in chosen.wanted):
                chosen.callbacks, chosen.fired = chosen.fired + chosen.callbacks, []  # called again once they land
        older = [j for j in self._jobs.values() if j.model == chosen.model and j.rank == chosen.rank
                 and j.step < chosen.step and not j.started and j.skipped is None]
        if older and self.kept is not None:
            kept = self.kept
            try:
                pinned = self._unlocked(lambda: kept(chosen.model))
            except TierStoreError as e:  # unknown: skip nothing this time (a pin may keep any of them)
                log.debug("pins of %s unknown: %s", chosen.model, e)
                return
            # the lock was released while the index answered: take only what is still unstarted
            older = [j for j in older if j.step not in pinned and not j.started and j.skipped is None]  # type: ignore[operator]
        if not older:
            return
        why = f"step {chosen.step} was migrated first (the durable tier lagged behind the saves)"
        for j in older:
            j.skipped = why
            for n, v in list(j.pending.items()):
                del j.pending[n]
                self._queued -= 1
                if n in chosen.reach:  # still needed: migrated with the chosen step
                    chosen.pending[n] = v
                    self._queued += 1
                else:
                    self._outcome[n] = Skipped(why)
            self.skipped_steps += 1
            log.info("migration of step %s of %s (rank %s) skipped: %s", j.step, j.model, j.rank, why)
        ready = [r for r in (self._ready(j) for j in older) if r]
        if ready:
            self._running += 1  # flush() waits for these callbacks too
            try:
                self._unlocked(lambda: self._fire_all(ready))
            finally:
                self._running -= 1
        self._cv.notify_all()

    def _fire_all(self, ready: list[_Ready]) -> None:
        for r in ready:
            self._fire(*r)

    def _hold(self, ready: list[_Ready], delta: int) -> None:
        """Count the steps of ``ready`` as migrating while their callbacks run (lock held)."""
        for _cbs, _failures, first in ready:
            if first is None:
                continue
            ident = (first.model, first.step)
            n = self._firing.get(ident, 0) + delta
            if n > 0:
                self._firing[ident] = n
            else:
                self._firing.pop(ident, None)

    # -- completion -----------------------------------------------------------------------------
    def _ready(self, job: _Job) -> _Ready | None:
        """``job``'s callbacks and failures if every copy it waits for settled (lock held); an idle job is
        forgotten."""
        if job.callbacks and all(n in self._outcome for n in job.wanted):
            callbacks, job.callbacks = job.callbacks, []
            job.fired += callbacks
            failures: Failures = [(k, e) for n, k in job.wanted.items() if (e := self._outcome[n]) is not None]
            first = next(iter(job.wanted.values()), None)
            if job.idle and self._jobs.get(job.ident) is job:
                del self._jobs[job.ident]
            return callbacks, failures, first
        if job.idle and not job.wanted and self._jobs.get(job.ident) is job:
            del self._jobs[job.ident]  # migrated (or skipped) before its vote: when_done finds the outcomes
        return None

    def _fire(self, callbacks: list[Callable[[Failures], None]], failures: Failures,
              first: ShardKey | None) -> None:
        """Run a job's callbacks; retry each like a migration when the index is unreachable."""
        for callback in callbacks:
            try:
                self.policy.call(lambda cb=callback: cb(failures), on_retry=self._count)  # type: ignore[misc]
            except FencedError as e:  # a zombie's migration counts for nothing: said, not raised by flush()
                log.warning("the migrated mark of a fenced writer was refused (%s: %s)", type(e).__name__, e)
            except Exception as e:  # noqa: BLE001 - a callback's failure must not kill the worker
                log.error("migration callback failed: %s", e)
                if first is not None:  # flush() reports it
                    with self._cv:
                        self._errors.append((first, e))

    def _count(self, attempt: int, delay: float, error: Exception) -> None:
        self.retried += 1

    def _finish(self, job: _Job, key: ShardKey, name: str, error: BaseException | None) -> None:
        with self._cv:
            job.running.discard(name)
            self._began.pop(name, None)
            self._phase.pop(name, None)
            if name in self._warned:
                self._warned.discard(name)
                log.warning("migration of %s to the %s tier finished after its stall (%s)", key, self.target.tier,
                            "failed" if error is not None else "migrated")
            if error is not None:
                self._errors.append((key, error))
            if len(self._outcome) > 100_000:  # bounded memory: names are never reused, old ones are forgotten
                self._outcome = {n: e for n, e in self._outcome.items() if self._waited(n)}
            self._outcome[name] = error
            ready = [r for r in (self._ready(j) for j in list(self._jobs.values())) if r]
            self._hold(ready, +1)
        try:
            self._fire_all(ready)
        finally:
            with self._cv:
                self._hold(ready, -1)
                self._running -= 1  # only now: flush() returns once the callbacks ran
                self._cv.notify_all()

    def _waited(self, name: str) -> bool:
        return any(name in j.wanted for j in self._jobs.values())

    # -- moving one object -----------------------------------------------------------------------
    def _migrate(self, key: ShardKey, checksum: str, name: str) -> None:
        if self._abandoned:  # close() gave up: no retry goes on after it (a plain error: not retried)
            raise RuntimeError(f"migration of {key} abandoned by close()")
        self._phase[name] = "before_each hook"
        if self.before_each is not None:
            self.before_each(key)
        self._phase[name] = f"read from the {self.source.tier} tier"
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
            self._phase[name] = f"put to the {self.target.tier} tier"
            self.target.put(name, blob)  # the name is this write's alone: a retry rewrites the same copy
        finally:
            if isinstance(blob, memoryview):
                blob.release()
        if self._abandoned:
            return  # close() gave up waiting: the copy stays unindexed (an orphan for gc), never recorded late
        self._phase[name] = "record in the index"
        if not self.index.add_tier(key, self.target.tier, name=name):
            try:  # the record went or names another copy: this one is garbage in the target tier
                self.target.delete(name)
            except TierStoreError as e:
                log.warning("could not delete superseded %s from the %s tier: %s", name, self.target.tier, e)
            return
        self.bytes_migrated += size

    def _migrate_with_retries(self, key: ShardKey, checksum: str, name: str) -> None:
        """Migrate one object; retry transient failures with exponential backoff (the store's policy)."""
        def said(attempt: int, delay: float, e: Exception) -> None:
            self.retried += 1
            log.info("migration of %s failed (%s); retry %d of %d in %.2f s", key, e, attempt,
                     self.policy.retries, delay)

        self.policy.call(lambda: self._migrate(key, checksum, name), on_retry=said)

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
            with self._cv:
                item = None
                while item is None:
                    if (self._closing and not self._queued) or self._abandoned:
                        return
                    item = self._next()
                    if item is None:
                        self._cv.wait(0.5)
            job, name, key, checksum = item
            error: Exception | None = None
            try:
                self._migrate_with_retries(key, checksum, name)
            except Exception as e:  # noqa: BLE001 - a worker thread records every failure; flush() raises it
                error = e
            if self._abandoned:  # close() gave up on it: the store is gone, nothing more is recorded
                log.info("migration of %s finished after close() abandoned it; not recorded", key)
                return
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
            self._finish(job, key, name, error)

    # -- bounds (issue 28: every wait ends) ---------------------------------------------------------
    def stalled(self) -> list[tuple[ShardKey, str, float]]:
        """Objects whose migration has run for ``stall_s`` or more: ``(key, what it is blocked in, seconds)``."""
        if self.stall_s is None:
            return []
        now = time.monotonic()
        with self._cv:
            return [(k, self._phase.get(n, "?"), now - t0) for n, (k, t0) in self._began.items()
                    if now - t0 >= self.stall_s]

    def _watchdog(self) -> None:
        """Report each object whose migration stalls, once, within about ``stall_s`` of it stalling."""
        assert self.stall_s is not None
        lower_priority(self.nice)
        interval = max(0.05, min(1.0, self.stall_s / 4))
        while True:
            with self._cv:
                if self._closing and not self._began and not self._queued:
                    return
                if self._abandoned:
                    return
                self._cv.wait(interval)
                now = time.monotonic()
                new = [(n, k, now - t0, self._phase.get(n, "?")) for n, (k, t0) in self._began.items()
                       if now - t0 >= self.stall_s and n not in self._warned]
                self._warned.update(n for n, *_ in new)
            for _n, key, age, phase in new:
                log.warning("migration to the %s tier stalled: step %s of %s (%s) has been blocked in %s for "
                            "%.1f s; the step stays memory-only until it finishes", self.target.tier, key.step,
                            key.model, key, phase, age)

    def unfinished(self) -> list[tuple[str, int]]:
        """``(model, step)`` of the jobs not finished: queued, running, or waiting for their callbacks."""
        with self._cv:
            return sorted({(j.model, j.step) for j in self._jobs.values()
                           if j.skipped is None and (j.pending or j.running or j.callbacks)}
                          | set(self._firing))

    def _timeout(self, what: str, waited: float, bound: str) -> DurableTimeoutError:
        steps = self.unfinished()
        stalled = self.stalled()
        blocked = "; ".join(f"{k} blocked in {p} for {a:.1f} s" for k, p, a in stalled[:3]) or "none stalled"
        shown = ", ".join(f"{m}@{st}" for m, st in steps[:10])
        return DurableTimeoutError(
            f"{what}: the {self.target.tier} tier did not finish within {waited:.1f} s ({bound}); "
            f"{len(steps)} step(s) still memory-only: {shown or 'none'} ({blocked})",
            what=what, tier=self.target.tier, steps=steps, waited_s=waited, bound=bound,
            stalled=[(str(k), p, a) for k, p, a in stalled])

    def flush(self, timeout: float | None = None, *, bound: str = "timeout") -> None:
        """Wait until everything queued so far has migrated (or was skipped); raise :class:`MigrationError`
        on failures.

        Raises:
            DurableTimeoutError: not done within ``timeout`` seconds (``None``: no bound); it names the
                steps still memory-only and what the migration is blocked in. Nothing is dropped: the
                migration goes on.
        """
        t0 = time.monotonic()
        deadline = None if timeout is None else t0 + timeout
        with self._cv:
            while self._queued or self._running:
                left = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
                if left <= 0:
                    break
                self._cv.wait(left)
            else:
                left = None
            if left is not None:
                raise self._timeout("flush", time.monotonic() - t0, bound)
            errors, self._errors = self._errors, []
        if errors:
            names = ", ".join(str(k) for k, _ in errors[:5])
            raise MigrationError(
                f"{len(errors)} object(s) failed to reach the {self.target.tier} tier: {names}: {errors[0][1]}",
                failures=errors,
            ) from errors[0][1]

    def close(self, timeout: float | None = 30.0) -> list[tuple[str, int]]:
        """Stop the workers once the queue drained, waiting at most ``timeout`` seconds in all; return the
        ``(model, step)`` whose migration did not finish (they stay memory-only; empty when all did).

        Past the bound, the work still queued is abandoned and a worker blocked in a call (a hung put) is
        left behind (a daemon thread).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        for t in [*self._threads, *([self._watch] if self._watch is not None else [])]:
            t.join(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
        left = self.unfinished()
        with self._cv:
            self._abandoned = True  # a worker that finishes its call now stops
            self._cv.notify_all()
        return left
