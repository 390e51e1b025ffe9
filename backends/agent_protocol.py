"""The wire protocol between the peer tier (:mod:`backends.peer`) and the node agent.

It lives in ``backends/`` so that both :mod:`backends.peer` and
:mod:`tierstore.agent` can import it without breaking the import layering.
This module is the one owner of the format: every frame is packed and
unpacked with the same ``Struct`` constant (:data:`CHALLENGE`,
:data:`REQUEST`, :data:`REPLY`), little-endian.

Version 2 (this one). Version 1 signed a request id that nobody checked and
bound a frame to nothing, so a captured frame was accepted again, on any
connection, forever. Version 2 binds every request to one connection (a
server nonce) and to one moment in it (a monotonic request id).

A connection is one UCX endpoint from the agent's listener; it carries one
*session*, in this order:

0. **Challenge.** On connect the agent sends one :data:`CHALLENGE` frame of
   :data:`CHALLENGE_FRAME_SIZE` bytes (under ucxx's own per-endpoint tag):
   ``magic`` (``b"TSCH"``), ``version``, ``flags`` (:data:`CHALLENGE_FLAG_LANE`:
   the agent offers a shared-memory lane), a fresh random 16-byte ``nonce``,
   the session's ``tag_base`` and the agent's ``host_id`` (:func:`host_id`).
   Every later message uses the tag :func:`tag` derives from ``tag_base``
   (sent and received with ucxx's ``force_tag``): slot 0 carries frames,
   slot ``i + 1`` chunk ``i`` of a payload, and bit 23 tells the agent's
   messages from the client's.
1. **Request frame** (client to agent), exactly :data:`REQUEST_FRAME_SIZE`
   bytes: the :data:`REQUEST` header, then the UTF-8 object name, zero-padded.
   Fields: ``magic`` (``b"TSAG"``), ``version``, ``op``, ``flags``
   (:data:`FLAG_CHECKSUM`, :data:`FLAG_IF_ABSENT`), ``chunk_shift`` (chunk =
   ``1 << chunk_shift`` bytes), ``key_len``, ``payload_len``, ``checksum``
   (xxh3-128 of the payload, or zeros), ``request_id`` and ``token``:
   HMAC-SHA256 under the shared secret of the header bytes before the token,
   then the session's nonce, then the name bytes. So the token binds op,
   flags, chunk size, name, payload length, payload checksum, request id and
   the connection. The request id must be above the last one the agent
   accepted in this session (the first is 1): replayed on the same connection
   a frame is refused with :data:`Status.REPLAY`, on another connection with
   :data:`Status.AUTH` (another nonce). The agent checks, in order: frame
   (magic, version), token, request id, op, flags, chunk size, name, lengths.
   An error reply leaves the connection usable (payload only flows after
   ``READY``).
2. **Reply frame** (agent to client), exactly :data:`REPLY_FRAME_SIZE` bytes:
   the :data:`REPLY` header and a short UTF-8 message, zero-padded.
3. ``PUT``: the agent validates the request, reserves the space, posts the
   receives and only then answers ``READY``; the client sends the payload as
   ``ceil(payload_len / chunk)`` chunk messages, received in place into the
   reservation. The agent verifies the checksum, publishes the object and
   answers ``OK`` (or an error, and nothing is published). ``GET``/``LIST``:
   the reply (``OK`` with ``payload_len`` and checksum) is followed by the
   payload in chunks.
   ``TAIL``: a ``GET`` of the object's last bytes alone (a trailer check reads
   16 bytes, not the object): ``payload_len`` in the request is how many
   bytes are wanted (at most :data:`MAX_TAIL`; no payload follows the
   request), and the reply is a ``GET``'s for those bytes (fewer where the
   object is shorter). An agent from before ``TAIL`` answers ``UNKNOWN_OP``;
   the client then reads the whole object with ``GET``.
   ``RANGE``: a ``GET`` of the bytes ``[offset, offset + length)`` alone (a
   ranged read: a resharded restore reads the slices it needs, not whole
   copies). ``payload_len`` in the request is the length; the first 8 bytes
   of its ``checksum`` field are the offset (little-endian, :func:`range_field`;
   the other 8 are zero), so the token binds it. No payload follows the
   request; the reply is a ``GET``'s for those bytes (fewer where the object
   ends sooner, none past its end). An agent from before ``RANGE`` answers
   ``UNKNOWN_OP``; the client then reads the whole object with ``GET``.
4. ``LANE`` (same host only: equal :func:`host_id`): a ``PUT``-shaped
   request whose payload is the client's UCX worker address, answered ``OK``.
   From then on the agent sends every reply and payload of the session
   through an endpoint it created from that address with
   ``endpoint_error_handling=False`` (which lets UCX use shared memory),
   under tags with bit 63 set (``lane=True``). The client keeps sending on
   the listener's endpoint and posts its receives there (tags match per
   worker, not per endpoint), so a dead agent still fails them at once. The
   agent never receives over shared memory: a client SIGKILLed halfway
   through writing into the agent's shared-memory queue could wedge it for
   every lane, and CMA (``process_vm_readv``) from a dead process aborts the
   reader without error handling, which is why UCX's CMA transport is off
   (:data:`backends.ucx_util.UCX_ENV_DEFAULTS`).

Timeouts and caps are the agent's (:class:`tierstore.agent.AgentConfig`):
a first valid request within the handshake timeout, an idle timeout between
requests, payload progress within the header timeout after ``READY``, a cap
on connections and on unauthenticated ones.

Replies are not signed: a client trusts its transport to the agent (a
``GET`` payload is still checked against the checksum in the reply).

Mixed versions fail fast or loudly, never half-work: a version-1 client reads
the challenge as a malformed reply (``ProtocolError``) and its frames, sent
under tags nobody receives, are dropped; a version-2 client of a version-1
agent gets no challenge and gives up after its connect timeout; a frame of
another version is answered ``BAD_FRAME``.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import re
import secrets
import socket
import struct
from dataclasses import dataclass
from typing import ClassVar

import xxhash

from backends.base import validate_object_name
from tierstore.errors import (
    AuthenticationError,
    CorruptObjectError,
    InvalidKeyError,
    KeyExistsError,
    ProtocolError,
    TierFullError,
    TierStoreError,
)

__all__ = [
    "CHALLENGE",
    "CHALLENGE_FLAG_LANE",
    "CHALLENGE_FRAME_SIZE",
    "DEFAULT_CHUNK_SHIFT",
    "FLAG_CHECKSUM",
    "FLAG_IF_ABSENT",
    "MAGIC",
    "MAX_CHUNKS",
    "MAX_KEY_LEN",
    "MAX_LANE_ADDRESS",
    "MAX_TAIL",
    "NONCE_LEN",
    "REPLY",
    "REPLY_FRAME_SIZE",
    "REQUEST",
    "REQUEST_FRAME_SIZE",
    "VERSION",
    "Challenge",
    "ClientSession",
    "Op",
    "Reply",
    "Request",
    "RequestRejected",
    "Session",
    "Status",
    "checksum",
    "chunk_spans",
    "error_for_status",
    "host_id",
    "new_tag_base",
    "pack_challenge",
    "pack_reply",
    "pack_request",
    "range_field",
    "range_offset",
    "session_base",
    "sign",
    "tag",
    "unpack_challenge",
    "unpack_reply",
    "unpack_request",
    "validate_prefix",
]

MAGIC = b"TSAG"
REPLY_MAGIC = b"TSAR"
CHALLENGE_MAGIC = b"TSCH"
VERSION = 2
MAX_KEY_LEN = 1024
TOKEN_LEN = 32
NONCE_LEN = 16
HOST_ID_LEN = 16
#: magic, version, flags, reserved, nonce, tag_base, host_id
CHALLENGE = struct.Struct("<4sBBH16sQ16s")
CHALLENGE_FRAME_SIZE = CHALLENGE.size
CHALLENGE_FLAG_LANE = 0x01
#: magic, version, op, flags, chunk_shift, key_len, payload_len, checksum, request_id, token
REQUEST = struct.Struct("<4sBBBBIQ16sQ32s")
_SIGNED_LEN = REQUEST.size - TOKEN_LEN
REQUEST_FRAME_SIZE = REQUEST.size + MAX_KEY_LEN
#: magic, version, status, flags, pad, msg_len, payload_len, checksum, request_id
REPLY = struct.Struct("<4sBBBBIQ16sQ")
REPLY_FRAME_SIZE = 256
MAX_MESSAGE_LEN = REPLY_FRAME_SIZE - REPLY.size
#: the largest worker address a LANE request may carry
MAX_LANE_ADDRESS = 4096
#: the most bytes one ``TAIL`` asks for
MAX_TAIL = 4096

FLAG_CHECKSUM = 0x01
FLAG_IF_ABSENT = 0x02
_KNOWN_FLAGS = FLAG_CHECKSUM | FLAG_IF_ABSENT
MIN_CHUNK_SHIFT, MAX_CHUNK_SHIFT = 16, 30
DEFAULT_CHUNK_SHIFT = 24  # 16 MiB
_ZERO16 = bytes(16)
_PREFIX_RE = re.compile(r"[A-Za-z0-9._/-]*")

# tag layout (64 bits): bit 63 lane, bits 24..62 the session's random base, bit 23 direction, bits 0..22 slot
_LANE_BIT = 1 << 63
_TO_CLIENT = 1 << 23
_SLOT_MASK = _TO_CLIENT - 1
#: the most chunks one payload may have (slot 0 is the frame)
MAX_CHUNKS = _SLOT_MASK - 1


class Op:
    PUT, GET, DELETE, EXISTS, LIST, PING, LANE, TAIL, RANGE = 1, 2, 3, 4, 5, 6, 7, 8, 9
    ALL = frozenset({1, 2, 3, 4, 5, 6, 7, 8, 9})
    NAMES: ClassVar[dict[int, str]] = {1: "PUT", 2: "GET", 3: "DELETE", 4: "EXISTS", 5: "LIST", 6: "PING", 7: "LANE",
                                       8: "TAIL", 9: "RANGE"}
    #: the reads: their ``OK`` reply is followed by a payload
    READS = frozenset({GET, LIST, TAIL, RANGE})


class Status:
    OK, NOT_FOUND, READY, EXISTS = 0, 1, 2, 3
    BAD_FRAME, AUTH, UNKNOWN_OP, BAD_KEY, TOO_LARGE, CHECKSUM, FULL, INTERNAL, REPLAY, BUSY = (
        10, 11, 12, 13, 14, 15, 16, 17, 18, 19)


@dataclass(frozen=True)
class Challenge:
    flags: int
    nonce: bytes
    tag_base: int
    host_id: bytes


@dataclass(frozen=True)
class Request:
    op: int
    flags: int
    chunk_shift: int
    key: str
    payload_len: int
    checksum: bytes
    request_id: int

    @property
    def chunk(self) -> int:
        return 1 << self.chunk_shift

    @property
    def offset(self) -> int:
        """Where a ``RANGE`` starts (:func:`range_offset` of its checksum field)."""
        return range_offset(self.checksum)


def range_field(offset: int) -> bytes:
    """The ``checksum`` field of a ``RANGE`` request starting at ``offset``."""
    return offset.to_bytes(8, "little") + bytes(8)


def range_offset(field: bytes) -> int:
    """The offset a ``RANGE`` request's ``checksum`` field carries (:func:`range_field`)."""
    return int.from_bytes(field[:8], "little")


