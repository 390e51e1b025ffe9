"""The node agent: owns a node's host tier and serves it to peers over UCX.

One agent runs per node (``tierstore agent --node-id N --host-root
/dev/shm/... --port P --secret-file F [--redis URL]``). It outlives trainer
crashes, so the host-tier copies it serves survive them, and peers on other
nodes read and write that tier through it (:class:`backends.peer.PeerBackend`).

Protocol: see :mod:`backends.agent_protocol`. The agent authenticates every
request (HMAC under the shared secret), validates every field (op, name,
lengths bounded by ``max_object_bytes``), never executes or unpickles what it
receives, and answers an error frame for a bad request while it keeps serving
every other connection. A put is received chunk by chunk straight into a
host-tier reservation (no second staging copy) and published only after the
whole payload arrived and its checksum matched, so a put cut short by a dead
peer leaves nothing readable.

Registration: with a Redis URL (or client), the agent writes the hash
``ts:node:<node_id>`` (node_id, address, capacity, used, pid, started) with a
TTL refreshed by a heartbeat thread, and adds the id to the set ``ts:nodes``;
a crashed agent's hash expires. A clean shutdown (SIGTERM/SIGINT) removes both.

Security: every connection gets a fresh challenge and every request is
signed for that connection and numbered (:mod:`backends.agent_protocol`), so
a captured frame is refused when replayed, on its own connection or another.
A connection must send an authentic request within ``handshake_timeout_s``
and then one at least every ``idle_timeout_s``; a put's payload must make
progress every ``header_timeout_s`` after ``READY`` or its reservation is
freed. At most ``max_connections`` connections are served (fewer if the fd
limit cannot fit them) and at most ``max_unauthenticated`` of them before
their first authentic request: a new one evicts the oldest unauthenticated
one, so a flood of idle connections cannot lock out a peer that has the
secret. The serving of one connection is :mod:`tierstore.cli.agent_conn`.

Memory a peer sends unasked (:mod:`backends.ucx_server`): the agent's UCX
context has no active messages (they are dropped as they arrive); tag
messages no receive is posted for are received and dropped right after every
progress step of the worker, so UCX's unexpected queue never holds more than
one step's worth; stream bytes land in one posted buffer per connection.
What can be traced to a session (a tag under its session's base, stream
bytes on its endpoint) is charged to that connection, and one charged more
than ``max_peer_unexpected_bytes`` is closed with a logged reason. Drops are
logged once per ``report_interval_s``, and after a flood the agent hands the
freed heap back to the system.

Network note: ``ucxx`` listeners bind every interface of the agent's network
namespace (ucxx has no bind address); ``host`` is only the address advertised
to peers. Inside a network namespace (``tierstore testbed --netns``) "every
interface" is that namespace's loopback and its veth, so the agent is
reachable on the node's own address and nowhere else; on a host it is every
interface of the host. Authentication is what keeps other hosts out; firewall
the port on untrusted networks. ``UCX_NET_DEVICES`` must name the interface
peers reach (``lo`` only on one machine).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import resource
import signal
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backends import agent_protocol as P
from backends.base import Backend
from backends.host import HostBackend
from backends.ucx_server import init_server_context
from backends.ucx_util import cma_excluded, import_ucxx
from consistency.index import Index
from consistency.nodes import NodeRegistry
from tierstore.cli.agent_conn import Connection
from tierstore.cli.agent_unasked import UNEXPECTED_MESSAGE_COST, Unasked
from tierstore.cli.common import HelpFormatter
from tierstore.errors import ConfigError, TierStoreError

__all__ = ["UNEXPECTED_MESSAGE_COST", "Agent", "AgentConfig", "DigestCache", "NodeRegistration", "main", "run_agent"]

log = logging.getLogger("tierstore.cli.agent")


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


class NodeRegistration:
    """Keeps this node registered in the index: a heartbeat thread over :class:`~consistency.nodes.NodeRegistry`.

    Args:
        registry: the node registry of the index.
        node_id: the node id.
        fields: the registration's fields (values str/int).
        ttl_s: expiry of the registration; :meth:`start` refreshes it every ``heartbeat_s``.
        used: optional callable returning the bytes used, written on each heartbeat.
    """

    def __init__(self, registry: NodeRegistry, node_id: str, fields: dict[str, Any], *, ttl_s: float = 10.0,
                 heartbeat_s: float = 3.0, used: Any = None) -> None:
        self.registry = registry
        self.node_id = node_id
        self.fields = {k: str(v) for k, v in fields.items()}
        self.ttl_s = ttl_s
        self.heartbeat_s = heartbeat_s
        self._used = used
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self) -> None:
        fields = dict(self.fields)
        if self._used is not None:
            fields["used"] = str(self._used() or 0)
        self.registry.beat(self.node_id, fields, self.ttl_s)

    def start(self) -> None:
        self.beat()
        self._thread = threading.Thread(target=self._run, name=f"ts-heartbeat-{self.node_id}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self.beat()
            except Exception as e:  # noqa: BLE001 - keep beating through a Redis blip
                log.warning("heartbeat for node %s failed: %s", self.node_id, e)

    def stop(self, *, unregister: bool = True) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if unregister:
            try:
                self.registry.remove(self.node_id)
            except TierStoreError as e:  # best effort; the TTL expires it anyway
                log.warning("could not unregister node %s: %s", self.node_id, e)


def _default_backend(config: AgentConfig) -> Backend:
    return HostBackend(config.host_root, capacity_bytes=config.capacity_bytes)


def _fd_limit() -> int:
    """Raise this process's soft fd limit to its hard limit; return the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            pass
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft


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


