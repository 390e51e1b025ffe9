"""Stand-in hosts for the testbed: Linux network namespaces on a private bridge (needs root and iproute2).

:class:`Fabric` builds, for nodes ``node0..``, one network namespace each,
joined to a bridge it creates in the launcher's namespace by a veth pair:

* the bridge ``tsbr<id>`` holds ``10.A.B.1/24`` (a /24 no interface here
  uses yet): the launcher and the services it runs (the index server, the S3
  server) bind there, so every node reaches them across its link;
* node ``i`` lives in namespace ``ts-<id>-node<i>`` with its end of the veth
  named :data:`IFNAME` at ``10.A.B.(10 + i)/24`` and its own loopback; its
  processes start through :meth:`Fabric.command` with :meth:`Fabric.env`
  (``UCX_NET_DEVICES`` naming :data:`IFNAME`, not ``lo``, or UCX's TCP
  transport would advertise the namespace's loopback to peers; and
  ``GLOO_SOCKET_IFNAME``).

Traffic between nodes crosses two veths and the bridge, so a node can be
partitioned: :meth:`Fabric.cut` sets its host-side veth down (packets are
dropped, nothing is reset: peers see silence, as with a pulled cable) and
:meth:`Fabric.heal` brings it back. A node agent's UCX listener binds every
interface of its namespace, which here means the node's own address and its
loopback: it is reachable across the bridge at the node's address only.

Shared memory (``/dev/shm``) is not namespaced, and the peer tier's
shared-memory lane is only used between processes in one network namespace
(:func:`backends.agent_protocol.host_id`), so node-to-node traffic never
bypasses the links.

:meth:`Fabric.down` removes every namespace (with its veth end) and the bridge.
"""

from __future__ import annotations

import ipaddress
import os
import random
import shutil
import subprocess
import uuid
from collections.abc import Sequence
from typing import Self

__all__ = ["IFNAME", "Fabric", "netns_supported"]

#: the name of each node's interface inside its namespace
IFNAME = "ts0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=30)


def netns_supported() -> tuple[bool, str]:
    """Whether namespaces, veths and bridges can be made here, and why not."""
    if shutil.which("ip") is None:
        return False, "the ip command (iproute2) is missing: apt-get install -y iproute2"
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    name = f"ts-probe-{uuid.uuid4().hex[:6]}"
    br = f"tsp{uuid.uuid4().hex[:8]}"
    try:
        r = _ip("netns", "add", name, check=False)
        if r.returncode != 0:
            return False, f"cannot create a network namespace: {r.stderr.strip()}"
        r = _ip("link", "add", br, "type", "bridge", check=False)
        if r.returncode != 0:
            return False, f"cannot create a bridge: {r.stderr.strip()}"
        return True, ""
    finally:
        _ip("link", "del", br, check=False)
        _ip("netns", "del", name, check=False)


def _used_networks() -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    out = _ip("-4", "-o", "addr", "show", check=False).stdout + _ip("-4", "route", "show", check=False).stdout
    nets = []
    for tok in out.split():
        if "/" in tok and tok[0].isdigit():
            try:
                nets.append(ipaddress.ip_network(tok, strict=False))
            except ValueError:
                pass
    return nets


class Fabric:
    """Namespaces ``node0..`` on a private bridge; see the module docstring.

    Args:
        nodes: the node names, in order (node ``i`` gets ``10.A.B.(10 + i)``).
    """

    def __init__(self, nodes: Sequence[str]) -> None:
        self.id = uuid.uuid4().hex[:6]
        self.nodes = list(nodes)
        self.bridge = f"tsbr{self.id}"
        used = _used_networks()
        for _ in range(1000):
            net = ipaddress.ip_network(f"10.{random.randint(64, 250)}.{random.randint(0, 255)}.0/24")
            if not any(net.overlaps(u) for u in used):
                break
        else:
            raise RuntimeError("no free 10.x.y.0/24 for the testbed's bridge")
        hosts = list(net.hosts())
        self.network = net
        self.gateway = str(hosts[0])
        self.ns = {n: f"ts-{self.id}-{n}" for n in self.nodes}
        self.ip = {n: str(hosts[9 + i]) for i, n in enumerate(self.nodes)}
        self.veth = {n: f"tsv{self.id}{i}" for i, n in enumerate(self.nodes)}
        self._up = False

    def up(self) -> Self:
        """Create the bridge, the namespaces and their links (undone by :meth:`down` if anything fails)."""
        self._up = True
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/{self.network.prefixlen}", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for n in self.nodes:
                ns, veth = self.ns[n], self.veth[n]
                _ip("netns", "add", ns)
                _ip("link", "add", veth, "type", "veth", "peer", "name", IFNAME, "netns", ns)
                _ip("link", "set", veth, "master", self.bridge, "up")
                _ip("-n", ns, "addr", "add", f"{self.ip[n]}/{self.network.prefixlen}", "dev", IFNAME)
                _ip("-n", ns, "link", "set", IFNAME, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.down()
            raise
        return self

    def command(self, node: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``node``'s namespace."""
        return ["ip", "netns", "exec", self.ns[node], *argv]

    def env(self, node: str) -> dict[str, str]:
        """Environment for ``node``'s processes: UCX and gloo on the node's interface."""
        return {"UCX_NET_DEVICES": IFNAME, "GLOO_SOCKET_IFNAME": IFNAME}

    def cut(self, node: str) -> None:
        """Partition ``node``: its link goes down (traffic to and from it is dropped)."""
        _ip("link", "set", self.veth[node], "down")

    def heal(self, node: str) -> None:
        _ip("link", "set", self.veth[node], "up")

    def counters(self, node: str) -> dict[str, int]:
        """Bytes that crossed ``node``'s link so far: ``sent`` by the node, ``received`` by it."""
        base = f"/sys/class/net/{self.veth[node]}/statistics"
        with open(f"{base}/rx_bytes") as rx, open(f"{base}/tx_bytes") as tx:  # host side: its rx is what the node sent
            return {"sent": int(rx.read()), "received": int(tx.read())}

    def down(self) -> None:
        """Remove the namespaces (their veth ends go with them) and the bridge. Idempotent."""
        if not self._up:
            return
        for n in self.nodes:
            _ip("link", "del", self.veth[n], check=False)
            _ip("netns", "del", self.ns[n], check=False)
        _ip("link", "del", self.bridge, check=False)
        self._up = False

    def __enter__(self) -> Self:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()
