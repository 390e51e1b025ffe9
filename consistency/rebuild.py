"""Rebuild the Redis index from the durable tier's manifests.

The index is a cache of what the durable tier proves: S3 (or the local
durable directory) is the source of truth for durable steps. When the index
is lost (a server restarted without persistence, a FLUSHALL), call
:func:`rebuild_index` once, from one process, before restoring:

1. list ``<model>/_manifest/*.json`` in the durable tier (every model, or one);
2. parse and validate each manifest (``durable`` must be true);
3. check that every object it names (its own and its ``deps``: the delta bases
   and ref targets of older steps it reaches) is present in the durable tier;
   a step with a missing object is skipped and reported;
4. re-record every object with the durable tier (and the host tier where the
   local host tier still holds a copy with the same size), the step as
   ``durable`` with its world and layout, and its manifest;
5. raise the model's epoch to at least the newest manifest's epoch (a restore
   then bumps it past every writer of those steps).

Steps that were only committed in memory are gone from the index: the report
lists the steps whose objects the host tier still holds but no durable
manifest covers (``lost_steps``). Idempotent; safe to run again.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from consistency.index import translate_redis_errors
from consistency.manifest import parse_manifest
from tierstore.errors import ConfigError, ManifestError, TierStoreError
from tierstore.keys import ShardKey

if TYPE_CHECKING:
    from tierstore.store import TierStore

__all__ = ["RebuildReport", "rebuild_index"]

log = logging.getLogger(__name__)

_MANIFEST_DIR = "/_manifest/"


@dataclass
class RebuildReport:
    """What :func:`rebuild_index` restored and what it could not."""

    restored: dict[str, list[int]] = field(default_factory=dict)
    objects: int = 0
    skipped: dict[str, str] = field(default_factory=dict)
    lost_steps: dict[str, list[int]] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"restored": self.restored, "objects": self.objects, "skipped": self.skipped,
                "lost_steps": self.lost_steps}


def _manifest_names(store: TierStore, model: str | None) -> list[tuple[str, str, int]]:
    out = []
    for name in store.durable.list(f"{model}/_manifest/" if model else ""):
        if _MANIFEST_DIR not in name or not name.endswith(".json"):
            continue
        m, rest = name.split(_MANIFEST_DIR, 1)
        if "/" in m or model is not None and m != model:
            continue
        stem = rest[: -len(".json")]
        if stem.isdigit():
            out.append((name, m, int(stem)))
    return sorted(out, key=lambda t: (t[1], t[2]))


def _record(store: TierStore, o: dict, epoch: int) -> None:
    key = ShardKey.parse(o["key"])
    tiers = [store.durable.tier]
    try:
        if store.host.size(str(key)) == o["size"]:
            tiers.append(store.host.tier)
    except TierStoreError:
        pass
    store.index.record_object(
        key, kind=o["kind"], size=o["size"], checksum=o["checksum"], tiers=tiers,
        base=ShardKey.parse(o["base"]) if o.get("base") else None,
        target=ShardKey.parse(o["target"]) if o.get("target") else None, epoch=epoch,
    )


def rebuild_index(store: TierStore, model: str | None = None) -> RebuildReport:
    """Restore the index's durable steps (of ``model``, or of every model) from durable manifests.

    Raises:
        ConfigError: the store has no durable tier.
        TierUnavailableError: the index or the durable tier cannot be reached.
    """
    if store.durable is None:
        raise ConfigError("rebuild_index needs a durable tier: the index is rebuilt from its manifests")
    report = RebuildReport()
    idx = store.index
    max_epoch: dict[str, int] = {}
    for name, m_name, step in _manifest_names(store, model):
        raw = store.durable.get(name)
        if raw is None:
            continue
        try:
            m = parse_manifest(bytes(raw), model=m_name, step=step)
            if not m.get("durable"):
                raise ManifestError("not a durable manifest")
        except ManifestError as e:
            report.skipped[name] = str(e)
            log.warning("rebuild: skipping %s: %s", name, e)
            continue
        entries = [o for v in m["ranks"].values() for o in v["objects"]] + list(m.get("deps", []))
        missing = [o["key"] for o in entries if not store.durable.exists(o["key"])]
        if missing:
            report.skipped[name] = f"{len(missing)} object(s) missing from the durable tier, e.g. {missing[0]}"
            continue
        for o in entries:
            _record(store, o, -1)
        report.objects += len(entries)
        ks = store.steps._keys(m_name, step)
        committed = m.get("committed_at", 0.0)
        index_copy = {k: v for k, v in m.items() if k not in ("durable", "deps")}
        with translate_redis_errors(f"rebuild step {step} of {m_name}", idx.url):
            pipe = idx.r.pipeline(transaction=True)
            pipe.sadd("ts:models", m_name)
            pipe.delete(ks["step"], ks["votes"])
            pipe.hset(ks["step"], mapping={
                "state": "durable", "world": m["world"], "epoch": m.get("epoch", 0), "started": committed,
                "decided": committed, "durable_at": committed, "layout": json.dumps(m.get("layout")),
                "timeout": 0, "nmigrated": m["world"], "rebuilt": 1,
            })
            pipe.zadd(ks["steps"], {str(step): step})
            pipe.set(ks["manifest"], json.dumps(index_copy, separators=(",", ":")))
            pipe.execute()
        report.restored.setdefault(m_name, []).append(step)
        max_epoch[m_name] = max(max_epoch.get(m_name, 0), int(m.get("epoch", 0) or 0))
    for m_name, ep in max_epoch.items():
        with translate_redis_errors(f"rebuild epoch of {m_name}", idx.url):
            cur = int(idx.r.get(idx.k(m_name, "epoch")) or 0)
            if ep > cur:
                idx.r.set(idx.k(m_name, "epoch"), ep)
    report.lost_steps = _lost_steps(store, model, report)
    return report


def _lost_steps(store: TierStore, model: str | None, report: RebuildReport) -> dict[str, list[int]]:
    """Steps whose objects the host tier holds but that no restored durable manifest covers."""
    held: dict[tuple[str, int], list[ShardKey]] = {}
    try:
        names = list(store.host.list(f"{model}/" if model else ""))
    except TierStoreError:
        return {}
    for n in names:
        try:
            key = ShardKey.parse(n)
        except TierStoreError:
            continue
        if key.step not in report.restored.get(key.model, []):
            held.setdefault((key.model, key.step), []).append(key)
    lost: dict[str, list[int]] = {}
    for (m_name, step), keys in sorted(held.items()):
        if not any(store.index.get_objects(keys)):  # objects reached as deps of a durable step are not lost
            lost.setdefault(m_name, []).append(step)
    return lost
