"""Rebuild the Redis index from the durable tier's manifests.

The index is a cache of what the durable tier proves: S3 (or the local
durable directory) is the source of truth for durable steps. When the index
is lost (a server restarted without persistence, a FLUSHALL), call
:func:`rebuild_index` once, from one process, before restoring:

1. list ``<model>/_manifest/*.json`` in the durable tier (every model, or one);
2. parse and validate each manifest (``durable`` must be true);
3. check that every object of its complete set (its own, the older layer
   versions it inherits, and its ``deps``: the delta bases and ref targets it
   reaches) is present in the durable tier, under the physical name the
   manifest records; a step with a missing object is skipped and reported;
4. re-record every object with the durable tier (and the host tier where the
   local host tier still holds that copy with the same size), the step as
   ``durable`` with its world and layout, and its manifest;
5. raise the model's epoch to at least the newest epoch the durable tier
   records (its manifests' and its epoch records', see
   :meth:`~consistency.twophase.StepProtocol.open_epoch`): a restore then
   bumps it past every writer of those steps, so no zombie is unfenced.

6. restore the pins the durable tier records (``<model>/_pins/``, see
   :meth:`~consistency.steprecords.StepRecords.pin`) of the steps it restored:
   a checkpoint a framework still holds stays pinned, so a retention pass run
   before the framework's next save cannot collect it. A record of a step that
   is not durable (its manifest is gone or was skipped) or that does not parse
   is ignored and reported (``pins_ignored``); where a crash left a label with
   records of two steps, both are kept (the label's next pin, or unpin, settles it).

Steps that were only committed in memory are gone from the index: the report
lists the steps whose objects the host tier still holds but no durable
manifest covers (``lost_steps``). A step whose manifest is skipped (it does not
parse, or objects are missing) is recorded ``aborted`` with why, where the index
has no record of it, so the read path's check for an index that lost records
(:meth:`consistency.epochs.EpochLog.check_records`) is satisfied by the rebuild.
Idempotent; safe to run again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from backends.base import Backend
from consistency.index import ObjectRecord
from consistency.manifest import (
    complete_entries,
    durable_manifest_prefix,
    durable_pin_model,
    durable_pin_prefix,
    parse_durable_manifest_name,
    parse_durable_pin,
    parse_manifest,
)
from consistency.twophase import StepProtocol
from tierstore.errors import ConfigError, ManifestError, TierStoreError
from tierstore.keys import ShardKey, split_object_name

__all__ = ["RebuildReport", "rebuild_index"]

log = logging.getLogger(__name__)


@dataclass
class RebuildReport:
    """What :func:`rebuild_index` restored and what it could not."""

    restored: dict[str, list[int]] = field(default_factory=dict)
    objects: int = 0
    skipped: dict[str, str] = field(default_factory=dict)
    lost_steps: dict[str, list[int]] = field(default_factory=dict)
    pins: dict[str, int] = field(default_factory=dict)  # model -> (label, step) pins restored
    pins_ignored: dict[str, str] = field(default_factory=dict)  # pin record -> why it was not restored

    def to_json(self) -> dict:
        return {"restored": self.restored, "objects": self.objects, "skipped": self.skipped,
                "lost_steps": self.lost_steps, "pins": self.pins, "pins_ignored": self.pins_ignored}


def _pin_names(names: list[str], model: str | None) -> list[tuple[str, str]]:
    """``(name, model)`` of the pin records among ``names``."""
    out = []
    for name in names:
        m = durable_pin_model(name)
        if m is not None and (model is None or m == model):
            out.append((name, m))
    return sorted(out)


def _restore_pins(steps: StepProtocol, durable: Backend, names: list[tuple[str, str]],
                  report: RebuildReport) -> None:
    """Restore the pins whose records ``names`` are, of the steps ``report`` restored."""
    found: dict[str, dict[str, list[int]]] = {}
    for name, m_name in names:
        raw = durable.get(name)
        if raw is None:
            continue
        try:
            label, step = parse_durable_pin(m_name, name, bytes(raw))
        except ManifestError as e:
            report.pins_ignored[name] = str(e)
            log.warning("rebuild: ignoring pin record %s: %s", name, e)
            continue
        if step not in report.restored.get(m_name, []):
            report.pins_ignored[name] = f"pin {label!r} names step {step} of {m_name}, which is not durable"
            continue
        found.setdefault(m_name, {}).setdefault(label, []).append(step)
    for m_name, pins in sorted(found.items()):
        report.pins[m_name] = steps.restore_pins(m_name, pins)


def _manifest_names(durable: Backend, model: str | None,
                    everything: list[str] | None = None) -> list[tuple[str, str, int]]:
    out = []
    for name in (everything if everything is not None else durable.list(durable_manifest_prefix(model) if model
                                                                         else "")):
        got = parse_durable_manifest_name(name)
        if got is not None and (model is None or got[0] == model):
            out.append((name, *got))
    return sorted(out, key=lambda t: (t[1], t[2]))


def _record(steps: StepProtocol, durable: Backend, host: Backend | None, o: dict) -> None:
    rec = ObjectRecord.from_json(o)
    tiers = [durable.tier]
    try:
        if host is not None and host.size(rec.name) == rec.size:
            tiers.append(host.tier)
    except TierStoreError:
        pass
    steps.index.record_object(rec.key, kind=rec.kind, size=rec.size, checksum=rec.checksum, tiers=tiers,
                              base=rec.base, target=rec.target, epoch=-1, name=rec.name, restore=True)


def rebuild_index(steps: StepProtocol, model: str | None = None, *, host: Backend | None = None) -> RebuildReport:
    """Restore the index's durable steps (of ``model``, or of every model) from durable manifests.

    Args:
        steps: the commit protocol over the index to rebuild, with its durable tier.
        model: one model, or every model in the durable tier.
        host: the local host tier: objects it still holds are recorded there too, and the
            report's ``lost_steps`` lists what it holds that no durable manifest covers.

    Raises:
        ConfigError: there is no durable tier.
        TierUnavailableError: the index or the durable tier cannot be reached.
    """
    durable = steps.durable
    if durable is None:
        raise ConfigError("rebuild_index needs a durable tier: the index is rebuilt from its manifests")
    report = RebuildReport()
    max_epoch: dict[str, int] = {}
    everything = list(durable.list("")) if model is None else None  # one listing serves both
    pin_names = _pin_names(list(durable.list(durable_pin_prefix(model))) if model is not None else everything or [],
                           model)
    for name, m_name, step in _manifest_names(durable, model, everything):
        raw = durable.get(name)
        if raw is None:
            continue
        try:
            m = parse_manifest(bytes(raw), model=m_name, step=step)
            if not m.get("durable"):
                raise ManifestError("not a durable manifest")
        except ManifestError as e:
            report.skipped[name] = str(e)
            log.warning("rebuild: skipping %s: %s", name, e)
            steps.record_unrebuildable(m_name, step, str(e))
            continue
        entries = complete_entries(m)
        missing = [o["key"] for o in entries if not durable.exists(o.get("name") or o["key"])]
        if missing:
            report.skipped[name] = f"{len(missing)} object(s) missing from the durable tier, e.g. {missing[0]}"
            steps.record_unrebuildable(m_name, step, report.skipped[name])
            continue
        # oldest first: a delta's base is recorded before it (see BYRANK in consistency.scripts: a delta on a
        # record not there yet marks the model's links as leaving a rank)
        for o in sorted(entries, key=lambda o: ShardKey.parse(o["key"]).step):
            _record(steps, durable, host, o)
        report.objects += len(entries)
        steps.restore_durable(m_name, m)
        report.restored.setdefault(m_name, []).append(step)
        max_epoch[m_name] = max(max_epoch.get(m_name, 0), int(m.get("epoch", 0) or 0))
    _restore_pins(steps, durable, pin_names, report)
    models = set(max_epoch) | ({model} if model is not None else set())
    for m_name in models:
        ep = max(max_epoch.get(m_name, 0), steps.durable_epoch(m_name))
        if ep > 0:
            steps.index.raise_epoch(m_name, ep)
    report.lost_steps = _lost_steps(steps, host, model, report) if host is not None else {}
    return report


def _lost_steps(steps: StepProtocol, host: Backend, model: str | None, report: RebuildReport) -> dict[str, list[int]]:
    """Steps whose objects the host tier holds but that no restored durable manifest covers."""
    held: dict[tuple[str, int], list[ShardKey]] = {}
    try:
        names = list(host.list(f"{model}/" if model else ""))
    except TierStoreError:
        return {}
    for n in names:
        try:
            key, _tag = split_object_name(n)
        except TierStoreError:
            continue
        if key.step not in report.restored.get(key.model, []):
            held.setdefault((key.model, key.step), []).append(key)
    lost: dict[str, list[int]] = {}
    for (m_name, step), keys in sorted(held.items()):
        if not any(steps.index.get_objects(keys)):  # objects reached as deps of a durable step are not lost
            lost.setdefault(m_name, []).append(step)
    return lost
