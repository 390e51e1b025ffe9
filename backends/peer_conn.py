"""One connection of the peer tier to one node agent: handshake, session, lane, one exchange at a time.

Protocol (see :mod:`backends.agent_protocol`): :func:`connect` creates the
endpoint to the agent's listener, reads the challenge and, when the agent is
on this host (same :func:`~backends.agent_protocol.host_id`) and offers it,
opens the shared-memory lane. :meth:`PeerConn.exchange` then runs one request
(on the lane if there is one, else on the listener's endpoint) and returns
the reply and any payload. The caller (:class:`backends.peer.PeerBackend`)
holds ``lock`` around each exchange and aborts the connection on any error
inside one, since its state is then unknown.

The lane's endpoints have no error handling (that is what lets UCX use
shared memory), so they would not notice a dead agent; the listener's
endpoint does, and its close callback aborts the lane, which fails whatever
the lane was waiting for.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
from collections.abc import Sequence
from typing import Any

from backends import agent_protocol as P
from tierstore.errors import CorruptObjectError, InvalidValueError, ProtocolError

__all__ = ["PeerConn", "connect"]

log = logging.getLogger("tierstore.peer")

_MMAP_MIN = 1 << 20  # receive buffers from this size are fresh pre-faulted anonymous mappings
#: chunks on a shared-memory lane are at least this large (256 MiB): each chunk is one UCX rendezvous, whose
#: fixed cost shows at shared-memory speed; on a network the caller's (smaller) chunk bounds a stall's detection
LANE_CHUNK_SHIFT = 28


def alloc(nbytes: int) -> memoryview:
    """A writable buffer of ``nbytes`` for a payload, pre-faulted when large (no page faults while receiving)."""
    if nbytes < _MMAP_MIN:
        return memoryview(bytearray(nbytes))
    flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20) | getattr(mmap, "MAP_POPULATE", 0)
    return memoryview(mmap.mmap(-1, nbytes, flags=flags))


def chunk_views(parts: Sequence[memoryview], chunk: int) -> list[memoryview | bytes]:
    """The payload chunks of the concatenation of ``parts``: views, copying only chunks that straddle parts."""
    out: list[memoryview | bytes] = []
    idx, off = 0, 0  # the part and offset the next chunk starts at
    total = sum(p.nbytes for p in parts)
    for a, b in P.chunk_spans(total, chunk):
        want = b - a
        pieces = []
        while want:
            while parts[idx].nbytes == off:
                idx, off = idx + 1, 0
            take = min(want, parts[idx].nbytes - off)
            pieces.append(parts[idx][off:off + take])
            off += take
            want -= take
        out.append(pieces[0] if len(pieces) == 1 else b"".join(pieces))
    return out


class PeerConn:
    """A session with one agent: the listener's endpoint, the optional lane, the session and a lock."""

    def __init__(self, ep: Any, session: P.ClientSession) -> None:
        self.ep = ep
        self.lane: Any = None
        self.session = session
        self.lock = asyncio.Lock()

    @property
    def closed(self) -> bool:
        return self.ep.closed or (self.lane is not None and self.lane.closed)

    def abort(self) -> None:
        for ep in (self.lane, self.ep):
            if ep is not None and not ep.closed:
                ep.abort()

    # -- one channel -------------------------------------------------------------
    def _send(self, buf: Any, slot: int) -> Any:
        ep, lane = (self.lane, True) if self.lane is not None else (self.ep, False)
        return ep.send(buf, tag=P.tag(self.session.tag_base, slot, lane=lane), force_tag=True)

    def _recv(self, buf: Any, slot: int) -> Any:
        ep, lane = (self.lane, True) if self.lane is not None else (self.ep, False)
        return ep.recv(buf, tag=P.tag(self.session.tag_base, slot, to_client=True, lane=lane), force_tag=True)

    async def _reply(self, rid: int) -> P.Reply:
        frame = bytearray(P.REPLY_FRAME_SIZE)
        await self._recv(frame, 0)
        reply = P.unpack_reply(frame)
        if reply.request_id != rid and not (reply.request_id == 0 and reply.status >= P.Status.BAD_FRAME):
            raise ProtocolError(f"reply for request {reply.request_id} while waiting for {rid}")
        return reply

    async def exchange(self, op: int, key: str, parts: Sequence[memoryview] = (), *, flags: int = 0,
                       digest: bytes = bytes(16), chunk_shift: int = P.DEFAULT_CHUNK_SHIFT,
                       out: memoryview | None = None) -> tuple[P.Reply, memoryview | None]:
        """Run one request; return the final reply and the payload of an ``OK`` GET/LIST/LANE.

        Raises:
            CorruptObjectError: a payload does not match the checksum in its reply.
            InvalidValueError: ``out`` is smaller than the object.
            ProtocolError: a malformed or out-of-order reply.
        """
        if self.lane is not None:
            chunk_shift = max(chunk_shift, LANE_CHUNK_SHIFT)
        chunk = 1 << chunk_shift
        nbytes = sum(p.nbytes for p in parts)
        rid, frame = self.session.request(op, key, flags=flags, payload_len=nbytes, digest=digest,
                                          chunk_shift=chunk_shift)
        await self._send(frame, 0)
        reply = await self._reply(rid)
        if op in (P.Op.PUT, P.Op.LANE) and reply.status == P.Status.READY:
            views = chunk_views(parts, chunk)
            await asyncio.gather(*(self._send(v, i + 1) for i, v in enumerate(views)))
            reply = await self._reply(rid)
        if op not in (P.Op.GET, P.Op.LIST, P.Op.LANE) or reply.status != P.Status.OK:
            return reply, None
        n = reply.payload_len
        if op == P.Op.LANE and n > P.MAX_LANE_ADDRESS:
            raise ProtocolError(f"lane address of {n} bytes from the agent")
        if out is not None and n > out.nbytes:
            raise InvalidValueError(f"{key!r} is {n} bytes; the buffer given holds {out.nbytes}", key=key)
        buf = out[:n] if out is not None else alloc(n)
        await asyncio.gather(*(self._recv(buf[a:b], i + 1) for i, (a, b) in enumerate(P.chunk_spans(n, chunk))))
        if reply.flags & P.FLAG_CHECKSUM and P.checksum([buf]) != reply.checksum:
            raise CorruptObjectError(f"checksum mismatch reading {key!r} from a peer", key=key, tier="peer")
        return reply, buf

    async def open_lane(self, ucxx: Any) -> bool:
        """Ask for a shared-memory lane and switch to it; ``False`` if the agent refused one."""
        mine = memoryview(bytes(ucxx.get_worker_address()))
        reply, theirs = await self.exchange(P.Op.LANE, "", [mine])
        if reply.status != P.Status.OK or not theirs:
            log.debug("agent refused a lane: %s", reply.message)
            return False
        lane = await ucxx.create_endpoint_from_worker_address(ucxx.get_ucx_address_from_buffer(bytes(theirs)),
                                                              endpoint_error_handling=False)
        loop = asyncio.get_running_loop()

        def tcp_closed() -> None:  # the agent went away: fail whatever the lane waits for
            loop.call_soon_threadsafe(lambda: None if lane.closed else lane.abort())

        self.ep.set_close_callback(tcp_closed)
        self.lane = lane
        return True


async def connect(ucxx: Any, host: str, port: int, secret: bytes, *, connect_timeout: float,
                  shm: bool) -> PeerConn:
    """Connect to the agent at ``host:port``: read its challenge, open a lane when it is on this host."""
    ep = await ucxx.create_endpoint(host, port, connect_timeout=connect_timeout)
    try:
        frame = bytearray(P.CHALLENGE_FRAME_SIZE)
        await ep.recv(frame)
        challenge = P.unpack_challenge(frame)
        conn = PeerConn(ep, P.ClientSession(secret, challenge))
        if shm and challenge.flags & P.CHALLENGE_FLAG_LANE and challenge.host_id == P.host_id():
            await conn.open_lane(ucxx)
        return conn
    except BaseException:
        ep.abort()
        raise
