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
   an older epoch is refused with :class:`FencedError`.

A rank learns the outcome with :meth:`wait` (polls with backoff) or by
subscribing to ``ts:{model}:events``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from backends.base import Backend
from consistency.index import Index, translate_redis_errors
from consistency.manifest import (
    MANIFEST_VERSION,
    durable_manifest_name,
    manifest_objects,
    parse_manifest,
)
from consistency.scripts import BEGIN, DURABLE, EXPIRE, MIGRATED, VOTE
from tierstore.errors import (
    CommitError,
    FencedError,
    KeyExistsError,
    StepAbortedError,
    TierUnavailableError,
)
from tierstore.keys import ShardKey, validate_name

__all__ = ["DECIDED", "STATES", "EventSubscription", "StepProtocol", "StepRecord"]

log = logging.getLogger(__name__)

STATES = ("preparing", "committed", "aborted", "durable")
DECIDED = ("committed", "aborted", "durable")

def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else ("" if v is None else str(v))


def _f(v: str | None) -> float | None:
    return float(v) if v else None


@dataclass(frozen=True)
class StepRecord:
    """What the index records of one step (see :meth:`StepProtocol.records`)."""

    step: int
    state: str
    world: int = 0
    epoch: int = 0
    votes: int = 0
    started: float | None = None
    decided: float | None = None
    durable_at: float | None = None
    reason: str | None = None
    rebuilt: bool = False

    @property
    def commit_latency_s(self) -> float | None:
        """Seconds from the step's begin to its decision (``None`` while undecided)."""
        if self.started is None or self.decided is None:
            return None
        return self.decided - self.started


class EventSubscription:
    """A subscription to a model's step events: ``(step, state)`` each time a step is decided or durable.

    Get one from :meth:`StepProtocol.subscribe`; :meth:`close` it when done.
    """

    def __init__(self, pubsub: Any, url: str, model: str) -> None:
        self._p = pubsub
        self._url = url
        self._model = model

    def get(self, timeout: float) -> tuple[int, str] | None:
        """The next event within ``timeout`` seconds, else ``None``."""
        with translate_redis_errors(f"events of {self._model}", self._url):
            msg = self._p.get_message(timeout=timeout)
        if msg is None:
            return None
        parts = _s(msg.get("data")).split()
        if len(parts) != 2 or not parts[0].isdigit():
            return None
        return int(parts[0]), parts[1]

    def close(self) -> None:
        self._p.close()