@dataclass(frozen=True)
class Reply:
    status: int
    message: str
    payload_len: int = 0
    checksum: bytes = _ZERO16
    request_id: int = 0
    flags: int = 0


# -- helpers -------------------------------------------------------------------------
def sign(secret: bytes, signed: bytes | memoryview) -> bytes:
    """HMAC-SHA256 of ``signed`` (header before the token, nonce, name bytes)."""
    return hmac.new(secret, signed, hashlib.sha256).digest()


def checksum(buffers) -> bytes:
    """xxh3-128 digest (16 bytes) of the concatenation of ``buffers``."""
    h = xxhash.xxh3_128()
    for b in buffers:
        h.update(b)
    return h.digest()


def chunk_spans(nbytes: int, chunk: int) -> list[tuple[int, int]]:
    """``(start, stop)`` byte ranges of the payload chunks, in order (none for 0 bytes)."""
    return [(i, min(i + chunk, nbytes)) for i in range(0, nbytes, chunk)]


def new_tag_base() -> int:
    """A random session tag base (39 random bits, never zero)."""
    return (secrets.randbits(39) | 1) << 24


def tag(base: int, slot: int, *, to_client: bool = False, lane: bool = False) -> int:
    """The UCX tag of ``slot`` (0: frames, ``i + 1``: chunk ``i``) in the session with ``base``."""
    if not 0 <= slot <= _SLOT_MASK:
        raise ValueError(f"slot {slot} out of range")
    return base | slot | (_TO_CLIENT if to_client else 0) | (_LANE_BIT if lane else 0)


