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

Security note: ``ucxx`` listeners bind every interface (it has no bind
address); ``host`` is the address advertised to peers. Authentication is what
keeps other hosts out; firewall the port on untrusted networks.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backends import agent_protocol as P
from backends.base import Backend
from backends.host import HostBackend
from backends.ucx_util import import_ucxx
from consistency.index import Index
from consistency.nodes import NodeRegistry
from tierstore.errors import ConfigError, KeyExistsError, TierFullError, TierStoreError

__all__ = ["Agent", "AgentConfig", "NodeRegistration", "main", "run_agent"]

log = logging.getLogger("tierstore.cli.agent")


@dataclass(frozen=True)
class AgentConfig:
    """Configuration of one node agent.

    Memory bound: one in-flight put per connection holds a reservation of its
    object's size (at most ``max_object_bytes``); gets send from the stored
    mapping, without a copy.

    Attributes:
        node_id: this node's id (a validated name segment).
        host_root: the host tier's directory (normally below ``/dev/shm``).
        secret: the shared secret peers authenticate with (non-empty).
        port: UCX listener port; 0 picks a free one (printed when ready).
        host: the address advertised to peers in the registration.
        redis_url: where to register; ``None`` disables registration.
        capacity_bytes: the host tier's budget (``None``: unbounded).
        max_object_bytes: the largest object a put may carry.
        io_timeout_s: a put's payload must arrive within this time.
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
    ttl_s: float = 10.0
    heartbeat_s: float = 3.0

    def __post_init__(self) -> None:
        if not self.secret:
            raise ConfigError("the agent needs a non-empty shared secret", field="secret")
        if not self.node_id or "/" in self.node_id or not P._PREFIX_RE.fullmatch(self.node_id):
            raise ConfigError(f"invalid node id {self.node_id!r}", field="node_id")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"invalid port {self.port}", field="port")


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


class Agent:
    """Serves one :class:`~backends.base.Backend` (normally the host tier) to peers.

    Use :meth:`serve` inside an event loop (it returns after :meth:`stop`), or
    :func:`run_agent` for a whole process with signal handling.
    """

    def __init__(self, config: AgentConfig, backend: Backend | None = None, *, index: Index | None = None) -> None:
        self.config = config
        self.backend = backend if backend is not None else _default_backend(config)
        self._index = index
        self.port: int | None = None
        self._listener: Any = None
        self._stopped: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._registration: NodeRegistration | None = None
        self._ucxx = import_ucxx()

    # -- lifecycle -----------------------------------------------------------------
    async def start(self) -> int:
        """Start listening (and register); return the port."""
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        self._listener = self._ucxx.create_listener(self._serve_connection, port=self.config.port)
        self.port = int(self._listener.port)
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
            self._listener.close()
            self.backend.close()

    def stop(self) -> None:
        """Ask :meth:`serve` to return; safe from any thread or a signal handler."""
        if self._loop is not None and self._stopped is not None:
            self._loop.call_soon_threadsafe(self._stopped.set)

    # -- one connection ----------------------------------------------------------
    async def _serve_connection(self, ep: Any) -> None:
        frame = bytearray(P.REQUEST_FRAME_SIZE)
        try:
            while not ep.closed:
                frame[:] = bytes(P.REQUEST_FRAME_SIZE)
                try:
                    await ep.recv(frame)
                except self._ucxx.exceptions.UCXMsgTruncated:
                    await self._reply(ep, P.Reply(P.Status.BAD_FRAME, "request frame too long"))
                    continue
                await self._handle(ep, frame)
        except Exception as e:  # noqa: BLE001 - the peer went away or broke the transport: drop it only
            log.debug("connection closed: %s: %s", type(e).__name__, e)
        finally:
            if not ep.closed:
                ep.abort()

    async def _reply(self, ep: Any, reply: P.Reply) -> None:
        await ep.send(P.pack_reply(reply))

    async def _handle(self, ep: Any, frame: bytearray) -> None:
        try:
            req = P.unpack_request(frame, self.config.secret, self.config.max_object_bytes)
        except P.RequestRejected as r:
            log.warning("rejected request: %s", r.message)
            await self._reply(ep, P.Reply(r.status, r.message))
            return
        rid = req.request_id
        try:
            if req.op == P.Op.PUT:
                await self._put(ep, req)
                return
            if req.op == P.Op.GET:
                await self._get(ep, req)
                return
            if req.op == P.Op.LIST:
                data = "\n".join(self.backend.list(req.key)).encode()
                await self._reply(ep, P.Reply(P.Status.OK, "", len(data), request_id=rid))
                await self._send_payload(ep, memoryview(data), req.chunk)
                return
            if req.op == P.Op.DELETE:
                found = self.backend.delete(req.key)
            elif req.op == P.Op.EXISTS:
                found = self.backend.exists(req.key)
            else:  # PING
                found = True
            status = P.Status.OK if found else P.Status.NOT_FOUND
            await self._reply(ep, P.Reply(status, self.config.node_id, request_id=rid))
        except TierStoreError as e:
            await self._reply(ep, P.Reply(P.Status.INTERNAL, f"{type(e).__name__}: {e}", request_id=rid))

    async def _send_payload(self, ep: Any, data: memoryview, chunk: int) -> None:
        spans = P.chunk_spans(data.nbytes, chunk)
        await asyncio.gather(*(ep.send(data[a:b], tag=i + 1) for i, (a, b) in enumerate(spans)))

    async def _get(self, ep: Any, req: P.Request) -> None:
        data = self.backend.get(req.key)
        if data is None:
            await self._reply(ep, P.Reply(P.Status.NOT_FOUND, "", request_id=req.request_id))
            return
        view = memoryview(data).cast("B")
        digest = P.checksum([view]) if req.flags & P.FLAG_CHECKSUM else bytes(16)
        await self._reply(ep, P.Reply(P.Status.OK, "", view.nbytes, digest, req.request_id,
                                      req.flags & P.FLAG_CHECKSUM))
        await self._send_payload(ep, view, req.chunk)

    async def _put(self, ep: Any, req: P.Request) -> None:
        rid = req.request_id
        try:
            if self.backend.reservable:
                res = self.backend.reserve(req.key, req.payload_len)
                buf = res.buffer
            else:
                res, buf = None, memoryview(bytearray(req.payload_len))
        except TierFullError as e:
            await self._reply(ep, P.Reply(P.Status.FULL, str(e), request_id=rid))
            return
        published = False
        try:
            await self._reply(ep, P.Reply(P.Status.READY, "", request_id=rid))
            spans = P.chunk_spans(req.payload_len, req.chunk)
            try:
                await asyncio.wait_for(
                    asyncio.gather(*(ep.recv(buf[a:b], tag=i + 1) for i, (a, b) in enumerate(spans))),
                    self.config.io_timeout_s)
            except BaseException:
                ep.abort()  # cancel any receive still posted into the buffer before it is freed
                raise
            if req.flags & P.FLAG_CHECKSUM and P.checksum([buf]) != req.checksum:
                await self._reply(ep, P.Reply(P.Status.CHECKSUM, "payload checksum mismatch", request_id=rid))
                return
            if_absent = bool(req.flags & P.FLAG_IF_ABSENT)
            try:
                if res is not None:
                    res.commit(if_absent=if_absent)
                else:
                    self.backend.put(req.key, buf, if_absent=if_absent)
                published = True
            except KeyExistsError as e:
                published = True  # commit already dropped the reservation
                await self._reply(ep, P.Reply(P.Status.EXISTS, str(e), request_id=rid))
                return
            await self._reply(ep, P.Reply(P.Status.OK, self.config.node_id, request_id=rid))
        finally:
            if not published and res is not None:
                del buf
                res.abort()


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
    p = argparse.ArgumentParser(prog="tierstore agent", description="Serve this node's host tier to peers over UCX.")
    p.add_argument("--node-id", required=True)
    p.add_argument("--host-root", required=True, help="host tier directory, e.g. /dev/shm/tierstore/node0")
    p.add_argument("--port", type=int, default=0, help="UCX listener port (0: any free port)")
    p.add_argument("--host", default="127.0.0.1", help="address advertised to peers")
    p.add_argument("--secret-file", required=True, help="file holding the shared secret")
    p.add_argument("--redis", default=None, help="redis:// URL to register this node in")
    p.add_argument("--capacity-bytes", type=int, default=None)
    p.add_argument("--max-object-bytes", type=int, default=AgentConfig.max_object_bytes)
    p.add_argument("--ttl", type=float, default=AgentConfig.ttl_s, help="registration TTL in seconds")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="expose Prometheus metrics on 127.0.0.1:PORT (needs prometheus_client)")
    p.add_argument("--log-level", default="WARNING")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; prints ``tierstore-agent ready node=<id> port=<port>`` when listening."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = AgentConfig(
        node_id=args.node_id, host_root=args.host_root, secret=_read_secret(args.secret_file), port=args.port,
        host=args.host, redis_url=args.redis, capacity_bytes=args.capacity_bytes,
        max_object_bytes=args.max_object_bytes, ttl_s=args.ttl, heartbeat_s=max(0.2, args.ttl / 3))

    if args.metrics_port is not None:
        from tierstore.cli.metrics import serve  # lazy: only with --metrics-port

        serve(args.metrics_port)

    def ready(port: int) -> None:
        print(f"tierstore-agent ready node={config.node_id} port={port}", flush=True)

    run_agent(config, ready=ready)
    return 0


if __name__ == "__main__":
    sys.exit(main())
