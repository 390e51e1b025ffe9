"""One connection of the node agent: its session, its request loop and its shared-memory lane.

Protocol: :class:`tierstore.agent.server.Agent` creates one :class:`Connection`
per endpoint its listener accepts and awaits :meth:`Connection.serve`, which

1. posts the receive of the first request frame, then sends the challenge
   (:mod:`backends.agent_protocol`, step 0);
2. serves requests one at a time until the peer goes, a timeout fires
   (handshake: no authentic request yet; idle: none for a while; header: a
   payload stalls), or the agent closes it (:meth:`close`: eviction, stop);
3. on the way out aborts its endpoints, waits for their posted receives to
   be cancelled, and only then frees any reservation they were writing into
   (a receive UCX never finishes nor cancels has its pages released under
   its mapping instead, see :func:`_release_stuck`).

Every receive is posted before the message that makes the peer send it
(the next request frame as soon as one arrives, a payload's chunks before
``READY``), so nothing a well-behaved peer sends waits in UCX's unexpected
queue; the agent drains that queue as junk after every progress step
(:class:`backends.ucx_server.UnexpectedDrain`), charging a connection
(:meth:`Connection.charge`) for what arrived under its session's tags, and
keeps a stream receive posted on each endpoint
(:class:`backends.ucx_server.StreamSink`), charging the stream bytes too. A
connection charged more than ``max_peer_unexpected_bytes`` is closed, and
the reason logged.

A ``LANE`` request moves the session's replies and payloads (not its
requests, not put payloads) to an endpoint created from the client's worker
address, without error handling, so UCX sends them through shared memory.
The agent only ever *sends* on a lane: what a client sends still arrives on
the listener's endpoint, whose error handling cancels it cleanly if the
client dies. (Receiving over shared memory from a client that can be
SIGKILLed mid-message would let it wedge the agent's shared-memory queue,
which every lane shares.)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Sequence
from typing import Any

from backends import agent_protocol as P
from backends.shm_mapping import release_pages
from backends.ucx_server import StreamSink
from backends.ucx_util import post_recv
from tierstore.agent.base import AgentHost, log
from tierstore.errors import KeyExistsError, TierFullError, TierStoreError

__all__ = ["Connection"]

_CANCEL_WAIT_S = 5.0  # how long aborted receives may take to be cancelled before their memory is released


def _consume(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()  # retrieved where it matters; silences "exception never retrieved" for the rest


def _release_stuck(buf: memoryview) -> None:
    """Give back the memory under the reservation of a put whose payload was cut short.

    A receive may outlive the put: one whose sender died in the middle of a
    rendezvous on an endpoint without error handling stays posted forever,
    and even a cancelled one can keep its view of the buffer alive inside
    ucxx for as long as ucxx keeps the request (seen here: a few puts in a
    hundred cut short by departing peers). Such a buffer must stay mapped
    (UCX may hold a pointer), but its pages need not stay allocated: they are
    punched out of the shared-memory segment (``MADV_REMOVE``), after which
    the reservation is aborted as usual. A late write would only fault in a
    page of the already unlinked segment.
    """
    try:
        release_pages(buf)
    except (OSError, ValueError) as e:  # not a shared-memory mapping: keep the pages
        log.warning("could not release a stuck buffer's pages: %s", e)


class _Closed(Exception):
    """The connection is over (timeout, eviction, broken payload): stop serving it."""


class _Channel:
    """One way to the client: the listener's endpoint, or the lane (an endpoint to the client's worker address)."""

    def __init__(self, ep: Any, base: int, *, lane: bool) -> None:
        self.ep = ep
        self.base = base
        self.lane = lane

    def send(self, buf: Any, slot: int = 0) -> Awaitable[Any]:
        return self.ep.send(buf, tag=P.tag(self.base, slot, to_client=True, lane=self.lane), force_tag=True)

    def reply(self, reply: P.Reply) -> Awaitable[Any]:
        return self.send(P.pack_reply(reply))


class Connection:
    """One accepted endpoint and its session (see the module docstring).

    Everything the client sends arrives on the listener's endpoint
    (``self.tcp``); replies and payloads leave on ``self.out``, which is the
    lane once the client opened one.
    """

    def __init__(self, agent: AgentHost, ep: Any, tag_base: int) -> None:
        self.agent = agent
        cfg = agent.config
        self.cfg = cfg
        self.session = P.Session(cfg.secret, cfg.max_object_bytes, tag_base)
        self.tcp = _Channel(ep, tag_base, lane=False)
        self.out = self.tcp
        self.accepted = time.monotonic()
        self.last_active = self.accepted
        self.closed = False
        self.close_reason = ""
        self.unexpected_bytes = 0  # charged so far: what the peer sent that nobody asked for
        self.sink: StreamSink | None = None
        self._posted: set[asyncio.Future] = set()

    @property
    def authenticated(self) -> bool:
        return self.session.authenticated

    # -- lifecycle ---------------------------------------------------------------
    async def serve(self) -> None:
        try:
            self.sink = self.agent.unasked.open_sink(self.tcp.ep, self._stream_bytes)
            frame = bytearray(P.REQUEST_FRAME_SIZE)
            first = self._post(frame, 0)
            flags = P.CHALLENGE_FLAG_LANE if self.agent.shm_lanes else 0
            await asyncio.wait_for(self.tcp.ep.send(self.session.challenge(flags)), self.cfg.handshake_timeout_s)
            await self._loop(frame, first)
        except _Closed as e:
            log.info("connection closed: %s", e)
        except Exception as e:  # noqa: BLE001 - the peer went away or broke the transport: drop it only
            log.debug("connection closed: %s: %s", type(e).__name__, e)
        finally:
            self.close()
            await self._settle()

    def close(self) -> None:
        """Abort the endpoints (cancelling their posted receives); :meth:`serve` then returns."""
        if self.closed:
            return
        self.closed = True
        if self.sink is not None:
            self.agent.unasked.close_sink(self.sink)
        for ch in (self.out, self.tcp):
            if not ch.ep.closed:
                ch.ep.abort()

    def charge(self, nbytes: int, what: str) -> None:
        """Count ``nbytes`` the peer sent unasked (``what``); over the agent's per-peer limit, close the connection."""
        self.unexpected_bytes += nbytes
        limit = self.cfg.max_peer_unexpected_bytes
        if self.unexpected_bytes > limit and not self.closed:
            self.close_reason = (f"sent {self.unexpected_bytes} bytes nobody asked for (last: {what}), over the "
                                 f"limit of {limit} (max_peer_unexpected_bytes)")
            log.warning("closing a connection (session %#x, %s): %s", self.session.tag_base,
                        "authenticated" if self.authenticated else "never authenticated", self.close_reason)
            self.agent.stats["abusive_closed"] += 1
            self.close()

    def _stream_bytes(self, nbytes: int) -> None:
        self.agent.stats["stream_bytes"] += nbytes
        self.charge(nbytes, "stream bytes")

    async def _settle(self) -> bool:
        """Wait until every receive posted on this connection completed or was cancelled."""
        pending = [f for f in self._posted if not f.done()]
        if pending:
            await asyncio.wait(pending, timeout=_CANCEL_WAIT_S)
        return all(f.done() for f in pending)

    def _post(self, buf: Any, slot: int) -> asyncio.Future:
        fut = post_recv(self.tcp.ep, buf, P.tag(self.tcp.base, slot))
        self._posted.add(fut)
        fut.add_done_callback(self._posted.discard)
        fut.add_done_callback(_consume)  # a receive cancelled by close() is nobody's error
        return fut

    # -- the request loop --------------------------------------------------------
    def _deadline(self) -> tuple[float, str]:
        if not self.session.authenticated:
            return self.accepted + self.cfg.handshake_timeout_s, "no authentic request within the handshake timeout"
        return self.last_active + self.cfg.idle_timeout_s, "idle timeout"

    async def _next_frame(self, fut: asyncio.Future) -> None:
        while True:
            deadline, why = self._deadline()
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Closed(why)
            done, _ = await asyncio.wait([fut], timeout=left)
            if done:
                fut.result()
                return

    async def _loop(self, first: bytearray, fut: asyncio.Future) -> None:
        """Serve requests one at a time, enforcing the session's timeouts.

        ``first`` is the buffer the posted receive ``fut`` writes the first frame into.
        """
        bufs = [first, bytearray(P.REQUEST_FRAME_SIZE)]
        cur = 0
        truncated = self.agent.ucxx.exceptions.UCXMsgTruncated
        while not self.closed:
            frame = bufs[cur]
            bad = None
            try:
                await self._next_frame(fut)
            except truncated:
                bad = P.Reply(P.Status.BAD_FRAME, "request frame too long")
            cur ^= 1
            bufs[cur][:] = bytes(P.REQUEST_FRAME_SIZE)
            fut = self._post(bufs[cur], 0)  # the next frame's receive, before this one is answered
            self.last_active = time.monotonic()
            if bad is not None:
                await self.out.reply(bad)
                continue
            await self._handle(frame)
            self.last_active = time.monotonic()

    async def _handle(self, frame: bytearray) -> None:
        try:
            req = self.session.accept(frame)
        except P.RequestRejected as r:
            log.warning("rejected request: %s", r.message)
            await self.out.reply(P.Reply(r.status, r.message, request_id=r.request_id))
            return
        rid = req.request_id
        backend = self.agent.backend
        out = self.out
        try:
            if req.op == P.Op.PUT:
                await self._put(req)
            elif req.op == P.Op.GET:
                await self._get(req)
            elif req.op == P.Op.TAIL:
                await self._tail(req)
            elif req.op == P.Op.RANGE:
                await self._range(req)
            elif req.op == P.Op.LANE:
                await self._open_lane(req)
            elif req.op == P.Op.LIST:
                data = "\n".join(backend.list(req.key)).encode()
                await self._send_payload(P.Reply(P.Status.OK, "", len(data), request_id=rid), memoryview(data),
                                         req.chunk)
            else:
                if req.op == P.Op.DELETE:
                    found = backend.delete(req.key)
                    self.agent.digests.forget(req.key)
                elif req.op == P.Op.EXISTS:
                    found = backend.exists(req.key)
                else:  # PING
                    found = True
                status = P.Status.OK if found else P.Status.NOT_FOUND
                await out.reply(P.Reply(status, self.cfg.node_id, request_id=rid))
        except TierStoreError as e:
            await out.reply(P.Reply(P.Status.INTERNAL, f"{type(e).__name__}: {e}", request_id=rid))

    # -- payloads ----------------------------------------------------------------
    async def _progress(self, futs: Sequence[Awaitable[Any]], what: str) -> None:
        """Wait for all ``futs``; each must complete within the header timeout of the previous one."""
        # Never cancel these: cancelling the asyncio side leaves the UCX request posted. On a stall the
        # caller closes the connection, which cancels them in UCX; _settle then sees them finish.
        pending = {asyncio.ensure_future(f) for f in futs}
        for f in pending:
            f.add_done_callback(_consume)
        end = time.monotonic() + self.cfg.io_timeout_s
        while pending:
            left = min(self.cfg.header_timeout_s, end - time.monotonic())
            done, pending = await asyncio.wait(pending, timeout=max(0.0, left), return_when=asyncio.FIRST_COMPLETED)
            if not done:
                raise _Closed(f"{what} stalled (header timeout {self.cfg.header_timeout_s}s, "
                              f"I/O timeout {self.cfg.io_timeout_s}s)")
            for f in done:
                f.result()

    async def _receive_payload(self, req: P.Request, buf: memoryview, ready: _Channel) -> None:
        """Post the payload's receives, answer READY on ``ready``, and wait for the payload (header timeout)."""
        futs = [self._post(buf[a:b], i + 1) for i, (a, b) in enumerate(P.chunk_spans(req.payload_len, req.chunk))]
        await ready.reply(P.Reply(P.Status.READY, "", request_id=req.request_id))
        await self._progress(futs, f"payload of {P.Op.NAMES[req.op]} {req.key!r}")

    async def _send_payload(self, reply: P.Reply, data: memoryview, chunk: int) -> None:
        out = self.out
        spans = P.chunk_spans(data.nbytes, chunk)
        if len(spans) > P.MAX_CHUNKS:
            await out.reply(P.Reply(P.Status.TOO_LARGE, "object needs too many chunks; use a larger chunk size",
                                    request_id=reply.request_id))
            return
        await out.reply(reply)
        await self._progress([out.send(data[a:b], i + 1) for i, (a, b) in enumerate(spans)], "reply payload")

    async def _get(self, req: P.Request) -> None:
        digests = self.agent.digests
        before = digests.version(req.key) if req.flags & P.FLAG_CHECKSUM else None
        data = self.agent.backend.get(req.key)
        if data is None:
            await self.out.reply(P.Reply(P.Status.NOT_FOUND, "", request_id=req.request_id))
            return
        view = memoryview(data).cast("B")
        digest = bytes(16)
        if req.flags & P.FLAG_CHECKSUM:
            digest = digests.digest(req.key, view, before)
        await self._send_payload(P.Reply(P.Status.OK, "", view.nbytes, digest, req.request_id,
                                         req.flags & P.FLAG_CHECKSUM), view, req.chunk)

    async def _tail(self, req: P.Request) -> None:
        """The object's last ``req.payload_len`` bytes (a trailer check): a GET's reply for them alone."""
        data = self.agent.backend.tail(req.key, req.payload_len)
        if data is None:
            await self.out.reply(P.Reply(P.Status.NOT_FOUND, "", request_id=req.request_id))
            return
        view = memoryview(data).cast("B")
        digest = P.checksum([view]) if req.flags & P.FLAG_CHECKSUM else bytes(16)
        await self._send_payload(P.Reply(P.Status.OK, "", view.nbytes, digest, req.request_id,
                                         req.flags & P.FLAG_CHECKSUM), view, req.chunk)

    async def _range(self, req: P.Request) -> None:
        """The object's bytes ``[req.offset, req.offset + req.payload_len)`` (a ranged read): a GET's reply for
        them alone."""
        backend = self.agent.backend
        if backend.ranged_get:
            data = backend.get_range(req.key, req.offset, req.payload_len)
        else:
            whole = backend.get(req.key)
            data = None if whole is None else memoryview(whole).cast("B")[req.offset:req.offset + req.payload_len]
        if data is None:
            await self.out.reply(P.Reply(P.Status.NOT_FOUND, "", request_id=req.request_id))
            return
        view = memoryview(data).cast("B")
        digest = P.checksum([view]) if req.flags & P.FLAG_CHECKSUM else bytes(16)
        await self._send_payload(P.Reply(P.Status.OK, "", view.nbytes, digest, req.request_id,
                                         req.flags & P.FLAG_CHECKSUM), view, req.chunk)

    async def _put(self, req: P.Request) -> None:
        rid = req.request_id
        backend = self.agent.backend
        out = self.out
        try:
            if backend.reservable:
                res = backend.reserve(req.key, req.payload_len)
                buf = res.buffer
            else:
                res, buf = None, memoryview(bytearray(req.payload_len))
        except TierFullError as e:
            await out.reply(P.Reply(P.Status.FULL, str(e), request_id=rid))
            return
        published = False
        try:
            try:
                await self._receive_payload(req, buf, out)
            except BaseException:
                self.close()  # cancels the receives still posted into the reservation
                settled = await self._settle()
                if res is not None:
                    _release_stuck(buf)  # the segment is unlinked next: its pages go now, whoever still views them
                    if not settled:
                        self.agent.stats["stuck_receives"] = self.agent.stats.get("stuck_receives", 0) + 1
                        log.warning("receives into %r not cancelled within %ss; its memory is released, its "
                                    "mapping kept", req.key, _CANCEL_WAIT_S)
                raise
            if req.flags & P.FLAG_CHECKSUM and P.checksum([buf]) != req.checksum:
                await out.reply(P.Reply(P.Status.CHECKSUM, "payload checksum mismatch", request_id=rid))
                return
            if_absent = bool(req.flags & P.FLAG_IF_ABSENT)
            try:
                if res is not None:
                    res.commit(if_absent=if_absent)
                else:
                    backend.put(req.key, buf, if_absent=if_absent)
                published = True
            except KeyExistsError as e:
                published = True  # commit already dropped the reservation
                await out.reply(P.Reply(P.Status.EXISTS, str(e), request_id=rid))
                return
            if req.flags & P.FLAG_CHECKSUM:
                self.agent.digests.remember(req.key, req.checksum)
            else:
                self.agent.digests.forget(req.key)
            await out.reply(P.Reply(P.Status.OK, self.cfg.node_id, request_id=rid))
        finally:
            if not published and res is not None:
                del buf
                res.abort()

    # -- the shared-memory lane --------------------------------------------------
    async def _open_lane(self, req: P.Request) -> None:
        """Switch this session's replies and payloads to an endpoint to the client's worker address."""
        rid = req.request_id
        if not self.agent.shm_lanes or self.out is not self.tcp:
            await self.out.reply(P.Reply(P.Status.BAD_FRAME, "no lane offered on this connection", request_id=rid))
            return
        addr = bytearray(req.payload_len)
        try:
            await self._receive_payload(req, memoryview(addr), self.tcp)
        except BaseException:
            self.close()
            raise
        ucxx = self.agent.ucxx
        try:
            ep = await asyncio.wait_for(
                ucxx.create_endpoint_from_worker_address(ucxx.get_ucx_address_from_buffer(bytes(addr)),
                                                         endpoint_error_handling=False),
                self.cfg.handshake_timeout_s)
        except Exception as e:  # noqa: BLE001 - a bad address: refuse the lane, keep the connection
            await self.tcp.reply(P.Reply(P.Status.BAD_FRAME, f"cannot reach the lane address: {e}", request_id=rid))
            return
        await self.tcp.reply(P.Reply(P.Status.OK, self.cfg.node_id, request_id=rid))
        self.out = _Channel(ep, self.session.tag_base, lane=True)
