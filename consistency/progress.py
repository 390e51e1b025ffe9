"""Epochs, index loss, job incarnations and rank progress: the Checkpointer's operations besides the vote.

:class:`Incarnations` is this part of :class:`consistency.twophase.StepProtocol`.
Every rank of a job incarnation calls :meth:`Incarnations.join_epoch` once (the
first raises the epoch, see :mod:`consistency.epochs`), then
:meth:`Incarnations.note_progress` as it begins saving each step; a rank that
waits for the others reads :meth:`Incarnations.progress` (see
:mod:`tierstore.train.ranks`). :meth:`Incarnations.check_index` runs before a
step begins, an epoch is taken, or a read finds nothing committed.
"""

from __future__ import annotations

from consistency.index import translate_redis_errors
from consistency.stepbase import StepBase, _s
from tierstore.errors import CommitError
from tierstore.keys import validate_name

__all__ = ["Incarnations"]


class Incarnations(StepBase):
    """Epochs, index-loss checks, incarnations and progress (part of ``StepProtocol``)."""

    # -- epochs and index loss (see consistency.epochs) --------------------------------
    def durable_epoch(self, model: str) -> int:
        """The newest epoch of ``model`` recorded in the durable tier (0 if none or no durable tier)."""
        return self.epochs.durable_epoch(model)

    def open_epoch(self, model: str) -> int:
        """Take a new epoch of ``model`` (a new incarnation); see :meth:`EpochLog.open_epoch`.

        Raises:
            IndexLostError: the index lost this model (see :meth:`check_index`).
        """
        validate_name(model, "model")
        self.check_index(model)
        return self.epochs.open_epoch(model)

    def durable_steps(self, model: str) -> list[int]:
        """Steps of ``model`` with a durable manifest in the durable tier."""
        return self.epochs.durable_steps(model)

    def check_index(self, model: str) -> None:
        """Refuse to start ``model`` fresh on an index that lost it; see :meth:`EpochLog.check_index`."""
        self.epochs.check_index(model, self.on_lost)

    def check_records(self, model: str, states: dict[int, str]) -> bool:
        """Refuse to resume ``model`` from an index that lost some of its records; ``True``: they were rebuilt
        (read them again). See :meth:`EpochLog.check_records`."""
        return self.epochs.check_records(model, states, self.on_lost)
    # -- incarnations and rank progress (the Checkpointer's; see tierstore.train.ranks) -------------
    def join_epoch(self, model: str, token: str, base: int) -> int:
        """The epoch of the job incarnation ``token``: the first rank to join raises the model's epoch.

        Args:
            token: the incarnation's id (every rank of it passes the same).
            base: the epoch the incarnation saw when it started (``-1``: unknown).

        Raises:
            FencedError: the incarnation's epoch is older than the current one, or
                another incarnation raised the epoch after ``base`` before this one joined.
        """
        validate_name(model, "model")
        self._register(model)
        self.check_index(model)
        k = self.index._k
        want = 0  # first a probe: a known (or fenced) incarnation reserves nothing
        for _ in range(64):
            with translate_redis_errors(f"join epoch of {model}", self.index.url):
                got = int(self.index.run_script(self._join, [k(model, "epoch"), k(model, "incarnations")],
                                                [token, int(base), want], what=f"join the epoch of {model}"))
            if got > 0:
                if got == want:
                    self.epochs.prune(model, want)
                return got
            want = self.epochs.reserve(model)  # recorded durably before the index hands it out
        raise CommitError(f"could not join an epoch of {model}: it kept moving", model=model)

    def note_progress(self, model: str, rank: int, step: int, epoch: int | None) -> None:
        """Record that ``rank`` (of incarnation ``epoch``) has begun saving ``step``."""
        with translate_redis_errors(f"progress of rank {rank} of {model}", self.index.url):
            self.index._r.hset(self.index._k(model, "progress"), str(rank), f"{-1 if epoch is None else epoch} {step}")

    def progress(self, model: str) -> dict[int, tuple[int, int]]:
        """``rank -> (epoch, step)``: the newest step each rank began saving (see :meth:`note_progress`)."""
        with translate_redis_errors(f"progress of {model}", self.index.url):
            raw = self.index._r.hgetall(self.index._k(model, "progress"))
        out = {}
        for r, v in raw.items():
            parts = _s(v).split()
            if _s(r).isdigit() and len(parts) == 2:
                out[int(_s(r))] = (int(parts[0]), int(parts[1]))
        return out
