"""Garbage collection and host-tier eviction.

Retention (:class:`Retention`): keep the last ``keep_last`` committed steps,
every ``keep_durable_every``-th durable step, every step still being
prepared, and every step a kept step ``requires`` (a replay's base and logs).
:func:`collect` deletes, from every tier and the index:

- objects of aborted steps, and of committed steps the retention drops,
  that no kept manifest reaches. A manifest records the complete set of
  objects a restore of its step reads (its own, the older layer versions it
  inherits under a layer-wise policy, every delta base and ref target they
  reach: :func:`consistency.manifest.complete_entries`), so keeping what the
  kept manifests list is right for every policy; links the index records
  beyond them are followed too (manifests written before they listed them);
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
from consistency.manifest import complete_entries
from consistency.twophase import StepProtocol
from tierstore.keys import ShardKey

__all__ = ["GCReport", "Retention", "closure", "collect", "reachable", "required_steps"]

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


def _manifest(steps: StepProtocol, model: str, step: int, cache: dict[int, dict] | None) -> dict | None:
    if cache is None:
        return steps.manifest(model, step)
    m = cache.get(step)
    if m is None:
        m = steps.manifest(model, step)
        if m is not None:  # a committed step's manifest never changes while its writer's epoch lasts
            cache[step] = m
    return m


def required_steps(steps: StepProtocol, model: str, step_numbers: list[int], *,
                   cache: dict[int, dict] | None = None) -> set[int]:
    """``step_numbers`` with every step their manifests (transitively) ``require``.

    ``cache``: parsed manifests by step, filled and reused (a writer's retention passes one for as long
    as its epoch lasts: a committed manifest changes only when a newer incarnation supersedes the step).
    """
    out: set[int] = set()
    todo = list(step_numbers)
    while todo:
        s = todo.pop()
        if s in out:
            continue
        out.add(s)
        m = _manifest(steps, model, s, cache)
        if m is not None:
            todo += [r for r in m.get("requires", []) if r not in out]
    return out


def reachable(steps: StepProtocol, model: str, step_numbers: list[int], *,
              cache: dict[int, dict] | None = None) -> set[ShardKey]:
    """Every object a restore of one of ``step_numbers`` reads: the complete sets their manifests (and the
    manifests of the steps they require) record, with any delta base or ref target the index links beyond.
    Each manifest is read once (``cache``: see :func:`required_steps`)."""
    cache = {} if cache is None else cache
    roots: set[ShardKey] = set()
    for s in sorted(required_steps(steps, model, step_numbers, cache=cache)):
        m = _manifest(steps, model, s, cache)
        if m is not None:
            roots.update(ShardKey.parse(o["key"]) for o in complete_entries(m))
    return closure(steps.index, roots)


def collect(steps: StepProtocol, model: str, retention: Retention = Retention(), *,
            delete: Callable[[ShardKey, str], object], dry_run: bool = True, max_staleness: int = 0,
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
        delete: ``delete(key, name)`` deletes the record of ``key`` if it still names the copy ``name``, then
            that copy from every tier (a record replaced meanwhile is left alone).
        still_migrating: whether an object is still queued for migration (left for a later pass).
    """
    index = steps.index
    for s, st in steps.steps(model):
        if st == "preparing":
            steps.abort_if_stale(model, s)
    recorded = steps.steps(model)
    if not dry_run:  # decide only on states the index's replicas have (a failover cannot take a kept step back)
        index.sync(model, "collect garbage")
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
    kept = required_steps(steps, model, sorted(kept)) & set(committed)
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
    if not dry_run:  # a committed step's may be being written right now: it goes too (see maybe_durable)
        steps.delete_durable_manifests(model, [s for s in dropped if state.get(s) in ("committed", "durable")])
    for key, rec in zip(victims, recs):
        report.deleted.append(str(key))
        report.bytes_freed += rec.size if rec else 0
        if not dry_run:
            delete(key, rec.name if rec is not None else str(key))
    if not dry_run:
        steps.drop_steps(model, dropped, keep_aborted_state=True)
    return report
