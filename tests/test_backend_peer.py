"""The peer tier against live agents (real subprocesses on loopback): conformance, replication, failures."""

from __future__ import annotations

import os
import threading
import time

import pytest

from backends.host import HostBackend
from backends.peer import PeerAddress, PeerBackend, rank_peers
from tests._agents import AgentCluster, AgentProc, require_ucxx
from tests.conformance import BackendConformance
from tierstore.errors import AuthenticationError, TierUnavailableError

pytestmark = pytest.mark.ucx


@pytest.fixture(scope="module")
def cluster3():
    require_ucxx()
    c = AgentCluster(3)
    yield c
    c.close()


@pytest.fixture
def fresh_cluster(request):
    require_ucxx()
    c = AgentCluster(request.param if hasattr(request, "param") else 2)
    yield c
    c.close()


def _wipe(cluster) -> None:
    b = PeerBackend(cluster.addresses, secret=cluster.secret)
    try:
        for name in list(b.list()):
            b.delete(name)
    finally:
        b.close()


class TestPeerConformance(BackendConformance):
    concurrent_create_once_checked = False
    concurrent_create_once_skip_reason = (
        "PeerBackend.atomic_create_once is False: if_absent is checked per replica, not across replicas"
    )

    @pytest.fixture
    def backend(self, cluster3):
        b = PeerBackend(cluster3.addresses, secret=cluster3.secret, replication=2, local_node_id="node0")
        yield b
        b.close()
        _wipe(cluster3)


# -- placement (pure logic) ----------------------------------------------------------
def test_rank_peers_deterministic_distinct_and_spread():
    peers = [PeerAddress(f"n{i}", "127.0.0.1", 1000 + i) for i in range(5)]
    firsts = set()
    for i in range(200):
        name = f"m/layer{i}/1/0"
        order = rank_peers(name, peers, exclude="n2")
        assert order == rank_peers(name, list(reversed(peers)), exclude="n2")  # input order does not matter
        assert len({p.node_id for p in order}) == 4 and "n2" not in {p.node_id for p in order}
        firsts.add(order[0].node_id)
    assert firsts == {"n0", "n1", "n3", "n4"}  # every peer leads for some names


# -- replication ---------------------------------------------------------------------
def test_replicas_on_distinct_non_local_nodes(cluster3):
    b = PeerBackend(cluster3.addresses, secret=cluster3.secret, replication=2, local_node_id="node1")
    try:
        data = os.urandom(300_000)
        b.put("rep/x", data)
        holders = [a.node_id for a in cluster3.agents if (a.root / "rep" / "x").exists()]
        assert holders == ["node0", "node2"]
        assert bytes(HostBackend(cluster3.agents[2].root).get("rep/x")) == data
        assert b.delete("rep/x") is True
        assert not any((a.root / "rep" / "x").exists() for a in cluster3.agents)
    finally:
        b.close()


def test_wrong_secret_is_refused(cluster3):
    b = PeerBackend(cluster3.addresses, secret=b"not the secret")
    try:
        with pytest.raises(AuthenticationError):
            b.put("auth/x", b"1")
    finally:
        b.close()
    assert not any((a.root / "auth").exists() for a in cluster3.agents)


def test_more_replicas_than_peers(cluster3):
    b = PeerBackend(cluster3.addresses, secret=cluster3.secret, replication=3, local_node_id="node0")
    try:
        with pytest.raises(TierUnavailableError):
            b.put("r3/x", b"1")
    finally:
        b.close()


