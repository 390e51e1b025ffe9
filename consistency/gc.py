"""Garbage collection and host-tier eviction.

Retention (:class:`Retention`): keep the last ``keep_last`` committed steps,
every ``keep_durable_every``-th durable step, and every step still being
prepared. :func:`collect` deletes, from every tier and the index:

- objects of aborted steps, and of committed steps the retention drops,
  that no kept manifest reaches (a kept manifest reaches its own objects,
  their delta bases and their ref targets, transitively);
- orphans: objects of a step never begun, older than the newest decided step.

Steps still preparing, and anything newer than the newest decided step, are
never touched, nor is anything their objects reach.

Nothing reachable from a kept manifest is ever deleted, so it is safe to run
beside training: a step committing concurrently is newer than every step
collected. :func:`evict_host` frees host memory by dropping host copies that
the durable tier already holds, oldest first, never those of the newest
committed step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from consistency.index import translate_redis_errors
from consistency.manifest import durable_manifest_name, manifest_objects
from tierstore.errors import TierFullError
from tierstore.keys import ShardKey

if TYPE_CHECKING:
    from tierstore.store import TierStore

__all__ = ["GCReport", "Retention", "collect", "evict_host", "reachable"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Retention:
    keep_last: int = 2
    keep_durable_every: int = 0  # 0: keep no extra durable steps


@dataclass
class GCReport:
    kept_steps: list[int] = field(default_factory=list)
    dropped_steps: list[int] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    bytes_freed: int = 0
    dry_run: bool = True
    deferred: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"kept_steps": self.kept_steps, "dropped_steps": self.dropped_steps, "deleted": self.deleted,
                "bytes_freed": self.bytes_freed, "dry_run": self.dry_run, "deferred": self.deferred}


def _closure(store: TierStore, roots: set[ShardKey]) -> set[ShardKey]:
    """``roots`` with every delta base and ref target they reach, transitively (from index records)."""
    out: set[ShardKey] = set()
    todo = sorted(roots)
    while todo:
        todo = [k for k in dict.fromkeys(todo) if k not in out]
        out.update(todo)
        nxt: list[ShardKey] = []
        for rec in store.index.get_objects(todo):
            if rec is not None:
                nxt += [k for k in (rec.base, rec.target) if k is not None and k not in out]
        todo = nxt
    return out


def reachable(store: TierStore, model: str, steps: list[int]) -> set[ShardKey]:
    """Every object reachable from the manifests of ``steps`` (with delta bases and ref targets)."""
    roots: set[ShardKey] = set()
    for s in steps:
        m = store.steps.manifest(model, s)
        if m is not None:
            roots.update(ShardKey.parse(o["key"]) for o in manifest_objects(m))
    return _closure(store, roots)


def collect(store: TierStore, model: str, retention: Retention = Retention(), *, dry_run: bool = True,
            max_staleness: int = 0) -> GCReport:
    """Delete what ``retention`` does not keep; see the module docstring.

    Order of work: steps still preparing past their timeout are aborted
    first. The kept set is computed from the kept manifests *and* from every
    object of a step still preparing or newer than the newest decided step
    (a delta being written keeps its base). Then, for each dropped durable
    step, its durable manifest is deleted first (so an index rebuild can
    never resurrect a step whose objects are going), then its objects from
    every tier and the index, then its step records (an aborted step keeps
    its ``state``, so a late vote cannot re-open it).
    """
    for s, st in store.steps.steps(model):
        if st == "preparing":
            store.steps.abort_if_stale(model, s)
    steps = store.steps.steps(model)
    state = dict(steps)
    committed = [s for s, st in steps if st in ("committed", "durable")]
    durable = [s for s, st in steps if st == "durable"]
    aborted = {s for s, st in steps if st == "aborted"}
    preparing = {s for s, st in steps if st not in ("committed", "durable", "aborted")}
    newest_decided = max([s for s, st in steps if s not in preparing], default=-1)
    kept = set(committed[-retention.keep_last:]) if retention.keep_last > 0 else set()
    if retention.keep_durable_every > 0:
        kept |= {s for s in durable if s % retention.keep_durable_every == 0}
    if committed and max_staleness > 0:
        newest = committed[-1]
        kept |= {s for s in committed if newest - max_staleness <= s <= newest}
    objects = store.index.list_objects(model)
    in_flight = {k for k in objects if k.step in preparing or k.step > newest_decided}
    keep_objs = reachable(store, model, sorted(kept)) | _closure(store, in_flight)
    report = GCReport(kept_steps=sorted(kept), dry_run=dry_run)
    report.dropped_steps = sorted((set(committed) - kept) | aborted)
    dropped = set(report.dropped_steps)
    victims = []
    for key in objects:
        if key in keep_objs or key.step in preparing or key.step > newest_decided:
            continue
        if key.step in dropped or (key.step not in state and key.step < newest_decided):
            victims.append(key)  # of a dropped step, or an orphan no step ever recorded
    recs = store.index.get_objects(victims)
    if getattr(store, "_migrator", None) is not None and store.durable is not None:
        # an object still queued for migration is left for a later pass: deleting it under the migrator
        # would surface as a migration failure
        pending = [(k, r) for k, r in zip(victims, recs) if r is not None and store.durable.tier not in r.tiers]
        report.deferred = [str(k) for k, _ in pending]
        skip = {k for k, _ in pending}
        victims, recs = [k for k in victims if k not in skip], [r for k, r in zip(victims, recs) if k not in skip]
    if not dry_run:
        for s in sorted(dropped):
            if state.get(s) == "durable" and store.durable is not None:
                store.durable.delete(durable_manifest_name(model, s))
    for key, rec in zip(victims, recs):
        report.deleted.append(str(key))
        report.bytes_freed += rec.size if rec else 0
        if not dry_run:
            store.delete(key)
    if not dry_run:
        idx = store.index
        with translate_redis_errors(f"drop steps of {model}", idx.url):
            pipe = idx.r.pipeline(transaction=False)
            for s in sorted(dropped):
                pipe.delete(idx.k(model, "manifest", s), idx.k(model, "votes", s))
                if s not in aborted:
                    pipe.delete(idx.k(model, "step", s))
                    pipe.zrem(idx.k(model, "steps"), s)
            pipe.execute()
    return report


def _durable_copy_valid(store: TierStore, key: ShardKey) -> bool:
    """Whether the durable tier's copy of ``key`` is there and matches the index's checksum."""
    from tierstore import codec
    from tierstore.errors import CorruptObjectError, TierStoreError

    rec = store.index.get_object(key)
    try:
        blob = store.durable.get(str(key)) if store.durable is not None else None
        return blob is not None and rec is not None and codec.verify(blob) == rec.checksum
    except (CorruptObjectError, TierStoreError):
        return False


def evict_host(store: TierStore, nbytes: int) -> int:
    """Free at least ``nbytes`` in the host tier by dropping host copies that are durable.

    Never drops the only copy of anything, nor a copy of a model's newest
    committed step. Raises :class:`TierFullError` when not enough can be freed.
    """
    freed = 0
    candidates: list[tuple[float, ShardKey, int]] = []
    for model in store.index.models():
        committed = [s for s, st in store.steps.steps(model) if st in ("committed", "durable")]
        newest = committed[-1] if committed else None
        for key in store.index.list_objects(model):
            if key.step == newest:
                continue
            rec = store.index.get_object(key)
            if rec and "host" in rec.tiers and store.durable is not None and store.durable.tier in rec.tiers:
                candidates.append((rec.created, key, rec.size))
    for _created, key, size in sorted(candidates, key=lambda c: c[0]):
        if freed >= nbytes:
            break
        if not _durable_copy_valid(store, key):
            continue  # the index says durable, but that copy does not verify: the host copy is the last good one
        if store.host.delete(str(key)):
            store.index.remove_tier(key, "host")
            freed += size
    freed += store.host.drain_pool()
    if freed < nbytes:
        raise TierFullError(
            f"host tier full: only {freed} of {nbytes} bytes could be freed without dropping the last copy "
            "of a committed version; raise the host budget or let migration catch up",
            tier="host", needed=nbytes, freed=freed,
        )
    return freed
