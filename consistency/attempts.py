"""One writer per step: a step begun for one writer's attempt, and only that attempt's writes and votes count.

:class:`Attempts` is this part of :class:`consistency.twophase.StepProtocol`.
A writer that cannot share a step with another (the DCP ``StorageWriter``,
:mod:`tierstore.interop.dcp_storage`: two processes may save the same step
number at once) calls :meth:`Attempts.claim` once per save, on one rank,
with a fresh token, and hands the token to every rank; each rank then writes
(``TierStore.put(..., attempt=token)``) and votes (``vote(..., attempt=token)``)
under it. The index refuses (:class:`~tierstore.errors.StepBusyError`):

- a claim of a step another token's attempt is still preparing, before the
  caller wrote anything;
- a write or vote whose token is not the step's attempt's (a zombie of an
  attempt that was taken over), and a write or vote without a token for a
  step an attempt holds.

A step's attempt is taken over only on evidence that it cannot commit: it is
past its own timeout (recorded ``aborted``, ``timed out``), or its *lease*
lapsed (recorded ``aborted``, ``lease lapsed``), or the claim carries a newer
epoch than the attempt's (a newer incarnation of the job; recorded
``aborted``, ``fenced by epoch E``); an ``aborted`` step is begun again.

Leases: a claim with ``lease_s > 0`` holds the step only while its writer
renews it (:meth:`Attempts.renew`, the same token; :class:`Lease` renews from a
daemon thread every ``lease_s / 3``, so the renewal never waits on the write
making progress: a slow write keeps its lease). A claim not renewed for longer
than ``lease_s`` (its writer is dead: SIGKILL, a lost node) is taken over by
the next claim of the step, so a job restarted at once saves the same step
number again within seconds instead of after the attempt's timeout. A live
writer renews, so two live writers of one step are still refused
(:class:`~tierstore.errors.StepBusyError` names the lease and when it
lapses). A claim refused by a leased attempt may wait (``wait_s``) for the
lease to lapse: it polls (every ``lease_s / 3``, at most 1 s) and gives up at once
when it sees the holder renew (alive), else after ``wait_s``. The timeout still
bounds every attempt (a writer alive but hung keeps renewing until then).
What the lapsed attempt wrote is never part of the new attempt's commit: its
votes are dropped by the new claim, its late writes and votes are refused
(the token is not the step's attempt's), and a committed manifest names only
the copies the new attempt's votes recorded. The new attempt's number is the old one's + 1. A committed step is
immutable (:class:`~tierstore.errors.StepCommittedError`); nothing committed
is touched, and what a failed attempt wrote is either replaced by the new
attempt's write of the same key or collected by garbage collection.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass

from consistency.scripts import RENEW
from consistency.stepbase import StepBase, _s
from tierstore.errors import CommitError, StepBusyError, StepCommittedError, TierStoreError

__all__ = ["DEFAULT_LEASE_S", "Attempts", "Claim", "Lease"]

log = logging.getLogger(__name__)

DEFAULT_LEASE_S = 10.0  # the DCP writer's default lease (tierstore.interop.dcp_storage.TierStoreWriter(lease=))


@dataclass(frozen=True)
class Claim:
    """The attempt a :meth:`Attempts.claim` holds.

    Attributes:
        attempt: its number (1 for a step's first attempt).
        previous: why the attempt before it ended (``None`` for a first attempt, or when this token
            already held the step): its recorded reason, or ``"timed out: ..."`` / ``"fenced: ..."``
            when this claim decided it.
        previous_state: ``"aborted"`` when a previous attempt ended, else ``None``.
    """

    attempt: int
    previous: str | None = None
    previous_state: str | None = None

    @property
    def retried(self) -> bool:
        """Whether this attempt saves the step again after an attempt that did not commit."""
        return self.previous_state is not None


class Attempts(StepBase):
    """Exclusive attempts of a step (part of ``StepProtocol``); see the module docstring."""

    def claim(self, model: str, step: int, world_size: int, token: str, *, layout: dict | None = None,
              epoch: int | None = None, timeout_s: float | None = None, lease_s: float = 0.0,
              wait_s: float = 0.0) -> Claim:
        """Begin ``step`` for the writer ``token`` alone (idempotent for the same token).

        Args:
            world_size: the voters of the attempt.
            token: the writer's attempt token: fresh per save, the same on every rank of it.
            layout: as for :meth:`~consistency.twophase.StepProtocol.begin`.
            epoch: the job incarnation's epoch, if the writer has one: fences older epochs, and takes
                over an attempt of an older epoch at once.
            timeout_s: the attempt's timeout (default: the protocol's ``step_timeout_s``); past it a
                new claim takes the step over.
            lease_s: the attempt's lease (0: none): not renewed (:meth:`renew`, :class:`Lease`) for this
                long, a new claim takes the step over.
            wait_s: how long a claim refused by another writer's *leased* attempt waits for that lease to
                lapse (0: refuse at once); it is refused at once when the holder renews meanwhile.

        Raises:
            StepBusyError: another writer's attempt holds the step (nothing was changed).
            StepCommittedError: the step is committed (a committed step is immutable).
            FencedError: ``epoch`` is older than the job's.
            IndexLostError: the index lost this model (see :meth:`EpochLog.check_index`).
        """
        self._check(model, step, world_size)
        if not isinstance(token, str) or not token or len(token) > 200 or not token.isprintable():
            raise CommitError(f"an attempt token must be a non-empty printable string, got {token!r}")
        ks = self._keys(model, step)
        self._register(model)
        timeout = self.step_timeout_s if timeout_s is None else timeout_s

        if isinstance(lease_s, bool) or not isinstance(lease_s, (int, float)) or not lease_s >= 0:
            raise CommitError(f"lease_s must be a non-negative number of seconds, got {lease_s!r}")
        if isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or not wait_s >= 0:
            raise CommitError(f"wait_s must be a non-negative number of seconds, got {wait_s!r}")

        def run(check: bool) -> list[str]:
            out = self._run(
                f"claim step {step} of {model}", self._claim,
                [ks["epoch"], ks["step"], ks["steps"], ks["votes"], ks["objs"], ks["vinfo"]],
                [-1 if epoch is None else epoch, step, world_size, json.dumps(layout), timeout,
                 "1" if check else "0", token, ks["events"], ks["decided"], f"{float(lease_s):g}"],
            )
            return [_s(v) for v in out]

        deadline = time.monotonic() + wait_s
        quiet_before, slept = 0.0, None
        while True:
            try:
                out = run(self.durable is not None)
                if out[0] == "unknown":  # a new model, or one the index lost: the durable tier tells
                    self.epochs.check_index(model, self.on_lost)
                    out = run(False)
            except StepCommittedError as e:
                raise StepCommittedError(
                    f"step {step} of {model} is already committed and cannot be saved again "
                    "(a committed step is immutable; save a new step number)", model=model, step=step) from e
            if out[0] != "busy":
                return Claim(int(out[1]), out[2] or None, out[3] or None)
            lease, quiet = float(out[5] or 0), float(out[6] or 0)
            # unrenewed, the quiet time grew by the time slept; renewed (the holder is alive), it fell behind
            renewed = slept is not None and quiet < quiet_before + slept / 2
            lapses_in = max(lease - quiet, 0.0)
            # wait only for a lease that lapses within the wait (0.5 s of slack for the index's round trips)
            if lease <= 0 or renewed or wait_s <= 0 or lapses_in > max(deadline - time.monotonic(), 0.0) + 0.5:
                raise self._busy(model, step, out)
            quiet_before, t0 = quiet, time.monotonic()
            time.sleep(min(lapses_in + 0.05, lease / 3, 1.0))  # a renewal, a decision or the lapse shows soon
            slept = time.monotonic() - t0

    @staticmethod
    def _busy(model: str, step: int, out: list[str]) -> StepBusyError:
        attempt, world, age, limit = int(out[1]), int(out[2] or 0), float(out[3]), float(out[4])
        lease, quiet = float(out[5] or 0), float(out[6] or 0)
        left = max(limit - age, 0.0) if limit > 0 else None
        when = f"it times out in {left:.1f} s" if left is not None else "it never times out"
        lapses = max(lease - quiet, 0.0) if lease > 0 else None
        if lapses is not None:
            when += (f"; it holds a lease of {lease:g} s, last renewed {quiet:.1f} s ago: the lease lapses in "
                     f"{lapses:.1f} s unless its writer (alive) renews it")
        return StepBusyError(
            f"step {step} of {model} is being saved by another writer (attempt {attempt}, {world} voters, "
            f"began {age:.1f} s ago; {when}): a step has one writer at a time. Save another step number, "
            "or this one again once that attempt timed out" + (" or its lease lapsed" if lapses is not None else ""),
            model=model, step=step, attempt=attempt, world=world, age_s=age, expires_in_s=left,
            lease_s=lease if lease > 0 else None, lapses_in_s=lapses)

    def renew(self, model: str, step: int, token: str) -> str:
        """Renew the lease of ``step``'s attempt if ``token`` holds it; return the step's state.

        ``"preparing"``: renewed. Anything else (``"committed"``, ``"aborted"``, ``"durable"``, ``""`` for
        no record, ``"expired"`` for an attempt past its timeout, or ``"taken"`` when another token holds
        it): nothing was renewed, and there is nothing left to renew.
        """
        script = self.__dict__.get("_renew")
        if script is None:
            script = self.__dict__["_renew"] = self.index._r.register_script(RENEW)  # consistency/ owns the client
        st, lease = (_s(v) for v in self._run(f"renew the lease of step {step} of {model}", script,
                                               [self._keys(model, step)["step"]], [token]))
        return "taken" if st == "preparing" and not lease else st


class Lease:
    """Renews a claimed attempt's lease from a daemon thread until :meth:`stop`, or the step leaves ``preparing``.

    Args:
        attempts: the protocol the claim was made with.
        model, step, token: the claim's.
        lease_s: the claim's lease; renewed every ``every_s`` (default ``lease_s / 3``, so two renewals may
            fail or be late before it lapses).

    The thread renews whatever the writer is doing (a long write keeps its lease); it needs the GIL for a
    moment per renewal, so a C extension holding the GIL longer than ``lease_s - every_s`` could let the lease
    lapse (a write is then refused, typed: the step is not committed with the other writer's objects).
    A renewal that fails (index unreachable) is logged and tried again at the next interval.
    """

    def __init__(self, attempts: Attempts, model: str, step: int, token: str, lease_s: float,
                 every_s: float | None = None) -> None:
        self.attempts, self.model, self.step, self.token = attempts, model, step, token
        self.lease_s = lease_s
        self.every_s = lease_s / 3 if every_s is None else every_s
        self.renewals = 0
        self.state = "preparing"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"tierstore-lease {model}/{step}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                state = self.attempts.renew(self.model, self.step, self.token)
            except TierStoreError as e:
                log.warning("step %d of %s: renewing the attempt's lease failed (%s); trying again in %.1f s",
                            self.step, self.model, e, self.every_s)
                continue
            if state != "preparing":
                self.state = state
                return
            self.renewals += 1

    def stop(self) -> None:
        """Stop renewing (the save finished or failed); waits for a renewal in flight."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=max(self.every_s, 1.0) + 30.0)
