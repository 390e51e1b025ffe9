"""A real local Redis Cluster: N primaries + N replicas of the bundled server on loopback (tests, benchmarks).

The cluster is made the way an operator without ``valkey-cli`` would make it,
through redis-py: ``CLUSTER ADDSLOTSRANGE`` on each primary, ``CLUSTER MEET``
to join the nodes, ``CLUSTER REPLICATE`` for the replicas, then wait until
every node reports ``cluster_state:ok`` and every replica's link is up. Each
node gets two free ports (client and cluster bus, ``--cluster-port``), so no
fixed port range is assumed. ``cluster-node-timeout`` is short (2 s by
default) so an automatic failover takes a few seconds; a busy machine wants
it longer, or nodes that answer late are failed over spuriously.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import redis
from redis.cluster import key_slot

from tierstore.embedded import server_binary
from tierstore.ports import free_port

__all__ = ["ClusterNode", "LocalCluster"]

SLOTS = 16384


@dataclass
class ClusterNode:
    port: int
    bus_port: int
    workdir: Path
    proc: subprocess.Popen | None = None

    def client(self, timeout: float = 5.0) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=timeout, decode_responses=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class LocalCluster:
    """``primaries`` primaries with one replica each, started by :meth:`start`, stopped by :meth:`stop`.

    Node ``i < primaries`` starts as a primary; node ``primaries + i`` as its replica.
    Usable as a context manager (start, then stop).
    """

    def __init__(self, workdir: Path, primaries: int = 3, node_timeout_ms: int = 2000):
        self.workdir = workdir
        self.primaries = primaries
        self.node_timeout_ms = node_timeout_ms
        self.nodes: list[ClusterNode] = []
        for i in range(2 * primaries):
            d = workdir / f"node{i}"
            d.mkdir(parents=True, exist_ok=True)
            self.nodes.append(ClusterNode(free_port(), free_port(), d))

    @property
    def url(self) -> str:
        """A seed URL: one node (the index detects the cluster behind it)."""
        return f"redis://127.0.0.1:{self.nodes[0].port}/0"

    # -- processes ---------------------------------------------------------------------
    def _spawn(self, n: ClusterNode) -> None:
        args = [server_binary(), "--port", str(n.port), "--cluster-port", str(n.bus_port), "--bind", "127.0.0.1",
                "--dir", str(n.workdir), "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(self.node_timeout_ms), "--appendonly", "no", "--save", "",
                "--repl-diskless-sync-delay", "0",
                "--logfile", str(n.workdir / "server.log")]
        n.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                n.client(1).ping()
                return
            except redis.exceptions.RedisError:
                if n.proc.poll() is not None:
                    raise RuntimeError(f"cluster node on port {n.port} exited: "
                                       f"{(n.workdir / 'server.log').read_text()[-1500:]}") from None
                time.sleep(0.02)
        raise RuntimeError(f"cluster node on port {n.port} did not start")

    def start(self) -> None:
        for n in self.nodes:
            self._spawn(n)
        cs = [n.client() for n in self.nodes]
        for i in range(self.primaries):
            lo, hi = i * SLOTS // self.primaries, (i + 1) * SLOTS // self.primaries - 1
            cs[i].execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
        for c in cs[1:]:
            c.execute_command("CLUSTER", "MEET", "127.0.0.1", self.nodes[0].port, self.nodes[0].bus_port)
        ids = [c.execute_command("CLUSTER", "MYID") for c in cs]
        self._until(lambda: all(self._known(c) >= len(cs) for c in cs), "the nodes to meet")
        for i in range(self.primaries):
            cs[self.primaries + i].execute_command("CLUSTER", "REPLICATE", ids[i])
        self.wait_ok()

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every live node says ``cluster_state:ok``, every live replica's link to its primary is up,
        and every live node sees every other live node online (``CLUSTER SHARDS`` health)."""
        live = {n.port for n in self.nodes if n.alive()}

        def ok() -> bool:
            for n in self.nodes:
                if not n.alive():
                    continue
                c = n.client(1)
                if c.cluster("info")["cluster_state"] != "ok":
                    return False
                repl = c.info("replication")
                if repl["role"] == "slave" and repl.get("master_link_status") != "up":
                    return False
                for shard in c.execute_command("CLUSTER", "SHARDS"):  # parsed into dicts by redis-py
                    for node in shard["nodes"]:
                        if int(node["port"]) in live and node["health"] != "online":
                            return False
            return True

        self._until(ok, "the cluster to be ok", timeout)

    @staticmethod
    def _known(c: redis.Redis) -> int:
        lines = c.execute_command("CLUSTER", "NODES").splitlines()
        return sum(1 for ln in lines if "handshake" not in ln and "noaddr" not in ln)

    @staticmethod
    def _until(cond, what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                if cond():
                    return
            except redis.exceptions.RedisError as e:
                last = e
            time.sleep(0.05)
        raise RuntimeError(f"timed out waiting for {what} (last error: {last})")

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        for n in self.nodes:
            if n.alive():
                assert n.proc is not None
                n.proc.kill()
                n.proc.wait(10)

    # -- topology ----------------------------------------------------------------------
    def node_by_port(self, port: int) -> ClusterNode:
        return next(n for n in self.nodes if n.port == port)

    def primary_of(self, key: str) -> ClusterNode:
        """The live node currently serving ``key``'s slot as primary."""
        slot = key_slot(key.encode())
        for n in self.nodes:
            if not n.alive():
                continue
            for lo, hi, primary, *_ in n.client(1).execute_command("CLUSTER", "SLOTS"):
                if lo <= slot <= hi:
                    return self.node_by_port(int(primary[1]))
        raise RuntimeError(f"no live node serves slot {slot}")

    def replica_of(self, primary: ClusterNode) -> ClusterNode:
        c = primary.client(1)
        myid = c.execute_command("CLUSTER", "MYID")
        for ln in c.execute_command("CLUSTER", "NODES").splitlines():
            f = ln.split()
            if f[3] == myid and "fail" not in f[2]:
                return self.node_by_port(int(f[1].split("@")[0].rsplit(":", 1)[1]))
        raise RuntimeError(f"primary on port {primary.port} has no replica")

    def kill(self, n: ClusterNode) -> None:
        assert n.proc is not None
        n.proc.kill()
        n.proc.wait(10)

    def restart(self, n: ClusterNode) -> None:
        """Start a killed node again (its nodes.conf makes it rejoin, as a replica if it was failed over)."""
        self._spawn(n)

    def flushall(self) -> None:
        for n in self.nodes:
            if n.alive() and n.client(1).info("replication")["role"] == "master":
                n.client().flushall()
