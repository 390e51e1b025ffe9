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
past its own timeout (recorded ``aborted``, ``timed out``), or the claim
carries a newer epoch than the attempt's (a newer incarnation of the job;
recorded ``aborted``, ``fenced by epoch E``); an ``aborted`` step is begun
again. The new attempt's number is the old one's + 1. A committed step is
immutable (:class:`~tierstore.errors.StepCommittedError`); nothing committed
is touched, and what a failed attempt wrote is either replaced by the new
attempt's write of the same key or collected by garbage collection.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from consistency.stepbase import StepBase, _s
from tierstore.errors import CommitError, StepBusyError, StepCommittedError

__all__ = ["Attempts", "Claim"]


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
              epoch: int | None = None, timeout_s: float | None = None) -> Claim:
        """Begin ``step`` for the writer ``token`` alone (idempotent for the same token).

        Args:
            world_size: the voters of the attempt.
            token: the writer's attempt token: fresh per save, the same on every rank of it.
            layout: as for :meth:`~consistency.twophase.StepProtocol.begin`.
            epoch: the job incarnation's epoch, if the writer has one: fences older epochs, and takes
                over an attempt of an older epoch at once.
            timeout_s: the attempt's timeout (default: the protocol's ``step_timeout_s``); past it a
                new claim takes the step over.

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

        def run(check: bool) -> list[str]:
            out = self._run(
                f"claim step {step} of {model}", self._claim,
                [ks["epoch"], ks["step"], ks["steps"], ks["votes"], ks["objs"], ks["vinfo"]],
                [-1 if epoch is None else epoch, step, world_size, json.dumps(layout), timeout,
                 "1" if check else "0", token, ks["events"], ks["decided"]],
            )
            return [_s(v) for v in out]

        try:
            out = run(self.durable is not None)
            if out[0] == "unknown":  # a new model, or one the index lost: the durable tier tells
                self.epochs.check_index(model, self.on_lost)
                out = run(False)
        except StepCommittedError as e:
            raise StepCommittedError(
                f"step {step} of {model} is already committed and cannot be saved again "
                "(a committed step is immutable; save a new step number)", model=model, step=step) from e
        if out[0] == "busy":
            attempt, world, age, limit = int(out[1]), int(out[2] or 0), float(out[3]), float(out[4])
            left = max(limit - age, 0.0) if limit > 0 else None
            when = f"it times out in {left:.1f} s" if left is not None else "it never times out"
            raise StepBusyError(
                f"step {step} of {model} is being saved by another writer (attempt {attempt}, {world} voters, "
                f"began {age:.1f} s ago; {when}): a step has one writer at a time. Save another step number, "
                "or this one again once that attempt timed out",
                model=model, step=step, attempt=attempt, world=world, age_s=age, expires_in_s=left)
        return Claim(int(out[1]), out[2] or None, out[3] or None)
