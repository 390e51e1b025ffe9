"""Retention per tier and garbage collection.

Each tier survives another failure, so each keeps its own window
(:func:`plan_retention`):

- **memory tiers** (host, peer) keep the last ``keep_last`` committed steps
  (at least 1), widened by the staleness bound and by what those steps
  ``require`` (a replay's base and logs), and every object their manifests reach;
- **the durable tier** always keeps the newest durable step and everything its
  manifest reaches, plus the last ``keep_durable`` durable steps and every
  ``keep_durable_every``-th one. An object leaves the durable tier only once
  a newer durable step exists that does not reach it: after any node loss a
  restore finds a step no older than the newest step that was durable at
  the moment of the loss;
- windows count the live line only: committed steps of an older incarnation
  *ahead* of the newest step the newest incarnation committed (a restore fell
  back past them) are held, never retired here, until the live line saves
  their numbers again (supersedes them, with proof that they are lost);
- a **pinned** committed step (:meth:`consistency.steprecords.StepRecords.pin`: a
  checkpoint path that Lightning's top-k or the Trainer's ``save_total_limit``
  still holds names it) is kept whatever the windows: by the memory tiers
  until it is durable, then by the durable tier (its memory copies go); pins are
  recorded in the durable tier too, so an index rebuild restores them (every step
  a label's records name, where a crash left more than one);
- a committed step in neither window is **retired**: its step records go
  first (it is no longer reported, nor restorable, anywhere), then its
  durable manifest (an index rebuild can never resurrect it), then its
  objects that no kept step reaches, from every tier and the index. A committed step
  newer than the newest durable step whose migration may still finish
  (``hold``) is not retired yet;
- a step kept only by the durable tier loses its memory copies (only where
  the index records a durable copy: never the last copy of anything);
- aborted steps, and objects of steps never begun (orphans older than the
  newest decided step), are collected; steps still preparing, anything newer
  than the newest decided step and everything their objects reach are never
  touched. An aborted step keeps its ``state`` (a tombstone: a late ``begin``
  of the same incarnation cannot open it again) until the proof that no
  writer can still reach it: a kept committed step of the same or a newer
  epoch is newer than it, and it is older than every kept step (every rank
  of its epoch voted for a later step, or its epoch is fenced). Then its
  record goes too, so tombstones stay bounded by the windows; a step an index
  rebuild could not use keeps its record (its durable manifest stays).

A manifest records the complete set of objects a restore of its step reads
(its own, the older layer versions it inherits under a layer-wise policy,
every delta base and ref target they reach), and :mod:`consistency.closure`
is the one owner of what that set is, so keeping what it returns for the kept
steps is right for every policy; links the index records beyond them are
followed too (manifests written before they listed them).

The writer's retention after each save (:func:`tierstore.train.writing.retain`)
and :func:`collect` (``tierstore admin gc``, :meth:`tierstore.store.TierStore.gc`)
both act on :func:`plan_retention`. It is safe beside training: a step
committing concurrently is newer than every step collected, and ``keep_last``
is at least 1, so the newest committed step (whose complete set holds every
base a running writer's next delta or layer-wise step reads) is always kept.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from consistency.closure import closure, reachable, required_steps
from consistency.index import ObjectRecord
from consistency.retired import RetiredCopy
from consistency.twophase import StepProtocol
from tierstore.errors import ConfigError
from tierstore.keys import ShardKey

__all__ = ["GCReport", "Retention", "RetentionPlan", "closure", "collect", "plan_retention", "reachable",
           "required_steps", "retire"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Retention:
    """What each tier keeps (see the module docstring).

    Attributes:
        keep_last: committed steps the memory tiers keep (at least 1).
        keep_durable_every: also keep every M-th durable step in the durable tier (0: none).
        keep_durable: durable steps the durable tier keeps, newest first (at least 1).
    """

    keep_last: int = 2
    keep_durable_every: int = 0
    keep_durable: int = 1

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise ConfigError(f"keep_last must be at least 1 (the newest committed step is what a running writer's "
                              f"next step builds on), got {self.keep_last}", field="keep_last")
        if self.keep_durable < 1:
            raise ConfigError(f"keep_durable must be at least 1 (the newest durable step is the last line), "
                              f"got {self.keep_durable}", field="keep_durable")
        if self.keep_durable_every < 0:
            raise ConfigError(f"keep_durable_every must be >= 0, got {self.keep_durable_every}",
                              field="keep_durable_every")


@dataclass
class GCReport:
    """What :func:`collect` did (or, with ``dry_run``, would do).

    Attributes:
        kept_steps: steps some tier keeps; ``durable_only``: those only the durable tier keeps.
        dropped_steps: retired committed steps and collected aborted ones.
        deleted: objects deleted from every tier; ``bytes_freed`` their size.
        released: objects whose memory copies went (their durable copy stays); ``bytes_released``.
        deferred: objects of steps whose migration may still finish (a later pass decides).
        retired: copies of superseded steps deleted (a newer durable step exists).
        temp_removed: temp files of interrupted writes removed from a local durable directory.
    """

    kept_steps: list[int] = field(default_factory=list)
    dropped_steps: list[int] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    bytes_freed: int = 0
    dry_run: bool = True
    deferred: list[str] = field(default_factory=list)
    durable_only: list[int] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    bytes_released: int = 0
    retired: list[str] = field(default_factory=list)
    temp_removed: int = 0

    def to_json(self) -> dict:
        return {"kept_steps": self.kept_steps, "dropped_steps": self.dropped_steps, "deleted": self.deleted,
                "bytes_freed": self.bytes_freed, "dry_run": self.dry_run, "deferred": self.deferred,
                "durable_only": self.durable_only, "released": self.released,
                "bytes_released": self.bytes_released, "retired": self.retired, "temp_removed": self.temp_removed}


@dataclass
class RetentionPlan:
    """Which steps each tier keeps, and the objects that follows (see :func:`plan_retention`).

    Attributes:
        memory: steps the memory tiers keep; ``durable``: steps the durable tier keeps.
        retired: committed steps to retire (durable manifest, objects no kept step reaches, records).
        aborted: aborted steps to collect; ``held``: committed steps left for a later pass.
        expired: the aborted steps whose tombstone goes too (see the module docstring); ``attempts``: the
            attempt of each aborted step (only that attempt's records are collected).
        keep_memory / keep_durable: objects the memory tiers / the durable tier keep.
        keep_held: what the held steps' restores read (kept for them, from a retired step too).
        protected: objects of steps in flight and what they reach (never touched).
        newest_decided: objects of steps newer than this are in flight; ``recorded``: steps with a record.
        retention: the windows the plan was made with (recorded by :func:`retire`, shown by ``admin steps``).
    """

    memory: list[int]
    durable: list[int]
    retired: list[int]
    aborted: list[int]
    held: list[int]
    keep_memory: set[ShardKey]
    keep_durable: set[ShardKey]
    protected: set[ShardKey]
    newest_decided: int
    recorded: set[int]
    newest_durable: int = -1
    retention: Retention | None = None
    keep_held: set[ShardKey] = field(default_factory=set)
    expired: list[int] = field(default_factory=list)
    attempts: dict[int, int] = field(default_factory=dict)
    _gone: set[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._gone = set(self.retired) | set(self.aborted)

    @property
    def kept(self) -> list[int]:
        """Steps some tier keeps."""
        return sorted(set(self.memory) | set(self.durable))

    def fate(self, key: ShardKey) -> str:
        """``"keep"``, ``"release"`` (memory copies go, the durable copy stays) or ``"delete"`` for ``key``."""
        if (key in self.protected or key in self.keep_memory or key in self.keep_held
                or key.step > self.newest_decided):
            return "keep"
        if key in self.keep_durable:
            return "release"
        if key.step in self._gone or key.step not in self.recorded:
            return "delete"  # of a retired or aborted step, or an orphan no step ever recorded
        return "keep"


def _ahead(recs: list) -> set[int]:
    """Committed steps of an older incarnation ahead of the live line: newer than the newest step the newest
    committing epoch committed (a restore fell back past them: lost, or unreadable when it looked).

    They count in no window and are never retired here: the live line supersedes or passes them when it
    saves their numbers again. So a resumed job's own steps are what retention keeps, and a step older
    than them is never retired on the strength of a step the resumed job could not read.
    """
    committed = [r for r in recs if r.state in ("committed", "durable")]
    if not committed:
        return set()
    live = max(r.epoch for r in committed)
    frontier = max(r.step for r in committed if r.epoch == live)
    return {r.step for r in committed if r.step > frontier and r.epoch < live}


def plan_retention(steps: StepProtocol, model: str, retention: Retention, *, records: list | None = None,
                   max_staleness: int = 0, floor: Callable[[int], int] | None = None,
                   hold: Callable[[Any], bool] | None = None, cache: dict[int, dict] | None = None,
                   objects: list[ShardKey] | None = None, rank: int | None = None) -> RetentionPlan:
    """Which steps each tier keeps, what is retired, and the objects that follows; see the module docstring.

    Args:
        records: the model's step records (default: read them).
        max_staleness: a layer-wise resume at R reads layers saved as far back as R - max_staleness:
            the memory window is widened by it.
        floor: ``floor(oldest)`` widens the memory window to the step a restore of ``oldest`` starts from.
        hold: ``hold(record)`` for a committed step newer than the newest durable step: its migration may
            still finish, so it is not retired by this pass.
        cache: parsed manifests by step (see :func:`required_steps`).
        objects: every object of ``model`` in the index (default: list them); or one rank's own, where every
            link of ``model`` is rank-local (:meth:`~consistency.objects.ObjectIndex.list_rank_objects`): the
            objects of its steps in flight, and what they reach, are what the plan protects, and only that
            rank's objects may be retired with it.
        rank: the plan is for that rank's objects alone: its keep sets hold that rank's keys (each kept
            step's complete set holds every rank's), so :meth:`RetentionPlan.fate` answers for them only.
    """
    recs = steps.records(model) if records is None else records
    state = {r.step: r.state for r in recs}
    ahead = _ahead(recs)
    committed = [r.step for r in recs if r.state in ("committed", "durable") and r.step not in ahead]
    durable = [r.step for r in recs if r.state == "durable" and r.step not in ahead]
    aborted = [r.step for r in recs if r.state == "aborted"]
    preparing = {r.step for r in recs if r.state not in ("committed", "durable", "aborted")}
    newest_decided = max([r.step for r in recs if r.step not in preparing], default=-1)
    memory: set[int] = set()
    if committed:
        oldest = committed[-retention.keep_last] if len(committed) >= retention.keep_last else committed[0]
        oldest -= max_staleness
        if floor is not None:
            oldest = min(oldest, floor(oldest))
        memory = {s for s in committed if s >= oldest}
    # pinned steps (a framework's checkpoint names them: StepRecords.pin) stay: in memory until durable, then
    # in the durable tier only (so host memory follows the window, not the number of checkpoints kept)
    pinned = steps.pinned_steps(model) & set(committed)
    memory |= pinned - set(durable)
    memory = required_steps(steps, model, sorted(memory), cache=cache) & set(committed)
    kept_durable = set(durable[-retention.keep_durable:]) | (pinned & set(durable))
    if retention.keep_durable_every > 0:
        kept_durable |= {s for s in durable if s % retention.keep_durable_every == 0}
    kept_durable = required_steps(steps, model, sorted(kept_durable), cache=cache) & set(committed)
    newest_durable = durable[-1] if durable else -1
    held = ahead | {r.step for r in recs if r.state == "committed" and r.step > newest_durable
                    and r.step not in memory and r.step not in ahead and hold is not None and hold(r)}
    retired = set(committed) - memory - kept_durable - held
    expired = _expired(recs, memory | kept_durable)
    objects = steps.index.list_objects(model) if objects is None else objects
    objects_in_flight = {k for k in objects if k.step in preparing or k.step > newest_decided}
    return RetentionPlan(
        memory=sorted(memory), durable=sorted(kept_durable - memory), retired=sorted(retired),
        aborted=sorted(aborted), held=sorted(held),
        keep_memory=reachable(steps, model, sorted(memory), cache=cache, rank=rank),
        keep_durable=reachable(steps, model, sorted(kept_durable), cache=cache, rank=rank),
        protected=closure(steps.index, objects_in_flight) if objects_in_flight else set(),
        newest_decided=newest_decided, recorded=set(state), newest_durable=newest_durable, retention=retention,
        # a held step stays, so what its restore reads stays with it (from a retired step too)
        keep_held=reachable(steps, model, sorted(held), cache=cache, rank=rank) if held else set(),
        expired=expired, attempts={r.step: r.attempt for r in recs if r.state == "aborted"},
    )


def _expired(recs: list, kept: set[int]) -> list[int]:
    """The aborted steps whose tombstone may go: older than every kept step, with a kept committed step of the
    same or a newer epoch (every rank of the aborted step's epoch voted for that later step after it, since a
    rank saves its steps in order; or that epoch is fenced). Not a step an index rebuild could not use
    (``rebuilt``: its record keeps the check for lost records from taking it for a lost step)."""
    if not kept:
        return []
    oldest = min(kept)
    by_step = {r.step: r for r in recs}
    newest_epoch = max(by_step[s].epoch for s in kept if s in by_step)
    return sorted(r.step for r in recs if r.state == "aborted" and not r.rebuilt and r.step < oldest
                  and r.epoch <= newest_epoch)


def retire(steps: StepProtocol, model: str, plan: RetentionPlan, keys: list[ShardKey], *,
           delete: Callable[[list[tuple[ShardKey, str]]], object],
           release: Callable[[ShardKey, ObjectRecord], bool], drop: Callable[[str], object],
           retired_ok: Callable[[RetiredCopy], bool] | None = None, report: GCReport | None = None,
           dry_run: bool = False, known: Mapping[ShardKey, ObjectRecord] | None = None) -> GCReport:
    """Carry out ``plan`` on ``keys`` (the objects considered: a writer's own, or every object of ``model``).

    In this order: the records of the retired and collected steps (so no step is reported, or restored,
    while its copies go; an aborted step keeps its ``state`` until it expires, so a late begin cannot re-open
    it; the retired ones are counted in the model's retention note, which ``tierstore admin steps`` shows); their
    durable manifests (so an index rebuild can never resurrect a step whose objects are going); the
    memory copies of what only the durable tier keeps (``release``, only where the index records a
    durable copy); the objects no kept step reaches (``delete``, one call for all of them after the
    releases, given ``(key, name)`` pairs: from every tier and the index, each while its record still names
    that copy); then the retired steps' durable manifests once more (one a migration wrote meanwhile).
    Before all that, the copies of superseded steps older than the newest durable step of the live
    line (:mod:`consistency.retired`; those ``retired_ok`` accepts) go: ``drop(name)`` from every tier.

    ``known``: records the caller wrote itself (a Checkpointer's own objects): an object to delete whose
    record is there is not read again, its copy's name is taken from it. That is no weaker evidence: a
    record is deleted only while it still names that copy, so a stale one leaves the object for a later
    pass. Objects to release are always read (whether a durable copy is recorded is what decides).
    """
    report = report or GCReport(dry_run=dry_run)
    # copies of superseded steps, kept until the live line has a newer durable step
    gone = [c for c in steps.index.retired(model)
            if c.step < plan.newest_durable and (retired_ok is None or retired_ok(c))]
    report.retired = [c.name for c in gone]
    if gone and not dry_run:
        for c in gone:
            drop(c.name)
        steps.index.forget_retired(model, [c.name for c in gone])
    report.kept_steps, report.durable_only = plan.kept, plan.durable
    report.dropped_steps = sorted(set(plan.retired) | set(plan.aborted))
    fates = {k: plan.fate(k) for k in keys}
    todo = [k for k, f in fates.items() if f != "keep"]
    known = known or {}
    read = [k for k in todo if fates[k] == "release" or k not in known]
    recs: dict[ShardKey, ObjectRecord | None] = {k: known[k] for k in todo if fates[k] != "release" and k in known}
    if read:
        recs.update(zip(read, steps.index.get_objects(read)))
    if not dry_run:  # no longer reported (nor restorable) before anything of them goes
        dropped = set(steps.drop_steps(model, plan.retired, keep_aborted_state=True))
        # aborted: only the attempt the plan saw (a newer incarnation may have begun the number again); the
        # tombstones no writer can reach any more go too (see _expired)
        steps.drop_aborted(model, plan.attempts, tombstones=plan.expired)
        steps.note_retention(model, sorted(dropped & set(plan.retired)), memory=plan.memory, durable=plan.durable,
                             keep_last=plan.retention.keep_last if plan.retention else None,
                             time_s=steps.index.server_time())  # what admin steps says of the missing steps
        steps.delete_durable_manifests(model, plan.retired)  # before the objects: no rebuild resurrects them
    batch: list[tuple[ShardKey, str]] = []
    for key in todo:
        rec = recs.get(key)
        if fates[key] == "release":
            if rec is not None and steps.durable is not None and steps.durable.tier in rec.tiers \
                    and set(rec.tiers) - {steps.durable.tier}:
                report.released.append(str(key))
                report.bytes_released += rec.size
                if not dry_run:
                    release(key, rec)
            continue
        report.deleted.append(str(key))
        report.bytes_freed += rec.size if rec else 0
        if not dry_run:
            batch.append((key, rec.name if rec is not None else str(key)))
    if batch:
        delete(batch)
    if not dry_run:
        # a migration that finished meanwhile may have written a durable manifest before the records went
        # (once they are gone, its own mark fails and it deletes what it wrote): delete it again
        steps.delete_durable_manifests(model, plan.retired)
    return report


def collect(steps: StepProtocol, model: str, retention: Retention = Retention(), *,
            delete: Callable[[list[tuple[ShardKey, str]]], object],
            release: Callable[[ShardKey, ObjectRecord], bool], drop: Callable[[str], object],
            dry_run: bool = True, max_staleness: int = 0, migrating: bool = False) -> GCReport:
    """Apply ``retention`` to every object of ``model`` (``tierstore admin gc``); see the module docstring.

    Steps still preparing past their timeout are aborted first. Decisions are taken on states the
    index's replicas have (a failover cannot take a kept step back).

    Args:
        steps: the commit protocol (index, manifests, durable tier).
        delete: ``delete([(key, name), ...])`` deletes the record of each ``key`` if it still names the copy
            ``name``, then that copy from every tier (a record replaced meanwhile is left alone).
        release: ``release(key, record)`` drops the memory tiers' copies of ``key`` (its durable copy stays).
        drop: ``drop(name)`` deletes the copy ``name`` from every tier (a superseded step's).
        migrating: a migration to the durable tier runs: a committed step newer than the newest durable
            step is held (not retired) unless it is recorded memory-only (its migration gave up or
            was skipped), and its objects are reported ``deferred``.
    """
    for s, st in steps.steps(model):
        if st == "preparing":
            steps.abort_if_stale(model, s)
    if not dry_run:
        steps.index.sync(model, "collect garbage")
    keys = steps.index.list_objects(model)
    plan = plan_retention(steps, model, retention, max_staleness=max_staleness, objects=keys,
                          hold=(lambda r: r.memory_only is None) if migrating else None)
    report = retire(steps, model, plan, keys, delete=delete, release=release, drop=drop, dry_run=dry_run)
    held = set(plan.held)
    report.deferred = [str(k) for k in keys if k.step in held and plan.fate(k) == "keep"
                       and k not in plan.keep_memory and k not in plan.protected]
    return report
