"""The node agent under attack: replayed frames, idle-connection floods, stalled puts, unexpected-message floods.

Agents run as real subprocesses; clients are real UCX endpoints on loopback
(the test process's ucxx loop). Each test would have failed against the
version-1 agent (no challenge, no timeouts, no caps, no sweeper).
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import time
import uuid
from pathlib import Path

import pytest

from backends import agent_protocol as P
from backends.peer import PeerBackend
from backends.ucx_util import ucx_loop
from tests._agents import SECRET, AgentCluster, RawClient, require_ucxx
from tierstore.errors import TierUnavailableError

pytestmark = pytest.mark.ucx


def _tmp_files(root) -> list:
    return [p for p in root.rglob(".tmp-*")] if root.exists() else []


def _wait_until(cond, timeout: float, step: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step)
    return cond()


# -- replays ---------------------------------------------------------------------------
class _RecordingEndpoint:
    """A ucxx endpoint that keeps a copy of every request frame sent through it (a wire tap)."""

    def __init__(self, inner, frames: list[bytes]) -> None:
        self._inner = inner
        self._frames = frames

    def __getattr__(self, name):
        return getattr(self._inner, name)

    async def send(self, buf, *args, **kw):
        if memoryview(buf).nbytes == P.REQUEST_FRAME_SIZE:
            self._frames.append(bytes(buf))
        return await self._inner.send(buf, *args, **kw)


class _Tap:
    def __init__(self, inner, frames: list[bytes]) -> None:
        self._inner = inner
        self._frames = frames

    def __getattr__(self, name):
        return getattr(self._inner, name)

    async def create_endpoint(self, *a, **kw):
        return _RecordingEndpoint(await self._inner.create_endpoint(*a, **kw), self._frames)

    async def create_endpoint_from_worker_address(self, *a, **kw):
        return _RecordingEndpoint(await self._inner.create_endpoint_from_worker_address(*a, **kw), self._frames)


@pytest.fixture(scope="module")
def agent():
    require_ucxx()
    c = AgentCluster(1)
    yield c
    c.close()


def _op(frame: bytes) -> int:
    return P.REQUEST.unpack_from(frame, 0)[2]


@pytest.mark.parametrize("shm", [True, False], ids=["lane", "tcp"])
def test_frames_captured_from_a_peer_are_refused_on_a_new_connection(agent, shm):
    """GET/LIST/DELETE/PUT frames captured off a real client's wire, resent by anyone: refused, nothing done."""
    frames: list[bytes] = []
    peer = PeerBackend(agent.addresses, secret=SECRET, shm=shm)
    peer.wrap_transport(lambda ucxx: _Tap(ucxx, frames))
    root = agent.agents[0].root
    try:
        payload = os.urandom(2 << 20)
        peer.put("replay/victim", payload)
        assert bytes(peer.get("replay/victim")) == payload
        assert list(peer.list("replay/")) == ["replay/victim"]
        assert peer.delete("replay/victim")
        peer.put("replay/victim", payload)  # back again: a replayed DELETE must not remove it
    finally:
        peer.close()
    captured = {_op(f): f for f in frames}
    assert {P.Op.PUT, P.Op.GET, P.Op.LIST, P.Op.DELETE} <= set(captured)
    attacker = RawClient(agent.agents[0].port)
    try:
        for op in (P.Op.GET, P.Op.LIST, P.Op.DELETE, P.Op.PUT):
            attacker.send(captured[op])
            reply = attacker.reply()
            assert reply.status == P.Status.AUTH, (P.Op.NAMES[op], reply)
        assert _tmp_files(root) == []  # the replayed PUT header reserved nothing
    finally:
        attacker.close()
    assert (root / "replay" / "victim").read_bytes() == payload


def test_frames_resent_on_the_same_connection_are_refused(agent):
    c = RawClient(agent.agents[0].port)
    root = agent.agents[0].root
    try:
        data = os.urandom(1000)
        put = c.request(P.Op.PUT, "same/x", flags=P.FLAG_CHECKSUM, payload_len=len(data), digest=P.checksum([data]))
        c.send(put)
        assert c.reply().status == P.Status.READY
        c.send(data, slot=1)
        assert c.reply().status == P.Status.OK
        get = c.request(P.Op.GET, "same/x")
        c.send(get)
        r = c.reply()
        assert r.status == P.Status.OK
        c.recv(bytearray(r.payload_len), slot=1)
        delete = c.request(P.Op.DELETE, "same/x")
        c.send(delete)
        assert c.reply().status == P.Status.OK
        (root / "same").mkdir(exist_ok=True)
        (root / "same" / "x").write_bytes(b"again")
        for frame in (get, delete, put):
            c.send(frame)
            assert c.reply().status == P.Status.REPLAY
        assert _tmp_files(root) == []
        assert (root / "same" / "x").read_bytes() == b"again"
        # an old id after a newer one is refused too; the connection still serves fresh requests
        older = c.request(P.Op.EXISTS, "same/x")
        newer = c.request(P.Op.EXISTS, "same/x")
        c.send(newer)
        assert c.reply().status == P.Status.OK
        c.send(older)
        assert c.reply().status == P.Status.REPLAY
        c.send(c.request(P.Op.EXISTS, "same/x"))
        assert c.reply().status == P.Status.OK
    finally:
        c.close()


