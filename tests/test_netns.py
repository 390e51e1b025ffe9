"""Partitions on real interfaces: nodes in network namespaces on a bridge, a node's link cut mid-protocol.

Topology (:class:`tierstore.cli.testbed.Testbed` with ``netns=True``): the
index server and the S3 server on the bridge's address, three nodes each in
its own namespace with its own address and agent; rank 0 on ``node0``, rank 1
on ``node1``, ``node2`` stands by. Ranks are scripted processes
(:mod:`tests._netns_rank`) inside their node's namespace; a partition sets
the node's veth down (:meth:`tierstore.cli.netns.Fabric.cut`).

Invariants tried:

* a partitioned rank's vote times out (a typed error, not a hang) and the
  step aborts at its timeout: nothing is half-committed;
* a restore elsewhere (``node2``, no durable tier) reads the surviving
  replicas of the partitioned rank's shards, bit for bit;
* once the link is back, the zombie is fenced: its vote, its puts and its
  late migration are refused, and the step's state does not move.

Skipped, with the reason, where namespaces cannot be made (no root, no ``ip``).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
import uuid

import pytest

from tierstore.cli.netns import netns_supported

pytestmark = pytest.mark.ucx

MIB = 2.0  # per layer and rank


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    ok, why = netns_supported()
    if not ok:
        pytest.skip(f"network namespaces cannot be made here: {why}")
    from tests._agents import require_ucxx
    from tierstore.cli.testbed import Testbed

    require_ucxx()
    tb = Testbed(tmp_path_factory.mktemp("netns"), nodes=3, ranks_per_node=1, netns=True)
    try:
        tb.start_services()
        for node in tb.nodes:
            tb.start_agent(node)
        yield tb
    finally:
        tb.close()


class RankProc:
    """One scripted rank in a node's namespace (see :mod:`tests._netns_rank`)."""

    def __init__(self, tb, node: str, name: str) -> None:
        self.name = name
        self.proc = tb.spawn(name, [sys.executable, "-m", "tests._netns_rank"], node=node, stdin=subprocess.PIPE)
        # spawn logs stdout to a file; results are read back from it line by line
        self.log = tb.work / f"{name}.log"
        self._seen = 0

    def __call__(self, cmd: str, timeout: float = 120.0, **args) -> dict:
        """Run ``cmd`` with ``args`` in the rank; wait ``timeout`` seconds for its answer."""
        self.proc.stdin.write((json.dumps({"cmd": cmd, **args}) + "\n").encode())
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines = [ln for ln in self.log.read_text(errors="replace").splitlines() if ln.startswith("{")]
            if len(lines) > self._seen:
                self._seen += 1
                return json.loads(lines[self._seen - 1])
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited: {self.log.read_text()[-3000:]}")
            select.select([], [], [], 0.05)
        raise AssertionError(f"{self.name}: no answer to {cmd} in {timeout}s\n{self.log.read_text()[-3000:]}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _open(tb, rank: RankProc, node: str, model: str, *, durable: bool = True, host_root=None, gate=None) -> None:
    opts = {"model": model, "home": str(tb.work / f"home-{rank.name}"), "redis": tb.redis_url,
            "durable": f"s3://{tb.bucket}/{model}" if durable else "none", "node_id": node,
            "host_root": str(host_root or tb.shm / node), "peer_replicas": 1,
            "peer_secret_file": str(tb.secret_file)}
    if durable:
        opts["s3_endpoint_url"] = tb.s3_endpoint
    if gate:
        opts["gate"] = str(gate)
    r = rank("open", **opts)
    assert r["ok"], r


def _save(ranks: dict[int, RankProc], step: int, epoch: int, *, step_timeout: float = 60.0) -> None:
    for r, proc in ranks.items():
        assert proc("put", step=step, rank=r, mib=MIB, epoch=epoch)["ok"]
    assert ranks[0]("begin", step=step, world=2, epoch=epoch, step_timeout=step_timeout)["ok"]
    states = [proc("vote", step=step, rank=r, epoch=epoch) for r, proc in ranks.items()]
    assert all(s["ok"] for s in states), states
    assert states[-1]["state"] == "committed", states


def _wait_replicated(tb, model: str, step: int, rank: int, timeout: float = 90.0) -> None:
    """Until the index records a peer replica of each of ``rank``'s shards of ``step``."""
    from consistency.index import Index
    from tierstore import ShardKey

    index = Index(tb.redis_url)
    try:
        deadline = time.monotonic() + timeout
        for layer in ("block0", "block1"):
            while "peer" not in index.get_object(ShardKey(model, layer, step, rank)).tiers:
                assert time.monotonic() < deadline, f"no peer replica of {model}/{layer}/{step}/{rank}"
                time.sleep(0.1)
    finally:
        index.close()


def _heal(tb, node: str, rank: RankProc) -> None:
    """Bring ``node``'s link back and wait until its rank reaches the index (ARP forgot it while cut)."""
    tb.fabric.heal(node)
    deadline = time.monotonic() + 60
    while not rank("epoch")["ok"]:
        assert time.monotonic() < deadline, f"{node} cannot reach the index after the partition healed"
        time.sleep(0.5)


def _restore_elsewhere(tb, model: str) -> tuple[dict, int]:
    """A replacement for rank 1 on node2, without the durable tier: it must read the replicas."""
    spare = RankProc(tb, "node2", f"{model}-spare-{uuid.uuid4().hex[:4]}")
    try:
        _open(tb, spare, "node2", model, durable=False)
        epoch = spare("epoch", bump=True)
        assert epoch["ok"], epoch
        return spare("restore", rank=1, mib=MIB, timeout=180), epoch["epoch"]
    finally:
        spare.close()


def test_partition_during_a_vote(bed):
    tb, model = bed, f"vote{uuid.uuid4().hex[:4]}"
    ranks = {0: RankProc(tb, "node0", f"{model}-r0"), 1: RankProc(tb, "node1", f"{model}-r1")}
    try:
        for r, proc in ranks.items():
            _open(tb, proc, f"node{r}", model)
        e1 = ranks[0]("epoch", bump=True)["epoch"]
        assert ranks[1]("epoch")["epoch"] == e1
        _save(ranks, 1, e1)
        for proc in ranks.values():
            assert proc("flush")["ok"]  # step 1 replicated to a peer and durable
        # step 2: rank 0 votes; rank 1 writes its shards, then its node is cut off before it votes
        assert ranks[0]("put", step=2, rank=0, mib=MIB, epoch=e1)["ok"]
        assert ranks[0]("begin", step=2, world=2, epoch=e1, step_timeout=4.0)["ok"]
        assert ranks[0]("vote", step=2, rank=0, epoch=e1)["state"] == "preparing"
        assert ranks[1]("put", step=2, rank=1, mib=MIB, epoch=e1)["ok"]
        assert ranks[1]("flush")["ok"]
        tb.fabric.cut("node1")
        sent = tb.fabric.counters("node1")["sent"]
        try:
            vote = ranks[1]("vote", step=2, rank=1, epoch=e1, timeout=180)
            assert not vote["ok"] and vote["error"] in ("TierUnavailableError", "CommitError"), vote
            assert ranks[0]("wait", step=2, wait_s=30)["state"] == "aborted"  # the step timed out, whole
            restored, e2 = _restore_elsewhere(tb, model)
            assert restored["ok"] and restored["step"] == 1, restored
            assert e2 > e1
            assert tb.fabric.counters("node1")["sent"] == sent  # nothing crossed the cut link
        finally:
            _heal(tb, "node1", ranks[1])
        # the zombie is back on the network: fenced
        again = ranks[1]("vote", step=2, rank=1, epoch=e1, timeout=60)
        assert not again["ok"] and again["error"] in ("FencedError", "StepAbortedError", "CommitError"), again
        late = ranks[1]("put", step=3, rank=1, mib=MIB, epoch=e1, timeout=60)
        assert not late["ok"] and late["error"] == "FencedError", late
        begin = ranks[1]("begin", step=3, world=2, epoch=e1)
        assert not begin["ok"] and begin["error"] == "FencedError", begin
        assert ranks[0]("state", step=2)["state"] == "aborted"
    finally:
        for proc in ranks.values():
            proc("exit", timeout=10) if proc.proc.poll() is None else None
            proc.close()


def test_partition_during_migration(bed, tmp_path):
    tb, model = bed, f"mig{uuid.uuid4().hex[:4]}"
    gate = tmp_path / "open-the-gate"
    ranks = {0: RankProc(tb, "node0", f"{model}-r0"), 1: RankProc(tb, "node1", f"{model}-r1")}
    try:
        _open(tb, ranks[0], "node0", model)
        _open(tb, ranks[1], "node1", model, gate=gate)  # rank 1's uploads wait at the gate
        e1 = ranks[0]("epoch", bump=True)["epoch"]
        _save(ranks, 1, e1)  # committed in memory; rank 1's migration is held
        _wait_replicated(tb, model, 1, 1)
        assert ranks[0]("flush")["ok"]
        assert ranks[0]("state", step=1)["state"] == "committed"  # not durable: rank 1 has not migrated
        tb.fabric.cut("node1")
        try:
            gate.touch()  # rank 1's uploads start now, into a dead link
            time.sleep(1.0)
            restored, e2 = _restore_elsewhere(tb, model)
            assert restored["ok"] and restored["step"] == 1, restored
            assert e2 > e1
            assert ranks[0]("state", step=1)["state"] == "committed"
        finally:
            _heal(tb, "node1", ranks[1])
        # the zombie's uploads failed across the cut link (or, finishing late, are fenced): the step stays
        # committed in memory, never durable by a zombie's word
        flushed = ranks[1]("flush", timeout=240)
        if flushed["ok"]:  # the uploads got through after the heal: their "migrated" mark was refused
            assert "TSFENCED" in ranks[1].log.read_text() or "FencedError" in ranks[1].log.read_text()
        else:
            assert flushed["error"] in ("MigrationError", "FencedError"), flushed
        assert ranks[0]("state", step=1)["state"] == "committed", flushed
        late = ranks[1]("put", step=2, rank=1, mib=MIB, epoch=e1, timeout=60)
        assert not late["ok"] and late["error"] == "FencedError", late
    finally:
        for proc in ranks.values():
            proc("exit", timeout=10) if proc.proc.poll() is None else None
            proc.close()


def test_agent_listener_inside_a_namespace(bed):
    """ucxx binds every interface of the agent's namespace (it has no bind option). Inside a namespace that is
    the node's own address and loopback: other nodes and the host reach it at the node's address; another
    node's 127.0.0.1 is that node's own loopback. UCX must use the node's interface, not ``lo``."""
    import socket

    tb = bed
    port = _agent_port(tb, "node0")
    script = ("import sys; from backends.peer import PeerBackend, PeerAddress as A; "
              "b = PeerBackend([A('node0', sys.argv[1], int(sys.argv[2]))], "
              "secret=open(sys.argv[3], 'rb').read().strip(), connect_timeout_s=3, timeout_s=10); "
              "print(b.ping()); b.close()")

    def ping_from_node1(host: str, **env: str) -> str:
        argv = tb.fabric.command("node1", [sys.executable, "-c", script, host, str(port), str(tb.secret_file)])
        p = subprocess.run(argv, env={**tb.env, **tb.fabric.env("node1"), **env}, capture_output=True, text=True,
                           timeout=120)
        return p.stdout + p.stderr

    assert "'node0': True" in ping_from_node1(tb.fabric.ip["node0"])
    assert "'node0': False" in ping_from_node1("127.0.0.1")
    # with UCX on the namespace's loopback the data path cannot reach another node
    assert "'node0': False" in ping_from_node1(tb.fabric.ip["node0"], UCX_NET_DEVICES="lo")
    # the host (the bridge's side) reaches the listening port too: bind-all means every interface of the namespace
    with socket.create_connection((tb.fabric.ip["node0"], port), timeout=5):
        pass


def _agent_port(tb, node: str) -> int:
    from consistency.index import Index
    from consistency.nodes import NodeRegistry

    info = next(n for n in NodeRegistry(Index(tb.redis_url)).nodes() if n.node_id == node)
    host, _, port = info.address.rpartition(":")
    assert host == tb.fabric.ip[node]
    return int(port)


def test_fabric_is_gone_after_close(tmp_path):
    ok, why = netns_supported()
    if not ok:
        pytest.skip(f"network namespaces cannot be made here: {why}")
    from tierstore.cli.netns import Fabric

    with Fabric(["a", "b"]) as f:
        names = set(os.listdir("/var/run/netns")) if os.path.isdir("/var/run/netns") else set()
        assert set(f.ns.values()) <= names
        assert subprocess.run(["ip", "link", "show", f.bridge], capture_output=True).returncode == 0
    names = set(os.listdir("/var/run/netns")) if os.path.isdir("/var/run/netns") else set()
    assert not set(f.ns.values()) & names
    assert subprocess.run(["ip", "link", "show", f.bridge], capture_output=True).returncode != 0
