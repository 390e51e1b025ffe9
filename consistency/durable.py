"""The durable level of a step: migrated ranks, the durable manifest, memory-only steps.

:class:`DurableLevel` is this part of :class:`consistency.twophase.StepProtocol`:
each rank calls :meth:`DurableLevel.mark_migrated` once its objects of a
committed step reached the durable tier; the call that finds every rank
migrated writes the durable manifest (:meth:`DurableLevel.maybe_durable`), which writes
the durable manifest last, create-once: a step is durable only when every
object of its complete set is held by the durable tier in the copy its
manifest names; "manifest already exists" is accepted only when the one
there is the same manifest (another rank wrote it first), never swallowed
when it differs.
"""

from __future__ import annotations

import json
import logging

from backends.base import Backend
from consistency.index import Index, translate_redis_errors
from consistency.manifest import complete_entries, durable_manifest_name, manifest_objects, parse_manifest
from consistency.stepbase import StepBase, _s
from tierstore.errors import FencedError, KeyExistsError, ManifestError, TierStoreError
from tierstore.keys import ShardKey

__all__ = ["DurableLevel", "conflict", "durable_entries"]

log = logging.getLogger(__name__)


def durable_entries(index: Index, tier: str, m: dict, required: list[dict] = ()) -> list[dict] | None:  # type: ignore[assignment]
    """The entries a durable manifest adds to ``m``'s complete set, or ``None`` if the step is not durable yet.

    Every entry of :func:`complete_entries` (and of ``required``: the complete
    sets of the steps ``m`` requires, a replay's base and logs) must be recorded
    as held by the durable ``tier`` in the copy the manifest names; any delta
    base or ref target they reach that the manifest does not list (manifests
    written before they listed their deps) is returned, with the durable tier.
    """
    listed = {o["key"]: o for o in [*required, *complete_entries(m)]}
    own = {o["key"] for o in complete_entries(m)}
    seen: set[str] = set()
    todo = sorted(listed)
    extra: list[dict] = []
    while todo:
        recs = index.get_objects([ShardKey.parse(k) for k in todo])
        nxt: list[str] = []
        for name, rec in zip(todo, recs):
            seen.add(name)
            if rec is None or tier not in rec.tiers:
                return None
            want = listed.get(name)
            if want is not None and (want.get("name") or name) != rec.name:
                return None  # the index now names another copy than the manifest: never durable
            if want is None:
                extra.append({**rec.to_json(), "tiers": [tier]})
            elif name not in own:
                pass  # a required step's entry: its own manifest lists it
            for ref in (rec.base, rec.target):
                if ref is not None and str(ref) not in seen and str(ref) not in nxt:
                    nxt.append(str(ref))
        todo = nxt
    return extra


def conflict(durable: Backend, model: str, step: int, name: str, manifest: dict) -> str | None:
    """``None`` if the durable manifest already at ``name`` is ``manifest``, else why it conflicts."""
    raw = durable.get(name)
    try:
        there = parse_manifest(bytes(raw), model=model, step=step) if raw is not None else None
    except ManifestError:
        there = None
    if there == json.loads(json.dumps(manifest, sort_keys=True)):
        return None
    return (f"a different durable manifest of step {step} of {model} is already in the durable tier ({name}): "
            f"the index lost the step and it was saved again; the durable one is kept, this one stays "
            f"memory-only (run `tierstore admin rebuild-index {model} --yes` after an index loss)")


