"""The wire protocol between the peer tier (:mod:`backends.peer`) and the node agent.

It lives in ``backends/`` so that both :mod:`backends.peer` and
:mod:`tierstore.cli.agent` can import it without breaking the import layering.

Every message travels as a UCX tag message on one endpoint (one connection per
client and agent). A connection carries one request at a time:

1. The client sends one **request frame** of exactly :data:`REQUEST_FRAME_SIZE`
   bytes: the :data:`REQUEST` header (little-endian; the same ``Struct`` packs
   and unpacks it) followed by the UTF-8 object name, zero-padded.
2. The agent answers one **reply frame** of exactly :data:`REPLY_FRAME_SIZE`
   bytes: the :data:`REPLY` header and a short UTF-8 message, zero-padded.
3. ``PUT``: the agent validates the request, reserves the space and answers
   ``READY``; only then does the client send the payload as
   ``ceil(payload_len / chunk)`` tag messages (tag ``i + 1`` for chunk ``i``),
   each received in place into the reservation. The agent verifies the
   checksum, publishes the object and answers a final ``OK`` (or an error,
   and the object is not published).
4. ``GET``/``LIST``: the reply (``OK`` with ``payload_len`` and checksum) is
   followed by the payload in the same chunks.

Request header fields: ``magic`` (``b"TSAG"``), ``version``, ``op``,
``flags`` (:data:`FLAG_CHECKSUM`, :data:`FLAG_IF_ABSENT`), ``chunk_shift``
(chunk = ``1 << chunk_shift`` bytes), ``key_len``, ``payload_len``,
``checksum`` (xxh3-128 digest of the payload, or zeros), ``request_id`` and
``token``: HMAC-SHA256 under the shared secret of every header byte before the
token plus the name bytes. The agent checks the fields in this order: frame
(magic, version), token, op, name, lengths; any failure gets an error reply,
and the connection stays usable because payload only flows after ``READY``.
"""

from __future__ import annotations

import hashlib
import hmac
import re
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
    "DEFAULT_CHUNK_SHIFT",
    "FLAG_CHECKSUM",
    "FLAG_IF_ABSENT",
    "MAGIC",
    "MAX_KEY_LEN",
    "REPLY",
    "REPLY_FRAME_SIZE",
    "REQUEST",
    "REQUEST_FRAME_SIZE",
    "VERSION",
    "Op",
    "Reply",
    "Request",
    "RequestRejected",
    "Status",
    "checksum",
    "chunk_spans",
    "error_for_status",
    "pack_reply",
    "pack_request",
    "sign",
    "unpack_reply",
    "unpack_request",
    "validate_prefix",
]

MAGIC = b"TSAG"
REPLY_MAGIC = b"TSAR"
VERSION = 1
MAX_KEY_LEN = 1024
TOKEN_LEN = 32
#: magic, version, op, flags, chunk_shift, key_len, payload_len, checksum, request_id, token
REQUEST = struct.Struct("<4sBBBBIQ16sQ32s")
_SIGNED_LEN = REQUEST.size - TOKEN_LEN
REQUEST_FRAME_SIZE = REQUEST.size + MAX_KEY_LEN
#: magic, version, status, flags, pad, msg_len, payload_len, checksum, request_id
REPLY = struct.Struct("<4sBBBBIQ16sQ")
REPLY_FRAME_SIZE = 256
MAX_MESSAGE_LEN = REPLY_FRAME_SIZE - REPLY.size

FLAG_CHECKSUM = 0x01
FLAG_IF_ABSENT = 0x02
_KNOWN_FLAGS = FLAG_CHECKSUM | FLAG_IF_ABSENT
MIN_CHUNK_SHIFT, MAX_CHUNK_SHIFT = 16, 30
DEFAULT_CHUNK_SHIFT = 24  # 16 MiB
_ZERO16 = bytes(16)
_PREFIX_RE = re.compile(r"[A-Za-z0-9._/-]*")


class Op:
    PUT, GET, DELETE, EXISTS, LIST, PING = 1, 2, 3, 4, 5, 6
    ALL = frozenset({1, 2, 3, 4, 5, 6})
    NAMES: ClassVar[dict[int, str]] = {1: "PUT", 2: "GET", 3: "DELETE", 4: "EXISTS", 5: "LIST", 6: "PING"}


