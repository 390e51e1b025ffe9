"""Placement: which objects go to which tiers, by the failure class each survives.

TierCheck's rule: every save lands in memory close to the trainer (device,
host: a failed step, a process crash); replicas in other nodes' memory
survive a node loss (peer); bases and every K-th step go to durable storage
(a cluster outage). :class:`Placement` states it declaratively:

- ``peer_replicas``: R other nodes hold a replica of every object (0: none);
- ``durable_every``: objects of steps divisible by K go to the durable tier;
  full objects (bases) always go, so every delta chain's base is durable;
  ``0`` sends nothing but bases; ``1`` (the default) sends everything.
- budgets and version counts per tier are in :class:`~tierstore.config.StoreConfig`
  (``host_capacity_bytes``) and in garbage collection's retention.

Eviction never drops the last copy of a committed version that is not yet
durable: a full host tier makes the save fail with ``TierFullError``.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierstore.errors import ConfigError

__all__ = ["Placement"]


@dataclass(frozen=True)
class Placement:
    peer_replicas: int = 0
    durable_every: int = 1

    def __post_init__(self) -> None:
        if self.peer_replicas < 0 or self.durable_every < 0:
            raise ConfigError("peer_replicas and durable_every must be >= 0")

    def to_durable(self, kind: str, step: int) -> bool:
        if kind == "full":
            return True
        return self.durable_every > 0 and step % self.durable_every == 0

    def to_peer(self, kind: str, step: int) -> bool:
        return self.peer_replicas > 0
