"""The Redis index: schema, connection, object records and placement.

Every key of a model carries the hash tag ``{model}`` so that all of a
model's keys live in one Redis Cluster slot and the Lua scripts that touch
several of them stay atomic there. The schema (``m`` is the model name)::

    ts:models                      SET    model names
    ts:{m}:epoch                   STRING the job's current epoch (fencing)
    ts:{m}:objs                    ZSET   "layer/step/rank" scored by step
    ts:{m}:obj:<layer>/<step>/<rank>
                                   HASH   kind, size, checksum, base, target, epoch,
                                          created, t:<tier> = "1" per tier holding it
    ts:{m}:steps                   ZSET   step numbers scored by step
    ts:{m}:step:<N>                HASH   state, world, epoch, started, decided, durable, ...
    ts:{m}:votes:<N>               HASH   rank -> JSON vote
    ts:{m}:manifest:<N>            STRING the committed manifest (JSON)
    ts:{m}:events                  pub/sub channel: "<step> <state>"
    ts:node:<id>                   HASH   a node agent's registration (TTL), see :mod:`consistency.nodes`
    ts:nodes                       SET    registered node ids

Only ``consistency/`` knows these keys and holds the client (``Index._r``,
package-private): every other module calls a named operation of
:class:`Index`, :class:`~consistency.twophase.StepProtocol` or
:class:`~consistency.nodes.NodeRegistry`.

Errors from redis-py are translated here into :class:`TierUnavailableError`
(server gone), :class:`AccessDeniedError` (AUTH) and :class:`FencedError`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import redis

from tierstore.errors import (
    AccessDeniedError,
    ConfigError,
    FencedError,
    TierUnavailableError,
)
from tierstore.keys import ShardKey, validate_name

__all__ = ["KINDS", "Index", "ObjectRecord", "redact_url", "translate_redis_errors"]

_FENCED = "TSFENCED"
KINDS = ("full", "delta", "ref")
MODELS = "ts:models"

# Raise a model's epoch to at least ARGV[1]; never lowers it. KEYS: epoch. Returns the epoch.
_RAISE_EPOCH = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
local want = tonumber(ARGV[1])
if want > cur then redis.call('SET', KEYS[1], want); return want end
return cur
"""

# Record an object and its placement, refusing a stale epoch. KEYS: epoch, objs, obj. ARGV: epoch,
# objname, step, kind, size, checksum, base, target, created, tier...
_RECORD = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
local ep = tonumber(ARGV[1])
if ep >= 0 and ep < cur then return redis.error_reply('TSFENCED ' .. cur) end
redis.call('ZADD', KEYS[2], tonumber(ARGV[3]), ARGV[2])
redis.call('HSET', KEYS[3], 'kind', ARGV[4], 'size', ARGV[5], 'checksum', ARGV[6], 'base', ARGV[7],
           'target', ARGV[8], 'epoch', ARGV[1], 'created', ARGV[9])
for i = 10, #ARGV do redis.call('HSET', KEYS[3], 't:' .. ARGV[i], '1') end
return cur
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
    except redis.exceptions.AuthenticationError as e:
        raise AccessDeniedError(f"{what}: the index server refused the credentials", url=redact_url(url)) from e
    except redis.exceptions.NoPermissionError as e:
        raise AccessDeniedError(f"{what}: no permission on the index server: {e}", url=redact_url(url)) from e
    except redis.exceptions.ResponseError as e:
        msg = str(e)
        if msg.startswith(_FENCED):
            current = int(msg.split()[1]) if len(msg.split()) > 1 else None
            raise FencedError(f"{what}: rejected, the job's epoch is now {current}", epoch=current) from e
        if "NOAUTH" in msg or "WRONGPASS" in msg:
            raise AccessDeniedError(f"{what}: the index server needs valid credentials", url=redact_url(url)) from e
        raise TierUnavailableError(f"{what}: the index server answered an error: {e}", url=redact_url(url)) from e
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as e:
        raise TierUnavailableError(
            f"{what}: the index server at {redact_url(url)} cannot be reached ({e})", url=redact_url(url)
        ) from e


