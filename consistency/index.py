"""The Redis index: schema, connection, object records and placement.

Every key of a model carries the hash tag ``{model}`` so that all of a
model's keys live in one Redis Cluster slot and the Lua scripts that touch
several of them stay atomic there. The schema (``m`` is the model name)::

    ts:models                      SET    model names
    ts:{m}:epoch                   STRING the job's current epoch (fencing)
    ts:{m}:objs                    ZSET   "layer/step/rank" scored by step
    ts:{m}:byrank                  ZSET   "<rank>/layer/step/rank", all scored 0: the same objects, one
                                          rank's a ZRANGEBYLEX (retention lists its own rank's alone)
    ts:{m}:xlinks                  STRING "1" once a record links otherwise than rank-locally (a ref to
                                          another step, a delta on another rank or on a ref): retention
                                          then lists every rank's objects (ObjectIndex.list_rank_objects)
    ts:{m}:obj:<layer>/<step>/<rank>
                                   HASH   kind, size, checksum, base, target, epoch,
                                          created, name (the live copy's physical name),
                                          pinned (a committed manifest of another step
                                          reads it), t:<tier> = "1" per tier holding it
    ts:{m}:steps                   ZSET   step numbers scored by step (exact: steps <= 2**53 - 1)
    ts:{m}:step:<N>                HASH   state, world, epoch, attempt, started, decided, durable,
                                          memory_only, ...
    ts:{m}:votes:<N>               HASH   rank -> the vote's manifest part ('"<rank>":<JSON vote>')
    ts:{m}:vinfo:<N>               HASH   rank -> the vote's summary (layers, older links), until the decision
    ts:{m}:manifest:<N>            STRING the committed manifest (JSON)
    ts:{m}:events                  pub/sub channel: "<step> <state>"
    ts:{m}:decided                 pub/sub channel: "<step> <state> <started>" (StepProtocol.wait)
    ts:{m}:sync                    STRING a counter written before each WAIT (see :mod:`consistency.cluster`)
    ts:{m}:incarnations            HASH   job incarnation token -> its epoch (StepProtocol.join_epoch)
    ts:{m}:progress                HASH   rank -> "<epoch> <step>": the newest step it began saving
    ts:{m}:retired                 HASH   physical name -> a superseded step's copy, kept until a newer
                                          durable step (see :mod:`consistency.retired`)
    ts:{m}:retention               HASH   what the retention passes retired (StepRecords.note_retention)
    ts:{m}:pins                    HASH   label (a checkpoint path) -> a step every retention pass keeps
                                          (StepRecords.pin), or "B,A,...": the steps an index rebuild found
                                          durable pin records of for the label, its own first
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

The modules: :mod:`consistency.client` (the connection, key names, replica
acknowledgements, the translation of redis-py errors into
:class:`TierUnavailableError`, :class:`AccessDeniedError`, :class:`FencedError`),
:mod:`consistency.objects` (object records and placement), :mod:`consistency.retired`
(copies of superseded steps), and this one (models
and epochs; :class:`Index` is the one class callers use).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from typing import Any

from consistency.client import MODELS, _s, redact_url, translate_redis_errors
from consistency.cluster import acked
from consistency.objects import KINDS, ObjectRecord
from consistency.retired import RetiredIndex
from tierstore.keys import validate_name

__all__ = ["KINDS", "Index", "ObjectRecord", "redact_url", "translate_redis_errors"]

# Raise a model's epoch to at least ARGV[1]; never lowers it. KEYS: epoch. Returns the epoch.
_RAISE_EPOCH = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
local want = tonumber(ARGV[1])
if want > cur then redis.call('SET', KEYS[1], want); return want end
return cur
"""


class Index(RetiredIndex):
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

    @cached_property
    def _raise_epoch(self) -> Any:
        return self._r.register_script(_RAISE_EPOCH)

    def wrapped(self, wrap: Callable[[Any], Any]) -> Index:
        """A new :class:`Index` over ``wrap(client)`` (fault injection wraps the client this way)."""
        return Index(self.url, client=wrap(self._r), replicas=self._replicas,
                     replica_timeout_s=self.replica_timeout_s)

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

    # -- a model's whole record (consistency.lifecycle) ------------------------------------
    def model_keys(self, model: str) -> list[str]:
        """Every index key of ``model`` (its hash tag), for :func:`consistency.lifecycle.delete_model`."""
        validate_name(model, "model")
        with translate_redis_errors(f"list the keys of model {model}", self.url):
            return sorted(_s(k) for k in self._r.scan_iter(match=f"{self._k(model)}:*", count=1000))

    def drop_model(self, model: str) -> int:
        """Delete every index key of ``model`` and its entry in the models list; return the keys deleted.

        Only :func:`consistency.lifecycle.delete_model` calls this (after the durable manifests went).
        """
        keys = self.model_keys(model)
        with translate_redis_errors(f"delete model {model} from the index", self.url):
            pipe = self._r.pipeline(transaction=False)
            for k in keys:
                pipe.delete(k)  # one key per DEL: a cluster pipeline refuses multi-key DEL
            pipe.execute()
            self._r.srem(MODELS, model)
        self._listed.discard(model)  # a new model of the same name is listed again by its first record
        return len(keys)
