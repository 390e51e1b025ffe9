"""What ``tierstore admin`` shows: read-only views of the Redis index and the tiers, as plain data.

Every function takes an open :class:`~tierstore.store.TierStore` (or its
:class:`~consistency.index.Index`) and returns JSON-ready dicts and lists;
:mod:`tierstore.cli.admin` renders them as tables or JSON. Nothing here writes
to the index or a tier. Times are the index server's (``TIME``), so ages do
not depend on the admin host's clock.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from consistency.index import Index, ObjectRecord
from consistency.manifest import manifest_layers, manifest_objects
from consistency.nodes import NodeRegistry
from consistency.steprecords import durable_lag
from tierstore import codec
from tierstore.errors import CorruptObjectError, TierStoreError, UnknownError
from tierstore.keys import ShardKey

if TYPE_CHECKING:
    from tierstore.store import TierStore

__all__ = [
    "du_view",
    "layers_view",
    "models_view",
    "nodes_view",
    "require_model",
    "show_view",
    "steps_view",
    "verify_keys",
    "verify_objects",
    "where_view",
]


def require_model(store: TierStore, model: str) -> None:
    """Raise :class:`UnknownError` unless ``model`` is in the index."""
    known = store.models()
    if model not in known:
        hint = f"known: {', '.join(known)}" if known else "the index holds no model"
        raise UnknownError(f"no model {model!r} in the index ({hint})", what="model", model=model)


def _records(store: TierStore, keys: list[ShardKey]) -> list[ObjectRecord]:
    return [r for r in store.index.get_objects(keys) if r is not None] if keys else []


def models_view(store: TierStore) -> list[dict[str, Any]]:
    """One row per model: epoch, steps by state, newest committed/durable step, the durable lag (committed
    steps newer than the newest durable one, and seconds: :func:`consistency.steprecords.durable_lag`),
    objects, bytes, and whose objects a writer's retention pass reads: its own rank's (``by rank``), or every
    rank's where a record links across ranks otherwise than a ref within a step (``every rank``)."""
    rows = []
    for model in store.models():
        records = store.steps.records(model)
        steps = [(r.step, r.state) for r in records]
        committed = [s for s, st in steps if st in ("committed", "durable")]
        durable = [s for s, st in steps if st == "durable"]
        lag = lag_view(store, model, records)
        recs = _records(store, store.index.list_objects(model))
        by_state: dict[str, int] = defaultdict(int)
        for _s_, st in steps:
            by_state[st or "unknown"] += 1
        rows.append({
            "model": model,
            "epoch": store.index.epoch(model),
            "steps": len(steps),
            "states": dict(by_state),
            "newest_committed": committed[-1] if committed else None,
            "newest_durable": durable[-1] if durable else None,
            "durable_lag_steps": lag["durable_lag_steps"],
            "durable_lag_s": lag["durable_lag_s"],
            "objects": len(recs),
            "bytes": sum(r.size for r in recs),
            # what a writer's retention pass reads after each save (see ObjectIndex.list_rank_objects)
            "retention": "by rank" if store.index.links_rank_local(model) else "every rank",
        })
    return rows


def lag_view(store: TierStore, model: str, records: list | None = None) -> dict[str, Any]:
    """The durable lag of ``model``: newest committed and durable steps, committed steps newer than the
    newest durable one, and seconds (:func:`consistency.steprecords.durable_lag`)."""
    lag = durable_lag(store.steps.records(model) if records is None else records, store.index.server_time())
    return {"newest_committed": lag.newest_committed, "newest_durable": lag.newest_durable,
            "durable_lag_steps": lag.steps, "durable_lag_s": round(lag.seconds, 3)}


def retention_view(store: TierStore, model: str, records: list | None = None) -> dict[str, Any]:
    """Why ``admin steps`` lists the committed steps it does: how many are listed, how many retention
    retired (their records are gone: :meth:`consistency.steprecords.StepRecords.note_retention`), and the
    windows of the last pass that retired one (``memory`` steps, ``keep_last``; ``durable``: kept by the
    durable tier only), with the newest durable step."""
    recs = store.steps.records(model) if records is None else records
    listed = [r.step for r in recs if r.state in ("committed", "durable")]
    durable = [r.step for r in recs if r.state == "durable"]
    note = store.steps.retention_note(model) or {}
    retired = int(note.get("retired", 0))
    return {"committed": len(listed) + retired, "listed": len(listed), "retired": retired,
            "newest_retired": note.get("newest_retired"), "keep_last": note.get("keep_last"),
            "memory": note.get("memory"), "durable_only": note.get("durable"),
            "newest_durable": durable[-1] if durable else None}


def _bytes_per_tier(recs: list[ObjectRecord]) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for r in recs:
        for t in r.tiers:
            out[t] += r.size
    return dict(sorted(out.items()))


