"""The Redis index: schema, connection, object records and placement.

Every key of a model carries the hash tag ``{model}`` so that all of a
model's keys live in one Redis Cluster slot and the Lua scripts that touch
several of them stay atomic there. The schema (``m`` is the model name)::

    ts:models                      SET    model names
    ts:{m}:epoch                   STRING the job's current epoch (fencing)
    ts:{m}:objs                    ZSET   "layer/step/rank" scored by step
    ts:{m}:obj:<layer>/<step>/<rank>
                                   HASH   kind, size, checksum, base, target, epoch,
                                          created, name (the live copy's physical name),
                                          pinned (a committed manifest of another step
                                          reads it), t:<tier> = "1" per tier holding it
    ts:{m}:steps                   ZSET   step numbers scored by step (exact: steps <= 2**53 - 1)
    ts:{m}:step:<N>                HASH   state, world, epoch, attempt, started, decided, durable,
                                          memory_only, ...
    ts:{m}:votes:<N>               HASH   rank -> JSON vote
    ts:{m}:manifest:<N>            STRING the committed manifest (JSON)
    ts:{m}:events                  pub/sub channel: "<step> <state>"
    ts:{m}:sync                    STRING a counter written before each WAIT (see :mod:`consistency.cluster`)
    ts:{m}:incarnations            HASH   job incarnation token -> its epoch (StepProtocol.join_epoch)
    ts:{m}:progress                HASH   rank -> "<epoch> <step>": the newest step it began saving
    ts:node:<id>                   HASH   a node agent's registration (TTL), see :mod:`consistency.nodes`
    ts:nodes                       SET    registered node ids

The index may be one server or a Redis Cluster (a seed URL of any node is
detected; ``redis+cluster://`` forces it); when it is replicated, state
changes are acknowledged by its replicas before they are reported. Both are
:mod:`consistency.cluster`'s.

Only ``consistency/`` knows these keys and holds the client (``Index._r``,
package-private): every other module calls a named operation of
:class:`Index`, :class:`~consistency.twophase.StepProtocol` or
:class:`~consistency.nodes.NodeRegistry`.

Errors from redis-py are translated here into :class:`TierUnavailableError`
(server gone), :class:`AccessDeniedError` (AUTH) and :class:`FencedError`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any
from urllib.parse import urlparse

import redis
from redis.cluster import RedisCluster

from consistency.cluster import CLUSTER_SCHEMES, acked, connect, replica_count
from tierstore.errors import (
    AccessDeniedError,
    ConfigError,
    FencedError,
    StepCommittedError,
    TierStoreError,
    TierUnavailableError,
)
from tierstore.keys import ShardKey, object_name, validate_name

__all__ = ["KINDS", "Index", "ObjectRecord", "redact_url", "translate_redis_errors"]

_FENCED = "TSFENCED"
_COMMITTED = "TSCOMMITTED"
KINDS = ("full", "delta", "ref")
MODELS = "ts:models"

# Raise a model's epoch to at least ARGV[1]; never lowers it. KEYS: epoch. Returns the epoch.
_RAISE_EPOCH = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
local want = tonumber(ARGV[1])
if want > cur then redis.call('SET', KEYS[1], want); return want end
return cur
"""

# Record an object and its placement: refuse a stale epoch, and refuse to replace the record of a key of a
# committed step or of one a committed manifest reads (pinned): committed keys are create-once. KEYS: epoch,
# objs, obj, step (the key's step record). ARGV: epoch, objname, step, kind, size, checksum, base, target,
# created, name, restore ("1": re-recording what a durable manifest proves), tier... Returns the physical name
# of the copy the old record named ('' if none, '=' if that is the same copy).
_RECORD = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
local ep = tonumber(ARGV[1])
if ep >= 0 and ep < cur then return redis.error_reply('TSFENCED ' .. cur) end
local old = ''
if redis.call('EXISTS', KEYS[3]) == 1 then
  old = redis.call('HGET', KEYS[3], 'name') or ''
  if old == '' then old = '-' end
