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
from collections.abc import Callable
from typing import Any

from consistency.durable import DurableLevel
from consistency.index import translate_redis_errors
from consistency.manifest import MANIFEST_VERSION
from consistency.progress import Incarnations
from consistency.stepbase import DECIDED, STATES, _s
from consistency.steprecords import EventSubscription, StepRecord, StepRecords
from tierstore.errors import CommitError, StepAbortedError, StepCommittedError

__all__ = ["DECIDED", "MANIFEST_VERSION", "STATES", "EventSubscription", "StepProtocol", "StepRecord"]


class StepProtocol(StepRecords, Incarnations, DurableLevel):
    """The commit protocol over an :class:`~consistency.index.Index`, with an optional durable tier.

    Assembled from :class:`~consistency.stepbase.StepBase` (the constructor, its
    arguments and the scripts), :class:`~consistency.steprecords.StepRecords`,
    :class:`~consistency.progress.Incarnations` and
    :class:`~consistency.durable.DurableLevel`; this module holds the vote/commit path.

    Args:
        index: the index.
        durable: where durable manifests go (``None``: steps never become durable).
        step_timeout_s: a step still preparing this long after it began is aborted (0: never).
        clock: seconds since the epoch to use instead of the server's ``TIME`` (tests inject one).
        on_lost: called with a model the index lost (its durable manifests exist): it must restore
            the index (the store rebuilds it); ``None`` raises :class:`IndexLostError` instead.
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
                [ks["epoch"], ks["step"], ks["steps"], ks["votes"], ks["objs"]],
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
                  layout: dict | None = None) -> tuple[Any, list[str], list]:
        """The vote as ``(script, keys, args)``, ``now`` included: one ``EVALSHA`` (benchmarks, fault tests)."""
        self._check(model, step, world_size)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise CommitError(f"rank must be a non-negative int, got {rank!r}")
        vote = {"objects": [o.to_json() if hasattr(o, "to_json") else o for o in objects], "extra": extra}
        ks = self._keys(model, step)
        keys = [ks["epoch"], ks["step"], ks["steps"], ks["votes"], ks["manifest"]]
        args = [-1 if epoch is None else epoch, step, world_size or 0, json.dumps(layout), self.step_timeout_s,
                rank, json.dumps(vote, separators=(",", ":")), "1" if ok else "0", model, ks["events"], ks["prefix"]]
        return self._vote, keys, args

    def vote(self, model: str, step: int, rank: int, objects: list, *, extra: dict | None = None,
             ok: bool = True, epoch: int | None = None, world_size: int | None = None,
             layout: dict | None = None) -> str:
        """Vote; return the step's state after this vote (``committed`` if it was the last).

        ``objects`` are this rank's objects of the step (``ObjectInfo`` or their
        JSON); ``extra`` is the rank's small non-tensor state (JSON). A vote for
        a step never begun needs ``world_size``.

        Raises:
            FencedError: ``epoch`` is older than the job's.
            CommitError: bad arguments, a rank outside the world, or a step never begun.
        """
        script, keys, args = self.vote_call(model, step, rank, objects, extra=extra, ok=ok, epoch=epoch,
                                            world_size=world_size, layout=layout)
        self._register(model)
        state = _s(self._run(f"vote of rank {rank} for step {step} of {model}", script, keys, args))
        if state == "committed":
            self.maybe_durable(model, step, epoch=epoch)
        return state

    def wait(self, model: str, step: int, timeout: float | None = None, *,
             sleep: Callable[[float], None] | None = None) -> str:
        """Block until ``step`` is decided; return its state.

        Listens on ``ts:{model}:events`` (pub/sub: woken as soon as the step
        is decided) and re-reads the state at least every 50 ms, aborting a
        step past its own timeout. With ``sleep`` given, polls with backoff
        instead (tests inject it).

        Raises:
            CommitError: still undecided after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        state = self.abort_if_stale(model, step)
        if state in DECIDED:
            return state
        pubsub = None
        if sleep is None:
            pubsub = self._subscription(model)
        delay = 0.0002
        try:
            while True:
                state = self.abort_if_stale(model, step)
                if state in DECIDED:
                    return state
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise CommitError(f"step {step} of {model} is still {state or 'unknown'} after {timeout}s",
                                      model=model, step=step, state=state)
                if pubsub is not None:
                    with translate_redis_errors(f"events of {model}", self.index.url):
                        pubsub.get_message(timeout=min(0.05, left if left is not None else 0.05))
                elif sleep is not None:
                    sleep(min(delay, left) if left is not None else delay)
                    delay = min(delay * 2, 0.05)
        except BaseException:
            if pubsub is not None:  # a broken subscription is not reused
                self._local.subs.pop(model, None)
                pubsub.close()
            raise

    def _subscription(self, model: str):
        """This thread's subscription to ``model``'s events, kept between waits (drained before use)."""
        subs = self._local.__dict__.setdefault("subs", {})
        p = subs.get(model)
        if p is None:
            with translate_redis_errors(f"subscribe to events of {model}", self.index.url):
                p = self.index._r.pubsub(ignore_subscribe_messages=True)
                p.subscribe(self._keys(model, 0)["events"])
            subs[model] = p
        else:
            with translate_redis_errors(f"events of {model}", self.index.url):
                while p.get_message(timeout=0) is not None:
                    pass
        return p

    def abort_if_stale(self, model: str, step: int) -> str:
        """Abort ``step`` if it is still preparing past its timeout; return its state ("" if unknown)."""
        key = self._keys(model, step)["step"]
        state = _s(self._run(f"expire step {step} of {model}", self._expire, [key], [], ack=False))
        if state in DECIDED:  # reported only once the replicas have it (a no-op on an unreplicated index)
            self.index.sync(model, f"acknowledge step {step} {state}")
        return state

    def require_committed(self, model: str, step: int, timeout: float | None = None) -> str:
        state = self.wait(model, step, timeout)
        if state == "aborted":
            raise StepAbortedError(f"step {step} of {model} was aborted", model=model, step=step)
        return state
