"""The node agent's server: :class:`Agent` accepts and serves connections, :class:`NodeRegistration` keeps the
node registered, :func:`run_agent` runs one in a process until SIGTERM/SIGINT (see :mod:`tierstore.agent`).
"""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import threading
import time
from pathlib import Path
from typing import Any

from backends import agent_protocol as P
from backends.base import Backend
from backends.host import HostBackend
from backends.ucx_server import init_server_context
from backends.ucx_util import cma_excluded, import_ucxx
from consistency.index import Index
from consistency.nodes import NodeRegistry
from tierstore.agent.base import AgentConfig, DigestCache, log
from tierstore.agent.conn import Connection
from tierstore.agent.unasked import Unasked
from tierstore.errors import ConfigError, TierStoreError

__all__ = ["Agent", "NodeRegistration", "read_secret", "run_agent"]


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


def read_secret(path: str) -> bytes:
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
