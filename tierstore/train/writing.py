"""The Checkpointer's write side after the snapshot: what one save carries, objects by kind, retention.

A :class:`Snapshot` is what :meth:`Checkpointer.save` hands to its background
thread: host-tier objects already copied (``pendings``, sealed and published
there) and staged copies for the objects whose kind depends on the other
ranks (dedup) or on the previous version (deltas), written by
:func:`write_layer`. :func:`retain` applies the per-tier retention of
:mod:`consistency.gc` to the rank's objects after each save.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from consistency.gc import Retention, plan_retention, retire
from tierstore.delta import xor_delta
from tierstore.errors import TierStoreError
from tierstore.keys import ShardKey
from tierstore.train.dedup import part_of
from tierstore.train.policies import DiffTracker

__all__ = ["SaveStats", "Snapshot", "bits_equal", "nbytes", "retain", "write_layer"]

log = logging.getLogger(__name__)


class SaveStats:
    """Counters of what this rank wrote (bytes and objects per kind) and of how long the trainer was blocked.

    ``save_s``: seconds spent in ``save()``; ``wait_s`` / ``waits``: seconds
    and count of the waits of a lazy save's update gate that found the copy
    unfinished (:mod:`tierstore.train.lazy`). Their sum is the stall.
    ``changed_in_forward``: lazy saves voted down because a tensor changed in
    place between ``save()`` and its copy (:class:`~tierstore.errors.SnapshotChangedError`).
    ``skipped``: saves that wrote nothing because a standing step of an earlier incarnation holds their step
    (``wait()`` answers ``"skipped"``). ``per_step``: bytes written per step, for the last
    :attr:`PER_STEP_KEPT` steps saved (a run that saves every step would otherwise grow it for good).
    """

    PER_STEP_KEPT = 10_000

    def __init__(self) -> None:
        self.bytes = 0
        self.logical_bytes = 0
        self.objects = {"full": 0, "delta": 0, "ref": 0}
        self.saves = 0
        self.layers_saved = 0
        self.per_step: dict[int, int] = {}
        self.save_s = 0.0
        self.wait_s = 0.0
        self.waits = 0
        self.changed_in_forward = 0
        self.skipped = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "bytes": self.bytes,
            "logical_bytes": self.logical_bytes,
            "objects": dict(self.objects),
            "saves": self.saves,
            "layers_saved": self.layers_saved,
            "save_s": self.save_s,
            "wait_s": self.wait_s,
            "waits": self.waits,
            "changed_in_forward": self.changed_in_forward,
            "skipped": self.skipped,
        }

    def record(self, step: int, infos: list) -> None:
        for info in infos:
            self.bytes += info.size
            self.objects[info.kind] = self.objects.get(info.kind, 0) + 1
            self.per_step[step] = self.per_step.get(step, 0) + info.size
        while len(self.per_step) > self.PER_STEP_KEPT:
            del self.per_step[next(iter(self.per_step))]  # the oldest saved


@dataclass
class Snapshot:
    """One save, copied: what the background thread publishes, writes and votes.

    Attributes:
        step: the step.
        selected: the layers written at this step.
        pendings: ``(layer, PendingObject)`` already copied into the host tier.
        staged: ``layer -> tensors`` copied for :func:`write_layer` (dedup, deltas).
        metas: ``layer -> metadata`` of the staged layers.
        vote_extra: the JSON the vote carries.
        lw_params: ``layer -> parameter copies`` for the layerwise tracker.
        before_vote: run first on the background thread (replay's digest).
        collective: the background write runs a collective (dedup).
    """

    step: int
    selected: list[str]
    pendings: list[tuple[str, Any]] = field(default_factory=list)
    staged: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    metas: dict[str, dict] = field(default_factory=dict)
    vote_extra: dict[str, Any] = field(default_factory=dict)
    lw_params: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    before_vote: Callable[[dict], None] | None = None
    collective: bool = False

    def abort(self) -> None:
        for _, p in self.pendings:
            p.abort()
        self.pendings = []


def nbytes(ts: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts.values())


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def write_layer(store: Any, model: str, rank: int, ln: str, step: int, tensors: dict[str, torch.Tensor],
                meta: dict, owners: dict[str, int] | None, diff: DiffTracker | None, epoch: int | None) -> Any:
    """Write one staged layer: a ref (dedup, another rank owns it all), a delta, or a full object."""
    key = ShardKey(model, ln, step, rank)
    refs = {p: o for p, o in (owners or {}).items() if o != rank}
    present = {part_of(n) for n in tensors}
    refs = {p: o for p, o in refs.items() if p in present}
    if refs and set(refs) == present and len(set(refs.values())) == 1:
        if diff is not None:
            diff.forget(ln)
        target = ShardKey(model, ln, step, next(iter(refs.values())))
        return store.put(key, {}, None, kind="ref", target=target, epoch=epoch)
    mine = {n: t for n, t in tensors.items() if part_of(n) not in refs}
    meta = dict(meta)
    if refs:
        meta["_refs"] = refs
    if diff is None:
        return store.put(key, mine, meta, epoch=epoch)
    cpu0 = time.thread_time()
    kind, base_step = diff.kind(ln, step, mine)
    if kind == "delta" and base_step is not None:
        base = diff.base_tensors(ln)
        deltas = {n: xor_delta(t, base[n]) for n, t in mine.items() if not bits_equal(t, base[n])}
        meta["_delta"] = {
            n: {"dtype": str(mine[n].dtype).removeprefix("torch."), "shape": list(mine[n].shape)} for n in deltas
        }
        base_key = ShardKey(model, ln, base_step, rank)
        info = store.put(key, deltas, meta, kind="delta", base=base_key, epoch=epoch)
    else:
        info = store.put(key, mine, meta, epoch=epoch)
    diff.saved(ln, step, mine, kind)
    diff.record(ln, kind, nbytes(mine), info.size, time.thread_time() - cpu0)  # payoff: delta or full next
    return info


def retain(store: Any, model: str, rank: int, keep_last: int | None, max_staleness: int, last: Any,
           floor: Callable[[int], int] | None = None, manifests: dict[int, dict] | None = None,
           written: dict[int, dict[ShardKey, Any]] | None = None) -> Any:
    """Apply the per-tier retention of :mod:`consistency.gc` to this rank's objects of ``model``.

    Memory tiers keep the last ``keep_last`` committed steps; the durable tier the newest durable step
    and what it reaches; steps in neither are retired. A committed step newer than the newest durable
    one is held while this store's migrator works on it, or another rank's migration of it is under way.

    ``last`` is what the previous pass returned (the windows it acted on): an unchanged plan is not
    carried out again. ``floor(oldest)`` widens the memory window to the step a restore of ``oldest``
    starts from (replay: its base). ``manifests``: the caller's cache of parsed manifests (see
    :func:`consistency.gc.reachable`); entries below every kept step are dropped from it. ``written``: the
    records of what this writer wrote, by step (``retire``'s ``known``: the objects it deletes are not read
    again); its entries below every kept step are dropped, as ``manifests``'.
    """
    if keep_last is None:
        return last
    try:
        return _retain(store, model, rank, keep_last, max_staleness, last, floor, manifests, written)
    except TierStoreError as e:  # best effort: what stays now goes at a later pass; the save goes on
        log.warning("retention of %s after a save was cut short (%s: %s); a later save retries it",
                    model, type(e).__name__, e)
        return None


def _retain(store: Any, model: str, rank: int, keep_last: int, max_staleness: int, last: Any,
            floor: Callable[[int], int] | None, manifests: dict[int, dict] | None,
            written: dict[int, dict[ShardKey, Any]] | None = None) -> Any:
    busy = store.migrating_steps(model)

    def hold(rec: Any) -> bool:  # a migration may still make it durable
        # every rank migrated but not durable yet: the last rank is writing its durable manifest (retiring it
        # now made it never durable; held only until a newer step is durable)
        return rec.step in busy or (0 < rec.migrated and rec.memory_only is None)

    # this rank's objects alone (one listing whatever the world size), unless a record links otherwise than
    # rank-locally: then what every rank's steps in flight read is protected (ObjectIndex.list_rank_objects)
    objects, local = store.index.list_rank_objects(model, rank)
    if not local:
        objects = store.list(model)
    plan = plan_retention(store.steps, model, Retention(keep_last=max(1, keep_last)), max_staleness=max_staleness,
                          floor=floor, hold=hold, cache=manifests, objects=objects, rank=rank)
    signature = (tuple(plan.memory), tuple(plan.durable), tuple(plan.retired), tuple(plan.aborted))
    if signature == last:
        return last
    known = {k: rec for recs in (written or {}).values() for k, rec in recs.items()}
    retire(store.steps, model, plan, [k for k in objects if k.rank == rank], delete=store._collect,
           release=store.release, drop=store._drop_copy,
           retired_ok=lambda c: c.key.rank == rank if c.key is not None else rank == 0, known=known)
    for cache in (manifests, written):  # entries below every kept step: no later pass needs them
        if cache is not None and plan.kept:
            for s in [s for s in cache if s < plan.kept[0]]:
                del cache[s]
    return signature
