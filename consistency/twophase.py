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
import time
from typing import Any

from backends.base import Backend
from consistency.index import Index, translate_redis_errors
from consistency.manifest import MANIFEST_VERSION, durable_manifest_name, parse_manifest
from tierstore.errors import CommitError, KeyExistsError, StepAbortedError
from tierstore.keys import validate_name

__all__ = ["StepProtocol", "STATES", "DECIDED"]

log = logging.getLogger(__name__)

STATES = ("preparing", "committed", "aborted", "durable")
DECIDED = ("committed", "aborted", "durable")

_NOW = "local t = redis.call('TIME'); local now = tonumber(t[1]) + tonumber(t[2]) / 1e6\n"
_FENCE = (
    "local cur = tonumber(redis.call('GET', KEYS[1]) or '0')\n"
    "local ep = tonumber(ARGV[1])\n"
    "if ep >= 0 and ep < cur then return redis.error_reply('TSFENCED ' .. cur) end\n"
)

# KEYS: epoch, step, steps; ARGV: epoch, step, world, layout_json, timeout_s
_BEGIN = _FENCE + _NOW + """
if redis.call('EXISTS', KEYS[2]) == 0 then
  redis.call('HSET', KEYS[2], 'state', 'preparing', 'world', ARGV[3], 'epoch', ARGV[1], 'started', now,
             'layout', ARGV[4], 'timeout', ARGV[5])
  redis.call('ZADD', KEYS[3], tonumber(ARGV[2]), ARGV[2])
end
return redis.call('HGET', KEYS[2], 'state')
"""

# KEYS: epoch, step, steps, votes, manifest; ARGV: epoch, step, world, layout_json, timeout_s, rank, vote_json,
# ok, model, channel
_VOTE = _FENCE + _NOW + """
if redis.call('EXISTS', KEYS[2]) == 0 then
  redis.call('HSET', KEYS[2], 'state', 'preparing', 'world', ARGV[3], 'epoch', ARGV[1], 'started', now,
             'layout', ARGV[4], 'timeout', ARGV[5])
  redis.call('ZADD', KEYS[3], tonumber(ARGV[2]), ARGV[2])
end
local st = redis.call('HGET', KEYS[2], 'state')
if st ~= 'preparing' then return st end
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
local world = tonumber(redis.call('HGET', KEYS[2], 'world'))
if redis.call('HLEN', KEYS[4]) < world then return 'preparing' end
local votes = redis.call('HGETALL', KEYS[4])
local parts = {}
for i = 1, #votes, 2 do parts[#parts + 1] = cjson.encode(votes[i]) .. ':' .. votes[i + 1] end
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

# KEYS: step; ARGV: (none). Abort a step still preparing past its timeout.
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

# KEYS: epoch, step; ARGV: epoch, rank. Returns {migrated count, world, state}.
_MIGRATED = _FENCE + """
redis.call('HSET', KEYS[2], 'migrated:' .. ARGV[2], '1')
local n = 0
for _, f in ipairs(redis.call('HKEYS', KEYS[2])) do
  if string.sub(f, 1, 9) == 'migrated:' then n = n + 1 end
