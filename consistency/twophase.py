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
from collections.abc import Callable
from typing import Any

from backends.base import Backend
from consistency.index import Index, translate_redis_errors
from consistency.manifest import (
    MANIFEST_VERSION,
    durable_manifest_name,
    manifest_objects,
    parse_manifest,
)
from tierstore.errors import (
    CommitError,
    FencedError,
    KeyExistsError,
    StepAbortedError,
    TierUnavailableError,
)
from tierstore.keys import ShardKey, validate_name

__all__ = ["DECIDED", "STATES", "StepProtocol"]

log = logging.getLogger(__name__)

STATES = ("preparing", "committed", "aborted", "durable")
DECIDED = ("committed", "aborted", "durable")

# Time is the server's (TIME) unless the caller injects its own clock: every script takes "now" as its
# last ARGV, a negative value meaning "ask the server".
_NOW = """
local now = tonumber(ARGV[#ARGV])
if now == nil or now < 0 then local t = redis.call('TIME'); now = tonumber(t[1]) + tonumber(t[2]) / 1e6 end
"""
_FENCE = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
local ep = tonumber(ARGV[1])
if ep >= 0 and ep < cur then return redis.error_reply('TSFENCED ' .. cur) end
"""
# Create the step, or restart it when a newer epoch begins a step an older epoch left preparing (its votes
# are dropped: they belong to a fenced incarnation). KEYS: epoch, step, steps, votes. ARGV: epoch, step,
# world, layout_json, timeout_s.
_OPEN = """
local function open_step()
  local st = redis.call('HGET', KEYS[2], 'state')
  local sep = tonumber(redis.call('HGET', KEYS[2], 'epoch') or '-1')
  if st and not (st == 'preparing' and sep >= 0 and ep > sep) then return st end
  if tonumber(ARGV[3]) < 1 then return redis.error_reply('TSNOSTEP step ' .. ARGV[2] .. ' was never begun') end
  redis.call('DEL', KEYS[2], KEYS[4])
  redis.call('HSET', KEYS[2], 'state', 'preparing', 'world', ARGV[3], 'epoch', ARGV[1], 'started', now,
             'layout', ARGV[4], 'timeout', ARGV[5], 'nmigrated', 0)
  redis.call('ZADD', KEYS[3], tonumber(ARGV[2]), ARGV[2])
  return 'preparing'
end
"""

# KEYS: epoch, step, steps, votes; ARGV: epoch, step, world, layout_json, timeout_s, now
_BEGIN = _FENCE + _NOW + _OPEN + """
return open_step()
"""

# KEYS: epoch, step, steps, votes, manifest; ARGV: epoch, step, world (0: unknown), layout_json, timeout_s,
# rank, vote_json, ok, model, channel, now
_VOTE = _FENCE + _NOW + _OPEN + """
local st = open_step()
if type(st) == 'table' then return st end
if st ~= 'preparing' then return st end
local world = tonumber(redis.call('HGET', KEYS[2], 'world'))
if tonumber(ARGV[6]) >= world then
  return redis.error_reply('TSRANK rank ' .. ARGV[6] .. ' is outside the world of ' .. world)
end
local started = tonumber(redis.call('HGET', KEYS[2], 'started'))
local timeout = tonumber(redis.call('HGET', KEYS[2], 'timeout'))
if ARGV[8] ~= '1' or (timeout > 0 and now - started > timeout) then
  local why = 'negative vote of rank ' .. ARGV[6]
  if ARGV[8] == '1' then why = 'timed out' end
  redis.call('HSET', KEYS[2], 'state', 'aborted', 'decided', now, 'reason', why)
  redis.call('PUBLISH', ARGV[10], ARGV[2] .. ' aborted')
  return 'aborted'
end
redis.call('HSET', KEYS[4], ARGV[6], ARGV[7])
if redis.call('HLEN', KEYS[4]) < world then return 'preparing' end
local votes = redis.call('HGETALL', KEYS[4])
local parts = {}
for i = 1, #votes, 2 do parts[#parts + 1] = '"' .. votes[i] .. '":' .. votes[i + 1] end
local layout = redis.call('HGET', KEYS[2], 'layout')
local manifest = '{"version":' .. MANIFEST_VERSION .. ',"model":' .. cjson.encode(ARGV[9]) .. ',"step":' .. ARGV[2] ..
  ',"world":' .. world .. ',"epoch":' .. redis.call('HGET', KEYS[2], 'epoch') ..
  ',"committed_at":' .. string.format('%.6f', now) .. ',"layout":' .. layout ..
  ',"ranks":{' .. table.concat(parts, ',') .. '}}'