class Agent:
    """Serves one :class:`~backends.base.Backend` (normally the host tier) to peers.

    Use :meth:`serve` inside an event loop (it returns after :meth:`stop`), or
    :func:`run_agent` for a whole process with signal handling. The process's
    UCX worker must serve this agent only (no peer-tier client in the same
    process), and :meth:`start` creates it (:func:`backends.ucx_server.init_server_context`): the agent drops
    every tag message no receive was posted for.
    """

    def __init__(self, config: AgentConfig, backend: Backend | None = None, *, index: Index | None = None) -> None:
        self.config = config
        self.backend = backend if backend is not None else _default_backend(config)
        self.digests = DigestCache(self.backend)
        self._index = index
        self.port: int | None = None
        self.max_connections = config.max_connections
        self.shm_lanes = config.shm_lanes
        self.stats = {"refused": 0, "evicted": 0}
        self._conns: dict[Connection, None] = {}  # in accept order
        self._by_base: dict[int, Connection] = {}  # each live session's tag base
        self.unasked = Unasked(self)  # adds its counters to stats
        self._listener: Any = None
        self._stopped: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._registration: NodeRegistration | None = None
        self.ucxx = import_ucxx(server=True)

    # -- lifecycle -----------------------------------------------------------------
    async def start(self) -> int:
        """Start listening (and register); return the port."""
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        fit = max(1, (_fd_limit() - 64) // 3)  # about 2 fds per UCX connection, and room for the rest
        if fit < self.config.max_connections:
            log.warning("fd limit fits %d connections; serving at most that many (max_connections %d)", fit,
                        self.config.max_connections)
        self.max_connections = min(self.config.max_connections, fit)
        self.shm_lanes = self.config.shm_lanes and cma_excluded()
        if self.config.shm_lanes and not self.shm_lanes:
            log.warning("UCX_TLS=%s allows CMA: no shared-memory lanes (a client dying mid-transfer would abort "
                        "this agent); exclude it (UCX_TLS=^cma) to offer them", os.environ.get("UCX_TLS"))
        why = init_server_context()
        if why is not None:
            log.warning("the agent's UCX context accepts active messages (%s): ucxx keeps those no one receives",
                        why)
        self._listener = self.ucxx.create_listener(self._serve_connection, port=self.config.port)
        self.port = int(self._listener.port)
        self.unasked.start(self._loop)
        index = self._index
        if index is None and self.config.redis_url:
            index = self._index = Index(self.config.redis_url)
        if index is not None:
            self._registration = NodeRegistration(
                NodeRegistry(index), self.config.node_id,
                {"node_id": self.config.node_id, "address": f"{self.config.host}:{self.port}",
                 "capacity": self.config.capacity_bytes or 0, "used": 0, "pid": os.getpid(),
                 "started": f"{time.time():.3f}"},
                ttl_s=self.config.ttl_s, heartbeat_s=self.config.heartbeat_s, used=self.backend.used_bytes)
            await asyncio.to_thread(self._registration.start)
        log.info("agent %s listening on port %d", self.config.node_id, self.port)
        return self.port

    async def serve(self) -> None:
        """Start if needed, then serve until :meth:`stop`; unregister and close on the way out."""
        if self._listener is None:
            await self.start()
        assert self._stopped is not None
        try:
            await self._stopped.wait()
        finally:
            if self._registration is not None:
                await asyncio.to_thread(self._registration.stop)
            self.unasked.stop()
            self._listener.close()
            for conn in list(self._conns):
                conn.close()
            self.backend.close()

    def stop(self) -> None:
        """Ask :meth:`serve` to return; safe from any thread or a signal handler."""
        if self._loop is not None and self._stopped is not None:
            self._loop.call_soon_threadsafe(self._stopped.set)

    # -- connections ---------------------------------------------------------------
    def session(self, tag_base: int) -> Connection | None:
        """The live connection whose session has ``tag_base``, if any."""
        conn = self._by_base.get(tag_base)
        return conn if conn is not None and not conn.closed else None

    def connections(self) -> tuple[int, int]:
        """(open connections, of which not yet authenticated)."""
        live = [c for c in self._conns if not c.closed]
        return len(live), sum(1 for c in live if not c.authenticated)

    def _admit(self) -> bool:
        """Make room for one more connection: evict the oldest unauthenticated ones, or refuse."""
        live = [c for c in self._conns if not c.closed]
        unauth = [c for c in live if not c.authenticated]
        while unauth and (len(unauth) >= self.config.max_unauthenticated or len(live) >= self.max_connections):
            victim = unauth.pop(0)
            victim.close()
            live.remove(victim)
            self.stats["evicted"] += 1
        if len(live) >= self.max_connections:
            self.stats["refused"] += 1
            log.warning("refused a connection: %d authenticated connections open (max %d)", len(live),
                        self.max_connections)
            return False
        return True

    async def _serve_connection(self, ep: Any) -> None:
        if self._stopped is None or self._stopped.is_set() or not self._admit():
            ep.abort()
            return
        base = P.new_tag_base()
        while base in self._by_base:
            base = P.new_tag_base()
        conn = Connection(self, ep, base)
        self._by_base[base] = conn
        self._conns[conn] = None
        try:
            await conn.serve()
        finally:
            self._conns.pop(conn, None)
            self._by_base.pop(base, None)
            self.unasked.departed()


def _read_secret(path: str) -> bytes:
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as e:
        raise ConfigError(f"cannot read the secret file {path}: {e}", field="secret_file") from e
    if not secret:
        raise ConfigError(f"the secret file {path} is empty", field="secret_file")
    return secret


def run_agent(config: AgentConfig, backend: Backend | None = None, *, ready: Any = None) -> None:
    """Run an agent in this process until SIGTERM or SIGINT.

    Args:
        config: the agent's configuration.
        backend: the tier to serve (default: a :class:`~backends.host.HostBackend` on ``host_root``).
        ready: optional callable called with the port once listening.
    """

    async def _main() -> None:
        agent = Agent(config, backend)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, agent.stop)
        port = await agent.start()
        if ready is not None:
            ready(port)
        await agent.serve()

    asyncio.run(_main())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tierstore agent", description="Serve this node's host tier to peers over UCX.",
                                formatter_class=HelpFormatter, epilog="Needs ucxx: pip install 'tierstore[ucx]'.")
    p.add_argument("--node-id", required=True, help="this node's id, as peers and the index name it (required)")
    p.add_argument("--host-root", required=True, help="host tier directory, e.g. /dev/shm/tierstore/node0 (required)")
    p.add_argument("--port", type=int, default=0, help="UCX listener port (default: 0, any free port)")
    p.add_argument("--host", default="127.0.0.1", help="address advertised to peers")
    p.add_argument("--secret-file", required=True, help="file holding the peers' shared secret (required)")
    p.add_argument("--redis", default=None, help="redis:// URL to register this node in (default: no registration)")
    p.add_argument("--capacity-bytes", type=int, default=None, help="the host tier's budget (default: unbounded)")
    p.add_argument("--max-object-bytes", type=int, default=AgentConfig.max_object_bytes,
                   help="the largest object a peer may put")
    p.add_argument("--ttl", type=float, default=AgentConfig.ttl_s, help="registration TTL in seconds")
    for flag, field in (("--handshake-timeout", "handshake_timeout_s"), ("--idle-timeout", "idle_timeout_s"),
                        ("--header-timeout", "header_timeout_s"), ("--io-timeout", "io_timeout_s"),
                        ("--sweep-interval", "sweep_interval_s"), ("--report-interval", "report_interval_s")):
        p.add_argument(flag, type=float, default=getattr(AgentConfig, field), help="seconds (see AgentConfig)")
    p.add_argument("--max-connections", type=int, default=AgentConfig.max_connections,
                   help="open connections at most (the oldest unauthenticated one is evicted first)")
    p.add_argument("--max-unauthenticated", type=int, default=AgentConfig.max_unauthenticated,
                   help="connections still in their handshake at most")
    p.add_argument("--max-peer-unexpected-bytes", type=int, default=AgentConfig.max_peer_unexpected_bytes,
                   help="what one connection may send unasked before it is closed (a well-behaved peer sends none)")
    p.add_argument("--no-shm-lanes", action="store_true", help="never offer same-host clients a shared-memory lane")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="expose Prometheus metrics on 127.0.0.1:PORT, with tierstore[metrics] (default: off)")
    p.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING or ERROR")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; prints ``tierstore-agent ready node=<id> port=<port>`` when listening."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = AgentConfig(
        node_id=args.node_id, host_root=args.host_root, secret=_read_secret(args.secret_file), port=args.port,
        host=args.host, redis_url=args.redis, capacity_bytes=args.capacity_bytes,
        max_object_bytes=args.max_object_bytes, ttl_s=args.ttl, heartbeat_s=max(0.2, args.ttl / 3),
        handshake_timeout_s=args.handshake_timeout, idle_timeout_s=args.idle_timeout,
        header_timeout_s=args.header_timeout, io_timeout_s=args.io_timeout, sweep_interval_s=args.sweep_interval,
        report_interval_s=args.report_interval, max_peer_unexpected_bytes=args.max_peer_unexpected_bytes,
        max_connections=args.max_connections, max_unauthenticated=args.max_unauthenticated,
        shm_lanes=not args.no_shm_lanes)

    if args.metrics_port is not None:
        from tierstore.cli.metrics import serve  # lazy: only with --metrics-port

        serve(args.metrics_port)

    def ready(port: int) -> None:
        print(f"tierstore-agent ready node={config.node_id} port={port}", flush=True)

    run_agent(config, ready=ready)
    return 0


if __name__ == "__main__":
    sys.exit(main())
