"""One connection of the peer tier to one node agent: handshake, session, lane, one exchange at a time.

Protocol (see :mod:`backends.agent_protocol`): :func:`connect` creates the
endpoint to the agent's listener, reads the challenge and, when the agent is
on this host (same :func:`~backends.agent_protocol.host_id`) and offers it,
asks for a shared-memory lane: the agent then sends its replies and payloads
through an endpoint to this process's worker address (shared memory), while
this side keeps sending on the listener's endpoint and posts its receives
there too (tag matching is per worker, not per endpoint). So a dead agent
still fails every receive at once (the listener's endpoint has error
handling), and a get's payload moves at shared-memory speed.
:meth:`PeerConn.exchange` runs one request and returns the reply and any
payload. The caller (:class:`backends.peer.PeerBackend`) holds ``lock``
around each exchange and aborts the connection on any error inside one,
since its state is then unknown.

An agent that dies in the middle of writing into this process's
shared-memory queue can leave it wedged (the lane has no error handling); a
lane exchange that times out therefore turns lanes off for the rest of the
process (:func:`disable_lanes`).
"""

from __future__ import annotations

import asyncio
import logging
import mmap
from collections.abc import Sequence
from typing import Any

from backends import agent_protocol as P
from tierstore.errors import CorruptObjectError, InvalidValueError, ProtocolError

__all__ = ["LANE_CHUNK_SHIFT", "PeerConn", "connect", "disable_lanes", "lanes_enabled"]

log = logging.getLogger("tierstore.peer")

_MMAP_MIN = 1 << 20  # receive buffers from this size are fresh pre-faulted anonymous mappings
#: payloads sent by lane are chunked at least this coarsely (256 MiB): each chunk is one UCX rendezvous, whose
#: fixed cost shows at shared-memory speed; on a network the caller's (smaller) chunk bounds a stall's detection
LANE_CHUNK_SHIFT = 28


_lanes_off: str | None = None  # why this process asks for no more lanes


def disable_lanes(reason: str) -> None:
    """Ask no agent for a lane again in this process (see the module docstring)."""
    global _lanes_off
    if _lanes_off is None:
        log.warning("shared-memory lanes off for this process: %s", reason)
        _lanes_off = reason


def lanes_enabled() -> bool:
    return _lanes_off is None


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
    """A session with one agent: the listener's endpoint, whether replies come by lane, the session, a lock."""

    def __init__(self, ep: Any, session: P.ClientSession) -> None:
        self.ep = ep
        self.lane = False
        self.session = session
        self.lock = asyncio.Lock()

    @property
    def closed(self) -> bool:
        return self.ep.closed

    def abort(self) -> None:
        if not self.ep.closed:
            self.ep.abort()

    def _send(self, buf: Any, slot: int) -> Any:
        return self.ep.send(buf, tag=P.tag(self.session.tag_base, slot), force_tag=True)

    def _recv(self, buf: Any, slot: int) -> Any:
        tag = P.tag(self.session.tag_base, slot, to_client=True, lane=self.lane)
        return self.ep.recv(buf, tag=tag, force_tag=True)

    async def _reply(self, rid: int) -> P.Reply:
        frame = bytearray(P.REPLY_FRAME_SIZE)
        await self._recv(frame, 0)
        reply = P.unpack_reply(frame)
        if reply.request_id != rid and not (reply.request_id == 0 and reply.status >= P.Status.BAD_FRAME):
            raise ProtocolError(f"reply for request {reply.request_id} while waiting for {rid}")
        return reply

    async def exchange(self, op: int, key: str, parts: Sequence[memoryview] = (), *, flags: int = 0,
                       digest: bytes = bytes(16), chunk_shift: int = P.DEFAULT_CHUNK_SHIFT,
                       out: memoryview | None = None, length: int = 0,
                       offset: int = 0) -> tuple[P.Reply, memoryview | None]:
        """Run one request; return the final reply and the payload of an ``OK`` GET/LIST/TAIL/RANGE.

        ``length`` is the number of bytes a TAIL or a RANGE asks for (its request's ``payload_len``; nothing is
        sent); ``offset`` is where a RANGE starts (carried in its request's checksum field).

        Raises:
            CorruptObjectError: a payload does not match the checksum in its reply.
            InvalidValueError: ``out`` is smaller than the object.
            ProtocolError: a malformed or out-of-order reply.
        """
        if self.lane and op in (P.Op.GET, P.Op.LIST, P.Op.RANGE):
            chunk_shift = max(chunk_shift, LANE_CHUNK_SHIFT)
        chunk = 1 << chunk_shift
        nbytes = length if op in (P.Op.TAIL, P.Op.RANGE) else sum(p.nbytes for p in parts)
        if op == P.Op.RANGE:
            digest = P.range_field(offset)
        rid, frame = self.session.request(op, key, flags=flags, payload_len=nbytes, digest=digest,
                                          chunk_shift=chunk_shift)
        await self._send(frame, 0)
        reply = await self._reply(rid)
        if op in (P.Op.PUT, P.Op.LANE) and reply.status == P.Status.READY:
            views = chunk_views(parts, chunk)
            await asyncio.gather(*(self._send(v, i + 1) for i, v in enumerate(views)))
            reply = await self._reply(rid)
        if op not in P.Op.READS or reply.status != P.Status.OK:
            return reply, None
        n = reply.payload_len
        if out is not None and n > out.nbytes:
            raise InvalidValueError(f"{key!r} is {n} bytes; the buffer given holds {out.nbytes}", key=key)
        buf = out[:n] if out is not None else alloc(n)
        await asyncio.gather(*(self._recv(buf[a:b], i + 1) for i, (a, b) in enumerate(P.chunk_spans(n, chunk))))
        if reply.flags & P.FLAG_CHECKSUM and P.checksum([buf]) != reply.checksum:
            raise CorruptObjectError(f"checksum mismatch reading {key!r} from a peer", key=key, tier="peer")
        return reply, buf

    async def open_lane(self, ucxx: Any) -> bool:
        """Ask the agent to send through shared memory from now on; ``False`` if it refused."""
        mine = memoryview(bytes(ucxx.get_worker_address()))
        reply, _ = await self.exchange(P.Op.LANE, "", [mine])
        if reply.status != P.Status.OK:
            log.debug("agent refused a lane: %s", reply.message)
            return False
        self.lane = True
        return True


async def connect(ucxx: Any, host: str, port: int, secret: bytes, *, connect_timeout: float,
                  shm: bool) -> PeerConn:
    """Connect to the agent at ``host:port``: read its challenge, ask for a lane when it is on this host."""
    ep = await ucxx.create_endpoint(host, port, connect_timeout=connect_timeout)
    try:
        frame = bytearray(P.CHALLENGE_FRAME_SIZE)
        await ep.recv(frame)
        challenge = P.unpack_challenge(frame)
        conn = PeerConn(ep, P.ClientSession(secret, challenge))
        if (shm and lanes_enabled() and challenge.flags & P.CHALLENGE_FLAG_LANE
                and challenge.host_id == P.host_id()):
            await conn.open_lane(ucxx)
        return conn
    except BaseException:
        ep.abort()
        raise
