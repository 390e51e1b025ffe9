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
collected.

The caller passes what gc needs, not a store: the commit protocol (its
index and durable tier), how to delete one object from every tier and the
index, and which objects are still migrating (left for a later pass).
:meth:`tierstore.store.TierStore.gc` wires them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from consistency.index import Index, ObjectRecord
from consistency.manifest import manifest_objects
from consistency.twophase import StepProtocol
from tierstore.keys import ShardKey

__all__ = ["GCReport", "Retention", "closure", "collect", "reachable"]

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


def closure(index: Index, roots: set[ShardKey]) -> set[ShardKey]:
    """``roots`` with every delta base and ref target they reach, transitively (from index records)."""
    out: set[ShardKey] = set()
    todo = sorted(roots)
    while todo:
        todo = [k for k in dict.fromkeys(todo) if k not in out]
        out.update(todo)
        nxt: list[ShardKey] = []
        for rec in index.get_objects(todo):
            if rec is not None:
                nxt += [k for k in (rec.base, rec.target) if k is not None and k not in out]
        todo = nxt
    return out


def reachable(steps: StepProtocol, model: str, step_numbers: list[int]) -> set[ShardKey]:
    """Every object reachable from the manifests of ``step_numbers`` (with delta bases and ref targets)."""
    roots: set[ShardKey] = set()
    for s in step_numbers:
        m = steps.manifest(model, s)
        if m is not None:
            roots.update(ShardKey.parse(o["key"]) for o in manifest_objects(m))
    return closure(steps.index, roots)


def collect(steps: StepProtocol, model: str, retention: Retention = Retention(), *,
            delete: Callable[[ShardKey], object], dry_run: bool = True, max_staleness: int = 0,
            still_migrating: Callable[[ObjectRecord], bool] | None = None) -> GCReport:
    """Delete what ``retention`` does not keep; see the module docstring.

    Order of work: steps still preparing past their timeout are aborted
    first. The kept set is computed from the kept manifests *and* from every
    object of a step still preparing or newer than the newest decided step
    (a delta being written keeps its base). Then, for each dropped durable
    step, its durable manifest is deleted first (so an index rebuild can
    never resurrect a step whose objects are going), then its objects from
    every tier and the index, then its step records (an aborted step keeps
    its ``state``, so a late vote cannot re-open it).

    Args:
        steps: the commit protocol (index, manifests, durable tier).
        delete: deletes one object from every tier and the index.
        still_migrating: whether an object is still queued for migration (left for a later pass).
    """
    index = steps.index
    for s, st in steps.steps(model):
        if st == "preparing":
            steps.abort_if_stale(model, s)
    recorded = steps.steps(model)
    state = dict(recorded)
    committed = [s for s, st in recorded if st in ("committed", "durable")]
    durable = [s for s, st in recorded if st == "durable"]
    aborted = {s for s, st in recorded if st == "aborted"}
    preparing = {s for s, st in recorded if st not in ("committed", "durable", "aborted")}
    newest_decided = max([s for s, st in recorded if s not in preparing], default=-1)
    kept = set(committed[-retention.keep_last:]) if retention.keep_last > 0 else set()
    if retention.keep_durable_every > 0:
        kept |= {s for s in durable if s % retention.keep_durable_every == 0}
    if committed and max_staleness > 0:
        newest = committed[-1]
        kept |= {s for s in committed if newest - max_staleness <= s <= newest}
    objects = index.list_objects(model)
    in_flight = {k for k in objects if k.step in preparing or k.step > newest_decided}
    keep_objs = reachable(steps, model, sorted(kept)) | closure(index, in_flight)
    report = GCReport(kept_steps=sorted(kept), dry_run=dry_run)
    report.dropped_steps = sorted((set(committed) - kept) | aborted)
    dropped = set(report.dropped_steps)
    victims = []
    for key in objects:
        if key in keep_objs or key.step in preparing or key.step > newest_decided:
            continue
        if key.step in dropped or (key.step not in state and key.step < newest_decided):
            victims.append(key)  # of a dropped step, or an orphan no step ever recorded
    recs = index.get_objects(victims)
    if still_migrating is not None:
        # an object still queued for migration is left for a later pass: deleting it under the migrator
        # would surface as a migration failure
        pending = [(k, r) for k, r in zip(victims, recs) if r is not None and still_migrating(r)]
        report.deferred = [str(k) for k, _ in pending]
        skip = {k for k, _ in pending}
        victims, recs = [k for k in victims if k not in skip], [r for k, r in zip(victims, recs) if k not in skip]
    if not dry_run:
        steps.delete_durable_manifests(model, [s for s in dropped if state.get(s) == "durable"])
    for key, rec in zip(victims, recs):
        report.deleted.append(str(key))
        report.bytes_freed += rec.size if rec else 0
        if not dry_run:
            delete(key)
    if not dry_run:
        steps.drop_steps(model, dropped, keep_aborted_state=True)
    return report