def steps_view(store: TierStore, model: str) -> list[dict[str, Any]]:
    """One row per step: state, age, votes of world, epoch, seconds from commit to durable, bytes per tier
    (index placement)."""
    require_model(store, model)
    now = store.index.server_time()
    rows = []
    for rec in store.steps.records(model):
        recs = _records(store, store.index.list_objects(model, step=rec.step))
        lat = rec.commit_latency_s  # begin to decision: a commit latency only where the decision was a commit
        committed = rec.state in ("committed", "durable")
        rows.append({
            "step": rec.step,
            "state": rec.state,
            "age_s": round(now - rec.started, 3) if rec.started else None,
            "commit_latency_s": round(lat, 6) if lat is not None and committed else None,
            "aborted_after_s": round(lat, 6) if lat is not None and rec.state == "aborted" else None,
            "votes": rec.votes,
            "world": rec.world,
            "epoch": rec.epoch,
            "attempt": rec.attempt,
            "reason": rec.reason,
            "memory_only": rec.memory_only,
            "to_durable_s": round(rec.durable_at - rec.decided, 3) if rec.durable_at and rec.decided else None,
            "objects": len(recs),
            "bytes": sum(r.size for r in recs),
            "bytes_per_tier": _bytes_per_tier(recs),
        })
    return rows


def show_view(store: TierStore, model: str, step: int) -> dict[str, Any]:
    """A step's manifest as a grid of layers x ranks, each cell with kind, size and current tiers."""
    require_model(store, model)
    state = store.steps.state(model, step)
    if state is None:
        raise UnknownError(f"model {model!r} has no step {step}", what="step", model=model, step=step)
    manifest = store.steps.manifest(model, step)
    cells: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    layers: list[str] = []
    world = 0
    if manifest is not None:
        world = manifest["world"]
        layers = manifest_layers(manifest)
        entries = [(int(r), o) for r, vote in manifest["ranks"].items() for o in vote["objects"]]
    else:  # not committed: show what the index holds for the step
        entries = [(k.rank, {"key": str(k)}) for k in store.index.list_objects(model, step=step)]
    keys = [ShardKey.parse(o["key"]) for _, o in entries]
    recs = dict(zip(keys, store.index.get_objects(keys))) if keys else {}
    for (rank, o), key in zip(entries, keys):
        rec = recs.get(key)
        cells[key.layer][str(rank)] = {
            "key": str(key),
            "kind": o.get("kind") or (rec.kind if rec else None),
            "size": o.get("size") if o.get("size") is not None else (rec.size if rec else None),
            "checksum": o.get("checksum") or (rec.checksum if rec else None),
            "base": o.get("base") or (str(rec.base) if rec and rec.base else None),
            "target": o.get("target") or (str(rec.target) if rec and rec.target else None),
            "tiers": sorted(rec.tiers) if rec else [],
            "indexed": rec is not None,
        }
        world = max(world, rank + 1)
    layers = sorted(set(layers) | set(cells))
    return {
        "model": model,
        "step": step,
        "state": state,
        "world": world,
        "epoch": manifest.get("epoch") if manifest else None,
        "committed_at": manifest.get("committed_at") if manifest else None,
        "layers": layers,
        "cells": {ln: dict(sorted(cells.get(ln, {}).items())) for ln in layers},
        "extra": {r: v.get("extra") for r, v in manifest["ranks"].items()} if manifest else {},
        "bytes": sum(c["size"] or 0 for row in cells.values() for c in row.values()),
    }


def layers_view(store: TierStore, model: str) -> list[dict[str, Any]]:
    """Per layer: newest committed version, staleness against the newest committed step, bytes."""
    require_model(store, model)
    steps = store.steps.steps(model)
    committed = [s for s, st in steps if st in ("committed", "durable")]
    newest = committed[-1] if committed else None
    versions: dict[str, list[int]] = defaultdict(list)
    sizes: dict[tuple[str, int], int] = defaultdict(int)
    all_bytes: dict[str, int] = defaultdict(int)
    kinds: dict[tuple[str, int], set[str]] = defaultdict(set)
    declared: set[str] = set()
    for s in committed:
        m = store.steps.manifest(model, s)
        if m is None:
            continue
        declared |= set(manifest_layers(m))
        for o in manifest_objects(m):
            k = ShardKey.parse(o["key"])
            if s not in versions[k.layer]:
                versions[k.layer].append(s)
            sizes[(k.layer, s)] += int(o["size"])
            all_bytes[k.layer] += int(o["size"])
            kinds[(k.layer, s)].add(o["kind"])
    rows = []
    for layer in sorted(declared | set(versions)):
        vs = sorted(versions.get(layer, []))
        v = vs[-1] if vs else None
        rows.append({
            "layer": layer,
            "newest_version": v,
            "staleness": (newest - v) if (newest is not None and v is not None) else None,
            "versions": len(vs),
            "kinds": sorted(kinds.get((layer, v), ())) if v is not None else [],
            "bytes_newest": sizes.get((layer, v), 0) if v is not None else 0,
            "bytes_all_versions": all_bytes.get(layer, 0),
        })
    return rows


