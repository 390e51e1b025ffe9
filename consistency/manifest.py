"""Step manifests: the JSON record of a committed step, validated on read.

Schema (``version`` 1)::

    {"version": 1, "model": str, "step": int, "world": int, "epoch": int, "attempt": int,
     "committed_at": float, "layout": {...} | null, "durable": bool (durable copy only),
     "ranks": {"<rank>": {"objects": [{"key", "kind", "size", "checksum",
                                       "base", "target", "tiers", "name"}...],
                          "extra": {...} | null}},
     "inherited": [object entries of older steps],
     "deps": [object entries of older steps],
     "requires": [older step numbers],
     "missing": [layer names]}

``layout`` is what the trainer declared when the step began: its
``layers`` (every layer of the model, saved at this step or not) and the
parallel sizes (``dp``, ``tp``, ``pp``) where known.

A manifest records the **complete set** of objects a restore of its step
reads (:func:`complete_entries`), written at the commit point (see
:mod:`consistency.scripts`): its own objects; ``inherited``, for each layer
of the layout that no rank saved at this step, the entries of the older
version the step resolves to (layer-wise policies); ``deps``, every delta
base and ref target those reach, transitively; ``requires``, the older steps
whose manifests a restore also reads (a replay log step's base and logs).
``missing`` lists layers of the layout with no version to resolve to (the
step cannot be restored). Manifests written before these fields hold only
``ranks`` (and a durable copy its ``deps``).

``name`` is the physical name of the object's copy in the tiers
(:func:`tierstore.keys.object_name`); absent in older manifests (the key).

A step's durable copy of its manifest is ``model/_manifest/<step>.json``
(:func:`durable_manifest_name`, recognised by :func:`parse_durable_manifest_name`).
The durable tier's other records of a model are named here too (one owner of
the durable layout): its epoch records (``model/_epoch/``), superseded
manifests (``model/_superseded/``) and pin records (``model/_pins/<digest of
the label>.<step>.pin``, JSON ``{version, model, label, step}``, validated by
:func:`parse_durable_pin`).

A manifest of another version, another model, with missing ranks, objects
of another model or step, or malformed fields is refused with
:class:`ManifestError`. Never parsed with anything but ``json``.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from tierstore.errors import ManifestError
from tierstore.keys import ShardKey, split_object_name

__all__ = [
    "MANIFEST_VERSION",
    "MAX_MANIFEST_BYTES",
    "complete_entries",
    "durable_epoch_name",
    "durable_epoch_prefix",
    "durable_manifest_name",
    "durable_manifest_prefix",
    "durable_pin_label_prefix",
    "durable_pin_model",
    "durable_pin_name",
    "durable_pin_prefix",
    "durable_pin_record",
    "layer_entries",
    "manifest_objects",
    "parse_durable_epoch_name",
    "parse_durable_manifest_name",
    "parse_durable_pin",
    "parse_manifest",
    "superseded_manifest_name",
    "superseded_prefix",
]

MANIFEST_VERSION = 1
MAX_MANIFEST_BYTES = 256 << 20
_KINDS = ("full", "delta", "ref")


_MANIFEST_DIR = "/_manifest/"


def durable_manifest_prefix(model: str) -> str:
    """The durable tier's prefix of a model's durable manifests (see :func:`durable_manifest_name`)."""
    return f"{model}{_MANIFEST_DIR}"


def durable_manifest_name(model: str, step: int) -> str:
    """The durable tier's object name of a step's manifest (written last, create-once)."""
    return f"{durable_manifest_prefix(model)}{step:012d}.json"


def parse_durable_manifest_name(name: str) -> tuple[str, int] | None:
    """The ``(model, step)`` a durable manifest's name (:func:`durable_manifest_name`, of any model) holds, or
    ``None`` if ``name`` is not one (another record of the model, an object, a manifest's name with a folder
    below ``_manifest/``). The step may be written with any number of ASCII digits."""
    model, sep, rest = name.partition(_MANIFEST_DIR)
    if not sep or "/" in model or not rest.endswith(".json"):
        return None
    stem = rest[:-len(".json")]
    return (model, int(stem)) if stem.isascii() and stem.isdigit() else None


def superseded_prefix(model: str) -> str:
    """The durable tier's prefix of a model's superseded manifests (:func:`superseded_manifest_name`)."""
    return f"{model}/_superseded/"


def superseded_manifest_name(model: str, step: int, attempt: int) -> str:
    """Where a superseded step's durable manifest is kept (never read by a restore nor an index rebuild)."""
    return f"{superseded_prefix(model)}{step:012d}.{attempt}.json"


def durable_epoch_prefix(model: str) -> str:
    """The durable tier's prefix of a model's epoch records."""
    return f"{model}/_epoch/"


def durable_epoch_name(model: str, epoch: int) -> str:
    """The durable tier's record of epoch ``epoch`` of ``model`` (written create-once when the epoch is taken)."""
    return f"{durable_epoch_prefix(model)}{epoch:020d}.epoch"


