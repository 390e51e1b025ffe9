"""Two-phase commit of one step across all ranks, in the index.

Protocol, per step N of a model (every rank runs it; nobody blocks on a
collective):

1. *Prepare*: each rank writes its shards of N to the tiers the policy
   requires (``TierStore.put``/``snapshot``), then
2. *votes* (:meth:`StepProtocol.vote`): one atomic Lua script records the vote;
   the last vote of the world (its size recorded when the step began) flips N
   to ``committed`` and writes the manifest (the commit point). A negative
   vote, or a vote or :meth:`wait` after the step's timeout, flips it to
   ``aborted``. Time is the server's (``TIME``), so clock skew between ranks
   cannot decide a timeout.
3. *Durable*: once every rank's objects of N reached the durable tier
   (:meth:`mark_migrated`), the durable manifest is written there last,
   create-once, and N becomes ``durable``.
4. *Fencing*: ``begin``, ``vote`` and ``mark_migrated`` carry the job's epoch;
   an older epoch is refused with :class:`FencedError`. :meth:`open_epoch`
   takes a new epoch: recorded create-once in the durable tier
   (``model/_epoch/<epoch>``) before the index, so an epoch never goes
   backwards, even when the index is lost.
5. *Immutability*: a committed step cannot be begun again
   (:class:`StepCommittedError`, before anything is written); an aborted (or
   abandoned) step is begun again by a newer epoch as a new *attempt*.
   A writer that must not share a step (two DCP saves of one step number)
   begins it with :meth:`~consistency.attempts.Attempts.claim` instead: one
   writer's attempt, whose token every write and vote of it carries; see
   :mod:`consistency.attempts`.
6. *Index loss*: an index with no record of a model whose durable tier holds
   its manifests refuses to start fresh (:class:`IndexLostError`, from
   ``begin``, ``open_epoch`` and the read path), unless an ``on_lost``
   callback (the store's automatic rebuild) restores it.

A rank learns the outcome with :meth:`wait` (polls with backoff) or by
subscribing to ``ts:{model}:events``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from consistency.attempts import Attempts, Claim
from consistency.decisions import DecisionListener
from consistency.durable import DurableLevel
from consistency.manifest import MANIFEST_VERSION
from consistency.progress import Incarnations
from consistency.stepbase import DECIDED, STATES, _s
from consistency.steprecords import EventSubscription, StepRecord, StepRecords
from tierstore.errors import (
    CommitError,
    IncompleteStepError,
    StepAbortedError,
    StepCommittedError,
    TierUnavailableError,
)

__all__ = ["DECIDED", "MANIFEST_VERSION", "STATES", "Claim", "EventSubscription", "StepProtocol", "StepRecord",
           "Vote", "negative_reason", "vote_summary"]

REASON_CHARS = 500  # a negative vote's recorded reason is cut to this many characters


@dataclass(frozen=True)
class Vote:
    """One rank's vote (see :meth:`StepProtocol.vote`): its objects (``ObjectRecord`` or their JSON), its small
    non-tensor state, and, for a negative vote, why."""

    rank: int
    objects: Sequence[Any] = ()
    extra: dict | None = None
    ok: bool = True
    reason: str | None = None


def negative_reason(v: Vote) -> str:
    """What a negative vote records as its reason: ``v.reason``, else the ``error`` its extra carries, bounded."""
    why = v.reason
    if not why and isinstance(v.extra, dict) and v.extra.get("error"):
        why = str(v.extra["error"])
    why = " ".join((why or "").split())  # one line
    return why if len(why) <= REASON_CHARS else why[: REASON_CHARS - 3] + "..."


def _older(key: Any, step: int) -> bool:
    parts = key.split("/") if isinstance(key, str) else []
    return len(parts) >= 4 and parts[2].isdigit() and int(parts[2]) < step


def vote_summary(objects: Sequence[dict], step: int) -> str:
    """What the deciding vote needs of a vote without decoding it (see ``complete_set`` in
    :mod:`consistency.scripts`): ``l:<layer>`` per layer saved, ``r:<key>`` per delta base or ref target of an
    older step, ``o:<key>`` per own object of an older step; one per line."""
    out: set[str] = set()
    for o in objects:
        if not isinstance(o, dict):
            continue
        key = o.get("key")
        parts = key.split("/") if isinstance(key, str) else []
        if len(parts) >= 3 and parts[0] and parts[1]:
            out.add("l:" + parts[1])
        if _older(key, step):
            out.add(f"o:{key}")
        for ref in (o.get("base"), o.get("target")):
            if _older(ref, step):
                out.add(f"r:{ref}")
    return "\n".join(sorted(out))


class StepProtocol(StepRecords, Incarnations, DurableLevel, Attempts):
    """The commit protocol over an :class:`~consistency.index.Index`, with an optional durable tier.

    Assembled from :class:`~consistency.stepbase.StepBase` (the constructor, its
    arguments and the scripts), :class:`~consistency.steprecords.StepRecords`,
    :class:`~consistency.progress.Incarnations`, :class:`~consistency.durable.DurableLevel` and
    :class:`~consistency.attempts.Attempts` (one writer per step); this module holds the vote/commit path.
    The constructor's arguments are :class:`~consistency.stepbase.StepBase`'s.
    """

    def begin(self, model: str, step: int, world_size: int, *, layout: dict | None = None,
              epoch: int | None = None, timeout_s: float | None = None) -> str:
        """Record the step's world size, layout and timeout (first caller of an epoch wins).

        Idempotent while the step is preparing. A step that an older epoch left
        ``preparing`` or ``aborted`` is begun again as a new attempt (its votes
        dropped) when a newer epoch begins it. Returns the state.

        Raises:
            StepCommittedError: the step is committed (a committed step is immutable).
            IndexLostError: the index lost this model (see :meth:`check_index`).
            FencedError: ``epoch`` is older than the job's.
        """
        self._check(model, step, world_size)
        ks = self._keys(model, step)
        self._register(model)

        def run(check: bool) -> str:
            return _s(self._run(
                f"begin step {step} of {model}", self._begin,
                [ks["epoch"], ks["step"], ks["steps"], ks["votes"], ks["objs"], ks["vinfo"]],
                [-1 if epoch is None else epoch, step, world_size, json.dumps(layout),
                 self.step_timeout_s if timeout_s is None else timeout_s, "1" if check else "0"],
            ))

        try:
            state = run(self.durable is not None)
            if state == "unknown":  # a new model, or one the index lost: the durable tier tells (one round trip
                self.check_index(model)  # per begin otherwise)
                state = run(False)
            return state
        except StepCommittedError as e:
            raise StepCommittedError(
                f"step {step} of {model} is already committed and cannot be saved again "
                "(a committed step is immutable; save a new step number)", model=model, step=step) from e

    def vote_call(self, model: str, step: int, rank: int, objects: list, *, extra: dict | None = None,
                  ok: bool = True, epoch: int | None = None, world_size: int | None = None,
                  layout: dict | None = None, reason: str | None = None,
                  attempt: str | None = None) -> tuple[Any, list[str], list]:
        """The vote as ``(script, keys, args)``, ``now`` not included: one ``EVALSHA`` (benchmarks, fault tests)."""
        return self.votes_call(model, step, [Vote(rank, objects, extra=extra, ok=ok, reason=reason)], epoch=epoch,
                               world_size=world_size, layout=layout, attempt=attempt)

    def votes_call(self, model: str, step: int, votes: Sequence[Vote], *, epoch: int | None = None,
                   world_size: int | None = None, layout: dict | None = None,
                   attempt: str | None = None) -> tuple[Any, list[str], list]:
        """Several ranks' votes as one ``(script, keys, args)`` (see :meth:`vote_many`; ``now`` not included)."""
        self._check(model, step, world_size)
        if not votes:
            raise CommitError("a vote needs at least one rank", model=model, step=step)
        ks = self._keys(model, step)
        keys = [ks["epoch"], ks["step"], ks["steps"], ks["votes"], ks["manifest"], ks["vinfo"]]
        args: list = [-1 if epoch is None else epoch, step, world_size or 0, json.dumps(layout), self.step_timeout_s,
                      model, ks["events"], ks["prefix"], len(votes)]
        seen: set[int] = set()
        for v in votes:
            if isinstance(v.rank, bool) or not isinstance(v.rank, int) or v.rank < 0:
                raise CommitError(f"rank must be a non-negative int, got {v.rank!r}")
            if v.rank in seen:
                raise CommitError(f"rank {v.rank} votes twice in one call", model=model, step=step)
            seen.add(v.rank)
            objs = [o.to_json() if hasattr(o, "to_json") else o for o in v.objects]
            body = json.dumps({"objects": objs, "extra": v.extra}, separators=(",", ":"))
            args += [v.rank, body, "1" if v.ok else "0", vote_summary(objs, step),
                     "" if v.ok else negative_reason(v)]
        args.append(attempt or "")
        return self._vote, keys, args

    def vote(self, model: str, step: int, rank: int, objects: list, *, extra: dict | None = None,
             ok: bool = True, epoch: int | None = None, world_size: int | None = None,
             layout: dict | None = None, reason: str | None = None, attempt: str | None = None) -> str:
        """Vote; return the step's state after this vote (``committed`` if it was the last).

        ``objects`` are this rank's objects of the step (``ObjectInfo`` or their
        JSON); ``extra`` is the rank's small non-tensor state (JSON). A vote for
        a step never begun needs ``world_size``. A negative vote (``ok=False``)
        aborts the step; ``reason`` (else ``extra["error"]``) says why, recorded
        in the step's record (``tierstore admin steps``, :meth:`require_committed`).
        ``attempt`` is the writer's token of a :meth:`claim` of the step.

        Raises:
            FencedError: ``epoch`` is older than the job's.
            StepBusyError: the step is held by another attempt than ``attempt`` (see :meth:`claim`).
            IncompleteStepError: this vote decided the step, and the step reads an object (a delta base, a ref
                target, an inherited layer) or a required step the index does not hold: it is aborted.
            CommitError: bad arguments, a rank outside the world, or a step never begun.
        """
        return self.vote_many(model, step, [Vote(rank, objects, extra=extra, ok=ok, reason=reason)], epoch=epoch,
                              world_size=world_size, layout=layout, attempt=attempt)

    def vote_many(self, model: str, step: int, votes: Sequence[Vote], *, epoch: int | None = None,
                  world_size: int | None = None, layout: dict | None = None, attempt: str | None = None) -> str:
        """Record several ranks' votes in one atomic script (one round trip): a node's aggregator votes for
        its local ranks this way. Returns the step's state after them, as :meth:`vote`.

        All or none are recorded: a rank outside the world refuses the call; a negative one aborts the step.

        Raises:
            FencedError: ``epoch`` is older than the job's.
            IncompleteStepError: as :meth:`vote`.
            CommitError: bad arguments, a rank outside the world, or a step never begun.
        """
        script, keys, args = self.votes_call(model, step, votes, epoch=epoch, world_size=world_size, layout=layout,
                                             attempt=attempt)
        self._register(model)
        listener = self._listener(model)  # subscribed before the vote: its decision cannot be missed
        who = f"rank {votes[0].rank}" if len(votes) == 1 else f"{len(votes)} ranks"
        out = self._run(f"vote of {who} for step {step} of {model}", script, keys, args)
        state, started = _s(out[0]), _s(out[1])
        if state == "aborted" and len(out) > 2:  # this vote decided, and the step reads what the index lacks
            raise IncompleteStepError(f"step {step} of {model} cannot commit: {_s(out[2])}", model=model, step=step,
                                      reason=_s(out[2]))
        if state == "preparing" and started:
            listener.expect(model, step, started)
        if state == "committed" and self.durable is not None:
            self.maybe_durable(model, step, epoch=epoch)
        return state

    def wait(self, model: str, step: int, timeout: float | None = None, *,
             sleep: Callable[[float], None] | None = None) -> str:
        """Block until ``step`` is decided; return its state.

        After a vote of this process left the step preparing, waits for the
        decision of that attempt on ``ts:{model}:decided`` (see
        :mod:`consistency.decisions`) without reading the state; otherwise
        reads it first. Either way it re-reads the state at least every 50 ms,
        aborting a step past its own timeout. With ``sleep`` given, polls with
        backoff instead (tests inject it).

        Raises:
            CommitError: still undecided after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        listener = self._listener(model) if sleep is None else None
        started = listener.expected(model, step) if listener is not None else None
        if started is not None and listener is not None:
            try:
                if listener.heard(step, started) is not None:
                    started = None  # decided before this wait: the state may have moved on (durable), read it
            except TierUnavailableError:
                self._drop_listener(model, listener)
                listener, started = self._listener(model), None
        state = "preparing"
        delay = 0.0002
        while True:
            if started is None:  # nothing heard of this attempt (or 50 ms without its decision): read the state
                state, started = self._check_stale(model, step)
                if state in DECIDED:
                    return self._acked(model, step, state)
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise CommitError(f"step {step} of {model} is still {state or 'unknown'} after {timeout}s",
                                  model=model, step=step, state=state)
            if listener is None:
                assert sleep is not None
                sleep(min(delay, left) if left is not None else delay)
                delay = min(delay * 2, 0.05)
                started = None
                continue
            try:
                got = listener.await_decision(step, started, min(0.05, left) if left is not None else 0.05) \
                    if started else None
            except TierUnavailableError:
                self._drop_listener(model, listener)  # the next read tells whether the index is gone
                listener = self._listener(model)
                got = None
            if got is not None:
                return self._acked(model, step, got)
            if not started:  # an unknown step: poll
                time.sleep(min(0.05, left) if left is not None else 0.05)
            started = None

    def _acked(self, model: str, step: int, state: str) -> str:
        """``state`` once the replicas have it (a no-op on an unreplicated index)."""
        self.index.sync(model, f"acknowledge step {step} {state}")
        return state

    def _listener(self, model: str) -> DecisionListener:
        """This instance's listener to ``model``'s decisions (made on first use)."""
        with self._listeners_lock:
            got = self._listeners.get(model)
            if got is None or got.broken:
                if got is not None:
                    got.close()
                got = self._listeners[model] = DecisionListener(self.index, self._keys(model, 0)["decided"], model)
            return got

    def _drop_listener(self, model: str, listener: DecisionListener) -> None:
        with self._listeners_lock:
            if self._listeners.get(model) is listener:
                del self._listeners[model]
        listener.close()

    def close(self) -> None:
        """Close the subscriptions this instance holds (the index is the caller's)."""
        with self._listeners_lock:
            listeners, self._listeners = list(self._listeners.values()), {}
        for lst in listeners:
            lst.close()

    def _check_stale(self, model: str, step: int) -> tuple[str, str]:
        """Abort ``step`` if it is still preparing past its timeout; its state and start time ("" if unknown)."""
        key = self._keys(model, step)["step"]
        out = self._run(f"expire step {step} of {model}", self._expire, [key], [], ack=False)
        return _s(out[0]), _s(out[1])

    def abort_if_stale(self, model: str, step: int) -> str:
        """Abort ``step`` if it is still preparing past its timeout; return its state ("" if unknown)."""
        state = self._check_stale(model, step)[0]
        if state in DECIDED:  # reported only once the replicas have it (a no-op on an unreplicated index)
            self._acked(model, step, state)
        return state

    def require_committed(self, model: str, step: int, timeout: float | None = None) -> str:
        """Wait for ``step``; return its state if committed (or durable).

        Raises:
            StepAbortedError: the step was aborted (its recorded reason in the message and ``reason``).
            CommitError: still undecided after ``timeout`` seconds.
        """
        state = self.wait(model, step, timeout)
        if state == "aborted":
            recs = self.records(model, [step])
            why = recs[0].reason if recs else None
            raise StepAbortedError(f"step {step} of {model} was aborted" + (f": {why}" if why else ""),
                                   model=model, step=step, reason=why)
        return state