end
if ARGV[11] ~= '1' then
  local st = redis.call('HGET', KEYS[4], 'state')
  if st == 'committed' or st == 'durable' then
    return redis.error_reply('TSCOMMITTED step ' .. ARGV[3] .. ' is ' .. st .. ': ' .. ARGV[2] .. ' cannot be written again')
  end
  local pin = redis.call('HGET', KEYS[3], 'pinned')
  if pin then
    return redis.error_reply('TSCOMMITTED ' .. ARGV[2] .. ' is read by committed step ' .. pin)
  end
end
local pinned = redis.call('HGET', KEYS[3], 'pinned')
if old == ARGV[10] then old = '=' end
redis.call('DEL', KEYS[3])
redis.call('ZADD', KEYS[2], tonumber(ARGV[3]), ARGV[2])
redis.call('HSET', KEYS[3], 'kind', ARGV[4], 'size', ARGV[5], 'checksum', ARGV[6], 'base', ARGV[7],
           'target', ARGV[8], 'epoch', ARGV[1], 'created', ARGV[9], 'name', ARGV[10])
if pinned and old == '=' then redis.call('HSET', KEYS[3], 'pinned', pinned) end
for i = 12, #ARGV do redis.call('HSET', KEYS[3], 't:' .. ARGV[i], '1') end
return old
"""

# Set (ARGV[3] == '1') or clear a tier flag of a record, only while the record names the copy ARGV[2]
# (a copy of a replaced record must not be credited to the live one). KEYS: obj. ARGV: tier, name, set.
_TIER = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local name = redis.call('HGET', KEYS[1], 'name') or ''
if ARGV[2] ~= '' and name ~= '' and name ~= ARGV[2] then return 0 end
if ARGV[3] == '1' then redis.call('HSET', KEYS[1], 't:' .. ARGV[1], '1')
else redis.call('HDEL', KEYS[1], 't:' .. ARGV[1]) end
return 1
"""

# Set one field of an existing record. KEYS: obj. ARGV: field, value.
_ANNOTATE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""

# Pin existing records: a committed manifest of step ARGV[1] reads them. KEYS: obj...
_PIN = """
for i = 1, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then redis.call('HSETNX', KEYS[i], 'pinned', ARGV[1]) end
end
return #KEYS
"""

# Delete a record (and its member of objs), only while it names the copy ARGV[2] ('' : whatever it names).
# KEYS: objs, obj. ARGV: objname, name. Returns 1 if deleted.
_DELETE = """
if ARGV[2] ~= '' then
  local name = redis.call('HGET', KEYS[2], 'name') or ''
  if redis.call('EXISTS', KEYS[2]) == 1 and name ~= '' and name ~= ARGV[2] then return 0 end
end
redis.call('ZREM', KEYS[1], ARGV[1])
return redis.call('DEL', KEYS[2])
"""


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (safe to log)."""
    p = urlparse(url)
    if p.password:
        netloc = p.netloc.replace(f":{p.password}@", ":***@")
        return p._replace(netloc=netloc).geturl()
    return url


@contextmanager
def translate_redis_errors(what: str, url: str = "") -> Iterator[None]:
    """Translate redis-py errors into tierstore's tree, keeping the cause."""
    try:
        yield
    except TierStoreError:
        raise  # already translated (the client connects lazily, inside another operation's translation)
    except redis.exceptions.AuthenticationError as e:
        raise AccessDeniedError(f"{what}: the index server refused the credentials", url=redact_url(url)) from e
    except redis.exceptions.NoPermissionError as e:
        raise AccessDeniedError(f"{what}: no permission on the index server: {e}", url=redact_url(url)) from e
    except redis.exceptions.ResponseError as e:
        msg = str(e)
        if msg.startswith(_FENCED):
            current = int(msg.split()[1]) if len(msg.split()) > 1 else None
            raise FencedError(f"{what}: rejected, the job's epoch is now {current}", epoch=current) from e
        if msg.startswith(_COMMITTED):
            raise StepCommittedError(f"{what}: {msg.split(' ', 1)[1]} (a committed step is immutable)") from e
        if "NOAUTH" in msg or "WRONGPASS" in msg:
            raise AccessDeniedError(f"{what}: the index server needs valid credentials", url=redact_url(url)) from e
        raise TierUnavailableError(f"{what}: the index server answered an error: {e}", url=redact_url(url)) from e
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError,
            redis.exceptions.RedisClusterException) as e:
        raise TierUnavailableError(
            f"{what}: the index server at {redact_url(url)} cannot be reached ({e})", url=redact_url(url)
        ) from e


