"""The shared core of the commit protocol: its scripts, key names, argument checks and script runner.

:class:`StepBase` is the base of :class:`consistency.twophase.StepProtocol`
and of the parts it is assembled from (each a module of its own idea):
the vote/commit path (:mod:`consistency.twophase`), step records and their
listing (:mod:`consistency.steprecords`), the durable level
(:mod:`consistency.durable`), epochs and rank progress
(:mod:`consistency.progress`). Callers use :class:`~consistency.twophase.StepProtocol`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from backends.base import Backend
from backends.retry import RetryPolicy
from consistency.epochs import EpochLog
from consistency.index import Index, translate_redis_errors
from consistency.manifest import parse_manifest
from consistency.scripts import (
    BEGIN,
    CLAIM,
    DROP_ABORTED,
    DURABLE,
    EXPIRE,
    JOIN_EPOCH,
    MEMORY_ONLY,
    MIGRATED,
    SUPERSEDE,
    VOTE,
)
from tierstore.errors import CommitError, InvalidKeyError, TierUnavailableError
from tierstore.keys import validate_name, validate_step

__all__ = ["DECIDED", "STATES", "SerialJob", "SerialJobs", "StepBase"]

log = logging.getLogger(__name__)

STATES = ("preparing", "committed", "aborted", "durable")
DECIDED = ("committed", "aborted", "durable")


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else ("" if v is None else str(v))


def _f(v: str | None) -> float | None:
    return float(v) if v else None


class SerialJob:
    """One job of :class:`SerialJobs`: ``done`` once it ran. :meth:`settle` tells whichever of the job's end and its
    waiter's deadline comes first that it is first (``True``), so what the job met is reported once."""

    def __init__(self, fn: Callable[[SerialJob], Any]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._settled = False
        self.started: float | None = None  # time.monotonic() when it began to run

    def settle(self) -> bool:
        with self._lock:
            if self._settled:
                return False
            self._settled = True
            return True


class SerialJobs:
    """Jobs run one at a time, in submission order, on a daemon thread that lives while there is work (none is
    left behind idle, and a job that never returns does not hold up the interpreter's exit). A caller waits for
    its own job as long as it likes; jobs submitted after one that hangs wait behind it, so their order holds."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._jobs: deque[SerialJob] = deque()
        self._current: SerialJob | None = None

    def submit(self, fn: Callable[[SerialJob], Any]) -> SerialJob:
        """Queue ``fn(job)``; returns the job (wait on its ``done``)."""
        job = SerialJob(fn)
        with self._lock:
            self._jobs.append(job)
            start = self._current is None  # no worker: this job starts one (it marks the worker as running)
            if start:
                self._current = job
        if start:
            threading.Thread(target=self._run, name=self.name, daemon=True).start()
        return job

    def stalled(self, seconds: float) -> bool:
        """The job running now has run ``seconds`` or longer (a job submitted now waits behind it)."""
        with self._lock:
            started = self._current.started if self._current is not None else None
        return started is not None and time.monotonic() - started >= seconds

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._jobs:
                    self._current = None
                    return
                job = self._current = self._jobs.popleft()
                job.started = time.monotonic()
            try:
                job.fn(job)
            except Exception:  # the jobs report their own failures; one that escapes must not stop the rest
                log.exception("%s: a job failed", self.name)
            finally:
                job.done.set()


class StepBase:
    """The state every part of the protocol shares (see :class:`consistency.twophase.StepProtocol`).

    Args:
        index: the index.
        durable: where durable manifests go (``None``: steps never become durable).
        step_timeout_s: a step still preparing this long after it began is aborted (0: never).
        clock: seconds since the epoch to use instead of the server's ``TIME`` (tests inject one).
        on_lost: called with a model the index lost (its durable manifests exist): it must restore
            the index (the store rebuilds it); ``None`` raises :class:`IndexLostError` instead.
        retry: how the durable tier is asked again when it does not answer.
        pin_record_timeout_s: the most :meth:`~consistency.steprecords.StepRecords.pin` (and ``unpin``) waits
            for the durable tier's pin record after the index pin (see there); the attribute of that name may
            be changed later.
    """

    def __init__(self, index: Index, durable: Backend | None = None, *, step_timeout_s: float = 600.0,
                 clock: Callable[[], float] | None = None, on_lost: Callable[[str], object] | None = None,
                 retry: RetryPolicy | None = None, pin_record_timeout_s: float = 30.0):
        self.index = index
        self.retry = retry or RetryPolicy()
        self.pin_record_timeout_s = pin_record_timeout_s
        self._pin_records = SerialJobs("tierstore-pin-records")  # the durable pin records' writes, in order
        self.durable = durable
        self.step_timeout_s = step_timeout_s
        self.clock = clock
        self.on_lost = on_lost
        self.epochs = EpochLog(index, durable, timeout=lambda: self.pin_record_timeout_s)
        # pins whose durable record could not be written or removed (StepRecords.pin / unpin): the index pin
        # stands, the record only matters to an index rebuild; counted, the last one kept, each one logged
        self.durable_pin_failures = 0
        self.last_durable_pin_failure: str | None = None
        self._pin_failures_lock = threading.Lock()
        self._known_models: set[str] = set()
        self._listeners: dict[str, Any] = {}  # model -> DecisionListener (consistency.decisions)
        self._listeners_lock = threading.Lock()
        r = index._r  # consistency/ owns the client
        self._begin = r.register_script(BEGIN)
        self._claim = r.register_script(CLAIM)
        self._vote = r.register_script(VOTE)
        self._expire = r.register_script(EXPIRE)
        self._migrated = r.register_script(MIGRATED)
        self._durable = r.register_script(DURABLE)
        self._memory_only = r.register_script(MEMORY_ONLY)
        self._join = r.register_script(JOIN_EPOCH)
        self._supersede = r.register_script(SUPERSEDE)
        self._drop_aborted = r.register_script(DROP_ABORTED)

    def _register(self, model: str) -> None:
        """Add ``model`` to the models list once per instance (it lives outside the model's slot)."""
        if model not in self._known_models:
            self.index.register_model(model)
            self._known_models.add(model)

    def forget_model(self, model: str) -> None:
        """Forget what this instance cached of ``model`` (it was deleted: a new model of the name starts afresh)."""
        self._known_models.discard(model)
        with self._listeners_lock:
            got = self._listeners.pop(model, None)
        if got is not None:
            got.close()

    def _now(self) -> float:
        return -1.0 if self.clock is None else float(self.clock())

    def _keys(self, model: str, step: int) -> dict[str, str]:
        k = self.index._k
        return {
            "epoch": k(model, "epoch"),
            "step": k(model, "step", step),
            "steps": k(model, "steps"),
            "votes": k(model, "votes", step),
            "manifest": k(model, "manifest", step),
            "events": k(model, "events"),
            "decided": k(model, "decided"),
            "vinfo": k(model, "vinfo", step),
            "prefix": k(model, ""),
            "objs": k(model, "objs"),
        }

    @staticmethod
    def _check(model: str, step: int, world_size: int | None = None) -> None:
        validate_name(model, "model")
        try:
            validate_step(step)
        except InvalidKeyError as e:
            raise CommitError(f"step must be an int in 0..2**53-1, got {step!r}: {e}", model=model, step=step) from e
        if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int)
                                       or world_size < 1):
            raise CommitError(f"world_size must be a positive int, got {world_size!r}")

    def _run(self, what: str, script, keys: list[str], args: list, *, ack: bool = True) -> Any:
        try:
            with translate_redis_errors(what, self.index.url):  # ack: the replicas have it (Index.run_script)
                return self.index.run_script(script, keys, [*args, self._now()], ack=ack, what=what)
        except TierUnavailableError as e:
            msg = str(e.__cause__ or "")
            if "TSNOSTEP" in msg or "TSRANK" in msg:
                raise CommitError(f"{what}: {msg.split(' ', 1)[1] if ' ' in msg else msg}") from e.__cause__
            raise

    def state(self, model: str, step: int) -> str | None:
        with translate_redis_errors(f"state of step {step} of {model}", self.index.url):
            v = self.index._r.hget(self._keys(model, step)["step"], "state")
        return _s(v) if v is not None else None

    def manifest(self, model: str, step: int) -> dict | None:
        with translate_redis_errors(f"manifest of step {step} of {model}", self.index.url):
            raw = self.index._r.get(self._keys(model, step)["manifest"])
        return parse_manifest(raw, model=model, step=step) if raw is not None else None