# -- timeouts ------------------------------------------------------------------------------
def _closed_by_agent(c: RawClient, timeout: float) -> bool:
    """Whether a receive on ``c`` fails (the agent aborted its end) within ``timeout`` seconds."""
    return c.closed_by_agent(timeout)


@pytest.fixture
def quick_agent():
    require_ucxx()
    c = AgentCluster(1, extra=["--handshake-timeout", "1", "--idle-timeout", "2", "--header-timeout", "0.5"])
    yield c
    c.close()


@pytest.mark.parametrize("sent", [0, 1], ids=["header-only", "stalled-mid-payload"])
def test_put_header_without_payload_frees_its_reservation(quick_agent, sent):
    root = quick_agent.agents[0].root
    c = RawClient(quick_agent.agents[0].port)
    try:
        c.send(c.request(P.Op.PUT, "stall/x", payload_len=4 << 20, chunk_shift=20))
        assert c.reply().status == P.Status.READY
        for i in range(sent):
            c.send(os.urandom(1 << 20), slot=i + 1)
        assert _tmp_files(root), "the agent reserved the object"
        t0 = time.monotonic()
        assert _wait_until(lambda: not _tmp_files(root), 5.0), "the reservation outlived the header timeout"
        assert time.monotonic() - t0 < 4.0
        assert _closed_by_agent(c, 5.0)
    finally:
        c.close()
    assert not (root / "stall" / "x").exists()
    ok = RawClient(quick_agent.agents[0].port)
    try:
        ok.send(ok.request(P.Op.PING, ""))
        assert ok.reply().status == P.Status.OK
    finally:
        ok.close()


def test_unauthenticated_and_idle_connections_are_closed(quick_agent):
    port = quick_agent.agents[0].port
    silent = RawClient(port)
    wrong = RawClient(port, secret=b"not the secret")
    idle = RawClient(port)
    try:
        wrong.send(wrong.request(P.Op.PING, ""))
        assert wrong.reply().status == P.Status.AUTH  # answered, but it does not count as authenticated
        idle.send(idle.request(P.Op.PING, ""))
        assert idle.reply().status == P.Status.OK
        t0 = time.monotonic()
        assert _closed_by_agent(silent, 5.0)  # handshake timeout 1 s
        assert _closed_by_agent(wrong, 5.0)
        assert time.monotonic() - t0 < 4.0
        assert _closed_by_agent(idle, 6.0)  # idle timeout 2 s
    finally:
        for c in (silent, wrong, idle):
            c.close()


# -- caps ----------------------------------------------------------------------------------
def test_idle_connection_flood_does_not_lock_out_a_peer():
    """300 idle, never-authenticated connections against an agent limited to 256 fds: a real peer still gets in."""
    require_ucxx()
    c = AgentCluster(1, nofile=256, extra=["--max-unauthenticated", "8", "--handshake-timeout", "60"])
    flood: list[RawClient] = []
    try:
        agent = c.agents[0]
        fds0 = agent.open_fds()
        for _ in range(300):
            try:
                flood.append(RawClient(agent.port))
            except Exception:  # noqa: BLE001 - evicted before its challenge arrived: also fine
                pass
        assert agent.proc.poll() is None
        assert agent.open_fds() < 256 - 32, "the idle connections hold the agent's fds"
        peer = PeerBackend(c.addresses, secret=c.secret, shm=False)
        try:
            data = os.urandom(1 << 20)
            peer.put("flood/x", data)
            assert bytes(peer.get("flood/x")) == data
        finally:
            peer.close()
        assert agent.open_fds() - fds0 < 64
    finally:
        for f in flood:
            try:
                f.close()
            except Exception:  # noqa: BLE001
                pass
        c.close()


