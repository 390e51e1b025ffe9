"""What a restore of a step reads: the one owner of a step's closure.

A committed step's manifest records its **complete set** (:func:`consistency.manifest.complete_entries`):
its own objects, the older layer versions it inherits, every delta base and ref target they reach, and
``requires``, the older steps whose manifests a restore also reads (a replay log step's base and logs). The
commit point computes that set in the index (``complete_set`` in :mod:`consistency.scripts`) and refuses a
step whose set is not entirely in the index (:class:`~tierstore.errors.IncompleteStepError`), so every step
recorded committed can be rebuilt by the read path's own rules.

Every path that needs "what does step S read" or "who reads step S" asks this module: retention
(:mod:`consistency.gc`) keeps what :func:`reachable` returns for the kept steps, the Checkpointer's
resumed save asks :func:`readers_of` which committed steps still read a step it would replace, and the
record script refuses to replace an object a standing reader pins (``READERS`` in
:mod:`consistency.scripts`).
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any

from consistency.manifest import complete_entries
from tierstore.keys import ShardKey

if TYPE_CHECKING:
    from consistency.index import Index

__all__ = ["closure", "is_closed", "reachable", "read_keys", "read_steps", "readers_of", "required_steps"]


class _Cached(dict):
    """A parsed manifest kept in a caller's cache (see :func:`required_steps`), its complete set parsed once,
    and split by rank once: the set holds every rank's objects, so parsing (or filtering) it at every
    retention pass cost each rank time proportional to the world."""

    read: frozenset[ShardKey] | None = None
    by_rank: dict[int, frozenset[ShardKey]] | None = None


def read_keys(m: Mapping[str, Any], rank: int | None = None) -> AbstractSet[ShardKey]:
    """The objects a restore of a manifest's step reads, from the manifest alone (its complete set); with
    ``rank``, those of that rank alone."""
    if isinstance(m, _Cached):
        if m.read is None:
            m.read = frozenset(ShardKey.parse(o["key"]) for o in complete_entries(m))
        if rank is None:
            return m.read
        if m.by_rank is None:
            split: dict[int, set[ShardKey]] = {}
            for k in m.read:
                split.setdefault(k.rank, set()).add(k)
            m.by_rank = {r: frozenset(ks) for r, ks in split.items()}
        return m.by_rank.get(rank, frozenset())
    keys = {ShardKey.parse(o["key"]) for o in complete_entries(dict(m))}
    return keys if rank is None else {k for k in keys if k.rank == rank}


def read_steps(m: Mapping[str, Any]) -> set[int]:
    """The older steps a restore of a manifest's step reads: those whose objects are in its complete set, and
    those it ``requires``."""
    own = m["step"]
    return ({k.step for k in read_keys(m)} | {int(s) for s in m.get("requires", [])}) - {own}


def readers_of(step: int, manifests: Mapping[int, Mapping[str, Any] | None]) -> list[int]:
    """Of ``manifests`` (step -> parsed manifest, ``None`` for a step without one), the steps newer than ``step``
    whose restore reads something of ``step``: while they stand, ``step``'s objects cannot be replaced."""
    return sorted(t for t, m in manifests.items() if t > step and m is not None and step in read_steps(m))


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


def _manifest(steps: Any, model: str, step: int, cache: dict[int, dict] | None) -> dict | None:
    if cache is None:
        return steps.manifest(model, step)
    m = cache.get(step)
    if m is None:
        m = steps.manifest(model, step)
        if m is not None:  # a committed step's manifest never changes while its writer's epoch lasts
            m = cache[step] = _Cached(m)
    return m


def required_steps(steps: Any, model: str, step_numbers: list[int], *,
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


def is_closed(m: Mapping[str, Any]) -> bool:
    """Whether a manifest's complete set is closed under links: written by a commit point that records
    ``inherited``, ``deps`` (every delta base and ref target, transitively), ``requires`` and ``missing``.
    Older manifests (``ranks`` alone, or a durable copy's ``deps``) are not: their links are the index's."""
    return all(isinstance(m.get(f), list) for f in ("inherited", "deps", "requires", "missing"))


def reachable(steps: Any, model: str, step_numbers: list[int], *,
              cache: dict[int, dict] | None = None, rank: int | None = None) -> set[ShardKey]:
    """Every object a restore of one of ``step_numbers`` reads: the complete sets their manifests (and the
    manifests of the steps they require) record, with any delta base or ref target the index links beyond.
    Each manifest is read once (``cache``: see :func:`required_steps`).

    A complete set the commit point closed (:func:`is_closed`) is taken as it is: every link of its objects
    was followed when the step committed, and the records it names keep their links while the step stands
    (a record's base and target are those of its write; the inherited and dep records are pinned; a
    superseded step's records move to the retired set before its keys are written again). So retention
    reads no object record for it: before, each rank read the record of every rank's objects of every kept
    step at every save (about 1.7 x world x layers records per rank per save). Only an older manifest's
    objects are followed through the index's records.

    ``rank``: only that rank's objects of the result (a retention pass over one rank's objects). Where every
    manifest is closed, each one's set of that rank is taken as it is (split once per cached manifest), so the
    pass does not grow with the world; otherwise the whole result is computed and filtered."""
    cache = {} if cache is None else cache
    manifests = [m for s in sorted(required_steps(steps, model, step_numbers, cache=cache))
                 if (m := _manifest(steps, model, s, cache)) is not None]
    if rank is not None and all(is_closed(m) for m in manifests):
        mine: set[ShardKey] = set()
        for m in manifests:
            mine.update(read_keys(m, rank))
        return mine
    closed: set[ShardKey] = set()
    roots: set[ShardKey] = set()
    for m in manifests:
        (closed if is_closed(m) else roots).update(read_keys(m))
    out = closed | closure(steps.index, roots - closed) if roots - closed else closed
    return out if rank is None else {k for k in out if k.rank == rank}