def session_base(tag_value: int) -> int:
    """The session tag base that ``tag_value`` carries (bits 24..62), whatever its slot, direction and lane bits."""
    return tag_value & ~(_LANE_BIT | _TO_CLIENT | _SLOT_MASK) & ((1 << 64) - 1)


@functools.lru_cache(maxsize=1)
def host_id() -> bytes:
    """16 bytes naming this kernel and network namespace (equal ids: a shared-memory lane can work).

    Two network namespaces on one machine get different ids on purpose: they
    stand for different hosts (the testbed's ``--netns`` mode), whose traffic
    must cross their interfaces. Without ``/proc`` the id is random (no lane).
    """
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read().strip()
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return os.urandom(HOST_ID_LEN)
    return xxhash.xxh3_128(b"%s\0%d\0%s" % (boot, netns, socket.gethostname().encode())).digest()


# -- challenge -------------------------------------------------------------------------
def pack_challenge(ch: Challenge) -> bytearray:
    frame = bytearray(CHALLENGE_FRAME_SIZE)
    CHALLENGE.pack_into(frame, 0, CHALLENGE_MAGIC, VERSION, ch.flags, 0, ch.nonce, ch.tag_base, ch.host_id)
    return frame


def unpack_challenge(frame: bytes | bytearray | memoryview) -> Challenge:
    """Parse the agent's challenge; raise :class:`ProtocolError` if it is not one of this version."""
    if len(frame) < CHALLENGE.size:
        raise ProtocolError("short challenge frame from agent")
    magic, version, flags, _, nonce, base, hid = CHALLENGE.unpack_from(frame, 0)
    if magic != CHALLENGE_MAGIC or version != VERSION or base == 0:
        raise ProtocolError(f"the agent speaks another protocol (magic {magic!r}, version {version}; want {VERSION})")
    return Challenge(flags, nonce, base, hid)


