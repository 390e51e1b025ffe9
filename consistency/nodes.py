"""The node registry: which node agents are alive and where they listen.

Each agent registers ``ts:node:<id>`` (a hash: address, capacity, used, pid,
started) with a TTL that its heartbeat refreshes, and adds its id to
``ts:nodes``. A crashed agent disappears when its TTL expires; a stopped one
unregisters. Readers: peer discovery (:func:`discovery`, for
:class:`backends.peer.PeerBackend`), ``tierstore admin nodes`` and the testbed.

The registry keys live outside any model's hash slot; every operation here
touches one node's key plus the set, as separate commands (never a
cross-slot script).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from backends.peer import PeerAddress
from consistency.index import Index, translate_redis_errors

__all__ = ["NodeInfo", "NodeRegistry", "discovery"]

_NODES = "ts:nodes"


def _node_key(node_id: str) -> str:
    return f"ts:node:{node_id}"


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else ("" if v is None else str(v))


@dataclass(frozen=True)
class NodeInfo:
    """One registered node. ``alive`` is false when its registration expired but its id is still listed."""

    node_id: str
    alive: bool
    address: str | None = None
    capacity: int | None = None
    used: int | None = None
    pid: int | None = None
    started: float | None = None
    ttl_left_s: float | None = None


class NodeRegistry:
    """Registrations of node agents in the index.

    Args:
        index: the index the nodes register in.
    """

    def __init__(self, index: Index) -> None:
        self.index = index

    def beat(self, node_id: str, fields: dict[str, Any], ttl_s: float) -> None:
        """(Re-)register ``node_id`` with ``fields`` for ``ttl_s`` seconds (one heartbeat)."""
        r = self.index._r  # consistency/ owns the client
        with translate_redis_errors(f"register node {node_id}", self.index.url):
            pipe = r.pipeline(transaction=False)
            pipe.hset(_node_key(node_id), mapping={k: str(v) for k, v in fields.items()})
            pipe.pexpire(_node_key(node_id), max(1, int(ttl_s * 1000)))
            pipe.sadd(_NODES, node_id)
            pipe.execute()

    def remove(self, node_id: str) -> None:
        """Unregister ``node_id`` now (what its TTL would do a few seconds later)."""
        r = self.index._r
        with translate_redis_errors(f"unregister node {node_id}", self.index.url):
            r.delete(_node_key(node_id))
            r.srem(_NODES, node_id)

    def is_registered(self, node_id: str) -> bool:
        """Whether ``node_id`` has a live (unexpired) registration."""
        with translate_redis_errors(f"read node {node_id}", self.index.url):
            return bool(self.index._r.exists(_node_key(node_id)))

    def nodes(self) -> list[NodeInfo]:
        """Every listed node, sorted by id, with its registration (if still alive) and TTL left."""
        r = self.index._r
        with translate_redis_errors("list nodes", self.index.url):
            ids = sorted(_s(n) for n in r.smembers(_NODES))
            pipe = r.pipeline(transaction=False)
            for n in ids:
                pipe.hgetall(_node_key(n))
                pipe.pttl(_node_key(n))
            rows = pipe.execute()
        out = []
        for i, n in enumerate(ids):
            h = {_s(k): _s(v) for k, v in rows[2 * i].items()}
            ttl_ms = rows[2 * i + 1]
            out.append(NodeInfo(
                node_id=n,
                alive=bool(h),
                address=h.get("address") or None,
                capacity=int(h["capacity"]) if h.get("capacity") else None,
                used=int(h["used"]) if h.get("used") else None,
                pid=int(h["pid"]) if h.get("pid") else None,
                started=float(h["started"]) if h.get("started") else None,
                ttl_left_s=round(ttl_ms / 1000, 2) if isinstance(ttl_ms, int) and ttl_ms >= 0 else None,
            ))
        return out


def discovery(index: Index) -> Callable[[], list[PeerAddress]]:
    """A discovery callable for :class:`backends.peer.PeerBackend`: the live agents' addresses."""
    registry = NodeRegistry(index)

    def discover() -> list[PeerAddress]:
        out = []
        for node in registry.nodes():
            if not node.alive or not node.address:
                continue  # registration expired: the agent is gone
            host, _, port = node.address.rpartition(":")
            out.append(PeerAddress(node.node_id, host, int(port)))
        return out

    return discover