@pytest.mark.parametrize("fresh_cluster", [3], indirect=True)
def test_sigkill_one_replica_get_still_works(fresh_cluster):
    c = fresh_cluster
    b = PeerBackend(c.addresses, secret=c.secret, replication=2)
    try:
        objs = {f"k/{i}": os.urandom(100_000 + i) for i in range(6)}
        objs["k/big"] = os.urandom(8 << 20)
        for name, data in objs.items():
            b.put(name, data)
        victim = rank_peers("k/big", c.addresses)[0].node_id  # the first replica of the big object
        next(a for a in c.agents if a.node_id == victim).kill()
        for name, data in objs.items():
            got = b.get(name)
            assert got is not None and bytes(got) == data, name  # bitwise, from the surviving replica
            assert b.exists(name)
        # a new put skips the dead node and still gets two replicas
        b.put("k/after", b"after")
        assert bytes(b.get("k/after")) == b"after"
        assert b.ping()[victim] is False
    finally:
        b.close()


def test_all_replicas_dead_raises_naming_nodes(fresh_cluster):
    c = fresh_cluster
    b = PeerBackend(c.addresses, secret=c.secret, replication=2)
    try:
        b.put("d/x", b"payload")
        for a in c.agents:
            a.kill()
        with pytest.raises(TierUnavailableError) as ei:
            b.get("d/x")
        assert sorted(ei.value.nodes) == ["node0", "node1"]
        with pytest.raises(TierUnavailableError) as ei:
            b.put("d/y", b"1")
        assert sorted(ei.value.nodes) == ["node0", "node1"]
    finally:
        b.close()


def test_kill_agent_mid_replication(fresh_cluster):
    """SIGKILL a replica while a large object streams to it: typed error, nothing half-written readable."""
    c = fresh_cluster
    b = PeerBackend(c.addresses, secret=c.secret, replication=2, chunk_shift=20)
    data = os.urandom(96 << 20)
    victim = c.agents[1]
    outcome: list[BaseException | None] = []

    def put() -> None:
        try:
            b.put("mid/obj", data)
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - inspected below
            outcome.append(e)

    t = threading.Thread(target=put)
    try:
        t.start()
        deadline = time.monotonic() + 30
        while not any(p.name.startswith(".tmp") for p in victim.root.rglob("*")) and time.monotonic() < deadline:
            time.sleep(0.001)  # the agent has reserved the object: the payload is streaming
        victim.kill()
        t.join(60)
        assert not t.is_alive()
        assert isinstance(outcome[0], TierUnavailableError), outcome
        assert outcome[0].nodes == ["node1"]
        assert HostBackend(victim.root).get("mid/obj") is None  # only an unpublished temp file remains
        got = b.get("mid/obj")  # the surviving replica is complete or absent, never partial
        assert got is None or bytes(got) == data
    finally:
        b.close()


def test_reconnects_after_agent_restart(fresh_cluster):
    c = fresh_cluster
    b = PeerBackend(c.addresses, secret=c.secret, replication=2)
    try:
        b.put("re/x", b"one")
        old = c.agents[0]
        old.kill()
        c.agents[0] = AgentProc(old.node_id, old.root, c.secret_file, ["--port", str(old.port)])
        assert bytes(b.get("re/x")) == b"one"  # survived in the host tier (/dev/shm) across the restart
        b.put("re/y", b"two")  # the cached endpoint to the dead process is replaced
        assert (c.agents[0].root / "re" / "y").exists()
    finally:
        b.close()


# -- trailer checks ------------------------------------------------------------------
def _exchanges(monkeypatch) -> list[tuple[str, int, int]]:
    """Every exchange of this process's peer connections: (op, status, payload bytes of the reply)."""
    from backends import agent_protocol as P
    from backends.peer_conn import PeerConn

    seen: list[tuple[str, int, int]] = []
    real = PeerConn.exchange

    async def spy(self, op, key, *a, **kw):
        reply, data = await real(self, op, key, *a, **kw)
        seen.append((P.Op.NAMES.get(op, str(op)), reply.status, 0 if data is None else data.nbytes))
        return reply, data

    monkeypatch.setattr(PeerConn, "exchange", spy)
    return seen