# -- requests --------------------------------------------------------------------------
def pack_request(
    secret: bytes,
    nonce: bytes,
    op: int,
    key: str,
    *,
    flags: int = 0,
    payload_len: int = 0,
    digest: bytes = _ZERO16,
    request_id: int = 1,
    chunk_shift: int = DEFAULT_CHUNK_SHIFT,
) -> bytearray:
    """Build one request frame of :data:`REQUEST_FRAME_SIZE` bytes, signed for the session with ``nonce``."""
    kb = key.encode()
    if len(kb) > MAX_KEY_LEN:
        raise InvalidKeyError(f"object name is {len(kb)} bytes, at most {MAX_KEY_LEN}", field="name")
    frame = bytearray(REQUEST_FRAME_SIZE)
    REQUEST.pack_into(frame, 0, MAGIC, VERSION, op, flags, chunk_shift, len(kb), payload_len, digest,
                      request_id, bytes(TOKEN_LEN))
    frame[REQUEST.size:REQUEST.size + len(kb)] = kb
    frame[_SIGNED_LEN:REQUEST.size] = sign(secret, bytes(frame[:_SIGNED_LEN]) + bytes(nonce) + kb)
    return frame


class RequestRejected(Exception):
    """A request the agent answers with an error ``status`` (raised only inside the agent).

    ``authentic`` is true when the token was valid (the request id counts as used).
    """

    def __init__(self, status: int, message: str, *, request_id: int = 0, authentic: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.request_id = request_id
        self.authentic = authentic


def unpack_request(frame: bytes | bytearray | memoryview, secret: bytes, nonce: bytes, max_payload: int,
                   last_request_id: int = 0) -> Request:
    """Parse and validate a request frame of the session with ``nonce``.

    Raises:
        RequestRejected: carrying the error status; ``authentic`` once the token checked out.
    """
    if len(frame) < REQUEST.size:
        raise RequestRejected(Status.BAD_FRAME, "short frame")
    magic, version, op, flags, shift, key_len, payload_len, digest, rid, token = REQUEST.unpack_from(frame, 0)
    if magic != MAGIC:
        raise RequestRejected(Status.BAD_FRAME, "bad magic")
    if version != VERSION:
        raise RequestRejected(Status.BAD_FRAME, f"unsupported version {version} (this agent speaks {VERSION})")
    if key_len > MAX_KEY_LEN or REQUEST.size + key_len > len(frame):
        raise RequestRejected(Status.BAD_FRAME, f"key length {key_len} out of bounds")
    kb = bytes(frame[REQUEST.size:REQUEST.size + key_len])
    if not hmac.compare_digest(token, sign(secret, bytes(frame[:_SIGNED_LEN]) + bytes(nonce) + kb)):
        raise RequestRejected(Status.AUTH, "authentication failed")
    if rid <= last_request_id:
        raise RequestRejected(Status.REPLAY, f"request id {rid} is not above {last_request_id}: a replay")

    def reject(status: int, message: str) -> RequestRejected:
        return RequestRejected(status, message, request_id=rid, authentic=True)

    if op not in Op.ALL:
        raise reject(Status.UNKNOWN_OP, f"unknown op {op}")
    if flags & ~_KNOWN_FLAGS:
        raise reject(Status.BAD_FRAME, f"unknown flags {flags:#x}")
    if not MIN_CHUNK_SHIFT <= shift <= MAX_CHUNK_SHIFT:
        raise reject(Status.BAD_FRAME, f"chunk shift {shift} outside {MIN_CHUNK_SHIFT}..{MAX_CHUNK_SHIFT}")
    try:
        key = kb.decode()
    except UnicodeDecodeError:
        raise reject(Status.BAD_KEY, "object name is not UTF-8") from None
    if op == Op.LIST:
        if not _PREFIX_RE.fullmatch(key):
            raise reject(Status.BAD_KEY, "invalid list prefix")
    elif op not in (Op.PING, Op.LANE):
        try:
            validate_object_name(key)
        except InvalidKeyError as e:
            raise reject(Status.BAD_KEY, str(e)) from None
    limit = MAX_LANE_ADDRESS if op == Op.LANE else max_payload
    if op in (Op.PUT, Op.LANE) and payload_len > limit:
        raise reject(Status.TOO_LARGE, f"payload of {payload_len} bytes exceeds the limit of {limit}")
    if op in (Op.PUT, Op.LANE) and -(-payload_len // (1 << shift)) > MAX_CHUNKS:
        raise reject(Status.TOO_LARGE, f"payload of {payload_len} bytes needs more than {MAX_CHUNKS} chunks")
    if op == Op.TAIL and payload_len > MAX_TAIL:
        raise reject(Status.TOO_LARGE, f"a tail of {payload_len} bytes exceeds the limit of {MAX_TAIL}")
    if op == Op.RANGE and digest[8:] != _ZERO16[8:]:
        raise reject(Status.BAD_FRAME, "a range's offset field has bytes past its 8")
    if op not in (Op.PUT, Op.LANE, Op.TAIL, Op.RANGE) and payload_len != 0:
        raise reject(Status.BAD_FRAME, "payload length must be 0 for this op")
    return Request(op, flags, shift, key, payload_len, digest, rid)


class Session:
    """The agent's state of one connection: its nonce, tag base and the last request id accepted.

    Protocol: the agent sends :meth:`challenge` first, then passes every
    request frame to :meth:`accept`, which returns the request or raises
    :class:`RequestRejected`. ``authenticated`` turns true at the first frame
    whose token checks out.
    """

    def __init__(self, secret: bytes, max_payload: int, tag_base: int, *, nonce: bytes | None = None) -> None:
        self.secret = secret
        self.max_payload = max_payload
        self.tag_base = tag_base
        self.nonce = nonce if nonce is not None else os.urandom(NONCE_LEN)
        self.last_request_id = 0
        self.authenticated = False

    def challenge(self, flags: int = 0) -> bytearray:
        return pack_challenge(Challenge(flags, self.nonce, self.tag_base, host_id()))

    def accept(self, frame: bytes | bytearray | memoryview) -> Request:
        try:
            req = unpack_request(frame, self.secret, self.nonce, self.max_payload, self.last_request_id)
        except RequestRejected as r:
            if r.authentic:
                self.last_request_id = r.request_id
                self.authenticated = True
            raise
        self.last_request_id = req.request_id
        self.authenticated = True
        return req


class ClientSession:
    """The client's state of one connection: the agent's challenge and the next request id."""

    def __init__(self, secret: bytes, challenge: Challenge) -> None:
        self.secret = secret
        self.challenge = challenge
        self.tag_base = challenge.tag_base
        self._rid = 0

    def request(self, op: int, key: str, **kw) -> tuple[int, bytearray]:
        """The next request id and its signed frame (keywords as :func:`pack_request`)."""
        self._rid += 1
        return self._rid, pack_request(self.secret, self.challenge.nonce, op, key, request_id=self._rid, **kw)


# -- replies ---------------------------------------------------------------------------
def pack_reply(reply: Reply) -> bytearray:
    msg = reply.message.encode()[:MAX_MESSAGE_LEN]
    frame = bytearray(REPLY_FRAME_SIZE)
    REPLY.pack_into(frame, 0, REPLY_MAGIC, VERSION, reply.status, reply.flags, 0, len(msg),
                    reply.payload_len, reply.checksum, reply.request_id)
    frame[REPLY.size:REPLY.size + len(msg)] = msg
    return frame


def unpack_reply(frame: bytes | bytearray | memoryview) -> Reply:
    """Parse a reply frame; raise :class:`ProtocolError` if it is malformed."""
    magic, version, status, flags, _, msg_len, payload_len, digest, rid = REPLY.unpack_from(frame, 0)
    if magic != REPLY_MAGIC or version != VERSION or msg_len > MAX_MESSAGE_LEN:
        raise ProtocolError("malformed reply frame from agent")
    msg = bytes(frame[REPLY.size:REPLY.size + msg_len]).decode(errors="replace")
    return Reply(status, msg, payload_len, digest, rid, flags)


_ERRORS: dict[int, type[TierStoreError]] = {
    Status.AUTH: AuthenticationError,
    Status.REPLAY: AuthenticationError,
    Status.BAD_KEY: InvalidKeyError,
    Status.TOO_LARGE: TierFullError,
    Status.FULL: TierFullError,
    Status.CHECKSUM: CorruptObjectError,
    Status.EXISTS: KeyExistsError,
}


def error_for_status(reply: Reply, **fields) -> TierStoreError:
    """The typed error a client raises for an error reply (``ProtocolError`` by default)."""
    cls = _ERRORS.get(reply.status, ProtocolError)
    return cls(f"agent answered status {reply.status}: {reply.message}", status=reply.status, **fields)


def validate_prefix(prefix: str) -> str:
    if not isinstance(prefix, str) or not _PREFIX_RE.fullmatch(prefix) or len(prefix.encode()) > MAX_KEY_LEN:
        raise InvalidKeyError(f"invalid list prefix {prefix!r:.80}", field="prefix")
    return prefix
