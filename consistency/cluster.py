"""Redis Cluster for the index, and writes acknowledged by the index's replicas.

Who calls what: :class:`consistency.index.Index` calls :func:`connect` once
(it returns the client: a plain ``redis.Redis`` or a ``RedisCluster``) and
:func:`replica_count` when the number of replicas to wait for is left to
auto-detection; its ``run_script``, ``sync`` and epoch operations call
:func:`acked` for every write that must reach the replicas before it is
reported. Nothing outside ``consistency/`` imports this module.

**Detection.** A ``redis+cluster://`` (or ``rediss+cluster://``) URL forces
a cluster client. A plain ``redis://`` / ``rediss://`` seed of any one node
is asked ``INFO cluster``; ``cluster_enabled:1`` makes it a cluster (the
client discovers the other nodes from it). ``unix://`` is never a cluster.

**Slots.** Every key of a model carries the hash tag ``{model}``, so a
model's keys, and every Lua script and transaction over them, live in one
slot. The node registry (``ts:node:<id>``, ``ts:nodes``) and ``ts:models``
live in other slots and are only touched by single-key commands or
non-transactional pipelines, which the cluster client splits per node.
Pub/sub: ``PUBLISH`` (from a script too) is broadcast to every node of a
cluster, and redis-py's ``ClusterPubSub`` subscribes on the node serving
the channel's slot, so ``ts:{model}:events`` works unchanged.

**Replica acknowledgement.** Redis replication is asynchronous: a step the
primary committed is lost if the primary fails before a replica has it and
the replica is promoted. So a state change that is reported (a vote's
outcome, a begun step, a durable mark, a new epoch) is followed, on the same
connection to the primary serving the model's slot and in the same round
trip, by ``INCR ts:{model}:sync`` and ``WAIT replicas timeout``. ``WAIT``
blocks until the replicas acknowledged every write this connection made, and
the replication stream is ordered, so the ``INCR`` (issued after the script
read the state it reports) covers that state and everything before it: the
other ranks' votes and object records included. Fewer acknowledgements than
asked within the timeout raise :class:`~tierstore.errors.ReplicaAckError`:
the primary has the change, a replica may not, and a failover may lose it,
so it is *not* acknowledged (a vote that raised it is not a commit).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

import redis
from redis.cluster import RedisCluster
from redis.exceptions import AskError, ClusterDownError, MovedError, NoScriptError, TryAgainError

from tierstore.errors import ConfigError, ReplicaAckError

__all__ = ["CLUSTER_SCHEMES", "acked", "connect", "is_cluster", "replica_count"]

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
_REDIRECTS = (MovedError, AskError, TryAgainError, ClusterDownError)
_ATTEMPTS = 4  # a MOVED/ASK/TRYAGAIN after a reshard or failover: refresh the slot map and try again


def _plain(url: str) -> tuple[str, bool]:
    """``url`` with a ``+cluster`` scheme made plain, and whether it forced a cluster."""
    p = urlparse(url)
    if p.scheme in CLUSTER_SCHEMES:
        return p._replace(scheme=CLUSTER_SCHEMES[p.scheme]).geturl(), True
    return url, False


def connect(url: str, kwargs: dict[str, Any]) -> redis.Redis | RedisCluster:
    """The client for ``url``: a cluster client if the URL forces one or its server is a cluster node.

    Raises:
        ConfigError: a cluster URL over a unix socket, or a database other than 0 on a cluster.
        redis.exceptions.RedisError: the probe failed (the caller translates it).
    """
    plain, forced = _plain(url)
    scheme = urlparse(plain).scheme
    if scheme == "unix":
        if forced:
            raise ConfigError("a Redis Cluster is reached over TCP (redis+cluster://host:port), not a unix socket")
        return redis.Redis.from_url(plain, **kwargs)
    db = urlparse(plain).path.strip("/")
    if not forced:
        probe = redis.Redis.from_url(urlparse(plain)._replace(path="").geturl(), **kwargs)  # db 0: a cluster has no other
        try:
            cluster = is_cluster(probe)
        finally:
            probe.close()
        if not cluster:
            return redis.Redis.from_url(plain, **kwargs)
    if db not in ("", "0"):
        raise ConfigError(f"a Redis Cluster has only database 0, the URL asks for {db!r}")
    kw = {k: v for k, v in kwargs.items() if k != "health_check_interval"}
    return RedisCluster.from_url(plain, **kw)


def is_cluster(client: redis.Redis) -> bool:
    """Whether the server behind ``client`` runs in cluster mode (``INFO cluster``)."""
    try:
        info = client.info("cluster")
    except redis.exceptions.ResponseError:  # a server that does not know the section
        return False
    return bool(int(info.get("cluster_enabled", 0) or 0))


def replica_count(client: redis.Redis | RedisCluster) -> int:
    """Replicas attached now: the fewest any slot-serving primary has (cluster), or the server's."""
    if isinstance(client, RedisCluster):
        counts = []
        for shard in client.cluster_shards():
            sh = _text_keys(shard)
            if not sh.get("slots"):
                continue  # a shard serving no slot holds no model
            nodes = [_text_keys(n) for n in sh.get("nodes") or []]
            counts.append(sum(1 for n in nodes if _text(n.get("role")) == "replica"
                              and _text(n.get("health")) == "online"))
        return min(counts, default=0)
    info = client.info("replication")
    return sum(1 for k, v in info.items() if k.startswith("slave") and isinstance(v, dict) and v.get("state") == "online")


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v or "")