def parse_durable_epoch_name(model: str, name: str) -> int | None:
    """The epoch a durable epoch record's name holds, or ``None`` if ``name`` is not one."""
    prefix = durable_epoch_prefix(model)
    if not name.startswith(prefix) or not name.endswith(".epoch"):
        return None
    stem = name[len(prefix):-len(".epoch")]
    return int(stem) if stem.isdigit() and len(stem) == 20 else None


PIN_RECORD_VERSION = 1
MAX_PIN_RECORD_BYTES = 64 << 10


def durable_pin_prefix(model: str) -> str:
    """The durable tier's prefix of a model's pin records (see :func:`durable_pin_name`)."""
    return f"{model}/_pins/"


def durable_pin_model(name: str) -> str | None:
    """The model whose pin record ``name`` looks like (under its :func:`durable_pin_prefix`, ending ``.pin``),
    or ``None``; :func:`parse_durable_pin` validates the record itself."""
    model = name.split("/", 1)[0]
    return model if name.startswith(durable_pin_prefix(model)) and name.endswith(".pin") else None


def durable_pin_label_prefix(model: str, label: str) -> str:
    """The durable tier's prefix of the pin records of one ``label`` of ``model`` (every step it pins)."""
    digest = hashlib.blake2s(label.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
    return f"{durable_pin_prefix(model)}{digest}."


def durable_pin_name(model: str, label: str, step: int) -> str:
    """The durable tier's record of the pin ``label`` -> ``step`` of ``model`` (one small JSON record per
    ``(label, step)``, written create-once; the label, a checkpoint path, is in the record: the name holds
    its digest)."""
    return f"{durable_pin_label_prefix(model, label)}{step:012d}.pin"


def durable_pin_record(model: str, label: str, step: int) -> bytes:
    """The body of :func:`durable_pin_name`'s record (JSON)."""
    return json.dumps({"version": PIN_RECORD_VERSION, "model": model, "label": label, "step": step},
                      sort_keys=True).encode()


def parse_durable_pin(model: str, name: str, raw: bytes | str) -> tuple[str, int]:
    """The ``(label, step)`` of the pin record ``raw`` read at ``name``, validated (never anything but ``json``).

    Raises:
        ManifestError: not a pin record of ``model``, or one whose name is not that of its label and step.
    """
    if len(raw) > MAX_PIN_RECORD_BYTES:
        raise ManifestError(f"pin record {name}: {len(raw)} bytes is larger than {MAX_PIN_RECORD_BYTES}")
    try:
        d = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ManifestError(f"pin record {name} is not valid JSON: {e}") from e
    if not isinstance(d, dict) or d.get("version") != PIN_RECORD_VERSION:
        raise ManifestError(f"pin record {name}: unknown version {d.get('version') if isinstance(d, dict) else None!r}")
    label, step = d.get("label"), d.get("step")
    if d.get("model") != model or not isinstance(label, str) or not label or not isinstance(step, int) \
            or isinstance(step, bool) or step < 0:
        raise ManifestError(f"pin record {name}: not a pin of {model} (a label and a step)")
    if durable_pin_name(model, label, step) != name:
        raise ManifestError(f"pin record {name} names label {label[:80]!r} and step {step}: not its own name")
    return label, step


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise ManifestError(f"invalid manifest: {what}")


def _check_entry(o: Any, m: dict[str, Any], where: str) -> ShardKey:
    """Validate one object entry; return its key."""
    _need(isinstance(o, dict), f"{where}: an object entry is not an object")
    try:
        key = ShardKey.parse(o.get("key"))
        base = ShardKey.parse(o["base"]) if o.get("base") else None
        target = ShardKey.parse(o["target"]) if o.get("target") else None
    except Exception as e:
        raise ManifestError(f"{where}: bad object key: {e}") from e
    _need(key.model == m["model"], f"{where}: object {key} belongs to another model")
    _need(key.step <= m["step"], f"{where}: object {key} is newer than the step")
    _need(o.get("kind") in _KINDS, f"{where}: object {key} has unknown kind {o.get('kind')!r}")
    _need(_is_int(o.get("size")) and o["size"] >= 0, f"{where}: object {key} has a bad size")
    _need(isinstance(o.get("checksum"), str), f"{where}: object {key} has no checksum")
    tiers = o.get("tiers", [])
    _need(isinstance(tiers, list) and all(isinstance(t, str) for t in tiers), f"{where}: {key} has bad tiers")
    name = o.get("name")
    if name is not None:
        try:
            named, _tag = split_object_name(name)
        except Exception as e:
            raise ManifestError(f"{where}: object {key} has a bad name: {e}") from e
        _need(named == key, f"{where}: object {key} is named {name[:80]!r}, a copy of another key")
    for ref in (base, target):
        if ref is not None:
            _need(ref.model == m["model"], f"{where}: object {key} points into another model")
    if o["kind"] == "delta":
        _need(base is not None and base.step < key.step, f"{where}: delta {key} needs an older base")
    if o["kind"] == "ref":
        _need(target is not None and target.step <= key.step and target != key,
              f"{where}: ref {key} needs a target that is not itself")
    return key


def parse_manifest(raw: bytes | str | dict, *, model: str | None = None, step: int | None = None) -> dict[str, Any]:
    """Parse and validate a manifest; return it as a dict.

    Raises:
        ManifestError: naming what is wrong.
    """
    if isinstance(raw, dict):
        m = raw
    else:
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"manifest of {len(raw)} bytes is larger than {MAX_MANIFEST_BYTES}")
        try:
            m = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ManifestError(f"manifest is not valid JSON: {e}") from e
        except RecursionError as e:
            raise ManifestError("manifest JSON is nested too deeply") from e
    _need(isinstance(m, dict), "not an object")
    version = m.get("version")
    if version != MANIFEST_VERSION:
        raise ManifestError(f"unknown manifest version {version!r} (this tierstore reads version {MANIFEST_VERSION})")
    _need(isinstance(m.get("model"), str), "model must be a string")
    if model is not None and m["model"] != model:
        raise ManifestError(f"manifest is of model {m['model']!r}, expected {model!r}")
    _need(_is_int(m.get("step")) and m["step"] >= 0, "step must be a non-negative int")
    if step is not None and m["step"] != step:
        raise ManifestError(f"manifest is of step {m['step']}, expected {step}")
    _need(_is_int(m.get("world")) and 1 <= m["world"] <= 1 << 20, "world must be a positive int")
    world: int = m["world"]
    _need(isinstance(m.get("ranks"), dict), "ranks must be an object")
    ranks: dict[str, Any] = m["ranks"]
    _need(sorted(ranks, key=lambda r: int(r) if str(r).isdigit() else -1) == [str(r) for r in range(world)],
          f"ranks must be exactly 0..{world - 1}, got {sorted(ranks)[:8]}")
    _need(m.get("layout") is None or isinstance(m["layout"], dict), "layout must be an object or null")
    for r, vote in ranks.items():
        _need(isinstance(vote, dict), f"rank {r}: vote must be an object")
        objs = vote.get("objects")
        _need(isinstance(objs, list), f"rank {r}: objects must be a list")
        _need(vote.get("extra") is None or isinstance(vote["extra"], dict), f"rank {r}: extra must be an object")
        for o in objs:
            key = _check_entry(o, m, f"rank {r}")
            _need(key.step == m["step"], f"rank {r}: object {key} belongs to another step")
    _need(isinstance(m.get("durable", False), bool), "durable must be a bool")
    _need(m.get("attempt") is None or (_is_int(m["attempt"]) and m["attempt"] >= 1), "attempt must be a positive int")
    for field_name in ("inherited", "deps"):
        entries = m.get(field_name, [])
        _need(isinstance(entries, list), f"{field_name} must be a list")
        for o in entries:
            key = _check_entry(o, m, field_name)
            _need(key.step < m["step"], f"{field_name}: object {key} is not of an older step")
    requires = m.get("requires", [])
    _need(isinstance(requires, list) and all(_is_int(s) and 0 <= s < m["step"] for s in requires),
          "requires must be a list of older steps")
    missing = m.get("missing", [])
    _need(isinstance(missing, list) and all(isinstance(x, str) for x in missing), "missing must be a list of layers")
    return m