@dataclass(frozen=True)
class ObjectRecord:
    """One stored object: what the index records of it, what a put returns, what a vote carries.

    The one descriptor of an object across the project (the store returns it,
    votes and manifests carry its JSON, the read path resolves to it).
    ``tiers`` are the tiers recorded as holding a copy.
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
        )


def _s(v: bytes | str | None) -> str:
    if v is None:
        return ""
    return v.decode() if isinstance(v, bytes) else v


class Index:
    """A connection to the index server: models, epochs, object records and placement.

    Thread-safe (redis-py pools connections). The raw client is
    package-private to ``consistency/``.

    Args:
        url: ``redis://[user:pass@]host:port/db``, ``rediss://...`` (TLS) or
            ``unix:///path/to/socket``. A password may also come from ``password``.
        password: AUTH password (overrides the URL's).
        client: an existing redis-py client to use instead (tests, clusters).
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        password: str | None = None,
        client: redis.Redis | None = None,
        socket_timeout: float = 10.0,
        ssl_ca_certs: str | None = None,
    ) -> None:
        self.url = url or ""
        if client is None:
            if not url:
                raise ConfigError("the index needs a URL (redis://, rediss:// or unix://) or a client")
            scheme = urlparse(url).scheme
            if scheme not in ("redis", "rediss", "unix"):
                raise ConfigError(f"unsupported index URL scheme {scheme!r} in {redact_url(url)}")
            kwargs: dict[str, Any] = {"socket_timeout": socket_timeout, "health_check_interval": 30}
            if password is not None:
                kwargs["password"] = password
            if scheme == "rediss" and ssl_ca_certs:
                kwargs["ssl_ca_certs"] = ssl_ca_certs
            client = redis.Redis.from_url(url, **kwargs)
        self._r = client
        self._record = self._r.register_script(_RECORD)
        self._raise_epoch = self._r.register_script(_RAISE_EPOCH)

    def close(self) -> None:
        self._r.close()

    def wrapped(self, wrap: Callable[[Any], Any]) -> Index:
        """A new :class:`Index` over ``wrap(client)`` (fault injection wraps the client this way)."""
        return Index(self.url, client=wrap(self._r))

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

    def epoch(self, model: str) -> int:
        with translate_redis_errors("read epoch", self.url):
            return int(self._r.get(self._k(model, "epoch")) or 0)

    def bump_epoch(self, model: str) -> int:
        """Start a new incarnation of the job: older epochs are fenced from now on."""
        validate_name(model, "model")
        with translate_redis_errors("bump epoch", self.url):
            self._r.sadd(MODELS, model)
            return int(self._r.incr(self._k(model, "epoch")))

    def raise_epoch(self, model: str, at_least: int) -> int:
        """Raise ``model``'s epoch to at least ``at_least`` (never lowers it); return the epoch."""
        validate_name(model, "model")
        with translate_redis_errors(f"raise epoch of {model}", self.url):
            self._r.sadd(MODELS, model)
            return int(self._raise_epoch(keys=[self._k(model, "epoch")], args=[int(at_least)]))

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
    ) -> None:
        """Record an object and the tiers holding it; refuse it if ``epoch`` is stale (``FencedError``)."""
        m = key.model
        with translate_redis_errors(f"record {key}", self.url):
            self._r.sadd(MODELS, m)
            self._record(
                keys=[self._k(m, "epoch"), self._k(m, "objs"), self._k(m, "obj", self._objname(key))],
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
                    *tiers,
                ],
            )

    def add_tier(self, key: ShardKey, tier: str) -> None:
        with translate_redis_errors(f"add tier {tier} to {key}", self.url):
            okey = self._k(key.model, "obj", self._objname(key))
            if self._r.exists(okey):
                self._r.hset(okey, f"t:{tier}", "1")

    def remove_tier(self, key: ShardKey, tier: str) -> None:
        with translate_redis_errors(f"remove tier {tier} from {key}", self.url):
            self._r.hdel(self._k(key.model, "obj", self._objname(key)), f"t:{tier}")

    def set_object_field(self, key: ShardKey, field_name: str, value: str) -> None:
        with translate_redis_errors(f"annotate {key}", self.url):
            self._r.hset(self._k(key.model, "obj", self._objname(key)), field_name, value)

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
        )

    def delete_object(self, key: ShardKey) -> None:
        with translate_redis_errors(f"delete record of {key}", self.url):
            pipe = self._r.pipeline(transaction=True)
            pipe.zrem(self._k(key.model, "objs"), self._objname(key))
            pipe.delete(self._k(key.model, "obj", self._objname(key)))
            pipe.execute()

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
