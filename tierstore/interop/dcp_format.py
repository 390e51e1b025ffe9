"""What the DCP adapter stores: DCP metadata as JSON, and non-tensor values read back safely.

This module owns the stored form of a ``torch.distributed.checkpoint`` save in
tierstore (:mod:`tierstore.interop.dcp` owns the protocol):

- DCP's :class:`Metadata` is written as JSON (:func:`metadata_to_json` /
  :func:`metadata_from_json`), never pickled: tensor properties, sizes and
  chunks, the planner's fqn mappings, and where each item lives (``key``,
  ``name`` and ``type`` of its entry in a rank's object).
- A non-tensor value (DCP's ``BYTE_IO`` item) reaches the storage layer as
  the bytes of ``torch.save(value)`` made by DCP's save planner. Those bytes
  are stored unchanged, as a ``uint8`` tensor in the rank's object.
  :func:`restricted_load` is the only place they are unpickled: with
  ``torch.load(weights_only=True)`` (PyTorch's restricted unpickler: primitive
  types, containers, tensors, ``io.BytesIO``, ``bytes`` and whatever the caller allowed
  with ``torch.serialization.add_safe_globals`` or ``safe_globals=``), never
  a general unpickler. :func:`check_restricted` runs it at save time so that
  what could not be read back is refused before it is written.
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from tierstore.codec import DTYPES
from tierstore.errors import InvalidValueError, ManifestError

__all__ = [
    "BYTES",
    "SAFE_GLOBALS",
    "SCHEMA",
    "TENSOR",
    "check_restricted",
    "item_name",
    "metadata_from_json",
    "metadata_to_json",
    "resave",
    "restricted_load",
]

SCHEMA = 2
"""Schema of the metadata JSON (1: tensors only, metadata in the object's JSON; 2: adds non-tensor items)."""
_READABLE_SCHEMAS = (1, 2)
TENSOR = "tensor"
BYTES = "bytes"
SAFE_GLOBALS: tuple[Any, ...] = (io.BytesIO, bytes)
"""Always allowed besides PyTorch's own ``weights_only`` set. ``io.BytesIO``: it holds bytes and runs no code when
built (torchtitan's train state and DCP's own tests keep values in one). ``bytes``: ``torch.save`` pickles an empty
``b""`` as a call to ``bytes()``, which the restricted loader would otherwise refuse."""
_DTYPE_NAME = {v: k for k, v in DTYPES.items()}
_MAX_ITEM_NAME = 1024  # the codec's bound on a tensor name


def item_name(fqn: str, offset: Any, kind: str, seq: int) -> str:
    """The name of an item's entry in its rank's object: readable where it fits, else a sequence number."""
    if kind == BYTES:
        name = f"{fqn}@bytes"
    else:
        name = f"{fqn}@{','.join(str(int(o)) for o in offset) if offset is not None else ''}"
    return name if len(name) <= _MAX_ITEM_NAME else f"#{seq}"


# ------------------------------------------------------------------------------ non-tensor values


def restricted_load(data: bytes | memoryview, *, fqn: str, safe_globals: Iterable[Any] = ()) -> Any:
    """Unpickle ``torch.save`` bytes with PyTorch's restricted loader (``weights_only=True``).

    Args:
        data: the bytes DCP's planner made with ``torch.save(value)``.
        fqn: the state-dict key (named in errors).
        safe_globals: more classes/functions to allow, on top of :data:`SAFE_GLOBALS`
            and anything registered with ``torch.serialization.add_safe_globals``.

    Raises:
        InvalidValueError: the bytes need something the restricted loader does
            not allow (``unsafe_globals`` lists what), or are not a torch.save file.
    """
    allowed = [*SAFE_GLOBALS, *safe_globals]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(io.BytesIO(bytes(data)), map_location="cpu", weights_only=True)
    except Exception as e:  # UnpicklingError, a truncated archive, ...: all mean "cannot be read back safely"
        try:
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(bytes(data)))
            unsafe = [g for g in unsafe if g not in {_qualname(a) for a in allowed}]
        except Exception:  # noqa: BLE001  # not a torch.save archive at all: nothing more to name
            unsafe = []
        hint = (f"; it needs {', '.join(unsafe)}: store plain types (numbers, str, bytes, lists, dicts, tensors) "
                "or allow the class with torch.serialization.add_safe_globals / safe_globals=") if unsafe else ""
        raise InvalidValueError(
            f"{fqn}: the value cannot be read back with torch.load(weights_only=True){hint}",
            tensor=fqn, unsafe_globals=unsafe,
        ) from e


def _qualname(obj: Any) -> str:
    """``module.qualname`` as pickle names a global (``io.BytesIO`` is ``_io.BytesIO``)."""
    return f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"


