"""The peer tier: replicas in the host tier of other nodes, through their agents, over UCX.

Protocol (who calls what): the tier manager calls :meth:`PeerBackend.put`,
``get``, ``delete``, ``exists``, ``list`` and ``close`` from any thread. Each
call runs as a coroutine on the process's ``ucxx`` event-loop thread
(:func:`backends.ucx_util.ucx_loop`: one per process, because ``ucxx`` has one
worker per process) and the caller blocks on its result. The instance owns
its endpoints; ``close`` aborts them. The agents speak the
protocol of :mod:`backends.agent_protocol`.

Placement: for each object name the live peers (all but ``local_node_id``)
are ranked by rendezvous hashing (xxh64 of node id and name), so the order is
deterministic per name, spreads load, and never names a node twice. ``put``
writes to the first ``replication`` peers in parallel; a peer that cannot be
reached is replaced by the next in the ranking, and if fewer than
``replication`` replicas could be written the put raises
:class:`~tierstore.errors.TierUnavailableError` naming the nodes that failed.
``get`` and ``exists`` try the peers in ranked order (so a replica placed on a
fallback node is still found); ``delete`` and ``list`` ask every peer.

Errors: a miss is ``None``/``False``; if no peer could be reached at all the
call raises ``TierUnavailableError`` (fields ``nodes`` and ``key``). Error
replies map to typed errors (``AuthenticationError``, ``InvalidKeyError``,
``TierFullError``, ``CorruptObjectError``, ``KeyExistsError``,
``ProtocolError``). ``if_absent`` is checked per replica, not atomically
across replicas (``atomic_create_once = False``).

Connections (:mod:`backends.peer_conn`): one session per peer, cached, one
request at a time on it; a transport failure drops it and the request is
retried once on a new connection. To an agent on this host (same kernel and
network namespace) the session adds a shared-memory lane (``shm=True``): the
agent's replies and get payloads move through shared memory instead of
loopback TCP (puts still go over the listener's endpoint; see
:mod:`backends.agent_protocol`).

Bytes: ``put`` hashes the payload once (xxh3-128, bound into the request's
token) and sends it from the caller's buffers (only chunks that straddle two
buffers are copied); ``get`` receives into ``out`` when given (no copy
after the transfer), else into a fresh pre-faulted buffer, and hashes it
once. The agent receives a put in place into a host-tier reservation (a
pooled, already mapped segment where one of the size is free) and answers a
get's checksum from its digest cache without a pass over the object.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from backends import agent_protocol as P
from backends.base import Backend, Buffer, as_buffers, check_range, validate_object_name
from backends.peer_conn import PeerConn, connect, disable_lanes
from backends.ucx_util import import_ucxx, ucx_loop
from tierstore.errors import ConfigError, CorruptObjectError, InvalidValueError, ProtocolError, TierUnavailableError

__all__ = ["Discovery", "PeerAddress", "PeerBackend", "rank_peers"]


@dataclass(frozen=True)
class PeerAddress:
    """Where one node's agent listens."""

    node_id: str
    host: str
    port: int


Discovery = Callable[[], Sequence[PeerAddress]]


def rank_peers(name: str, peers: Sequence[PeerAddress], exclude: str | None = None) -> list[PeerAddress]:
    """Peers ordered by rendezvous score for ``name`` (highest first), without ``exclude``."""
    uniq = {p.node_id: p for p in peers if p.node_id != exclude}
    return sorted(uniq.values(), key=lambda p: xxhash.xxh64_intdigest(f"{p.node_id}\0{name}".encode()), reverse=True)


class _Unreachable(Exception):
    def __init__(self, peer: PeerAddress, cause: BaseException) -> None:
        super().__init__(f"{peer.node_id} ({peer.host}:{peer.port}): {type(cause).__name__}: {cause}")
        self.peer = peer


