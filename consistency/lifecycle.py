"""A model's lifecycle: deleting a whole model from the index and every tier.

``tierstore admin delete MODEL`` and :meth:`tierstore.store.TierStore.delete_model`
call :func:`delete_model`; frameworks that rotate checkpoints (Lightning's
``remove_checkpoint``, the Hugging Face Trainer's ``save_total_limit``) call it
through the store, so rotation leaves no dead model in ``store.models()``.

What goes, in this order (a crash in between leaves less, never a step that
an index rebuild could resurrect without its objects):

1. the durable manifests (``model/_manifest/``): no index rebuild can bring a
   step back once its objects start going;
2. every index key of the model (its hash tag: steps, votes, manifests,
   object records, epoch, incarnations, progress) and its entry in the models list;
3. every copy in every tier the caller passes whose name is under ``model/``
   (host, peer, durable objects), listed before step 1 and once more after
   step 2 (a migration in flight may have written a copy or a durable
   manifest meanwhile; one that finishes later finds no record and removes
   what it wrote); the durable tier's superseded manifests (``model/_superseded/``)
   and pin records go here too, and the report counts the superseded
   manifests apart from the copies;
4. last, the durable epoch records (``model/_epoch/``): a new model of the
   same name starts at epoch 1.

A model the index lost but whose durable tier still holds manifests or
objects is deleted the same way (step 2 has nothing to do).

**A live writer is positive evidence against deleting.** Unless ``force``,
the delete is refused (:class:`~tierstore.errors.ModelInUseError`) when a
writer looks live: a step still preparing within its timeout, or a step begun
or decided less than ``idle_s`` seconds ago (the index server's clock). A
writer that goes on after a forced delete creates the model anew.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from backends.base import Backend
from consistency.manifest import durable_epoch_prefix, durable_manifest_prefix, durable_pin_prefix, superseded_prefix
from consistency.twophase import StepProtocol
from tierstore.errors import ModelInUseError, TierStoreError, UnknownError
from tierstore.keys import validate_name

__all__ = ["IDLE_S", "ModelDeleteReport", "delete_model", "writer_activity"]

log = logging.getLogger(__name__)

IDLE_S = 900.0
"""Seconds after its newest step began or was decided during which a model's writer counts as live."""


@dataclass
class ModelDeleteReport:
    """What :func:`delete_model` deleted (or, with ``dry_run``, would delete)."""

    model: str
    dry_run: bool = True
    steps: list[int] = field(default_factory=list)
    index_keys: int = 0
    durable_manifests: list[int] = field(default_factory=list)
    epoch_records: int = 0
    superseded_manifests: int = 0
    copies: dict[str, int] = field(default_factory=dict)
    left: dict[str, str] = field(default_factory=dict)
    live: str | None = None

    def to_json(self) -> dict:
        return {"model": self.model, "dry_run": self.dry_run, "steps": self.steps, "index_keys": self.index_keys,
                "durable_manifests": self.durable_manifests, "epoch_records": self.epoch_records,
                "superseded_manifests": self.superseded_manifests,
                "copies": self.copies, "left": self.left, "live": self.live}


def writer_activity(steps: StepProtocol, model: str, idle_s: float = IDLE_S) -> str | None:
    """Why a writer of ``model`` looks live (``None``: nothing in the index says so)."""
    if not steps.index.knows(model):
        return None
    recs = steps.records(model)
    if not recs:
        return None
    now = steps.index.server_time()
    for r in recs:
        if r.state == "preparing" and r.started is not None and (
                steps.step_timeout_s <= 0 or now - r.started < steps.step_timeout_s):
            return f"step {r.step} is being saved (began {now - r.started:.0f} s ago)"
    newest = max((t for r in recs for t in (r.started, r.decided) if t is not None), default=None)
    if newest is not None and now - newest < idle_s:
        return f"its newest step was saved {now - newest:.0f} s ago (less than {idle_s:.0f} s)"
    return None


def delete_model(steps: StepProtocol, model: str, tiers: Sequence[Backend], *, dry_run: bool = True,
                 force: bool = False, idle_s: float = IDLE_S) -> ModelDeleteReport:
    """Delete ``model`` from the index and from ``tiers``; see the module docstring.

    Args:
        steps: the commit protocol (its index and durable tier).
        tiers: every tier to delete copies from (the store's host, peer and durable tiers).
        dry_run: only report what would go.
        force: delete even while a writer looks live.
        idle_s: see :func:`writer_activity`.

    Raises:
        UnknownError: neither the index nor any tier holds anything of ``model``.
        ModelInUseError: a writer looks live and ``force`` is not given (nothing deleted).
        TierUnavailableError: the index or a tier cannot be reached (what was deleted before stays deleted;
            deleting again finishes the job).
    """
    validate_name(model, "model")
    index, durable = steps.index, steps.durable
    report = ModelDeleteReport(model, dry_run=dry_run)
    prefix = f"{model}/"
    epochs = durable_epoch_prefix(model)
    names: dict[int, list[str]] = {}
    for i, tier in enumerate(tiers):
        try:
            names[i] = sorted(tier.list(prefix))
        except TierStoreError as e:
            report.left[tier.tier] = f"cannot be listed: {e}"
            log.warning("delete %s: the %s tier cannot be listed: %s", model, tier.tier, e)
    known = index.knows(model) or model in index.models()
    if not known and not any(names.values()):
        raise UnknownError(f"no model {model!r} in the index or in any tier", what="model", model=model)
    report.steps = [s for s, _ in steps.steps(model)] if known else []
    report.index_keys = len(index.model_keys(model)) if known else 0
    report.durable_manifests = steps.durable_steps(model) if durable is not None else []
    # the durable tier's records (epochs, manifests, superseded manifests, pins), counted apart from the copies;
    # the superseded manifests and the pins go in 3.
    superseded = superseded_prefix(model)
    meta = (epochs, durable_manifest_prefix(model), superseded, durable_pin_prefix(model))
    for i, tier in enumerate(tiers):
        mine = [n for n in names.get(i, []) if not n.startswith(meta)]
        report.copies[tier.tier] = report.copies.get(tier.tier, 0) + len(mine)
        report.epoch_records += sum(1 for n in names.get(i, []) if n.startswith(epochs))
        report.superseded_manifests += sum(1 for n in names.get(i, []) if n.startswith(superseded))
    report.live = writer_activity(steps, model, idle_s) if known else None
    if dry_run:
        return report
    if report.live is not None and not force:
        raise ModelInUseError(f"model {model!r} has a live writer ({report.live}): stop the job first, or force "
                              "the delete (tierstore admin delete MODEL --yes --force)", model=model,
                              reason=report.live)
    if report.live is not None:
        log.info("deleting model %s although a writer looks live (%s): forced", model, report.live)
    steps.delete_durable_manifests(model, report.durable_manifests)  # 1. no rebuild can resurrect a step now
    if known:
        index.drop_model(model)  # 2.
    steps.forget_model(model)
    for i, tier in enumerate(tiers):  # 3., then once more: what an in-flight migration wrote before step 2
        mine = [n for n in names.get(i, []) if not n.startswith(meta)]
        try:
            tier.delete_many(mine)
            tier.delete_many([n for n in tier.list(prefix) if not n.startswith(epochs)])
        except TierStoreError as e:
            report.left[tier.tier] = f"some copies could not be deleted: {e}"
            log.warning("delete %s: copies left in the %s tier: %s", model, tier.tier, e)
    if durable is not None:  # 4.
        for i, tier in enumerate(tiers):
            if tier is durable:
                tier.delete_many([n for n in names.get(i, []) if n.startswith(epochs)])
    return report
