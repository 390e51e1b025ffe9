"""The node agent's leaves: its configuration, its digest cache and what a connection sees of it.

:class:`AgentConfig` and :class:`DigestCache` are used by :class:`tierstore.agent.server.Agent`;
:class:`AgentHost` is the part of the agent that a connection (:mod:`tierstore.agent.conn`) and the
drain of unasked messages (:mod:`tierstore.agent.unasked`) use, so they import this module and not the
agent's (no import circle: ``base`` <- ``conn``, ``unasked`` <- ``server``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

from backends import agent_protocol as P
from backends.base import Backend
from backends.host import HostBackend
from tierstore.errors import ConfigError

__all__ = ["AgentConfig", "AgentHost", "DigestCache", "log"]

#: the agent's logger (every module of :mod:`tierstore.agent` logs through it)
log = logging.getLogger("tierstore.agent")


@dataclass(frozen=True)
class AgentConfig:
    """Configuration of one node agent.

    Memory bound: before its first authentic request a connection holds two
    request-frame buffers (``2 * REQUEST_FRAME_SIZE``) and UCX's endpoint
    state, at most ``max_unauthenticated`` such connections at a time, each
    for at most ``handshake_timeout_s``; every connection also holds one
    16 KiB stream buffer. What peers send unasked is bounded in all by one
    progress step of the worker (unexpected tag messages are dropped after
    each; over TCP a step reads at most ``UCX_TCP_MAX_POLL`` times
    ``UCX_TCP_RX_SEG_SIZE``, 16 x 64 KiB, each message costing UCX up to a
    segment), and per connection by ``max_peer_unexpected_bytes`` of what
    can be traced to it (see :mod:`backends.ucx_server`). Only an authentic
    put reserves memory: one reservation of its object's size (at most
    ``max_object_bytes``) per channel, freed if its payload stalls
    ``header_timeout_s`` or takes longer than ``io_timeout_s``. Gets send
    from the stored mapping, without a copy.

    Attributes:
        node_id: this node's id (a validated name segment).
        host_root: the host tier's directory (normally below ``/dev/shm``).
        secret: the shared secret peers authenticate with (non-empty).
        port: UCX listener port; 0 picks a free one (printed when ready).
        host: the address advertised to peers in the registration.
        redis_url: where to register; ``None`` disables registration.
        capacity_bytes: the host tier's budget (``None``: unbounded).
        max_object_bytes: the largest object a put may carry.
        io_timeout_s: a request's payload must be through within this time.
        handshake_timeout_s: a new connection must send an authentic request within this time.
        idle_timeout_s: an authenticated connection with no request for this long is closed.
        header_timeout_s: after ``READY`` (and between payload chunks) the payload must progress within this.
        max_connections: connections served at once (lowered to what the fd limit fits).
        max_unauthenticated: connections without an authentic request yet; a new one evicts the oldest.
        sweep_interval_s: how often the agent also drains on a timer, besides after every progress step
            (0: never; the only drain where ucxx runs its own progress thread).
        max_peer_unexpected_bytes: what one connection may send unasked (tag messages under its session's
            tags, each costing its length plus :data:`UNEXPECTED_MESSAGE_COST`; stream bytes) before it is
            closed; a well-behaved peer sends none.
        report_interval_s: dropped messages are logged at most this often (one line with the totals).
        shm_lanes: offer same-host clients a shared-memory lane (see :mod:`backends.agent_protocol`);
            only while UCX's CMA transport is excluded (:func:`backends.ucx_util.cma_excluded`).
        ttl_s / heartbeat_s: registration TTL and its refresh period.
    """

    node_id: str
    host_root: str
    secret: bytes
    port: int = 0
    host: str = "127.0.0.1"
    redis_url: str | None = None
    capacity_bytes: int | None = None
    max_object_bytes: int = 16 << 30
    io_timeout_s: float = 120.0
    handshake_timeout_s: float = 10.0
    idle_timeout_s: float = 300.0
    header_timeout_s: float = 10.0
    max_connections: int = 256
    max_unauthenticated: int = 32
    sweep_interval_s: float = 0.2
    max_peer_unexpected_bytes: int = 1 << 20
    report_interval_s: float = 10.0
    shm_lanes: bool = True
    ttl_s: float = 10.0
    heartbeat_s: float = 3.0

    def __post_init__(self) -> None:
        if not self.secret:
            raise ConfigError("the agent needs a non-empty shared secret", field="secret")
        if not self.node_id or "/" in self.node_id or not P._PREFIX_RE.fullmatch(self.node_id):
            raise ConfigError(f"invalid node id {self.node_id!r}", field="node_id")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"invalid port {self.port}", field="port")
        for name in ("io_timeout_s", "handshake_timeout_s", "idle_timeout_s", "header_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0", field=name)
        if self.max_connections < 1 or self.max_unauthenticated < 1:
            raise ConfigError("max_connections and max_unauthenticated must be >= 1", field="max_connections")
        if self.max_peer_unexpected_bytes < 0:
            raise ConfigError("max_peer_unexpected_bytes must be >= 0", field="max_peer_unexpected_bytes")
        if self.sweep_interval_s < 0 or not self.report_interval_s > 0:
            raise ConfigError("sweep_interval_s must be >= 0 and report_interval_s > 0", field="sweep_interval_s")


class DigestCache:
    """xxh3-128 digests of served objects, each valid while its object is unchanged.

    A get with a checksum then costs the agent no pass over the object: the
    digest recorded when the object was put (verified against the payload)
    or first read is reused while the host tier's ``version`` of the object
    (inode, size, change time) is the same. A republished object (even in a
    reused pooled segment: the rename changes its change time) is hashed
    afresh. The client still checks the payload against the digest, so a
    copy that changed without a new version (a bit flipped in RAM) is caught
    rather than re-blessed. Only for a :class:`~backends.host.HostBackend`;
    other backends are hashed on every get. Bounded to ``max_entries`` (LRU).
    """

    def __init__(self, backend: Backend, max_entries: int = 1 << 16) -> None:
        self._version = backend.version if isinstance(backend, HostBackend) else None
        self._entries: OrderedDict[str, tuple[tuple[int, ...], bytes]] = OrderedDict()
        self.max_entries = max_entries

    def version(self, name: str) -> tuple[int, ...] | None:
        return self._version(name) if self._version is not None else None

    def digest(self, name: str, data: memoryview, before: tuple[int, ...] | None) -> bytes:
        """The digest of ``data``, read as ``name`` whose version was ``before`` just before the read."""
        hit = self._entries.get(name)
        if before is not None and hit is not None and hit[0] == before and self.version(name) == before:
            self._entries.move_to_end(name)
            return hit[1]
        digest = P.checksum([data])
        if before is not None and self.version(name) == before:
            self._store(name, before, digest)
        return digest

    def remember(self, name: str, digest: bytes) -> None:
        """Record ``digest`` for the object just published under ``name``."""
        v = self.version(name)
        if v is not None:
            self._store(name, v, digest)

    def forget(self, name: str) -> None:
        self._entries.pop(name, None)

    def _store(self, name: str, version: tuple[int, ...], digest: bytes) -> None:
        self._entries[name] = (version, digest)
        self._entries.move_to_end(name)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)


class AgentHost(Protocol):
    """What :class:`~tierstore.agent.conn.Connection` and :class:`~tierstore.agent.unasked.Unasked` use of
    the agent (:class:`tierstore.agent.server.Agent` is one)."""

    config: AgentConfig
    backend: Backend
    digests: DigestCache
    stats: dict[str, int]
    shm_lanes: bool
    ucxx: Any
    unasked: Any  # a tierstore.agent.unasked.Unasked

    def session(self, tag_base: int) -> Any:
        """The live :class:`~tierstore.agent.conn.Connection` of the session with ``tag_base``, or ``None``."""
