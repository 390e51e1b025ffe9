"""The read path: resolve the newest committed step of a model that verifies.

``resolve(protocol, tiers, model, max_staleness=S, step=None)`` (the store's
:meth:`~tierstore.store.TierStore.resolve` passes its protocol and tiers):

- candidates: every committed (or durable) step, newest first; with ``step``
  given, that step alone;
- a candidate R's manifest records the complete set of objects a restore of
  R reads (:func:`consistency.manifest.complete_entries`): for each layer of
  its declared layout the version v <= R it resolves to (saved at R, else
  inherited: parameters and optimizer state live in the same shard, so they
  always come from the same version), with R - v <= S (S = 0: exact), and
  every delta base and ref target they reach;
- R is chosen only if every object of that set *verifies*: the index still
  records the copy the manifest names (same physical name and checksum), a
  live tier holds that copy and its checksum matches, and no delta/ref chain
  is longer than ``max_chain`` links (what a read follows). How a copy is
  checked is ``verify``: ``"auto"`` hashes copies in tiers read locally (host
  memory, a local durable directory) and compares the stored trailer with
  the index's checksum in remote tiers (one 16-byte ranged read), ``"full"``
  hashes every copy, ``"trailer"`` reads only trailers;
- a candidate that does not verify is skipped, with a logged warning and an
  entry in :attr:`Resolution.skipped` saying why, and the next older one is
  tried. If none verifies, :class:`NoValidCopyError` names why the newest did
  not;
- **destroy only on proof**: a tier that fails to answer (unreachable,
  throttled: :class:`~tierstore.errors.TierUnavailableError`) is asked again
  with backoff (the store's :class:`~backends.retry.RetryPolicy`, as migration does); a step is judged *lost*
  (:attr:`Resolution.lost`) only on positive evidence: the index no longer
  records what its manifest names, or every live tier answered a miss or a
  bad checksum for one of its copies. A step skipped because some tier could
  not answer is *unknown* (in ``skipped``, not in ``lost``): a caller may fall
  back past it, but must not act on it as lost (supersede it, delete it). With no committed step at all, an index that lost the model raises
  :class:`~tierstore.errors.IndexLostError` (see
  :meth:`~consistency.twophase.StepProtocol.check_index`), never "fresh".

Manifests written before they recorded their complete set resolve layers
they did not save by searching older committed manifests (as before).

**A share of the checks** (``part=(i, n)``, the Checkpointer's collective
restore): the caller checks only the copies of the saved ranks ``s`` with
``s % n == i`` (and every object they reach by a delta base or a ref); the
layers, staleness and chains are judged as ever. Each of ``n`` ranks takes its
share, so together they check every copy, once, instead of each rank checking
every rank's copies (a resolve cost ranks x objects checks on every rank). A
step chosen so is restorable only once every share verified it: the ranks
agree on it (:meth:`tierstore.train.restore_side.RestoreSide._agreed_resolution`:
the oldest step each share resolved, then each share again at or below it,
``at_most``, until all agree).

All ranks resolve against the same committed manifests, and restore bumps
the epoch first, so no zombie can commit a newer step while they do: they
agree, as long as they see the same copies (a copy that fails on one rank
only is the Checkpointer's to agree on).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any

from backends.base import Backend
from backends.retry import RetryPolicy
from consistency.index import Index, ObjectRecord
from consistency.manifest import complete_entries, layer_entries, manifest_layers
from consistency.twophase import StepProtocol
from tierstore import codec
from tierstore.errors import CorruptObjectError, ManifestError, NoValidCopyError, TierStoreError
from tierstore.keys import ShardKey, validate_step

__all__ = ["Resolution", "resolve"]

log = logging.getLogger(__name__)

_COMMITTED = ("committed", "durable")


@dataclass
class Resolution:
    """Where a restore reads from.

    Attributes:
        step: the resume step R; ``layers`` the version each layer comes from.
        objects: ``(layer, rank) -> record`` of every object to read.
        skipped: newer committed steps that did not verify, and why (newest first).
        lost: those of ``skipped`` judged lost on positive evidence (the others: a tier did not answer).
        requires: older steps whose manifests a restore of R also reads (a replay's base and logs).
    """

    model: str
    step: int
    world_size: int
    layers: dict[str, int]
    objects: dict[tuple[str, int], ObjectRecord]
    extra: dict[int, Any] = field(default_factory=dict)
    state: str = "committed"
    skipped: dict[int, str] = field(default_factory=dict)
    requires: list[int] = field(default_factory=list)
    lost: set[int] = field(default_factory=set)

    def keys_for_rank(self, rank: int) -> dict[str, ShardKey]:
        return {layer: info.key for (layer, r), info in self.objects.items() if r == rank}


#: the most copies :meth:`_Verifier.prefetch` checks at once
PREFETCH_THREADS = 8


class _Unknown(str):
    """A reason a copy or step could not be checked (a tier did not answer): no evidence of loss."""


class _Verifier:
    """Verifies objects against the index and the tiers; caches verdicts per copy (key, name, checksum).

    A verdict is ``None`` (verifies), a reason (``str``: positive evidence that the copy is gone or bad),
    or an :class:`_Unknown` reason (a tier did not answer after ``retries`` tries with backoff).
    """

    def __init__(self, index: Index, tiers: Sequence[Backend], verify: str, retry: RetryPolicy):
        self.index = index
        self.tiers = tiers
        self.verify = verify
        self.retry = retry
        self.records: dict[ShardKey, ObjectRecord | None] = {}
        self.verdicts: dict[tuple[str, str, str], str | None] = {}
        self.silent: set[str] = set()  # tiers that did not answer after every retry: asked once from then on

    def load(self, keys: list[ShardKey]) -> None:
        todo = [k for k in dict.fromkeys(keys) if k not in self.records]
        if todo:
            self.records.update(zip(todo, self.index.get_objects(todo)))

    def record(self, key: ShardKey) -> ObjectRecord | None:
        self.load([key])
        return self.records[key]

    def prefetch(self, entries: Sequence[dict]) -> None:
        """Check the copies of ``entries`` at once, on up to :data:`PREFETCH_THREADS` threads, into the verdict
        cache: what :meth:`why_not` then returns for each, in order, is what asking one by one gives, without
        waiting a round trip per copy on a remote tier (the peer tier, the durable tier). Nothing is done
        where every tier is this node's memory or disks (a check there costs less than a thread hop).

        The first copy with a problem ends it: the checks not begun are dropped, those begun finish. Every
        copy before it in ``entries`` was begun (the threads take them in order), so the first problem in
        order, the step's verdict, is the one asking one by one finds; a step passed over is not checked
        to its last copy on every tier (a lost step's copies each cost a miss in every tier)."""
        todo = [o for o in entries if (o["key"], o.get("name") or o["key"], o["checksum"]) not in self.verdicts]
        if len(todo) < 2 or all(t.zero_copy_get or t.local_reads for t in self.tiers):
            return
        ex = ThreadPoolExecutor(max_workers=min(PREFETCH_THREADS, len(todo)), thread_name_prefix="tierstore-resolve")
        try:
            for f in as_completed([ex.submit(self.why_not, o) for o in todo]):
                if f.result() is not None:
                    break
        finally:
            ex.shutdown(wait=True, cancel_futures=True)

    def why_not(self, entry: dict) -> str | None:
        """``None`` if the copy the entry names verifies in some live tier, else why not."""
        key_s = entry["key"]
        name = entry.get("name") or key_s
        ident = (key_s, name, entry["checksum"])
        if ident not in self.verdicts:
            self.verdicts[ident] = self._check(ShardKey.parse(key_s), name, entry["checksum"])
        return self.verdicts[ident]

    def _check(self, key: ShardKey, name: str, checksum: str) -> str | None:
        rec = self.record(key)
        if rec is None:
            return f"{key} is not in the index"
        if rec.name != name or rec.checksum != checksum:
            return f"{key}: the index records another copy ({rec.name}) than the manifest ({name})"
        # the tiers the index names first; then the others, as the read path does: the index's tier names
        # say nothing of which node (the peer tier serves other nodes' host tiers)
        todo = sorted(self.tiers, key=lambda t: t.tier not in rec.tiers)
        answers: dict[str, str] = {}
        delays = self.retry.delays()
        while True:
            unanswered = []
            for tier in todo:
                problem = self._check_copy(tier, name, checksum)
                if problem is None:
                    return None
                answers[tier.tier] = problem
                if isinstance(problem, _Unknown):
                    unanswered.append(tier)
            delay = next(delays, None) if unanswered else None
            if delay is None or all(t.tier in self.silent for t in unanswered):
                self.silent.update(t.tier for t in unanswered)
                break
            self.retry.sleep(delay)
            todo = unanswered  # the tiers that answered a miss or a bad copy said so: no need to ask again
        held = ", ".join(sorted(rec.tiers)) or "none"
        why = (f"{key}: no live tier holds a copy that verifies (index says {held}; "
               f"{'; '.join(f'{t}: {p}' for t, p in answers.items()) or '-'})")
        return _Unknown(why) if any(isinstance(p, _Unknown) for p in answers.values()) else why

    def _check_copy(self, tier: Backend, name: str, checksum: str) -> str | None:
        full = self.verify == "full" or (self.verify == "auto" and (tier.zero_copy_get or tier.local_reads))
        try:
            if not full:
                tail = tier.tail(name, codec.TRAILER_SIZE)
                if tail is None:
                    return "missing"
                if len(tail) != codec.TRAILER_SIZE or tail.hex() != checksum:
                    return f"trailer {tail.hex()} is not the index's checksum {checksum}"
                return None
            blob = tier.get(name)
            if blob is None:
                return "missing"
            try:
                got = codec.verify(blob)
            finally:
                if isinstance(blob, memoryview):
                    blob.release()
            return None if got == checksum else f"checksum {got} is not the index's {checksum}"
        except CorruptObjectError as e:
            return f"corrupt ({e})"
        except TierStoreError as e:  # the tier did not answer: nothing is known of the copy
            return _Unknown(f"unreadable ({e})")


def _chain_problem(entries: dict[str, dict], verifier: _Verifier, max_chain: int) -> str | None:
    """Why a delta/ref chain of the set is unreadable (a link outside it, too long), else ``None``.

    Links outside the set (manifests written before they listed their deps) are looked up in
    the index and added to ``entries`` (they are verified like the rest).
    """
    depth: dict[str, int] = {}

    def link(o: dict) -> str | None:
        return o.get("base") if o.get("kind") == "delta" else o.get("target") if o.get("kind") == "ref" else None

    for start in list(entries):
        path: list[str] = []
        cur: str | None = start
        while cur is not None and cur not in depth:
            if cur in path or len(path) > max_chain + 1:
                break
            o = entries.get(cur)
            if o is None:
                rec = verifier.record(ShardKey.parse(cur))
                if rec is None:
                    return f"{path[-1] if path else start} reaches {cur}, which is not in the index"
                o = entries[cur] = rec.to_json()
            path.append(cur)
            cur = link(o)
        below = depth.get(cur, -1) if cur is not None else -1
        if cur is not None and cur not in depth:
            below = max_chain + 1  # a cycle or a chain past the limit
        for i, k in enumerate(reversed(path)):
            depth[k] = below + 1 + i
        if depth.get(start, 0) > max_chain:
            return f"{start} is {depth[start]} delta/ref links from its full base; a read follows at most {max_chain}"
    return None


def _legacy_inherited(m: dict, committed: list[int], manifest: Callable[[int], dict | None],
                      max_staleness: int) -> list[dict]:
    """Entries of the layers a manifest without ``inherited`` did not save: each layer's newest version in an
    older committed manifest within the staleness bound (the search older manifests need)."""
    own = {ShardKey.parse(o["key"]).layer for vote in m["ranks"].values() for o in vote["objects"]}
    out: list[dict] = []
    r = m["step"]
    for layer in manifest_layers(m):
        if layer in own:
            continue
        for v in reversed([s for s in committed if r - max_staleness <= s < r]):
            m_v = manifest(v)
            if m_v is None or m_v["world"] != m["world"]:
                continue
            found = [o for vote in m_v["ranks"].values() for o in vote["objects"]
                     if ShardKey.parse(o["key"]).layer == layer]
            if found:
                out += found
                break
    return out


def resolve(protocol: StepProtocol, tiers: Sequence[Backend], model: str, max_staleness: int = 0, *,
            max_chain: int = 64, step: int | None = None, verify: str = "auto",
            retry: RetryPolicy | None = None, at_most: int | None = None,
            part: tuple[int, int] | None = None) -> Resolution:
    """Resolve ``model``'s resume step and the version of each layer; see the module docstring.

    Args:
        protocol: the commit protocol (manifests, object records).
        tiers: the live tiers, fastest first.
        max_chain: the longest delta/ref chain a read follows.
        step: resolve this committed step only (no fallback).
        verify: ``"auto"``, ``"full"`` or ``"trailer"`` (see the module docstring).
        retry: how a tier that did not answer is asked again before a copy is called unknown
            (default :class:`~backends.retry.RetryPolicy`).
        at_most: the newest step to try (the older committed steps after it, as ever).
        part: ``(i, n)``: check only the copies of saved ranks ``s % n == i`` (the module docstring: a share
            of a collective restore's checks, whose ranks then agree); ``None``: every copy.

    Raises:
        NoValidCopyError: no candidate verifies (``reason`` says why the newest did not;
            ``skipped`` maps each candidate to why, ``lost`` lists those judged lost on
            positive evidence, ``evidence`` is ``"lost"`` when every candidate was), or ``step``
            is not committed.
        IndexLostError: nothing is committed in the index, but the durable tier holds steps of ``model``; or
            (resolving the newest step) the durable tier holds a durable step newer than every one the index
            records as durable, of which the index has no record (it lost some keys).
    """
    records = protocol.steps(model)
    if step is None and protocol.check_records(model, dict(records)):  # an index that lost some records
        records = protocol.steps(model)
    committed = [s for s, st in records if st in _COMMITTED]
    states = dict(records)
    if step is not None:
        validate_step(step)
        if step not in committed:
            why = f"step {step} of {model!r} is {states.get(step) or 'not recorded'}, not committed"
            raise NoValidCopyError(why, model=model, step=step, reason=why)
        candidates = [step]
    else:
        if not committed:
            protocol.check_index(model)  # a lost index is not a fresh job
            raise NoValidCopyError(f"model {model!r} has no committed step", model=model)
        candidates = [s for s in reversed(committed) if at_most is None or s <= at_most]
        if not candidates:
            why = f"no committed step of {model!r} at or below step {at_most}"
            raise NoValidCopyError(why, model=model, reason=why)
    if part is not None and not (isinstance(part, tuple) and len(part) == 2 and 0 <= part[0] < part[1]):
        raise ValueError(f"part must be (index, count) with 0 <= index < count, got {part!r}")
    manifests: dict[int, dict | None] = {}

    def manifest(s: int) -> dict | None:
        if s not in manifests:
            manifests[s] = protocol.manifest(model, s)
        return manifests[s]

    verifier = _Verifier(protocol.index, tiers, verify, retry or RetryPolicy())
    skipped: dict[int, str] = {}
    lost: set[int] = set()
    for r_step in candidates:
        try:
            found = _try_step(r_step, manifest, committed, verifier, max_staleness, max_chain, part)
        except ManifestError as e:  # a manifest that does not parse: positive evidence
            found = f"{type(e).__name__}: {e}"
        except TierStoreError as e:  # an unreachable index mid-way: nothing is known
            found = _Unknown(f"{type(e).__name__}: {e}")
        if isinstance(found, Resolution):
            found.model, found.state, found.skipped = model, states.get(r_step, "committed"), skipped
            found.lost = lost
            return found
        skipped[r_step] = str(found)
        if not isinstance(found, _Unknown):
            lost.add(r_step)
        log.warning("restore of %s: committed step %d skipped (%s): %s", model, r_step,
                    "lost" if r_step in lost else "unknown: a tier did not answer", found)
    first = skipped[candidates[0]]
    evidence = "lost" if len(lost) == len(candidates) else "unknown"
    if step is not None:
        raise NoValidCopyError(f"step {step} of {model!r} cannot be restored: {first}", model=model, step=step,
                               reason=first, skipped=skipped, lost=lost, evidence=evidence)
    raise NoValidCopyError(f"no committed step of {model!r} can be rebuilt: {first}", model=model, reason=first,
                           skipped=skipped, lost=lost, evidence=evidence)


def _try_step(r_step: int, manifest: Callable[[int], dict | None], committed: list[int], verifier: _Verifier,
              max_staleness: int, max_chain: int, part: tuple[int, int] | None = None) -> Resolution | str:
    """The resolution of ``r_step`` if everything it reads (of ``part``'s share) verifies, else why not."""

    def checked(o: dict) -> bool:
        return part is None or ShardKey.parse(o["key"]).rank % part[1] == part[0]

    m = manifest(r_step)
    if m is None:
        return "its manifest is gone from the index"
    if m.get("missing"):
        return f"layer(s) {', '.join(m['missing'][:5])} have no saved version to resolve to"
    if "inherited" not in m:
        m = {**m, "inherited": _legacy_inherited(m, committed, manifest, max_staleness)}
    by_layer = layer_entries(m)
    chosen: dict[str, int] = {}
    objects: dict[tuple[str, int], ObjectRecord] = {}
    for layer in manifest_layers(m):
        pairs = by_layer.get(layer)
        if not pairs:
            return f"layer {layer!r} has no version within {max_staleness} step(s) of {r_step}"
        version = max(ShardKey.parse(o["key"]).step for _, o in pairs)
        if r_step - version > max_staleness:
            return (f"layer {layer!r} resolves to step {version}, {r_step - version} step(s) older than the "
                    f"staleness bound {max_staleness}")
        chosen[layer] = version
        for rank, o in pairs:
            objects[(layer, rank)] = ObjectRecord.from_json(o)
    entries = {o["key"]: o for o in complete_entries(m) if checked(o)}
    for s in m.get("requires", []):
        if s not in committed or manifest(s) is None:
            return f"it replays onto step {s}, which is no longer committed"
        for o in complete_entries(manifest(s)):  # type: ignore[arg-type]
            if checked(o):
                entries.setdefault(o["key"], o)
    problem = _chain_problem(entries, verifier, max_chain)
    if problem is not None:
        return problem
    verifier.load([ShardKey.parse(k) for k in entries])
    verifier.prefetch(list(entries.values()))
    for o in entries.values():
        problem = verifier.why_not(o)
        if problem is not None:
            return problem
    extra = {int(r): v.get("extra") for r, v in m["ranks"].items()}
    return Resolution("", r_step, m["world"], chosen, objects, extra, requires=list(m.get("requires", [])))