def test_connection_cap_refuses_beyond_max_connections():
    require_ucxx()
    c = AgentCluster(1, extra=["--max-connections", "3", "--max-unauthenticated", "3"])
    clients: list[RawClient] = []
    try:
        for _ in range(3):
            cl = RawClient(c.agents[0].port)
            cl.send(cl.request(P.Op.PING, ""))
            assert cl.reply().status == P.Status.OK
            clients.append(cl)
        peer = PeerBackend(c.addresses, secret=c.secret, shm=False, connect_timeout_s=2.0)
        try:
            with pytest.raises(TierUnavailableError):
                peer.put("cap/x", b"1")  # three authenticated peers hold every slot
        finally:
            peer.close()
        clients.pop().close()
        peer = PeerBackend(c.addresses, secret=c.secret, shm=False)
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    peer.put("cap/x", b"1")
                    break
                except TierUnavailableError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
        finally:
            peer.close()
    finally:
        for cl in clients:
            cl.close()
        c.close()


# -- memory --------------------------------------------------------------------------------
def test_unreceived_tagged_messages_do_not_grow_the_agent():
    """An authenticated client floods tags nobody receives: the agent's memory plateaus, and it keeps serving."""
    require_ucxx()
    c = AgentCluster(1, extra=["--sweep-interval", "0.05"])
    agent = c.agents[0]
    flooder = RawClient(agent.port)
    try:
        flooder.send(flooder.request(P.Op.PING, ""))
        assert flooder.reply().status == P.Status.OK
        msg = bytearray(4096)
        rng = random.Random(0)

        async def burst(n: int) -> None:
            await asyncio.gather(*(flooder.ep.send(msg, tag=rng.getrandbits(63), force_tag=True) for _ in range(n)))

        def flood_round() -> None:
            asyncio.run_coroutine_threadsafe(burst(10_000), ucx_loop()).result(120)

        flood_round()
        time.sleep(0.5)
        after_one = agent.rss_bytes()
        for _ in range(6):  # 240 MB more of messages nobody receives
            flood_round()
        time.sleep(0.5)
        grown = agent.rss_bytes() - after_one
        assert grown < 64 << 20, f"agent grew {grown >> 20} MiB over 240 MB of unreceived messages"
        flooder.send(flooder.request(P.Op.PING, ""))
        assert flooder.reply().status == P.Status.OK
    finally:
        flooder.close()
        c.close()


# -- the lane --------------------------------------------------------------------------------
def test_same_host_peer_uses_a_lane_unless_disabled(agent):
    for shm, lane in ((True, True), (False, False)):
        peer = PeerBackend(agent.addresses, secret=SECRET, shm=shm)
        try:
            data = os.urandom(3 << 20)
            peer.put("lane/x", [data[:1000], data[1000:]])
            out = bytearray(4 << 20)
            got = peer.get("lane/x", out=out)
            assert got.obj is out and bytes(got) == data
            assert [conn.lane for conn in peer._conns.values()] == [lane]
        finally:
            peer.close()
    c = AgentCluster(1, extra=["--no-shm-lanes"])
    try:
        peer = PeerBackend(c.addresses, secret=c.secret)
        try:
            peer.put("lane/y", b"y")
            assert [conn.lane for conn in peer._conns.values()] == [False]
        finally:
            peer.close()
    finally:
        c.close()


@pytest.mark.parametrize("shm", [True, False], ids=["lane", "tcp"])
def test_peer_reconnects_after_the_agent_closes_an_idle_connection(quick_agent, shm):
    """The agent's idle timeout closes a cached session (and its lane); the next request reconnects promptly."""
    peer = PeerBackend(quick_agent.addresses, secret=SECRET, shm=shm, timeout_s=30)
    try:
        peer.put("idle/x", b"1")
        conn = next(iter(peer._conns.values()))
        assert conn.lane == shm
        time.sleep(3.0)  # idle timeout 2 s
        t0 = time.monotonic()
        peer.put("idle/y", b"2")
        assert bytes(peer.get("idle/x")) == b"1"
        assert time.monotonic() - t0 < 10.0
        assert next(iter(peer._conns.values())) is not conn
    finally:
        peer.close()