@dataclass(frozen=True)
class ObjectRecord:
    """One stored object: what the index records of it, what a put returns, what a vote carries.

    The one descriptor of an object across the project (the store returns it,
    votes and manifests carry its JSON, the read path resolves to it).
    ``tiers`` are the tiers recorded as holding a copy; ``name`` is the
    physical name of that copy in every tier (:func:`tierstore.keys.object_name`:
    the key plus a tag unique to the write; the plain key for copies written
    before tags).
    """

    key: ShardKey
    kind: str
    size: int
    checksum: str
    base: ShardKey | None = None
    target: ShardKey | None = None
    epoch: int = 0
    created: float = 0.0
    tiers: frozenset[str] = field(default_factory=frozenset)
    name: str = ""

    def __post_init__(self) -> None:
        if not self.name:
            object.__setattr__(self, "name", str(self.key))

    def to_json(self) -> dict[str, Any]:
        """The entry a vote and a manifest carry (see :mod:`consistency.manifest`)."""
        return {
            "key": str(self.key),
            "kind": self.kind,
            "size": self.size,
            "checksum": self.checksum,
            "base": str(self.base) if self.base else None,
            "target": str(self.target) if self.target else None,
            "epoch": self.epoch,
            "tiers": sorted(self.tiers),
            "name": self.name,
        }

    @classmethod
    def from_json(cls, o: dict[str, Any]) -> ObjectRecord:
        """The record of a manifest entry (validated by :func:`consistency.manifest.parse_manifest`)."""
        return cls(
            key=ShardKey.parse(o["key"]),
            kind=o["kind"],
            size=int(o["size"]),
            checksum=o["checksum"],
            base=ShardKey.parse(o["base"]) if o.get("base") else None,
            target=ShardKey.parse(o["target"]) if o.get("target") else None,
            epoch=int(o.get("epoch") or 0),
            tiers=frozenset(o.get("tiers") or ()),
            name=o.get("name") or "",
        )


def _s(v: bytes | str | None) -> str:
    if v is None:
        return ""
    return v.decode() if isinstance(v, bytes) else v


