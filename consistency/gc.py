"""Garbage collection and host-tier eviction.

Retention (:class:`Retention`): keep the last ``keep_last`` committed steps,
every ``keep_durable_every``-th durable step, and every step still being
prepared. :func:`collect` deletes, from every tier and the index:

- objects of aborted steps;
- objects of steps no kept manifest reaches (a kept manifest reaches its own
  objects, their delta bases and their ref targets, transitively) and older
  than the newest decided step (in-flight steps are never touched).

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

from consistency.manifest import manifest_objects
from tierstore.errors import TierFullError
from tierstore.keys import ShardKey

if TYPE_CHECKING:
    from tierstore.store import TierStore

__all__ = ["Retention", "GCReport", "collect", "reachable", "evict_host"]

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

    def to_json(self) -> dict:
        return {"kept_steps": self.kept_steps, "dropped_steps": self.dropped_steps, "deleted": self.deleted,
                "bytes_freed": self.bytes_freed, "dry_run": self.dry_run}


def reachable(store: TierStore, model: str, steps: list[int]) -> set[ShardKey]:
    """Every object reachable from the manifests of ``steps`` (with delta bases and ref targets)."""
    out: set[ShardKey] = set()
    todo: list[ShardKey] = []
    for s in steps:
        m = store.steps.manifest(model, s)
        if m is None:
            continue
        for o in manifest_objects(m):
            todo.append(ShardKey.parse(o["key"]))
    while todo:
        k = todo.pop()
        if k in out:
            continue
        out.add(k)
        rec = store.index.get_object(k)
        if rec is None:
            continue
        for nxt in (rec.base, rec.target):
            if nxt is not None and nxt not in out:
                todo.append(nxt)
    return out


def collect(store: TierStore, model: str, retention: Retention = Retention(), *, dry_run: bool = True,
            max_staleness: int = 0) -> GCReport:
    """Delete what ``retention`` does not keep; see the module docstring."""
    steps = store.steps.steps(model)
    committed = [s for s, st in steps if st in ("committed", "durable")]
    durable = [s for s, st in steps if st == "durable"]
    aborted = {s for s, st in steps if st == "aborted"}
    newest_decided = max([s for s, st in steps if st != "preparing"], default=-1)
    kept = set(committed[-retention.keep_last:]) if retention.keep_last > 0 else set()
    if retention.keep_durable_every > 0:
        kept |= {s for s in durable if s % retention.keep_durable_every == 0}
    if committed and max_staleness > 0:
        newest = committed[-1]
        kept |= {s for s in committed if newest - max_staleness <= s <= newest}
    keep_objs = reachable(store, model, sorted(kept))
    report = GCReport(kept_steps=sorted(kept), dry_run=dry_run)
    report.dropped_steps = sorted((set(committed) - kept) | aborted)
    for key in store.index.list_objects(model):
        if key in keep_objs:
            continue
        if key.step not in aborted and key.step >= newest_decided:
            continue  # in flight or newest: never touched
        if key.step not in aborted and key.step not in report.dropped_steps and key.step in kept:
            continue
        rec = store.index.get_object(key)
        report.deleted.append(str(key))
        report.bytes_freed += rec.size if rec else 0
        if not dry_run:
            store.delete(key)
    if not dry_run:
        r = store.index.r
        for s in report.dropped_steps:
            if s >= newest_decided and s not in aborted:
                continue
            r.delete(store.index.k(model, "manifest", s), store.index.k(model, "votes", s),
                     store.index.k(model, "step", s))
            r.zrem(store.index.k(model, "steps"), s)
    return report


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