def _check_copy(tier: Any, name: str, expected: str | None) -> dict[str, Any]:
    """Read ``tier``'s copy ``name`` (a physical name) and verify it: present, size, checksum, ok, error."""
    out: dict[str, Any] = {"tier": tier.tier, "present": False, "size": None, "checksum": None, "ok": None,
                           "error": None}
    try:
        blob = tier.get(name)
    except TierStoreError as e:
        out["error"] = f"{type(e).__name__}: {e}"
        out["ok"] = False
        return out
    if blob is None:
        return out
    out["present"] = True
    out["size"] = len(blob) if not isinstance(blob, memoryview) else blob.nbytes
    try:
        out["checksum"] = codec.verify(blob)
        out["ok"] = not expected or out["checksum"] == expected
        if not out["ok"]:
            out["error"] = f"checksum {out['checksum']} differs from the index's {expected}"
    except CorruptObjectError as e:
        out["ok"] = False
        try:
            out["checksum"] = codec.checksum(blob)
        except CorruptObjectError:
            out["checksum"] = None
        out["error"] = str(e)
    return out


def where_view(store: TierStore, key: ShardKey | str) -> dict[str, Any]:
    """Which tiers hold ``key``: the index's record, and each tier's copy read back and verified."""
    key = key if isinstance(key, ShardKey) else ShardKey.parse(key)
    rec = store.index.get_object(key)
    copies = [_check_copy(t, rec.name if rec else str(key), rec.checksum if rec else None) for t in store.tiers]
    for c in copies:
        c["indexed"] = bool(rec and c["tier"] in rec.tiers)
    if rec is None and not any(c["present"] for c in copies):
        raise UnknownError(f"no object {key} in the index or any tier", what="key", key=str(key))
    return {"key": str(key), "record": rec.to_json() if rec else None, "copies": copies}


def verify_keys(store: TierStore, model: str, step: int | None = None) -> list[ShardKey]:
    require_model(store, model)
    if step is not None and store.steps.state(model, step) is None and not store.index.list_objects(model, step=step):
        raise UnknownError(f"model {model!r} has no step {step}", what="step", model=model, step=step)
    return store.index.list_objects(model, step=step)


def verify_objects(store: TierStore, keys: list[ShardKey]) -> Iterator[dict[str, Any]]:
    """For each key: every copy read from every tier and verified against the index.

    A result is ``ok`` when every present copy verifies and every tier the
    index names holds a copy; ``problems`` says what is wrong otherwise.
    """
    for key, rec in zip(keys, store.index.get_objects(keys)):
        copies = [_check_copy(t, rec.name if rec else str(key), rec.checksum if rec else None) for t in store.tiers]
        problems = []
        for c in copies:
            if (c["present"] and not c["ok"]) or (c["error"] and not c["present"]):
                problems.append(f"{c['tier']}: {c['error']}")
            elif rec is not None and c["tier"] in rec.tiers and not c["present"]:
                problems.append(f"{c['tier']}: the index says it holds a copy, but it does not")
        if rec is None:
            problems.append("not in the index")
        elif not any(c["present"] for c in copies):
            problems.append("no tier holds a copy")
        yield {"key": str(key), "ok": not problems, "problems": problems,
               "tiers": {c["tier"]: ("ok" if c["ok"] else "BAD") if c["present"] else "-" for c in copies}}


def nodes_view(index: Index) -> list[dict[str, Any]]:
    """The registered node agents: address, capacity, used, pid, uptime, TTL left."""
    nodes = NodeRegistry(index).nodes()
    now = index.server_time()
    return [{
        "node_id": n.node_id,
        "alive": n.alive,
        "address": n.address,
        "capacity": n.capacity,
        "used": n.used,
        "pid": n.pid,
        "uptime_s": round(now - n.started, 1) if n.started else None,
        "ttl_left_s": n.ttl_left_s,
    } for n in nodes]


def du_view(store: TierStore, model: str | None = None) -> list[dict[str, Any]]:
    """Bytes and object counts per (model, tier, kind), from the index's placement."""
    models = [model] if model else store.models()
    if model:
        require_model(store, model)
    acc: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0])
    for m in models:
        for rec in _records(store, store.index.list_objects(m)):
            for t in sorted(rec.tiers) or ["(none)"]:
                a = acc[(m, t, rec.kind)]
                a[0] += 1
                a[1] += rec.size
    return [{"model": m, "tier": t, "kind": k, "objects": n, "bytes": b}
            for (m, t, k), (n, b) in sorted(acc.items())]