class DurableLevel(StepBase):
    """Migration marks, memory-only marks and the durable manifest (part of ``StepProtocol``)."""

    def mark_migrated(self, model: str, step: int, rank: int, failures: list, *, epoch: int | None = None) -> None:
        """Called when rank's objects of ``step`` reached the durable tier (or gave up trying).

        With ``failures`` (the migration gave up after its retries), the step
        is recorded as staying in memory only (``StepRecord.memory_only``,
        shown by ``tierstore admin steps``).

        Raises:
            FencedError: ``epoch`` is older than the job's (a zombie's migration counts for nothing).
        """
        if failures:
            first = failures[0]
            what = f"{first[0]}: {first[1]}" if isinstance(first, tuple) and len(first) == 2 else str(first)
            log.warning("step %s of %s: %d object(s) of rank %d failed to migrate; it stays memory-only (%s)",
                        step, model, len(failures), rank, what)
            self.mark_memory_only(model, step, f"{len(failures)} object(s) of rank {rank} failed to migrate: {what}")
            return
        ks = self._keys(model, step)
        with translate_redis_errors(f"mark step {step} migrated", self.index.url):
            self.index.run_script(self._migrated, [ks["epoch"], ks["step"]], [-1 if epoch is None else epoch, rank])
        self.maybe_durable(model, step, epoch=epoch)

    def required_entries(self, model: str, manifest: dict) -> list[dict] | None:
        """The complete sets of the steps ``manifest`` requires, transitively (a replay log step's base and
        logs: a restore of it reads them); ``None`` if one of their manifests is gone."""
        out: list[dict] = []
        seen: set[int] = set()
        todo = list(manifest.get("requires", []))
        while todo:
            s = todo.pop()
            if s in seen:
                continue
            seen.add(s)
            m = self.manifest(model, s)
            if m is None:
                return None
            out += complete_entries(m)
            todo += m.get("requires", [])
        return out

    def mark_memory_only(self, model: str, step: int, reason: str) -> bool:
        """Record that ``step`` stays in memory only, and why (if it is recorded and not durable)."""
        with translate_redis_errors(f"mark step {step} of {model} memory-only", self.index.url):
            return bool(self.index.run_script(self._memory_only, [self._keys(model, step)["step"]], [reason[:1000]]))

    def maybe_durable(self, model: str, step: int, *, epoch: int | None = None) -> bool:
        """If ``step`` is committed, every rank migrated, and every object it reaches is held by the
        durable tier: write the durable manifest there (last, create-once) and mark the step durable.

        The durable manifest is the committed one plus ``durable: true`` and
        the durable tier added to every entry's tiers (its ``deps`` completed
        from the index for manifests written before they listed them), so the
        index can be rebuilt from it alone.

        Raises:
            FencedError: ``epoch`` is stale.
            KeyExistsError: a *different* durable manifest of the step is already there (a
                lost index restarted from scratch): it is left alone, and the step stays memory-only.
        """
        if self.durable is None:
            return False
        ks = self._keys(model, step)
        with translate_redis_errors(f"check step {step} durability", self.index.url):
            pipe = self.index._r.pipeline(transaction=False)  # one round trip (one slot: the model's)
            pipe.hgetall(ks["step"])
            pipe.get(ks["epoch"])
            row, cur = pipe.execute()
            h = {_s(k): _s(v) for k, v in row.items()}
            current = int(cur or 0)
        if epoch is not None and epoch >= 0 and epoch < current:
            raise FencedError(f"step {step} of {model}: epoch {epoch} is fenced (now {current})", epoch=current)
        if h.get("state") != "committed" or int(h.get("nmigrated") or 0) < int(h.get("world") or 0):
            return False
        manifest = self.manifest(model, step)
        if manifest is None:
            return False
        required = self.required_entries(model, manifest)
        if required is None:
            return False
        extra = durable_entries(self.index, self.durable.tier, manifest, required)
        if extra is None:
            return False
        tier = self.durable.tier
        for o in [*manifest_objects(manifest), *manifest.get("inherited", []), *manifest.get("deps", [])]:
            o["tiers"] = sorted(set(o.get("tiers") or ()) | {tier})
        manifest["durable"] = True
        manifest["deps"] = sorted([*manifest.get("deps", []), *extra], key=lambda d: d["key"])
        data = json.dumps(manifest, sort_keys=True).encode()
        name = durable_manifest_name(model, step)
        self.index.sync(model, f"acknowledge step {step} before its durable manifest")  # never durable unreplicated
        try:
            self.durable.put(name, data, if_absent=True)
        except KeyExistsError as e:  # another rank wrote the same one; a different one is a conflict
            why = conflict(self.durable, model, step, name, manifest)
            if why is not None:
                log.error(why)
                try:
                    self.mark_memory_only(model, step, why)
                except TierStoreError:
                    pass
                raise KeyExistsError(why, key=name, tier=self.durable.tier, model=model, step=step) from e
        with translate_redis_errors(f"mark step {step} durable", self.index.url):
            marked = self.index.run_script(self._durable, [ks["epoch"], ks["step"]],
                                           [-1 if epoch is None else epoch, ks["events"], step, self._now()])
        if not marked and self.state(model, step) != "durable":
            # garbage collection dropped the step while its manifest was being written: an index rebuild
            # must not resurrect it
            self.durable.delete(name)
            return False
        return True