end
return {n, tonumber(redis.call('HGET', KEYS[2], 'world') or '0'), redis.call('HGET', KEYS[2], 'state') or ''}
"""

# KEYS: step, channel-less. ARGV: now-str. committed -> durable only.
_DURABLE = _NOW + """
if redis.call('HGET', KEYS[1], 'state') == 'committed' then
  redis.call('HSET', KEYS[1], 'state', 'durable', 'durable_at', now)
  redis.call('PUBLISH', ARGV[1], ARGV[2] .. ' durable')
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
        step_timeout_s: a step still preparing this long after it began is aborted.
    """

    def __init__(self, index: Index, durable: Backend | None = None, *, step_timeout_s: float = 600.0):
        self.index = index
        self.durable = durable
        self.step_timeout_s = step_timeout_s
        r = index.r
        self._begin = r.register_script(_BEGIN)
        self._vote = r.register_script(_VOTE)
        self._expire = r.register_script(_EXPIRE)
        self._migrated = r.register_script(_MIGRATED)
        self._durable = r.register_script(_DURABLE)

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
        if world_size is not None and (not isinstance(world_size, int) or world_size < 1):
            raise CommitError(f"world_size must be a positive int, got {world_size!r}")

    def begin(self, model: str, step: int, world_size: int, *, layout: dict | None = None,
              epoch: int | None = None, timeout_s: float | None = None) -> str:
        """Record the step's world size (first caller wins); idempotent."""
        self._check(model, step, world_size)
        ks = self._keys(model, step)
        with translate_redis_errors(f"begin step {step} of {model}", self.index.url):
            self.index.r.sadd("ts:models", model)
            return _s(self._begin(
                keys=[ks["epoch"], ks["step"], ks["steps"]],
                args=[-1 if epoch is None else epoch, step, world_size, json.dumps(layout),
                      self.step_timeout_s if timeout_s is None else timeout_s],
            ))

    def vote(self, model: str, step: int, rank: int, objects: list, *, extra: dict | None = None,
             ok: bool = True, epoch: int | None = None, world_size: int | None = None,
             layout: dict | None = None) -> str:
        """Vote; return the step's state after this vote (``committed`` if it was the last)."""
        self._check(model, step)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise CommitError(f"rank must be a non-negative int, got {rank!r}")
        vote = {"objects": [o.to_json() if hasattr(o, "to_json") else o for o in objects], "extra": extra}
        ks = self._keys(model, step)
        with translate_redis_errors(f"vote of rank {rank} for step {step} of {model}", self.index.url):
            self.index.r.sadd("ts:models", model)
            state = _s(self._vote(
                keys=[ks["epoch"], ks["step"], ks["steps"], ks["votes"], ks["manifest"]],
                args=[-1 if epoch is None else epoch, step, world_size or 1, json.dumps(layout),
                      self.step_timeout_s, rank, json.dumps(vote, separators=(",", ":")), "1" if ok else "0",
                      model, ks["events"]],
            ))
        if state == "committed":
            self.maybe_durable(model, step)
        return state

    def state(self, model: str, step: int) -> str | None:
        with translate_redis_errors(f"state of step {step} of {model}", self.index.url):
            v = self.index.r.hget(self._keys(model, step)["step"], "state")
        return _s(v) if v is not None else None

    def wait(self, model: str, step: int, timeout: float | None = None, *, sleep=time.sleep) -> str:
        """Block until ``step`` is decided; return its state.

        Raises:
            CommitError: still undecided after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.0005
        key = self._keys(model, step)["step"]
        while True:
            state = self.state(model, step)
            if state in DECIDED:
                return state
            with translate_redis_errors(f"expire step {step} of {model}", self.index.url):
                state = _s(self._expire(keys=[key], args=[]))
            if state in DECIDED:
                return state
            if deadline is not None and time.monotonic() >= deadline:
                raise CommitError(f"step {step} of {model} is still {state or 'unknown'} after {timeout}s",
                                  model=model, step=step, state=state)
            sleep(delay)
            delay = min(delay * 2, 0.05)

    def manifest(self, model: str, step: int) -> dict | None:
        with translate_redis_errors(f"manifest of step {step} of {model}", self.index.url):
            raw = self.index.r.get(self._keys(model, step)["manifest"])
        return parse_manifest(raw, model=model) if raw is not None else None

    def mark_migrated(self, model: str, step: int, rank: int, failures: list, *, epoch: int | None = None) -> None:
        """Called when rank's objects of ``step`` reached the durable tier (or failed to)."""
        if failures:
            log.warning("step %s of %s: %d object(s) of rank %d failed to migrate; it stays memory-only",
                        step, model, len(failures), rank)
            return
        ks = self._keys(model, step)
        with translate_redis_errors(f"mark step {step} migrated", self.index.url):
            self._migrated(keys=[ks["epoch"], ks["step"]], args=[-1 if epoch is None else epoch, rank])
        self.maybe_durable(model, step)

    def maybe_durable(self, model: str, step: int) -> bool:
        """If ``step`` is committed and every rank migrated, write the durable manifest and mark it durable."""
        if self.durable is None:
            return False
        ks = self._keys(model, step)
        with translate_redis_errors(f"check step {step} durability", self.index.url):
            h = {_s(k): _s(v) for k, v in self.index.r.hgetall(ks["step"]).items()}
        migrated = sum(1 for f in h if f.startswith("migrated:"))
        if h.get("state") != "committed" or migrated < int(h.get("world") or 0):
            return False
        manifest = self.manifest(model, step)
        if manifest is None:
            return False
        manifest["durable"] = True
        data = json.dumps(manifest, sort_keys=True).encode()
        try:
            self.durable.put(durable_manifest_name(model, step), data, if_absent=True)
        except KeyExistsError:
            pass  # another rank wrote it first: it holds the same manifest
        with translate_redis_errors(f"mark step {step} durable", self.index.url):
            self._durable(keys=[ks["step"]], args=[ks["events"], step])
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
        with translate_redis_errors(f"expire step {step} of {model}", self.index.url):
            return _s(self._expire(keys=[self._keys(model, step)["step"]], args=[]))

    def require_committed(self, model: str, step: int, timeout: float | None = None) -> str:
        state = self.wait(model, step, timeout)
        if state == "aborted":
            raise StepAbortedError(f"step {step} of {model} was aborted", model=model, step=step)
        return state


__all__ += ["MANIFEST_VERSION"]