class StepProtocol:
    """The commit protocol over an :class:`Index`, with an optional durable tier.

    Args:
        index: the index.
        durable: where durable manifests go (``None``: steps never become durable).
        step_timeout_s: a step still preparing this long after it began is aborted (0: never).
        clock: seconds since the epoch to use instead of the server's ``TIME`` (tests inject one).
    """

    def __init__(self, index: Index, durable: Backend | None = None, *, step_timeout_s: float = 600.0,
                 clock: Callable[[], float] | None = None):
        self.index = index
        self.durable = durable
        self.step_timeout_s = step_timeout_s
        self.clock = clock
        self._known_models: set[str] = set()
        self._local = threading.local()
        r = index._r  # consistency/ owns the client
        self._begin = r.register_script(BEGIN)
        self._vote = r.register_script(VOTE)
        self._expire = r.register_script(EXPIRE)
        self._migrated = r.register_script(MIGRATED)
        self._durable = r.register_script(DURABLE)

    def _register(self, model: str) -> None:
        """Add ``model`` to the models list once per instance (it lives outside the model's slot)."""
        if model not in self._known_models:
            self.index.register_model(model)
            self._known_models.add(model)

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
        }

    @staticmethod
    def _check(model: str, step: int, world_size: int | None = None) -> None:
        validate_name(model, "model")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CommitError(f"step must be a non-negative int, got {step!r}")
        if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int)
                                       or world_size < 1):
            raise CommitError(f"world_size must be a positive int, got {world_size!r}")

    def _run(self, what: str, script, keys: list[str], args: list) -> Any:
        try:
            with translate_redis_errors(what, self.index.url):
                return script(keys=keys, args=[*args, self._now()])
        except TierUnavailableError as e:
            msg = str(e.__cause__ or "")
            if "TSNOSTEP" in msg or "TSRANK" in msg:
                raise CommitError(f"{what}: {msg.split(' ', 1)[1] if ' ' in msg else msg}") from e.__cause__
            raise

    def begin(self, model: str, step: int, world_size: int, *, layout: dict | None = None,
              epoch: int | None = None, timeout_s: float | None = None) -> str:
        """Record the step's world size, layout and timeout (first caller of an epoch wins).

        Idempotent. A step that an older epoch left ``preparing`` is restarted
        (its votes dropped) when a newer epoch begins it. Returns the state.

        Raises:
            FencedError: ``epoch`` is older than the job's.
        """
        self._check(model, step, world_size)
        ks = self._keys(model, step)
        self._register(model)
        return _s(self._run(
            f"begin step {step} of {model}", self._begin,
            [ks["epoch"], ks["step"], ks["steps"], ks["votes"]],
            [-1 if epoch is None else epoch, step, world_size, json.dumps(layout),
             self.step_timeout_s if timeout_s is None else timeout_s],
        ))

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
                rank, json.dumps(vote, separators=(",", ":")), "1" if ok else "0", model, ks["events"]]
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

    def state(self, model: str, step: int) -> str | None:
        with translate_redis_errors(f"state of step {step} of {model}", self.index.url):
            v = self.index._r.hget(self._keys(model, step)["step"], "state")
        return _s(v) if v is not None else None

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

    def manifest(self, model: str, step: int) -> dict | None:
        with translate_redis_errors(f"manifest of step {step} of {model}", self.index.url):
            raw = self.index._r.get(self._keys(model, step)["manifest"])
        return parse_manifest(raw, model=model, step=step) if raw is not None else None

    def mark_migrated(self, model: str, step: int, rank: int, failures: list, *, epoch: int | None = None) -> None:
        """Called when rank's objects of ``step`` reached the durable tier (or failed to).

        Raises:
            FencedError: ``epoch`` is older than the job's (a zombie's migration counts for nothing).
        """
        if failures:
            log.warning("step %s of %s: %d object(s) of rank %d failed to migrate; it stays memory-only",
                        step, model, len(failures), rank)
            return
        ks = self._keys(model, step)
        with translate_redis_errors(f"mark step {step} migrated", self.index.url):
            self._migrated(keys=[ks["epoch"], ks["step"]], args=[-1 if epoch is None else epoch, rank])
        self.maybe_durable(model, step, epoch=epoch)

    def _durable_deps(self, model: str, m: dict) -> list[dict] | None:
        """Entries of every object the step reaches (delta bases, ref targets) outside it; ``None`` if any
        of them, or of the step's own objects, is not recorded as held by the durable tier."""
        tier = self.durable.tier if self.durable is not None else "durable"
        own = {o["key"] for o in manifest_objects(m)}
        seen: set[str] = set()
        todo = sorted(own)
        deps: list[dict] = []
        while todo:
            recs = self.index.get_objects([ShardKey.parse(k) for k in todo])
            nxt: list[str] = []
            for name, rec in zip(todo, recs):
                seen.add(name)
                if rec is None or tier not in rec.tiers:
                    return None
                if name not in own:
                    deps.append({**rec.to_json(), "tiers": [tier]})
                for ref in (rec.base, rec.target):
                    if ref is not None and str(ref) not in seen and str(ref) not in nxt:
                        nxt.append(str(ref))
            todo = nxt
        return sorted(deps, key=lambda d: d["key"])

    def maybe_durable(self, model: str, step: int, *, epoch: int | None = None) -> bool:
        """If ``step`` is committed, every rank migrated, and every object it reaches is held by the
        durable tier: write the durable manifest there (last, create-once) and mark the step durable.

        The durable manifest is the committed one plus ``durable: true``, the
        durable tier added to every object's tiers, and ``deps``: the entries
        of the objects of older steps it reaches, so the index can be rebuilt
        from it alone.
        """
        if self.durable is None:
            return False
        ks = self._keys(model, step)
        with translate_redis_errors(f"check step {step} durability", self.index.url):
            h = {_s(k): _s(v) for k, v in self.index._r.hgetall(ks["step"]).items()}
            current = int(self.index._r.get(ks["epoch"]) or 0)
        if epoch is not None and epoch >= 0 and epoch < current:
            raise FencedError(f"step {step} of {model}: epoch {epoch} is fenced (now {current})", epoch=current)
        if h.get("state") != "committed" or int(h.get("nmigrated") or 0) < int(h.get("world") or 0):
            return False
        manifest = self.manifest(model, step)
        if manifest is None:
            return False
        deps = self._durable_deps(model, manifest)
        if deps is None:
            return False
        tier = self.durable.tier
        for vote in manifest["ranks"].values():
            for o in vote["objects"]:
                o["tiers"] = sorted(set(o.get("tiers") or ()) | {tier})
        manifest["durable"] = True
        manifest["deps"] = deps
        data = json.dumps(manifest, sort_keys=True).encode()
        try:
            self.durable.put(durable_manifest_name(model, step), data, if_absent=True)
        except KeyExistsError:
            pass  # another rank wrote it first: it holds the same manifest
        with translate_redis_errors(f"mark step {step} durable", self.index.url):
            self._durable(keys=[ks["epoch"], ks["step"]],
                          args=[-1 if epoch is None else epoch, ks["events"], step, self._now()])
        return True

    def steps(self, model: str) -> list[tuple[int, str]]:
        """All recorded steps of ``model`` with their states, oldest first."""
        k = self.index._k
        with translate_redis_errors(f"steps of {model}", self.index.url):
            steps = [int(_s(s)) for s in self.index._r.zrange(k(model, "steps"), 0, -1)]
            pipe = self.index._r.pipeline(transaction=False)
            for s in steps:
                pipe.hget(k(model, "step", s), "state")
            states = pipe.execute()
        return [(s, _s(st)) for s, st in zip(steps, states)]

    def records(self, model: str, steps: Iterable[int] | None = None) -> list[StepRecord]:
        """The index's records of ``steps`` (default: every recorded step), in the given order."""
        k = self.index._k
        steps = [s for s, _ in self.steps(model)] if steps is None else list(steps)
        with translate_redis_errors(f"step records of {model}", self.index.url):
            pipe = self.index._r.pipeline(transaction=False)
            for s in steps:
                pipe.hgetall(k(model, "step", s))
                pipe.hlen(k(model, "votes", s))
            rows = pipe.execute()
        out = []
        for i, step in enumerate(steps):
            h = {_s(a): _s(b) for a, b in rows[2 * i].items()}
            out.append(StepRecord(
                step=step, state=h.get("state", ""), world=int(h.get("world") or 0), epoch=int(h.get("epoch") or 0),
                votes=int(rows[2 * i + 1]), started=_f(h.get("started")), decided=_f(h.get("decided")),
                durable_at=_f(h.get("durable_at")), reason=h.get("reason") or None, rebuilt=bool(h.get("rebuilt")),
            ))
        return out

    def drop_steps(self, model: str, steps: Iterable[int], *, keep_aborted_state: bool = True) -> None:
        """Delete the records of ``steps`` (manifest, votes, step record) from the index.

        With ``keep_aborted_state`` an aborted step keeps its record (a
        tombstone: a late vote of it cannot re-open it); otherwise every
        record goes and the step number can be begun again. Objects and
        durable manifests are the caller's (garbage collection deletes them
        first).
        """
        k = self.index._k
        steps = sorted(set(steps))
        if not steps:
            return
        states = dict(self.steps(model)) if keep_aborted_state else {}
        with translate_redis_errors(f"drop steps of {model}", self.index.url):
            pipe = self.index._r.pipeline(transaction=False)
            for s in steps:
                pipe.delete(k(model, "manifest", s), k(model, "votes", s))
                if states.get(s) != "aborted":
                    pipe.delete(k(model, "step", s))
                    pipe.zrem(k(model, "steps"), s)
            pipe.execute()

    def delete_durable_manifests(self, model: str, steps: Iterable[int]) -> None:
        """Delete the durable manifests of ``steps`` (first, before their objects: an index rebuild
        must never resurrect a step whose objects are going)."""
        if self.durable is None:
            return
        for s in sorted(set(steps)):
            self.durable.delete(durable_manifest_name(model, s))

    def restore_durable(self, model: str, manifest: dict) -> None:
        """Record a step from its durable manifest as ``durable`` (index rebuild), replacing what was there.

        The objects are the caller's to record first (:meth:`Index.record_object`).
        """
        step = manifest["step"]
        ks = self._keys(model, step)
        committed = manifest.get("committed_at", 0.0)
        index_copy = {k: v for k, v in manifest.items() if k not in ("durable", "deps")}
        with translate_redis_errors(f"rebuild step {step} of {model}", self.index.url):
            pipe = self.index._r.pipeline(transaction=True)
            pipe.delete(ks["step"], ks["votes"])
            pipe.hset(ks["step"], mapping={
                "state": "durable", "world": manifest["world"], "epoch": manifest.get("epoch", 0),
                "started": committed, "decided": committed, "durable_at": committed,
                "layout": json.dumps(manifest.get("layout")), "timeout": 0, "nmigrated": manifest["world"],
                "rebuilt": 1,
            })
            pipe.zadd(ks["steps"], {str(step): step})
            pipe.set(ks["manifest"], json.dumps(index_copy, separators=(",", ":")))
            pipe.execute()
        self.index.register_model(model)

    def subscribe(self, model: str) -> EventSubscription:
        """Subscribe to ``model``'s step events (the caller closes the subscription)."""
        validate_name(model, "model")
        with translate_redis_errors(f"subscribe to events of {model}", self.index.url):
            p = self.index._r.pubsub(ignore_subscribe_messages=True)
            p.subscribe(self._keys(model, 0)["events"])
        return EventSubscription(p, self.index.url, model)

    def abort_if_stale(self, model: str, step: int) -> str:
        """Abort ``step`` if it is still preparing past its timeout; return its state ("" if unknown)."""
        key = self._keys(model, step)["step"]
        return _s(self._run(f"expire step {step} of {model}", self._expire, [key], []))

    def require_committed(self, model: str, step: int, timeout: float | None = None) -> str:
        state = self.wait(model, step, timeout)
        if state == "aborted":
            raise StepAbortedError(f"step {step} of {model} was aborted", model=model, step=step)
        return state


__all__ += ["MANIFEST_VERSION"]