class Index:
    """A connection to the index server: models, epochs, object records and placement.

    Thread-safe (redis-py pools connections). The raw client is
    package-private to ``consistency/``; it connects on first use (a server
    that is not up yet fails the first operation, typed, not the constructor).

    Args:
        url: ``redis://[user:pass@]host:port/db``, ``rediss://...`` (TLS),
            ``unix:///path/to/socket``, or ``redis+cluster://host:port`` /
            ``rediss+cluster://...`` to force a Redis Cluster client. A plain
            ``redis://`` seed of a cluster node is detected as a cluster
            (``INFO cluster``). A password may also come from ``password``.
        password: AUTH password (overrides the URL's).
        client: an existing redis-py client (``Redis`` or ``RedisCluster``) to use instead.
        socket_timeout: seconds a command may take (raised past ``replica_timeout_s`` when acks are on).
        ssl_ca_certs: CA bundle for ``rediss://``.
        replicas: replicas that must acknowledge a state change before it is
            reported (``WAIT``); ``None``: 1 if the index is replicated (every
            slot-serving primary has a replica online, or a single server has
            a connected replica) when first needed, else 0.
        replica_timeout_s: how long a state change waits for its acknowledgements
            before it fails with :class:`~tierstore.errors.ReplicaAckError`.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        password: str | None = None,
        client: redis.Redis | RedisCluster | None = None,
        socket_timeout: float = 10.0,
        ssl_ca_certs: str | None = None,
        replicas: int | None = None,
        replica_timeout_s: float = 2.0,
    ) -> None:
        self.url = url or ""
        if replicas is not None and (isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0):
            raise ConfigError(f"replicas must be a non-negative int or None, got {replicas!r}")
        if not replica_timeout_s > 0:
            raise ConfigError(f"replica_timeout_s must be positive, got {replica_timeout_s!r}")
        self._replicas = replicas
        self.replica_timeout_s = float(replica_timeout_s)
        self._lock = threading.Lock()
        self._listed: set[str] = set()  # models this instance added to ts:models
        self._client = client
        self._kwargs: dict[str, Any] = {}
        if client is None:
            if not url:
                raise ConfigError("the index needs a URL (redis://, rediss://, unix://) or a client")
            scheme = urlparse(url).scheme
            if scheme not in ("redis", "rediss", "unix", *CLUSTER_SCHEMES):
                raise ConfigError(f"unsupported index URL scheme {scheme!r} in {redact_url(url)}")
            kwargs: dict[str, Any] = {"socket_timeout": max(socket_timeout, replica_timeout_s + 5.0),
                                      "health_check_interval": 30}
            if password is not None:
                kwargs["password"] = password
            if scheme.startswith("rediss") and ssl_ca_certs:
                kwargs["ssl_ca_certs"] = ssl_ca_certs
            self._kwargs = kwargs

    @property
    def _r(self) -> Any:
        """The redis-py client (``Redis`` or ``RedisCluster``), connected on first use."""
        c = self._client
        if c is None:
            with self._lock:
                if self._client is None:
                    with translate_redis_errors("connect to the index", self.url):
                        self._client = connect(self.url, self._kwargs)
                c = self._client
        return c

    @property
    def is_cluster(self) -> bool:
        """Whether the index is a Redis Cluster."""
        return isinstance(self._r, RedisCluster)

    @property
    def replicas(self) -> int:
        """Replica acknowledgements each state change waits for (auto-detected on first use if not given)."""
        if self._replicas is None:
            with translate_redis_errors("count the index's replicas", self.url):
                self._replicas = min(1, replica_count(self._r))
        return self._replicas

    @cached_property
    def _record(self) -> Any:
        return self._r.register_script(_RECORD)

    @cached_property
    def _raise_epoch(self) -> Any:
        return self._r.register_script(_RAISE_EPOCH)

    @cached_property
    def _tier(self) -> Any:
        return self._r.register_script(_TIER)

    @cached_property
    def _delete(self) -> Any:
        return self._r.register_script(_DELETE)

    @cached_property
    def _pin(self) -> Any:
        return self._r.register_script(_PIN)

    @cached_property
    def _annotate(self) -> Any:
        return self._r.register_script(_ANNOTATE)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    def wrapped(self, wrap: Callable[[Any], Any]) -> Index:
        """A new :class:`Index` over ``wrap(client)`` (fault injection wraps the client this way)."""
        return Index(self.url, client=wrap(self._r), replicas=self._replicas,
                     replica_timeout_s=self.replica_timeout_s)

    # -- replica-acknowledged writes (see consistency.cluster) ------------------------
    def run_script(self, script: Any, keys: Sequence[str], args: Sequence[Any], *, ack: bool = True,
                   what: str = "index write") -> Any:
        """Run a registered Lua script over ``keys`` (all of one model); with ``ack``, on a replicated
        index, return only once the replicas acknowledged it and everything it read.

        Raises:
            ReplicaAckError: too few replicas acknowledged in time (the primary has it; not acknowledged).
            redis.exceptions.RedisError: as the script does (callers translate).
        """
        if not ack or self.replicas == 0:
            return script(keys=list(keys), args=list(args))
        out = acked(self._r, keys[0], self._sync_key(keys[0]),
                    lambda p: p.evalsha(script.sha, len(keys), *keys, *args), replicas=self.replicas,
                    timeout_s=self.replica_timeout_s, what=what, scripts=(script,))
        if isinstance(out[0], Exception):
            raise out[0]
        return out[0]

    def sync(self, model: str, what: str = "acknowledge") -> None:
        """Return once the replicas have every write ``model``'s primary applied so far (no-op unreplicated).

        Raises:
            ReplicaAckError: too few replicas acknowledged within the timeout.
            TierUnavailableError: the index cannot be reached.
        """
        if self.replicas == 0:
            return
        with translate_redis_errors(f"{what} ({model})", self.url):
            acked(self._r, self._k(model, "sync"), self._k(model, "sync"), lambda p: None, replicas=self.replicas,
                  timeout_s=self.replica_timeout_s, what=f"{what} ({model})")

    @staticmethod
    def _sync_key(key: str) -> str:
        """The sync counter of the model whose key (``ts:{model}:...``) is given."""
        return key[: key.index("}") + 1] + ":sync"

    # -- keys (package-private: the schema above) ------------------------------------
    @staticmethod
    def _k(model: str, *parts: object) -> str:
        return ":".join([f"ts:{{{model}}}", *map(str, parts)])

    @staticmethod
    def _objname(key: ShardKey) -> str:
        return f"{key.layer}/{key.step}/{key.rank}"

    def ping(self) -> None:
        with translate_redis_errors("ping", self.url):
            self._r.ping()

    def server_time(self) -> float:
        """The index server's clock (``TIME``), in seconds since the epoch."""
        with translate_redis_errors("read server time", self.url):
            sec, usec = self._r.time()
        return sec + usec / 1e6

    # -- models and epochs -----------------------------------------------------------
    def models(self) -> list[str]:
        with translate_redis_errors("list models", self.url):
            return sorted(_s(m) for m in self._r.smembers(MODELS))

    def register_model(self, model: str) -> None:
        """Add ``model`` to the list of models (idempotent)."""
        validate_name(model, "model")
        with translate_redis_errors(f"register model {model}", self.url):
            self._r.sadd(MODELS, model)

    def knows(self, model: str) -> bool:
        """Whether the index holds any record of ``model`` (an epoch, a step or an object)."""
        validate_name(model, "model")
        with translate_redis_errors(f"look up model {model}", self.url):
            return bool(self._r.exists(self._k(model, "epoch"), self._k(model, "steps"), self._k(model, "objs")))

    def epoch(self, model: str) -> int:
        with translate_redis_errors("read epoch", self.url):
            return int(self._r.get(self._k(model, "epoch")) or 0)

    def bump_epoch(self, model: str) -> int:
        """Start a new incarnation of the job: older epochs are fenced from now on."""
        validate_name(model, "model")
        with translate_redis_errors("bump epoch", self.url):
            self._r.sadd(MODELS, model)
            key = self._k(model, "epoch")
            if self.replicas == 0:
                return int(self._r.incr(key))
            out = acked(self._r, key, self._k(model, "sync"), lambda p: p.incr(key), replicas=self.replicas,
                        timeout_s=self.replica_timeout_s, what=f"bump the epoch of {model}")
            if isinstance(out[0], Exception):
                raise out[0]
            return int(out[0])

    def raise_epoch(self, model: str, at_least: int) -> int:
        """Raise ``model``'s epoch to at least ``at_least`` (never lowers it); return the epoch."""
        validate_name(model, "model")
        with translate_redis_errors(f"raise epoch of {model}", self.url):
            self._r.sadd(MODELS, model)
            return int(self.run_script(self._raise_epoch, [self._k(model, "epoch")], [int(at_least)],
                                       what=f"raise the epoch of {model}"))

    # -- objects -------------------------------------------------------------------
    def record_object(
        self,
        key: ShardKey,
        *,
        kind: str,
        size: int,
        checksum: str,
        tiers: list[str],
        base: ShardKey | None = None,
        target: ShardKey | None = None,
        epoch: int | None = None,
        name: str | None = None,
        restore: bool = False,
    ) -> str | None:
        """Record an object, the physical ``name`` of its copy and the tiers holding it.

        Refused with :class:`FencedError` if ``epoch`` is stale, and with
        :class:`StepCommittedError` if the key's step is committed or a committed
        manifest reads the key (committed keys are create-once; ``restore``,
        for an index rebuild, re-records what a durable manifest proves).

        Returns:
            the physical name of the copy the replaced record named, when it is
            another copy (the caller deletes it: nothing committed reads it), else ``None``.
        """
        m = key.model
        name = name or str(key)
        with translate_redis_errors(f"record {key}", self.url):
            if m not in self._listed:  # ts:models lives outside the model's slot: one SADD per model and client
                self._r.sadd(MODELS, m)
                self._listed.add(m)
            old = _s(self._record(
                keys=[self._k(m, "epoch"), self._k(m, "objs"), self._k(m, "obj", self._objname(key)),
                      self._k(m, "step", key.step)],
                args=[
                    -1 if epoch is None else epoch,
                    self._objname(key),
                    key.step,
                    kind,
                    size,
                    checksum,
                    str(base) if base else "",
                    str(target) if target else "",
                    repr(time.time()),
                    name,
                    "1" if restore else "0",
                    *tiers,
                ],
            ))
        if old in ("", "="):
            return None
        return str(key) if old == "-" else old

    def add_tier(self, key: ShardKey, tier: str, *, name: str | None = None) -> bool:
        """Record that ``tier`` holds the copy ``name`` (default: whatever copy the record names).

        Returns whether the record (still) names that copy and was updated.
        """
        with translate_redis_errors(f"add tier {tier} to {key}", self.url):
            return bool(self._tier(keys=[self._k(key.model, "obj", self._objname(key))], args=[tier, name or "", "1"]))

    def remove_tier(self, key: ShardKey, tier: str, *, name: str | None = None) -> bool:
        with translate_redis_errors(f"remove tier {tier} from {key}", self.url):
            return bool(self._tier(keys=[self._k(key.model, "obj", self._objname(key))], args=[tier, name or "", "0"]))

    def set_object_field(self, key: ShardKey, field_name: str, value: str) -> None:
        """Annotate the record of ``key`` (if it exists: never creates one)."""
        with translate_redis_errors(f"annotate {key}", self.url):
            self._annotate(keys=[self._k(key.model, "obj", self._objname(key))], args=[field_name, value])

    def get_object(self, key: ShardKey) -> ObjectRecord | None:
        with translate_redis_errors(f"read record of {key}", self.url):
            h = self._r.hgetall(self._k(key.model, "obj", self._objname(key)))
        return self._parse_record(key, h) if h else None

    def get_objects(self, keys: list[ShardKey]) -> list[ObjectRecord | None]:
        with translate_redis_errors("read records", self.url):
            pipe = self._r.pipeline(transaction=False)
            for key in keys:
                pipe.hgetall(self._k(key.model, "obj", self._objname(key)))
            rows = pipe.execute()
        return [self._parse_record(k, h) if h else None for k, h in zip(keys, rows)]

    @staticmethod
    def _parse_record(key: ShardKey, h: dict) -> ObjectRecord:
        d = {_s(k): _s(v) for k, v in h.items()}
        return ObjectRecord(
            key=key,
            kind=d.get("kind", "full"),
            size=int(d.get("size") or 0),
            checksum=d.get("checksum", ""),
            base=ShardKey.parse(d["base"]) if d.get("base") else None,
            target=ShardKey.parse(d["target"]) if d.get("target") else None,
            epoch=int(d.get("epoch") or 0),
            created=float(d.get("created") or 0.0),
            tiers=frozenset(k[2:] for k in d if k.startswith("t:")),
            name=d.get("name") or object_name(key),
        )

    def delete_object(self, key: ShardKey, *, name: str | None = None) -> bool:
        """Delete the record of ``key``; with ``name``, only while it names that copy. Returns whether it went."""
        with translate_redis_errors(f"delete record of {key}", self.url):
            return bool(self._delete(keys=[self._k(key.model, "objs"), self._k(key.model, "obj", self._objname(key))],
                                     args=[self._objname(key), name or ""]))

    def pin_objects(self, keys: list[ShardKey], step: int) -> None:
        """Mark records as read by committed ``step`` (they can no longer be replaced; see :meth:`record_object`)."""
        if not keys:
            return
        by_model: dict[str, list[str]] = {}
        for key in keys:
            by_model.setdefault(key.model, []).append(self._k(key.model, "obj", self._objname(key)))
        with translate_redis_errors("pin records", self.url):
            for okeys in by_model.values():  # one model's keys share a slot
                self._pin(keys=okeys, args=[step])

    def list_objects(
        self, model: str, layer: str | None = None, step: int | None = None, rank: int | None = None
    ) -> list[ShardKey]:
        """Keys recorded for ``model``, filtered; sorted by (layer, step, rank)."""
        validate_name(model, "model")
        with translate_redis_errors(f"list objects of {model}", self.url):
            if step is None:
                names = self._r.zrange(self._k(model, "objs"), 0, -1)
            else:
                names = self._r.zrangebyscore(self._k(model, "objs"), step, step)
        out = []
        for n in names:
            lay, st, rk = _s(n).split("/")  # type: ignore[arg-type]
            if layer is not None and lay != layer:
                continue
            if rank is not None and int(rk) != rank:
                continue
            out.append(ShardKey(model, lay, int(st), int(rk)))
        return sorted(out, key=lambda k: (k.layer, k.step, k.rank))