@pytest.fixture
def reader(cluster3):
    """A client of cluster3's agents (replication 1, on node0); everything on the agents is wiped after."""
    b = PeerBackend(cluster3.addresses, secret=cluster3.secret, replication=1, local_node_id="node0")
    yield b
    b.close()
    _wipe(cluster3)


def test_tail_moves_the_trailer_alone(reader, monkeypatch):
    """A trailer check on the peer tier (what resolve asks of every copy it does not read) moves the bytes it
    asks for, not the object: one TAIL exchange whose payload is 16 bytes, checksummed like a GET's."""
    data = os.urandom(2 << 20)
    reader.put("tail/x", data)
    seen = _exchanges(monkeypatch)
    assert reader.tail("tail/x", 16) == data[-16:]
    assert [e for e in seen if e[0] != "LANE"] == [("TAIL", 0, 16)]
    assert reader.tail("tail/missing", 16) is None
    asked = [e for e in seen[1:] if e[0] != "LANE"]  # a new connection's lane opens with its first request
    assert asked and all(op == "TAIL" and status == 1 and n == 0 for op, status, n in asked), seen


def test_range_moves_the_slice_alone(reader, monkeypatch):
    """A ranged read on the peer tier (a resharded restore's slices) moves the bytes it asks for, not the object:
    one RANGE exchange each, checksummed like a GET's; short where the object ends sooner, empty past its end."""
    data = os.urandom(2 << 20)
    reader.put("range/x", data)
    seen = _exchanges(monkeypatch)
    assert bytes(reader.get_range("range/x", 1000, 5000)) == data[1000:6000]
    assert [e for e in seen if e[0] != "LANE"] == [("RANGE", 0, 5000)]
    assert bytes(reader.get_range("range/x", len(data) - 10, 100)) == data[-10:]
    assert bytes(reader.get_range("range/x", len(data) + 5, 10)) == b""
    assert bytes(reader.get_range("range/x", 0, len(data))) == data
    assert reader.get_range("range/missing", 0, 16) is None
    asked = [(op, status, n) for op, status, n in seen if op != "LANE"]
    assert asked[:4] == [("RANGE", 0, 5000), ("RANGE", 0, 10), ("RANGE", 0, 0), ("RANGE", 0, len(data))]
    assert asked[4:] and all(e == ("RANGE", 1, 0) for e in asked[4:]), seen  # the miss: NOT_FOUND each


def test_range_from_an_agent_without_it_reads_the_object(reader, monkeypatch):
    """An agent from before RANGE answers UNKNOWN_OP (the client asks with an op number no agent knows); the
    client then reads the whole object by GET and returns the slice: the same answers."""
    from backends import agent_protocol as P

    data = os.urandom(100_000)
    reader.put("range/old", data)
    monkeypatch.setattr(P.Op, "RANGE", 99)
    seen = _exchanges(monkeypatch)
    assert bytes(reader.get_range("range/old", 10, 20)) == data[10:30]
    assert [(op, status) for op, status, _ in seen if op != "LANE"] == [("99", P.Status.UNKNOWN_OP),
                                                                        ("GET", P.Status.OK)]
    assert reader.get_range("range/gone", 0, 16) is None


def test_tail_from_an_agent_without_it_reads_the_object(reader, monkeypatch):
    """An agent from before TAIL answers UNKNOWN_OP (here: the client asks with an op number no agent knows);
    the client then reads the whole object by GET and returns its last bytes: the same answers."""
    from backends import agent_protocol as P

    data = os.urandom(100_000)
    reader.put("tail/old", data)
    monkeypatch.setattr(P.Op, "TAIL", 99)
    seen = _exchanges(monkeypatch)
    assert reader.tail("tail/old", 16) == data[-16:]
    assert [(op, status) for op, status, _ in seen if op != "LANE"] == [("99", P.Status.UNKNOWN_OP),
                                                                        ("GET", P.Status.OK)]
    assert reader.tail("tail/old", 0) == b""
    assert reader.tail("tail/gone", 16) is None