class PeerBackend(Backend):
    """Objects replicated to other nodes' host tiers through their agents.

    Args:
        peers: the agents, or a callable returning them (e.g. :func:`consistency.nodes.discovery`), asked per call.
        secret: the shared secret the agents were started with.
        replication: how many distinct peers each put writes to.
        local_node_id: this node's id, never chosen as a replica.
        timeout_s: limit for one request to one peer (payload included).
        connect_timeout_s: limit for connecting to a peer.
        chunk_shift: payload chunk size, ``1 << chunk_shift`` bytes (default 16 MiB).
        verify: send and check xxh3-128 checksums of payloads.
        shm: use a shared-memory lane to agents on this host (same kernel and network namespace).
    """

    tier = "peer"
    survives = "node"
    zero_copy_get = False
    reservable = False
    atomic_create_once = False
    ranged_get = True  # RANGE: the bytes asked for alone

    def __init__(self, peers: Sequence[PeerAddress] | Discovery, *, secret: bytes, replication: int = 1,
                 local_node_id: str | None = None, timeout_s: float = 60.0, connect_timeout_s: float = 5.0,
                 chunk_shift: int = P.DEFAULT_CHUNK_SHIFT, verify: bool = True, shm: bool = True) -> None:
        if not secret:
            raise ConfigError("PeerBackend needs the agents' shared secret", field="secret")
        if replication < 1:
            raise ConfigError(f"replication must be >= 1, got {replication}", field="replication")
        if not P.MIN_CHUNK_SHIFT <= chunk_shift <= P.MAX_CHUNK_SHIFT:
            raise ConfigError(f"chunk_shift must be in {P.MIN_CHUNK_SHIFT}..{P.MAX_CHUNK_SHIFT}", field="chunk_shift")
        fixed = tuple(peers) if not callable(peers) else ()
        self._discover: Discovery = peers if callable(peers) else (lambda: fixed)
        self.secret = bytes(secret)
        self.replication = replication
        self.local_node_id = local_node_id
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.chunk_shift = chunk_shift
        self.verify = verify
        self.shm = shm
        self._ucxx = import_ucxx()
        self._transport_errors = (self._ucxx.exceptions.UCXError, asyncio.TimeoutError, OSError)
        self._conns: dict[PeerAddress, PeerConn] = {}
        self._closed = False
        self._loop = ucx_loop()

    def wrap_transport(self, wrap: Callable[[Any], Any]) -> None:
        """Replace the ucxx module this backend calls with ``wrap(ucxx)`` (fault injection, tracing).

        Call before the first request; open connections keep their endpoints.
        """
        self._ucxx = wrap(self._ucxx)

    # -- plumbing ------------------------------------------------------------------
    def _call(self, coro: Any) -> Any:
        if self._closed:
            coro.close()
            raise TierUnavailableError("PeerBackend is closed", tier="peer")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _ranked(self, name: str) -> list[PeerAddress]:
        return rank_peers(name, list(self._discover()), exclude=self.local_node_id)

    async def _connect(self, peer: PeerAddress) -> tuple[PeerConn, bool]:
        conn = self._conns.get(peer)
        if conn is not None and not conn.closed:
            return conn, False
        conn = await connect(self._ucxx, peer.host, peer.port, self.secret, connect_timeout=self.connect_timeout_s,
                             shm=self.shm)
        self._conns[peer] = conn
        return conn, True

    def _drop(self, peer: PeerAddress, conn: PeerConn) -> None:
        if self._conns.get(peer) is conn:
            del self._conns[peer]
        conn.abort()

    async def _request(self, peer: PeerAddress, op: int, key: str, parts: Sequence[memoryview] = (),
                       flags: int = 0, digest: bytes = bytes(16), out: memoryview | None = None,
                       length: int = 0, offset: int = 0) -> tuple[P.Reply, memoryview | None]:
        """One request to one peer; a transport failure on a cached connection is retried once."""
        for attempt in (0, 1):
            try:
                conn, fresh = await asyncio.wait_for(self._connect(peer), self.connect_timeout_s + 1)
            except (*self._transport_errors, ProtocolError) as e:
                raise _Unreachable(peer, e) from e
            async with conn.lock:
                try:
                    return await asyncio.wait_for(
                        conn.exchange(op, key, parts, flags=flags, digest=digest, chunk_shift=self.chunk_shift,
                                      out=out, length=length, offset=offset), self.timeout_s)
                except (*self._transport_errors, ProtocolError) as e:
                    if conn.lane and isinstance(e, asyncio.TimeoutError) and not conn.closed:
                        # the agent is alive (its endpoint has error handling) yet its lane went silent
                        disable_lanes(f"a lane exchange with {peer.node_id} timed out")
                    self._drop(peer, conn)
                    if fresh or attempt:
                        raise _Unreachable(peer, e) from e
                except BaseException:
                    self._drop(peer, conn)
                    raise
        raise AssertionError("unreachable")

    @staticmethod
    def _unavailable(what: str, key: str, failures: list[_Unreachable]) -> TierUnavailableError:
        nodes = [f.peer.node_id for f in failures]
        detail = "; ".join(str(f) for f in failures) or "no peers known"
        return TierUnavailableError(f"peer tier: {what} {key!r} failed: {detail}", key=key, tier="peer", nodes=nodes)

    # -- the interface ---------------------------------------------------------------
    def put(self, name: str, data: Buffer | Sequence[Buffer], *, if_absent: bool = False) -> None:
        validate_object_name(name)
        parts = [b for b in as_buffers(data) if b.nbytes]
        self._call(self._put(name, parts, if_absent, self._ranked(name)))

    async def _put(self, name: str, parts: list[memoryview], if_absent: bool, candidates: list[PeerAddress]) -> None:
        flags = (P.FLAG_CHECKSUM if self.verify else 0) | (P.FLAG_IF_ABSENT if if_absent else 0)
        digest = P.checksum(parts) if self.verify else bytes(16)
        failures: list[_Unreachable] = []
        written = 0
        errors: list[BaseException] = []
        while written < self.replication and candidates and not errors:
            batch = candidates[: self.replication - written]
            del candidates[: len(batch)]
            results = await asyncio.gather(
                *(self._request(p, P.Op.PUT, name, parts, flags, digest) for p in batch), return_exceptions=True)
            for peer, res in zip(batch, results):
                if isinstance(res, _Unreachable):
                    failures.append(res)
                elif isinstance(res, BaseException):
                    errors.append(res)
                elif res[0].status == P.Status.OK:
                    written += 1
                else:
                    errors.append(P.error_for_status(res[0], key=name, tier="peer", node=peer.node_id))
        if errors:
            raise errors[0]
        if written < self.replication:
            raise self._unavailable(f"replicating ({written}/{self.replication} replicas written)", name, failures)

    def get(self, name: str, *, out: Buffer | None = None) -> memoryview | None:
        """The object's bytes, or ``None``.

        Args:
            out: a writable buffer to receive into (no copy after the transfer); the
                result is then a view of its first bytes. An object larger than
                ``out`` raises :class:`~tierstore.errors.InvalidValueError`.
        """
        validate_object_name(name)
        target = None
        if out is not None:
            target = memoryview(out)
            if target.readonly:
                raise InvalidValueError("out must be a writable buffer", key=name)
            target = target.cast("B") if target.format != "B" or target.ndim != 1 else target
        return self._call(self._first(name, P.Op.GET, self._ranked(name), target))

    def exists(self, name: str) -> bool:
        validate_object_name(name)
        return self._call(self._first(name, P.Op.EXISTS, self._ranked(name))) is not None

    def tail(self, name: str, nbytes: int) -> bytes | None:
        """The object's last ``nbytes`` bytes, or ``None``: one ``TAIL`` exchange that moves those bytes alone
        (a trailer check on this tier moved the whole object); from an agent that predates ``TAIL``, the
        whole object by ``GET``, sliced."""
        validate_object_name(name)
        if not 0 <= nbytes <= P.MAX_TAIL:
            return super().tail(name, nbytes)
        data = self._call(self._first(name, P.Op.TAIL, self._ranked(name), length=nbytes))
        return None if data is None else bytes(data)

    def get_range(self, name: str, offset: int, length: int) -> memoryview | None:
        """The bytes ``[offset, offset + length)`` of the object (fewer where it ends sooner), or ``None``: one
        ``RANGE`` exchange that moves those bytes alone, checksummed as a ``GET``; from an agent that predates
        ``RANGE``, the whole object by ``GET``, sliced."""
        validate_object_name(name)
        check_range(offset, length)
        return self._call(self._first(name, P.Op.RANGE, self._ranked(name), length=length, offset=offset))

    async def _first(self, name: str, op: int, peers: list[PeerAddress], out: memoryview | None = None,
                     length: int = 0, offset: int = 0) -> Any:
        flags = P.FLAG_CHECKSUM if (self.verify and op in (P.Op.GET, P.Op.TAIL, P.Op.RANGE)) else 0
        failures: list[_Unreachable] = []
        corrupt: CorruptObjectError | None = None
        for peer in peers:
            try:
                reply, data = await self._request(peer, op, name, flags=flags, out=out, length=length,
                                                  offset=offset)
                if op in (P.Op.TAIL, P.Op.RANGE) and reply.status == P.Status.UNKNOWN_OP:  # an older agent
                    reply, data = await self._request(peer, P.Op.GET, name, flags=flags)
                    if data is not None:
                        data = data[max(0, data.nbytes - length):] if op == P.Op.TAIL else data[offset:offset + length]
            except _Unreachable as e:
                failures.append(e)
                continue
            except CorruptObjectError as e:
                corrupt = e
                continue
            if reply.status == P.Status.OK:
                return data if op in (P.Op.GET, P.Op.TAIL, P.Op.RANGE) else True
            if reply.status != P.Status.NOT_FOUND:
                raise P.error_for_status(reply, key=name, tier="peer", node=peer.node_id)
        if corrupt is not None:
            raise corrupt
        if (failures and len(failures) == len(peers)) or not peers:
            raise self._unavailable("reading", name, failures)
        return None

    async def _all(self, op: int, key: str, peers: list[PeerAddress]) -> list[tuple[P.Reply, memoryview | None]]:
        results = await asyncio.gather(*(self._request(p, op, key) for p in peers), return_exceptions=True)
        ok = [r for r in results if not isinstance(r, BaseException)]
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, _Unreachable):
                raise r
        if not ok:
            raise self._unavailable(P.Op.NAMES[op].lower(), key, [r for r in results if isinstance(r, _Unreachable)])
        return ok

    def delete(self, name: str) -> bool:
        validate_object_name(name)
        replies = self._call(self._all(P.Op.DELETE, name, self._ranked(name)))
        for reply, _ in replies:
            if reply.status not in (P.Status.OK, P.Status.NOT_FOUND):
                raise P.error_for_status(reply, key=name, tier="peer")
        return any(reply.status == P.Status.OK for reply, _ in replies)

    def list(self, prefix: str = "") -> Iterator[str]:
        P.validate_prefix(prefix)
        names: set[str] = set()
        for reply, data in self._call(self._all(P.Op.LIST, prefix, self._ranked(prefix))):
            if reply.status != P.Status.OK:
                raise P.error_for_status(reply, key=prefix, tier="peer")
            if data is not None and data.nbytes:
                names.update(bytes(data).decode().split("\n"))
        return iter(sorted(names))

    def ping(self) -> dict[str, bool]:
        """Which peers answer, by node id."""

        peers = list(self._discover())

        async def _ping() -> dict[str, bool]:
            res = await asyncio.gather(*(self._request(p, P.Op.PING, "") for p in peers), return_exceptions=True)
            return {p.node_id: not isinstance(r, BaseException) and r[0].status == P.Status.OK
                    for p, r in zip(peers, res)}

        return self._call(_ping())

    def close(self) -> None:
        if self._closed:
            return

        async def _close_all() -> None:
            for conn in list(self._conns.values()):
                conn.abort()
            self._conns.clear()

        self._closed = True
        asyncio.run_coroutine_threadsafe(_close_all(), self._loop).result(10)

    def __repr__(self) -> str:
        return f"<PeerBackend tier=peer replication={self.replication} local={self.local_node_id}>"