def check_restricted(data: bytes | memoryview, *, fqn: str, safe_globals: Iterable[Any] = ()) -> None:
    """Refuse (``InvalidValueError``) a value whose bytes :func:`restricted_load` could not read back."""
    restricted_load(data, fqn=fqn, safe_globals=safe_globals)


def resave(value: Any) -> io.BytesIO:
    """``torch.save(value)`` into a fresh, rewound BytesIO: what DCP's ``LoadPlanner.load_bytes`` consumes.

    ``value`` came out of :func:`restricted_load`, so every global this pickle
    names was admitted by the restricted loader: DCP's default planner, which
    unpickles it with ``weights_only=False``, rebuilds only those.
    """
    buf = io.BytesIO()
    torch.save(value, buf)
    buf.seek(0)
    return buf


# ------------------------------------------------------------------------------ metadata


def metadata_to_json(md: Metadata) -> dict:
    """DCP :class:`Metadata` as plain JSON (tensor, bytes and planner data).

    Raises:
        InvalidValueError: a tensor that is not strided and contiguous, or of a dtype the codec lacks.
    """
    sdm: dict[str, Any] = {}
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, BytesStorageMetadata):
            sdm[fqn] = {"type": BYTES}
            continue
        p = m.properties
        if p.layout != torch.strided or p.memory_format != torch.contiguous_format:
            raise InvalidValueError(f"{fqn}: only strided contiguous tensors are supported", tensor=fqn)
        if p.dtype not in _DTYPE_NAME:
            raise InvalidValueError(f"{fqn}: dtype {p.dtype} is not supported", tensor=fqn)
        sdm[fqn] = {
            "type": TENSOR,
            "dtype": _DTYPE_NAME[p.dtype],
            "requires_grad": bool(p.requires_grad),
            "size": list(m.size),
            "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in m.chunks],
        }
    planner = None
    if isinstance(md.planner_data, dict):
        planner = {k: list(v) for k, v in md.planner_data.items()}
    storage = [
        {"fqn": idx.fqn, "offset": list(idx.offset) if idx.offset is not None else None, "index": idx.index,
         **loc}
        for idx, loc in (md.storage_data or {}).items()
    ]
    sm = md.storage_meta
    return {
        "schema": SCHEMA,
        "version": md.version,
        "state_dict_metadata": sdm,
        "planner_data": planner,
        "storage_data": storage,
        "storage_meta": None
        if sm is None
        else {"checkpoint_id": None if sm.checkpoint_id is None else str(sm.checkpoint_id), "save_id": sm.save_id,
              "load_id": sm.load_id, "modules": list(sm.modules)},
    }


def _planner_path(v: Any) -> tuple:
    return tuple(v)


def metadata_from_json(doc: Any) -> Metadata:
    """Rebuild DCP :class:`Metadata` from :func:`metadata_to_json` output (schema 1 or 2).

    Raises:
        ManifestError: unknown schema or a malformed document.
    """
    try:
        if doc.get("schema") not in _READABLE_SCHEMAS:
            raise ManifestError(f"unknown DCP metadata schema {doc.get('schema')!r}")
        sdm: dict[str, Any] = {}
        for fqn, m in doc["state_dict_metadata"].items():
            if m["type"] == BYTES:
                sdm[fqn] = BytesStorageMetadata()
                continue
            if m["type"] != TENSOR:
                raise ManifestError(f"{fqn}: unknown item type {m['type']!r}")
            sdm[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=DTYPES[m["dtype"]], requires_grad=bool(m["requires_grad"])),
                size=torch.Size(m["size"]),
                chunks=[ChunkStorageMetadata(torch.Size(c["offsets"]), torch.Size(c["sizes"])) for c in m["chunks"]],
            )
        planner = doc.get("planner_data")
        if planner is not None:
            planner = {k: _planner_path(v) for k, v in planner.items()}
        storage = {}
        for s in doc["storage_data"]:
            offset = torch.Size(s["offset"]) if s["offset"] is not None else None
            loc = {"key": str(s["key"]), "name": str(s["name"]), "type": s.get("type", TENSOR)}
            if loc["type"] not in (TENSOR, BYTES):
                raise ManifestError(f"{s['fqn']}: unknown item type {loc['type']!r}")
            storage[MetadataIndex(s["fqn"], offset, s.get("index"))] = loc
        sm = doc.get("storage_meta")
        return Metadata(
            state_dict_metadata=sdm,
            planner_data=planner,
            storage_data=storage,
            storage_meta=None if sm is None else StorageMeta(sm["checkpoint_id"], sm["save_id"], sm["load_id"],
                                                             sm["modules"]),
            version=doc.get("version"),
        )
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        if isinstance(e, ManifestError):
            raise
        raise ManifestError(f"malformed DCP metadata: {e!r}") from e
