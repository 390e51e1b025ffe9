"""The read path: resolve the freshest consistent set of layers of a model.

``resolve(protocol, tiers, model, max_staleness=S)`` (the store's
:meth:`~tierstore.store.TierStore.resolve` passes its protocol and tiers):

- the resume step R is the newest committed (or durable) step that can be
  rebuilt;
- for each layer of the model at R (its declared layout), the newest version
  v <= R whose manifest holds the layer's shards for every rank, whose
  objects (and their delta bases and ref targets, transitively) are recorded
  in the index with at least one tier that still holds them, and with
  R - v <= S (S = 0: exact, every layer from R);
- parameters and optimizer state of a layer live in the same shard, so they
  always come from the same version.

If no step can be rebuilt, :class:`NoValidCopyError` names the first missing
shard of the newest step. All ranks resolve against the same committed
manifests, and restore bumps the epoch first, so no zombie can commit a newer
step while they do: they agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from backends.base import Backend
from consistency.index import ObjectRecord
from consistency.manifest import manifest_layers
from consistency.twophase import StepProtocol
from tierstore.errors import NoValidCopyError, TierStoreError
from tierstore.keys import ShardKey

__all__ = ["Resolution", "resolve"]


@dataclass
class Resolution:
    """Where a restore reads from."""

    model: str
    step: int
    world_size: int
    layers: dict[str, int]
    objects: dict[tuple[str, int], ObjectRecord]
    extra: dict[int, Any] = field(default_factory=dict)
    state: str = "committed"

    def keys_for_rank(self, rank: int) -> dict[str, ShardKey]:
        return {layer: info.key for (layer, r), info in self.objects.items() if r == rank}


class _Reach:
    """Caches which objects are reachable (recorded, held by a tier, chain intact)."""

    def __init__(self, protocol: StepProtocol, tiers: Sequence[Backend], max_chain: int):
        self.index = protocol.index
        self.tiers = tiers
        self.max_chain = max_chain
        self.cache: dict[ShardKey, str | None] = {}

    def why_not(self, key: ShardKey, depth: int = 0) -> str | None:
        if key in self.cache:
            return self.cache[key]
        reason: str | None = None
        if depth > self.max_chain:
            reason = f"{key}: chain too long"
        else:
            rec = self.index.get_object(key)
            if rec is None:
                reason = f"{key} is not in the index"
            elif not any(self._holds(t, key) for t in self.tiers if t.tier in rec.tiers):
                reason = f"{key}: no live tier holds it (index says {sorted(rec.tiers)})"
            elif rec.kind == "delta" and rec.base is not None:
                reason = self.why_not(rec.base, depth + 1)
            elif rec.kind == "ref" and rec.target is not None:
                reason = self.why_not(rec.target, depth + 1)
        self.cache[key] = reason
        return reason

    @staticmethod
    def _holds(tier: Backend, key: ShardKey) -> bool:
        try:
            return tier.exists(str(key))
        except TierStoreError:  # an unreachable tier does not hold it for this restore
            return False


def resolve(protocol: StepProtocol, tiers: Sequence[Backend], model: str, max_staleness: int = 0, *,
            max_chain: int = 64) -> Resolution:
    """Resolve ``model``'s resume step and the version of each layer; see the module docstring.

    Args:
        protocol: the commit protocol (manifests, object records).
        tiers: the live tiers, fastest first.
        max_chain: the longest delta/ref chain a read follows.
    """
    steps = [(s, st) for s, st in protocol.steps(model) if st in ("committed", "durable")]
    if not steps:
        raise NoValidCopyError(f"model {model!r} has no committed step", model=model)
    reach = _Reach(protocol, tiers, max_chain)
    manifests: dict[int, dict | None] = {}

    def manifest(step: int) -> dict | None:
        if step not in manifests:
            manifests[step] = protocol.manifest(model, step)
        return manifests[step]

    committed = [s for s, _ in steps]
    first_failure: str | None = None
    for r_step in reversed(committed):
        m_r = manifest(r_step)
        if m_r is None:
            continue
        world = m_r["world"]
        chosen: dict[str, int] = {}
        objects: dict[tuple[str, int], ObjectRecord] = {}
        failure = None
        for layer in manifest_layers(m_r):
            found = False
            for v in reversed([s for s in committed if r_step - max_staleness <= s <= r_step]):
                m_v = manifest(v)
                if m_v is None or m_v["world"] != world:
                    continue
                entries = {}
                for rank, vote in m_v["ranks"].items():
                    for o in vote["objects"]:
                        k = ShardKey.parse(o["key"])
                        if k.layer == layer:
                            entries[int(rank)] = (k, o)
                if not entries:
                    continue
                missing = [reach.why_not(k) for k, _ in entries.values()]
                missing = [w for w in missing if w]
                if missing:
                    failure = failure or missing[0]
                    continue
                chosen[layer] = v
                for rank, (k, o) in entries.items():
                    objects[(layer, rank)] = ObjectRecord.from_json(o)
                found = True
                break
            if not found:
                failure = failure or f"layer {layer!r} has no reachable version within {max_staleness} step(s) of {r_step}"
                break
        else:
            extra = {int(r): v.get("extra") for r, v in m_r["ranks"].items()}
            state = dict(steps).get(r_step, "committed")
            return Resolution(model, r_step, world, chosen, objects, extra, state)
        first_failure = first_failure or failure
    raise NoValidCopyError(
        f"no committed step of {model!r} can be rebuilt: {first_failure}", model=model, reason=first_failure
    )