redis.call('SET', KEYS[5], manifest)
redis.call('HSET', KEYS[2], 'state', 'committed', 'decided', now)
redis.call('PUBLISH', ARGV[10], ARGV[2] .. ' committed')
return 'committed'
""".replace("MANIFEST_VERSION", str(MANIFEST_VERSION))

# KEYS: step; ARGV: now. Abort a step still preparing past its timeout.
_EXPIRE = _NOW + """
local st = redis.call('HGET', KEYS[1], 'state')
if st ~= 'preparing' then return st end
local started = tonumber(redis.call('HGET', KEYS[1], 'started'))
local timeout = tonumber(redis.call('HGET', KEYS[1], 'timeout'))
if timeout > 0 and now - started > timeout then
  redis.call('HSET', KEYS[1], 'state', 'aborted', 'decided', now, 'reason', 'timed out')
  return 'aborted'
end
return st
"""

# KEYS: epoch, step; ARGV: epoch, rank. Counts each rank once. Returns {migrated, world, state}.
_MIGRATED = _FENCE + """
if redis.call('EXISTS', KEYS[2]) == 0 then return {0, 0, ''} end
if redis.call('HSETNX', KEYS[2], 'migrated:' .. ARGV[2], '1') == 1 then
  redis.call('HINCRBY', KEYS[2], 'nmigrated', 1)
end
return {tonumber(redis.call('HGET', KEYS[2], 'nmigrated')), tonumber(redis.call('HGET', KEYS[2], 'world') or '0'),
        redis.call('HGET', KEYS[2], 'state') or ''}
"""

# KEYS: epoch, step; ARGV: epoch, channel, step, now. committed -> durable only.
_DURABLE = _FENCE + _NOW + """
if redis.call('HGET', KEYS[2], 'state') == 'committed' then
  redis.call('HSET', KEYS[2], 'state', 'durable', 'durable_at', now)
  redis.call('PUBLISH', ARGV[2], ARGV[3] .. ' durable')
  return 1
end
return 0
"""


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else ("" if v is None else str(v))


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
        r = index.r
        self._begin = r.register_script(_BEGIN)
        self._vote = r.register_script(_VOTE)
        self._expire = r.register_script(_EXPIRE)
        self._migrated = r.register_script(_MIGRATED)
        self._durable = r.register_script(_DURABLE)

    def _register(self, model: str) -> None:
        """Add ``model`` to ``ts:models`` once per instance (it lives outside the model's slot)."""
        if model not in self._known_models:
            with translate_redis_errors(f"register model {model}", self.index.url):
                self.index.r.sadd("ts:models", model)
            self._known_models.add(model)

    def _now(self) -> float:
        return -1.0 if self.clock is None else float(self.clock())

    def _keys(self, model: str, step: int) -> dict[str, str]:
        k = self.index.k
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
            v = self.index.r.hget(self._keys(model, step)["step"], "state")
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
                else:
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
                p = self.index.r.pubsub(ignore_subscribe_messages=True)
                p.subscribe(self._keys(model, 0)["events"])
            subs[model] = p
        else:
            with translate_redis_errors(f"events of {model}", self.index.url):
                while p.get_message(timeout=0) is not None:
                    pass
        return p

    def manifest(self, model: str, step: int) -> dict | None:
        with translate_redis_errors(f"manifest of step {step} of {model}", self.index.url):
            raw = self.index.r.get(self._keys(model, step)["manifest"])
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
            h = {_s(k): _s(v) for k, v in self.index.r.hgetall(ks["step"]).items()}
            current = int(self.index.r.get(ks["epoch"]) or 0)
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
        k = self.index.k
        with translate_redis_errors(f"steps of {model}", self.index.url):
            steps = [int(_s(s)) for s in self.index.r.zrange(k(model, "steps"), 0, -1)]
            pipe = self.index.r.pipeline(transaction=False)
            for s in steps:
                pipe.hget(k(model, "step", s), "state")
            states = pipe.execute()
        return [(s, _s(st)) for s, st in zip(steps, states)]

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