def _text_keys(d: dict) -> dict[str, Any]:
    return {_text(k): v for k, v in d.items()}


def owner(client: redis.Redis | RedisCluster, key: str) -> redis.Redis:
    """The client of the primary serving ``key``'s slot (``client`` itself for a single server)."""
    if isinstance(client, RedisCluster):
        return client.get_redis_connection(client.get_node_from_key(key))
    return client


def _refresh(client: redis.Redis | RedisCluster) -> None:
    """Re-read the cluster's slot map (after a redirect or a lost node); a single server has none."""
    if isinstance(client, RedisCluster):
        try:
            client.nodes_manager.initialize()
        except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException):
            pass  # the next call tries again; the caller reports the original error


def acked(
    client: redis.Redis | RedisCluster,
    key: str,
    sync_key: str,
    build: Callable[[Any], None],
    *,
    replicas: int,
    timeout_s: float,
    what: str,
    scripts: tuple[Any, ...] = (),
) -> list[Any]:
    """Run ``build``'s commands on the primary serving ``key``, then ``INCR sync_key`` and ``WAIT``: one round trip.

    Args:
        client: the index's client.
        key: a key of the slot (all of ``build``'s keys and ``sync_key`` share its slot).
        sync_key: the slot's counter written after ``build`` so that ``WAIT`` covers what it read.
        build: adds the commands to a non-transactional pipeline (``EVALSHA`` of ``scripts`` allowed).
        replicas: acknowledgements to wait for (at least 1).
        timeout_s: ``WAIT``'s timeout.
        what: names the operation in errors.
        scripts: redis-py ``Script`` objects ``build`` calls by SHA (loaded on the node if missing).

    Returns:
        ``build``'s replies (an error reply is returned as its exception, for the caller to raise).

    Raises:
        ReplicaAckError: fewer than ``replicas`` replicas acknowledged within ``timeout_s``.
        redis.exceptions.RedisError: the node failed (the caller translates it); the slot map is refreshed first.
    """
    last: Exception | None = None
    for attempt in range(_ATTEMPTS):
        node = owner(client, key)
        pipe = node.pipeline(transaction=False)
        build(pipe)
        n = len(pipe.command_stack)
        pipe.incr(sync_key)
        pipe.wait(replicas, max(1, int(timeout_s * 1000)))
        try:
            out = pipe.execute(raise_on_error=False)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            _refresh(client)  # a failover: the next call finds the promoted replica
            raise
        errors = [r for r in out if isinstance(r, Exception)]
        if any(isinstance(e, NoScriptError) for e in errors):
            for s in scripts:
                node.script_load(s.script)
            continue
        redirect = next((e for e in errors if isinstance(e, _REDIRECTS)), None)
        if redirect is not None:
            last = redirect
            _refresh(client)
            time.sleep(0.05 * attempt)
            continue
        got = out[-1]
        replies = out[:n]
        if isinstance(got, Exception):
            raise got
        if int(got) < replicas:
            state = replies[0] if replies and not isinstance(replies[0], Exception) else None
            if isinstance(state, list):  # a script answering {state, ...}
                state = state[0] if state else None
            state = state.decode() if isinstance(state, bytes) else state
            raise ReplicaAckError(
                f"{what}: the index's primary applied it, but {got} of {replicas} replica(s) acknowledged it "
                f"within {timeout_s}s; it is not acknowledged (a failover may lose it)",
                wanted=replicas, acked=int(got), timeout_s=timeout_s, state=state)
        return replies
    assert last is not None
    raise last