def manifest_objects(m: dict[str, Any]) -> list[dict[str, Any]]:
    """Every object entry of a parsed manifest, all ranks."""
    return [o for vote in m["ranks"].values() for o in vote["objects"]]


def complete_entries(m: dict[str, Any]) -> list[dict[str, Any]]:
    """Every object entry a restore of the step reads: its own, ``inherited`` and ``deps`` (unique by key).

    The objects of the steps in ``requires`` are read too: they are in those steps' manifests.
    """
    out: dict[str, dict[str, Any]] = {}
    for o in [*manifest_objects(m), *m.get("inherited", []), *m.get("deps", [])]:
        out.setdefault(o["key"], o)
    return list(out.values())


def layer_entries(m: dict[str, Any]) -> dict[str, list[tuple[int, dict[str, Any]]]]:
    """Per layer, the ``(rank, entry)`` pairs a restore of the step reads: saved at the step, else inherited."""
    out: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for rank, vote in m["ranks"].items():
        for o in vote["objects"]:
            out.setdefault(ShardKey.parse(o["key"]).layer, []).append((int(rank), o))
    own = set(out)
    for o in m.get("inherited", []):
        k = ShardKey.parse(o["key"])
        if k.layer not in own:
            out.setdefault(k.layer, []).append((k.rank, o))
    return out


def manifest_layers(m: dict[str, Any]) -> list[str]:
    """The layers the model had at this step: the declared layout, else those saved."""
    layout = m.get("layout") or {}
    if isinstance(layout.get("layers"), list):
        return list(layout["layers"])
    return sorted({ShardKey.parse(o["key"]).layer for o in manifest_objects(m)})


__all__ += ["manifest_layers"]