def test_clients_killed_mid_transfer_on_the_lane_never_take_the_agent_down(agent):
    """Same-host clients SIGKILLed again and again in the middle of gets (by lane) and puts: the agent survives
    every one, frees every reservation and keeps serving lanes. (Two designs failed this: with UCX's CMA transport
    the agent aborted within a few kills; receiving puts over shared memory wedged its queue for every lane.)"""
    import random
    import signal
    import subprocess
    import sys

    from tests._agents import REPO

    root = agent.agents[0].root
    seed = PeerBackend(agent.addresses, secret=SECRET)
    try:
        seed.put("killed/big", os.urandom(1 << 20) * 128)
        assert [c.lane for c in seed._conns.values()] == [True]
    finally:
        seed.close()
    script = ("import os, sys; from backends.peer import PeerBackend, PeerAddress as A\n"
              "b = PeerBackend([A('node0', '127.0.0.1', int(sys.argv[1]))], secret=sys.argv[2].encode(), "
              "chunk_shift=20)\n"
              "data = os.urandom(1 << 20) * 256\n"
              "while True:\n    b.get('killed/big'); b.put('killed/x', data)")
    env = dict(os.environ, UCXX_LOG_LEVEL="FATAL")
    rng = random.Random(7)
    for _ in range(6):
        p = subprocess.Popen([sys.executable, "-c", script, str(agent.agents[0].port), SECRET.decode()], cwd=REPO,
                             env=env)
        try:
            time.sleep(2.0 + rng.random() * 2.0)
        finally:
            p.send_signal(signal.SIGKILL)
            p.wait(10)
        assert agent.agents[0].proc.poll() is None, "a client's death took the agent down"
    assert _wait_until(lambda: not _tmp_files(root), 30), "a dead client's reservation stayed"
    peer = PeerBackend(agent.addresses, secret=SECRET, timeout_s=20)
    try:
        peer.put("killed/y", b"fine")
        assert bytes(peer.get("killed/y")) == b"fine"
        assert len(peer.get("killed/big")) == 128 << 20
        assert [c.lane for c in peer._conns.values()] == [True]
    finally:
        peer.close()


def test_lanes_only_without_cma(monkeypatch):
    from backends.ucx_util import cma_excluded

    assert cma_excluded({})  # the default: UCX_TLS=^cma
    assert cma_excluded({"UCX_TLS": "^cma"}) and cma_excluded({"UCX_TLS": "^sm"})
    assert cma_excluded({"UCX_TLS": "tcp,posix,sysv,self"})
    for tls in ("all", "sm", "tcp,cma", "^posix", "rc,shm,cuda_copy"):
        assert not cma_excluded({"UCX_TLS": tls}), tls
    require_ucxx()  # imported (with its environment) before the agent's is changed below
    monkeypatch.setenv("UCX_TLS", "all")
    c = AgentCluster(1)
    try:
        peer = PeerBackend(c.addresses, secret=c.secret)
        try:
            peer.put("cma/x", b"x")
            assert [conn.lane for conn in peer._conns.values()] == [False]
        finally:
            peer.close()
    finally:
        c.close()


def test_digest_cache_follows_replacement_behind_the_agents_back(agent):
    """The agent answers a GET's checksum from the digest recorded at its PUT while the object's version
    (inode, size, change time) holds. An object replaced by the node's own store, not through the agent,
    even in the very same pooled segment (same inode), is hashed afresh: never a false alarm."""
    from backends.host import HostBackend

    root = agent.agents[0].root
    local = HostBackend(root, recycle_grace_s=0.0)
    peer = PeerBackend(agent.addresses, secret=SECRET)
    try:
        data = os.urandom(1 << 20)
        peer.put("digest/x", data)
        assert bytes(peer.get("digest/x")) == data  # served with the digest recorded at the put
        other = os.urandom(1 << 20)
        local.put("digest/x", other)  # a new segment under the same name
        assert bytes(peer.get("digest/x")) == other
        inode = (root / "digest" / "x").stat().st_ino
        assert local.delete("digest/x")  # into the pool...
        third = os.urandom(1 << 20)
        local.put("digest/x", third)  # ...and straight back under the same name: same inode, new bytes
        assert (root / "digest" / "x").stat().st_ino == inode
        assert bytes(peer.get("digest/x")) == third
    finally:
        peer.close()
        local.close()


def test_a_stuck_receive_gives_its_shared_memory_back(tmp_path):
    """A receive UCX never finishes nor cancels keeps its mapping, but its segment's pages are punched out, so it
    costs no shared memory (a late write stays harmless)."""
    from backends.host import HostBackend
    from tierstore.agent.conn import _release_stuck

    root = Path("/dev/shm") / f"ts-stuck-{uuid.uuid4().hex[:8]}"
    host = HostBackend(root)
    try:
        res = host.reserve("stuck/x", 16 << 20)
        res.buffer[:] = b"x" * (16 << 20)
        (tmp,) = (root / ".tmp").iterdir()  # a reservation is written in the tier's .tmp until commit
        assert tmp.stat().st_blocks * 512 >= 16 << 20
        _release_stuck(res.buffer)
        assert tmp.stat().st_blocks == 0
        res.buffer[123] = 1
        res.abort()
        assert list((root / ".tmp").iterdir()) == []
        assert not (root / "stuck").exists() or list((root / "stuck").iterdir()) == []
    finally:
        host.close()
        shutil.rmtree(root, ignore_errors=True)
