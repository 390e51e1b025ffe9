"""What a step's durable manifest records, and whether one already in the durable tier is the same.

Used by :meth:`consistency.twophase.StepProtocol.maybe_durable`, which writes
the durable manifest last, create-once: a step is durable only when every
object of its complete set is held by the durable tier in the copy its
manifest names; "manifest already exists" is accepted only when the one
there is the same manifest (another rank wrote it first), never swallowed
when it differs.
"""

from __future__ import annotations

import json

from backends.base import Backend
from consistency.index import Index
from consistency.manifest import complete_entries, parse_manifest
from tierstore.errors import ManifestError
from tierstore.keys import ShardKey

__all__ = ["conflict", "durable_entries"]


def durable_entries(index: Index, tier: str, m: dict) -> list[dict] | None:
    """The entries a durable manifest adds to ``m``'s complete set, or ``None`` if the step is not durable yet.

    Every entry of :func:`complete_entries` must be recorded as held by the
    durable ``tier`` in the copy the manifest names; any delta base or ref
    target they reach that the manifest does not list (manifests written
    before they listed their deps) is returned, with the durable tier.
    """
    listed = {o["key"]: o for o in complete_entries(m)}
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
