"""Epochs that never go backwards, and a lost index that is never taken for a fresh start.

The index holds a model's current epoch (fencing, see :mod:`consistency.twophase`).
:class:`EpochLog` also records every epoch taken in the durable tier, create-once,
*before* the index uses it (``model/_epoch/<epoch>.epoch``, the newest few kept,
see :func:`consistency.manifest.durable_epoch_name`), so a new epoch is always
newer than any epoch ever handed out, even after the index was lost; and it
tells an index that lost a model (no record of it at all) from a fresh model
by the durable manifests the durable tier still holds.

Protocol: :class:`~consistency.twophase.StepProtocol` owns one and calls
:meth:`EpochLog.check_index` before a step begins, an epoch is taken, or a
read finds nothing committed; :meth:`EpochLog.check_records` when a read resolves
the newest step (an index that lost some records of a model it still knows);
:meth:`EpochLog.open_epoch` at each restore.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from backends.base import Backend
from consistency.index import Index
from consistency.manifest import (
    durable_epoch_name,
    durable_epoch_prefix,
    durable_manifest_prefix,
    parse_durable_epoch_name,
    parse_durable_manifest_name,
)
from tierstore.errors import CommitError, IndexLostError, KeyExistsError, TierStoreError, TierUnavailableError

__all__ = ["EpochLog"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class EpochLog:
    """A model's epochs in the index and the durable tier (``durable`` may be ``None``: index only).

    Every call to the durable tier (the epoch records' listing, their create-once puts, the listing of the
    durable manifests) runs on one daemon thread, in order, and is waited for at most ``timeout()`` seconds
    (the protocol's ``pin_record_timeout_s``, 30 s by default): past it a hung tier (a hung mount, a silent S3
    endpoint) is treated as one that cannot be reached, which each caller already tolerates with a warning (an
    epoch not recorded durably, a loss check skipped), and the call goes on in the background. Calls queued
    behind one that outlived its deadline give up at once. The pruning of old records is not waited for.
    """

    def __init__(self, index: Index, durable: Backend | None, *, keep: int = 8,
                 timeout: Callable[[], float] | None = None) -> None:
        from consistency.stepbase import SerialJobs  # lazy: stepbase imports this module

        self.index = index
        self.durable = durable
        self.keep = keep
        self.timeout = timeout or (lambda: 30.0)
        self._jobs = SerialJobs("tierstore-epoch-records")

    def _bounded(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()`` on the records' thread, waited for at most ``timeout()`` s; past it (or queued behind a call
        that outlived it) :class:`~tierstore.errors.TierUnavailableError`, while ``fn`` goes on."""
        box: dict[str, Any] = {}

        def run(job: Any) -> None:
            try:
                box["value"] = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                box["error"] = e

        limit = max(0.0, float(self.timeout()))
        behind = self._jobs.stalled(limit)
        job = self._jobs.submit(run)
        if not job.done.wait(0.0 if behind else limit):
            why = (f"queued behind an earlier call the durable tier has not answered for {limit:g} s" if behind
                   else f"the durable tier did not answer within {limit:g} s")
            raise TierUnavailableError(f"{what}: {why}")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def durable_epoch(self, model: str) -> int:
        """The newest epoch of ``model`` recorded in the durable tier (0 if none, or unreadable)."""
        if self.durable is None:
            return 0
        durable = self.durable
        try:
            names = self._bounded(f"list the epoch records of {model}",
                                  lambda: list(durable.list(durable_epoch_prefix(model))))
        except TierStoreError as e:
            log.warning("cannot read the durable epoch records of %s: %s", model, e)
            return 0
        epochs = [parse_durable_epoch_name(model, n) for n in names]
        return max((e for e in epochs if e is not None), default=0)

    def open_epoch(self, model: str) -> int:
        """Take a new epoch of ``model`` (a new incarnation): writes of older epochs are fenced from now on.

        The candidate is one past both the index's epoch and the durable tier's
        newest record; it is recorded create-once in the durable tier (another
        incarnation that took it first makes this one try the next), then
        raised in the index. A durable tier that cannot be written does not
        stop a restart: the index still fences (with a warning).
        """
        if self.durable is None:
            return self.index.bump_epoch(model)
        for _ in range(64):
            want = self.reserve(model)
            if self.index.raise_epoch(model, want) == want:
                self.prune(model, want)
                return want
        raise CommitError(f"could not take a new epoch of {model}: it kept moving", model=model)

    def reserve(self, model: str) -> int:
        """Record a candidate epoch of ``model`` in the durable tier, create-once, and return it.

        The candidate is one past both the index's epoch and the durable tier's
        newest record (another incarnation that took it first makes this one
        try the next). The caller raises the index to it (``open_epoch``, or
        ``StepProtocol.join_epoch`` for a job's incarnation) and calls
        :meth:`prune` once it holds. Without a durable tier, or one that cannot
        be written, the candidate is the index's epoch + 1 (with a warning).
        """
        for _ in range(64):
            want = max(self.index.epoch(model), self.durable_epoch(model)) + 1
            if self.durable is None:
                return want
            body = json.dumps({"model": model, "epoch": want, "taken_at": time.time()}).encode()
            durable, name = self.durable, durable_epoch_name(model, want)
            try:
                self._bounded(f"record epoch {want} of {model}", lambda: durable.put(name, body, if_absent=True))
            except KeyExistsError:
                continue  # another incarnation took it first
            except TierStoreError as e:
                log.warning("epoch %d of %s is not recorded in the durable tier (%s): after an index loss "
                            "now, it could be taken again", want, model, e)
            return want
        raise CommitError(f"could not reserve a new epoch of {model}: it kept moving", model=model)

    def prune(self, model: str, newest: int) -> None:
        """Delete the durable epoch records of ``model`` older than the newest ``keep``, on the records' thread
        (in order after the puts before it; not waited for: old records only cost space)."""
        durable = self.durable
        if durable is None:
            return

        def run(job: Any) -> None:
            try:
                names = [(parse_durable_epoch_name(model, n), n) for n in durable.list(durable_epoch_prefix(model))]
                for e, n in sorted((e, n) for e, n in names if e is not None)[:-self.keep]:
                    if e < newest:
                        durable.delete(n)
            except TierStoreError as e:  # old records only cost space
                log.info("could not prune the epoch records of %s: %s", model, e)

        self._jobs.submit(run)

    def durable_steps(self, model: str) -> list[int]:
        """Steps of ``model`` with a durable manifest in the durable tier."""
        durable = self.durable
        if durable is None:
            return []
        out = []
        names = self._bounded(f"list the durable manifests of {model}",
                              lambda: list(durable.list(durable_manifest_prefix(model))))
        for name in names:
            got = parse_durable_manifest_name(name)
            if got is not None and got[0] == model:
                out.append(got[1])
        return sorted(out)

    def check_index(self, model: str, on_lost: Callable[[str], object] | None = None) -> None:
        """Refuse to start ``model`` fresh on an index that lost it.

        If the index has no record of ``model`` (no epoch, step or object) but
        the durable tier holds its durable manifests, the index was lost (a
        server restarted without persistence, a new index): ``on_lost`` is
        called to restore it, else :class:`IndexLostError` is raised. One
        ``EXISTS`` while the index knows the model; the durable tier is listed
        only when it does not (an unreachable durable tier is warned about,
        and checked again at the next call).
        """
        if self.durable is None or self.index.knows(model):
            return
        try:
            durable = self.durable_steps(model)
        except TierStoreError as e:
            log.warning("cannot check whether the index lost %s (the durable tier: %s)", model, e)
            return
        if not durable:
            return
        if on_lost is None:
            raise IndexLostError(
                f"the index has no record of model {model!r}, but the durable tier holds {len(durable)} durable "
                f"step(s) of it (newest {durable[-1]}): the index was lost. Run `tierstore admin rebuild-index "
                f"{model} --yes` before training or restoring (or open the store with rebuild_index_on_loss=True)",
                model=model, durable_steps=durable)
        log.warning("the index lost model %s (%d durable step(s)): rebuilding it from the durable tier",
                    model, len(durable))
        on_lost(model)

    def check_records(self, model: str, states: dict[int, str],
                      on_lost: Callable[[str], object] | None = None) -> bool:
        """Refuse to resume ``model`` from an index that lost some of its records (an evicting server, a
        failover that dropped writes, an operator's ``DEL``) where it still knows the model.

        ``states``: the index's steps of ``model`` (step -> state). The evidence: a durable manifest in the
        durable tier of a step newer than every step the index records as durable, of which the index has no
        record at all. Retention and ``admin delete`` remove a step's durable manifest only after its records
        and never that of the newest durable step, and a migration writes the manifest while the step is
        recorded committed, so no protocol state shows it. Then ``on_lost`` rebuilds the index from the
        durable tier (idempotent) and ``True`` is returned (read the records again), else
        :class:`IndexLostError` names the steps and the command. One listing of the durable manifests; an
        unreadable durable tier is warned about (nothing is known, nothing is refused).
        """
        if self.durable is None:
            return False
        try:
            durable = self.durable_steps(model)
        except TierStoreError as e:
            log.warning("cannot check whether the index lost records of %s (the durable tier: %s)", model, e)
            return False
        newest = max((s for s, st in states.items() if st == "durable"), default=-1)
        missing = [s for s in durable if s > newest and s not in states]
        if not missing:
            return False
        if on_lost is None:
            raise IndexLostError(
                f"the index lost records of model {model!r}: the durable tier holds durable step(s) "
                f"{', '.join(map(str, missing[-8:]))} of it, newer than every step the index records as durable "
                f"({newest if newest >= 0 else 'none'}), and the index has no record of them (an evicting "
                f"server, a failover that dropped writes, a deleted key). Run `tierstore admin rebuild-index "
                f"{model} --yes` before training or restoring (or open the store with rebuild_index_on_loss=True)",
                model=model, durable_steps=durable, missing_steps=missing)
        log.warning("the index lost the records of durable step(s) %s of %s: rebuilding it from the durable tier",
                    missing, model)
        on_lost(model)
        return True
