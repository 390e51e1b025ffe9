"""``torch.distributed.checkpoint`` storage on tierstore: ``dcp.save`` / ``dcp.load`` / ``dcp.async_save``.

Usage (every rank)::

    dcp.save(state_dict, storage_writer=TierStoreWriter(store, "gpt-dcp", step=100))
    dcp.load(state_dict, storage_reader=TierStoreReader(store, "gpt-dcp"))   # newest committed step

Write protocol (DCP's calls, who makes them, what tierstore does):

1. all ranks, ``set_up_storage_writer``: ``store.begin_step(model, step,
   world + 1)``; the extra voter (rank ``world``) is the coordinator's
   metadata record, so the step commits only once the metadata is in.
2. all ranks ``prepare_local_plan``; coordinator ``prepare_global_plan``:
   unchanged plans.
3. all ranks, ``write_data``: every tensor item (its projection, contiguous,
   on CPU) goes into ONE object per rank, ``ShardKey(model, "dcp", step,
   rank)``, tensor name ``<fqn>@<offsets>``; then the rank votes that object.
4. coordinator, ``finish``: DCP's :class:`Metadata` is serialised to JSON
   (never pickled: fqn -> properties, size and chunks; planner mappings;
   where each chunk lives), stored as ``ShardKey(model, "dcp-metadata", step,
   world)`` and voted by rank ``world``: the last vote, the commit point.

Read protocol: ``read_metadata`` finds the step (given, else the newest
committed one through ``store.resolve``), reads the metadata object and
rebuilds the dataclasses; ``read_data`` reads each rank object once, narrows
each chunk to the request and copies it into the planner's tensor. Any world
size may read (DCP reshards by chunk offsets).

Non-tensor items (DCP's ``BYTE_IO``: ``torch.save`` of arbitrary objects) are
refused on both sides: DCP's planner reads them back with
``torch.load`` with weights-only loading switched off, which is pickle on a read path.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard._utils import narrow_tensor_by_index as narrow
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import (
    StorageReader,
    StorageWriter,
    WriteResult,
)
from torch.futures import Future

from tierstore.codec import DTYPES
from tierstore.errors import (
    CommitError,
    InvalidValueError,
    ManifestError,
    NoValidCopyError,
)
from tierstore.keys import ShardKey, validate_name

__all__ = ["TierStoreReader", "TierStoreWriter", "metadata_from_json", "metadata_to_json"]

DATA_LAYER = "dcp"
META_LAYER = "dcp-metadata"
SCHEMA = 1
_DTYPE_NAME = {v: k for k, v in DTYPES.items()}


def _item_name(fqn: str, offset: Any) -> str:
    return f"{fqn}@{','.join(str(int(o)) for o in offset) if offset is not None else ''}"


def metadata_to_json(md: Metadata) -> dict:
    """DCP :class:`Metadata` as plain JSON (tensor and planner data only)."""
    sdm: dict[str, Any] = {}
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, BytesStorageMetadata):
            sdm[fqn] = {"type": "bytes"}
            continue
        p = m.properties
        if p.layout != torch.strided or p.memory_format != torch.contiguous_format:
            raise InvalidValueError(f"{fqn}: only strided contiguous tensors are supported", tensor=fqn)
        sdm[fqn] = {
            "type": "tensor",
            "dtype": _DTYPE_NAME[p.dtype],
            "requires_grad": bool(p.requires_grad),
            "size": list(m.size),
            "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in m.chunks],
        }
    planner = None
    if isinstance(md.planner_data, dict):
        planner = {k: list(v) for k, v in md.planner_data.items()}
    storage = [
        {"fqn": idx.fqn, "offset": list(idx.offset) if idx.offset is not None else None, **loc}
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


def metadata_from_json(doc: Any) -> Metadata:
    """Rebuild DCP :class:`Metadata` from :func:`metadata_to_json` output.

    Raises:
        ManifestError: unknown schema or a malformed document.
    """
    try:
        if doc.get("schema") != SCHEMA:
            raise ManifestError(f"unknown DCP metadata schema {doc.get('schema')!r}")
        sdm: dict[str, Any] = {}
        for fqn, m in doc["state_dict_metadata"].items():
            if m["type"] == "bytes":
                sdm[fqn] = BytesStorageMetadata()
                continue
            sdm[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=DTYPES[m["dtype"]], requires_grad=bool(m["requires_grad"])),
                size=torch.Size(m["size"]),
                chunks=[ChunkStorageMetadata(torch.Size(c["offsets"]), torch.Size(c["sizes"])) for c in m["chunks"]],
            )
        planner = doc.get("planner_data")
        if planner is not None:
            planner = {k: tuple(v) for k, v in planner.items()}
        storage = {
            MetadataIndex(s["fqn"], s["offset"]): {"key": s["key"], "name": s["name"]} for s in doc["storage_data"]
        }
        sm = doc.get("storage_meta")
        return Metadata(
            state_dict_metadata=sdm,
            planner_data=planner,
            storage_data=storage,
            storage_meta=None if sm is None else StorageMeta(sm["checkpoint_id"], sm["save_id"], sm["load_id"], sm["modules"]),
            version=doc.get("version"),
        )
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        if isinstance(e, ManifestError):
            raise
        raise ManifestError(f"malformed DCP metadata: {e!r}") from e


def _parse_id(checkpoint_id: str | os.PathLike) -> tuple[str, int | None]:
    s = str(checkpoint_id)
    if not s.startswith("tierstore://"):
        raise InvalidValueError(f"not a tierstore checkpoint id: {s!r} (want tierstore://model[/step])")
    parts = s[len("tierstore://"):].strip("/").split("/")
    return validate_name(parts[0], "model"), (int(parts[1]) if len(parts) > 1 and parts[1] else None)


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class TierStoreWriter(StorageWriter):
    """A DCP ``StorageWriter`` that saves step ``step`` of ``model`` into ``store``.

    A checkpoint id ``tierstore://model/step`` passed to ``dcp.save`` wins
    over the constructor's.
    """

    def __init__(self, store: Any, model: str, step: int, *, timeout: float = 120.0) -> None:
        super().__init__()
        self.store = store
        self.model = validate_name(model, "model")
        self.step = step
        self.timeout = timeout
        self.rank, self.world = _world()
        self.is_coordinator = False

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            model, step = _parse_id(checkpoint_id)
            self.model = model
            if step is not None:
                self.step = step

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return str(checkpoint_id).startswith("tierstore://")

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=f"tierstore://{self.model}/{self.step}")

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank, self.world = _world()
        self.store.begin_step(self.model, self.step, self.world + 1, layout={"layers": [DATA_LAYER, META_LAYER]})

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        key = ShardKey(self.model, DATA_LAYER, self.step, self.rank)
        tensors: dict[str, torch.Tensor] = {}
        results = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                raise InvalidValueError(
                    f"{item.index.fqn}: non-tensor values are not supported (DCP would read them back with pickle)",
                    tensor=item.index.fqn,
                )
            data = planner.resolve_data(item)
            if not isinstance(data, torch.Tensor):
                raise InvalidValueError(f"{item.index.fqn}: expected a tensor", tensor=item.index.fqn)
            t = data.detach().to("cpu").contiguous()
            name = _item_name(item.index.fqn, item.index.offset)
            tensors[name] = t
            results.append(WriteResult(item.index, t.numel() * t.element_size(), {"key": str(key), "name": name}))
        info = self.store.put(key, tensors, {"dcp": {"rank": self.rank, "world": self.world}})
        self.store.vote(self.model, self.step, self.rank, [info])
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        storage = {r.index: r.storage_data for rs in results for r in rs}
        md = Metadata(
            state_dict_metadata=metadata.state_dict_metadata,
            planner_data=metadata.planner_data,
            storage_data=storage,
            storage_meta=metadata.storage_meta,
            version=metadata.version,
        )
        key = ShardKey(self.model, META_LAYER, self.step, self.world)
        info = self.store.put(key, {}, {"dcp": metadata_to_json(md)})
        state = self.store.vote(self.model, self.step, self.world, [info])
        if state == "preparing":
            state = self.store.wait_step(self.model, self.step, timeout=self.timeout)
        if state not in ("committed", "durable"):
            raise CommitError(f"DCP save of step {self.step} of {self.model} is {state}", step=self.step)


class TierStoreReader(StorageReader):
    """A DCP ``StorageReader`` for step ``step`` of ``model`` (default: the newest committed)."""

    def __init__(self, store: Any, model: str, step: int | None = None) -> None:
        super().__init__()
        self.store = store
        self.model = validate_name(model, "model")
        self.step = step
        self.storage_data: dict[MetadataIndex, dict] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.model, self.step = _parse_id(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return str(checkpoint_id).startswith("tierstore://")

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.step is None:
            res = self.store.resolve(self.model)
            key = next(info.key for (layer, _r), info in res.objects.items() if layer == META_LAYER)
        else:
            keys = [k for k in self.store.list(self.model, META_LAYER, self.step)]
            if not keys:
                raise NoValidCopyError(f"no DCP metadata for step {self.step} of {self.model}", model=self.model)
            key = keys[0]
        shard = self.store.get(key)
        if shard is None:
            raise NoValidCopyError(f"{key}: DCP metadata is gone", key=str(key))
        self.step = key.step
        return metadata_from_json(shard.metadata.get("dcp") or {})

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        cache: dict[str, Any] = {}
        for req in plan.items:
            if req.type == LoadItemType.BYTE_IO:
                raise InvalidValueError(f"{req.storage_index.fqn}: non-tensor values are not supported")
            loc = self.storage_data[req.storage_index]
            if loc["key"] not in cache:
                shard = self.store.get(ShardKey.parse(loc["key"]))
                if shard is None:
                    raise NoValidCopyError(f"{loc['key']}: DCP data is gone", key=loc["key"])
                cache[loc["key"]] = shard.tensors
            t = narrow(cache[loc["key"]][loc["name"]], req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            if target.size() != t.size():
                raise InvalidValueError(f"{req.storage_index.fqn}: size {tuple(t.size())} != target {tuple(target.size())}")
            target.copy_(t)
            planner.commit_tensor(req, target)
        fut: Future = Future()
        fut.set_result(None)
        return fut