class Status:
    OK, NOT_FOUND, READY, EXISTS = 0, 1, 2, 3
    BAD_FRAME, AUTH, UNKNOWN_OP, BAD_KEY, TOO_LARGE, CHECKSUM, FULL, INTERNAL = 10, 11, 12, 13, 14, 15, 16, 17


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


@dataclass(frozen=True)
class Reply:
    status: int
    message: str
    payload_len: int = 0
    checksum: bytes = _ZERO16
    request_id: int = 0
    flags: int = 0


def sign(secret: bytes, signed: bytes | memoryview) -> bytes:
    """HMAC-SHA256 of ``signed`` (the header before the token, then the name bytes)."""
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


def pack_request(
    secret: bytes,
    op: int,
    key: str,
    *,
    flags: int = 0,
    payload_len: int = 0,
    digest: bytes = _ZERO16,
    request_id: int = 0,
    chunk_shift: int = DEFAULT_CHUNK_SHIFT,
) -> bytearray:
    """Build one signed request frame of :data:`REQUEST_FRAME_SIZE` bytes."""
    kb = key.encode()
    if len(kb) > MAX_KEY_LEN:
        raise InvalidKeyError(f"object name is {len(kb)} bytes, at most {MAX_KEY_LEN}", field="name")
    frame = bytearray(REQUEST_FRAME_SIZE)
    REQUEST.pack_into(frame, 0, MAGIC, VERSION, op, flags, chunk_shift, len(kb), payload_len, digest,
                      request_id, bytes(TOKEN_LEN))
    frame[REQUEST.size:REQUEST.size + len(kb)] = kb
    token = sign(secret, bytes(frame[:_SIGNED_LEN]) + kb)
    frame[_SIGNED_LEN:REQUEST.size] = token
    return frame


def unpack_request(frame: bytes | bytearray | memoryview, secret: bytes, max_payload: int) -> Request:
    """Parse and validate a request frame; raise :class:`RequestRejected` carrying the error status."""
    if len(frame) < REQUEST.size:
        raise RequestRejected(Status.BAD_FRAME, "short frame")
    magic, version, op, flags, shift, key_len, payload_len, digest, rid, token = REQUEST.unpack_from(frame, 0)
    if magic != MAGIC:
        raise RequestRejected(Status.BAD_FRAME, "bad magic")
    if version != VERSION:
        raise RequestRejected(Status.BAD_FRAME, f"unsupported version {version}")
    if key_len > MAX_KEY_LEN or REQUEST.size + key_len > len(frame):
        raise RequestRejected(Status.BAD_FRAME, f"key length {key_len} out of bounds")
    kb = bytes(frame[REQUEST.size:REQUEST.size + key_len])
    if not hmac.compare_digest(token, sign(secret, bytes(frame[:_SIGNED_LEN]) + kb)):
        raise RequestRejected(Status.AUTH, "authentication failed")
    if op not in Op.ALL:
        raise RequestRejected(Status.UNKNOWN_OP, f"unknown op {op}")
    if flags & ~_KNOWN_FLAGS:
        raise RequestRejected(Status.BAD_FRAME, f"unknown flags {flags:#x}")
    if not MIN_CHUNK_SHIFT <= shift <= MAX_CHUNK_SHIFT:
        raise RequestRejected(Status.BAD_FRAME, f"chunk shift {shift} outside {MIN_CHUNK_SHIFT}..{MAX_CHUNK_SHIFT}")
    try:
        key = kb.decode()
    except UnicodeDecodeError:
        raise RequestRejected(Status.BAD_KEY, "object name is not UTF-8") from None
    if op == Op.LIST:
        if not _PREFIX_RE.fullmatch(key):
            raise RequestRejected(Status.BAD_KEY, "invalid list prefix")
    elif op != Op.PING:
        try:
            validate_object_name(key)
        except InvalidKeyError as e:
            raise RequestRejected(Status.BAD_KEY, str(e)) from None
    if op == Op.PUT and payload_len > max_payload:
        raise RequestRejected(Status.TOO_LARGE, f"payload of {payload_len} bytes exceeds the limit of {max_payload}")
    if op != Op.PUT and payload_len != 0:
        raise RequestRejected(Status.BAD_FRAME, "payload length must be 0 for this op")
    return Request(op, flags, shift, key, payload_len, digest, rid)


class RequestRejected(Exception):
    """A request the agent answers with an error ``status`` (raised only inside the agent)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


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
