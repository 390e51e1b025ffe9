"""The DCP ``StorageReader`` on tierstore; its read protocol is in :mod:`tierstore.interop.dcp_storage`.

Users import it from :mod:`tierstore.interop.dcp` (usage there).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from torch.distributed._shard._utils import narrow_tensor_by_index as narrow
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from consistency.index import ObjectRecord
from consistency.manifest import manifest_objects
from tierstore.config import StoreConfig
from tierstore.errors import (
    CommitError,
    ManifestError,
    NoValidCopyError,
    RestoreMismatchError,
    StepAbortedError,
    TierStoreError,
    UnknownError,
)
from tierstore.interop.dcp_format import BYTES, TENSOR, metadata_from_json, resave, restricted_load
from tierstore.interop.dcp_storage import META_ENTRY, META_LAYER, check_step, parse_id, rank_model
from tierstore.interop.store_ref import StoreRef
from tierstore.keys import ShardKey, validate_name
from tierstore.store import TierStore

__all__ = ["TierStoreReader"]


class TierStoreReader(StorageReader):
    """A DCP ``StorageReader`` for step ``step`` of ``model`` (default: the newest committed).

    Args:
        store: a live TierStore, a StoreConfig, or a dict of :func:`tierstore.open` arguments.
        model: the model name.
        step: a step to load; only a ``committed`` or ``durable`` one is read.
        safe_globals: what non-tensor values may need besides PyTorch's ``weights_only`` set and ``io.BytesIO``.
    """

    def __init__(self, store: TierStore | StoreConfig | Mapping[str, Any] | None, model: str,
                 step: int | None = None, *, safe_globals: Iterable[Any] = ()) -> None:
        super().__init__()
        self._store = StoreRef(store)
        self.model = validate_name(model, "model")
        self.step = None if step is None else check_step(step)
        self.safe_globals = tuple(safe_globals)
        self.storage_data: dict[MetadataIndex, dict] = {}
        self.load_id = uuid.uuid4().hex
        self._loaded: tuple[str, int] | None = None
        self._copies: dict[ShardKey, ObjectRecord] = {}  # the loaded step's objects, as its manifest names them
        self.metadata_error: TierStoreError | None = None

    @property
    def store(self) -> TierStore:
        return self._store.get()

    @property
    def checkpoint_id(self) -> str:
        return f"tierstore://{self.model}" + ("" if self.step is None else f"/{self.step}")

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.model, self.step = parse_id(checkpoint_id)
        self.storage_data = {}
        self.load_id = uuid.uuid4().hex

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return str(checkpoint_id).startswith("tierstore://")

    def _pick(self, model: str) -> tuple[ShardKey, dict[ShardKey, ObjectRecord]]:
        """The step's metadata key and its objects as the step's manifest names them (the copies it committed)."""
        if self.step is None:
            res = self.store.resolve(model)
            copies = {info.key: info for info in res.objects.values()}
        else:
            state = self.store.steps.state(model, self.step)
            if not state:
                raise UnknownError(f"no step {self.step} of {model} in the index", what=f"{model}/{self.step}")
            if state == "aborted":
                raise StepAbortedError(f"step {self.step} of {model} was aborted", model=model, step=self.step)
            if state not in ("committed", "durable"):
                raise CommitError(f"step {self.step} of {model} is {state}, not committed: nothing to load",
                                  model=model, step=self.step, state=state)
            m = self.store.steps.manifest(model, self.step)
            if m is None:
                raise NoValidCopyError(f"step {self.step} of {model}: its manifest is gone from the index",
                                       model=model, step=self.step)
            copies = {rec.key: rec for rec in map(ObjectRecord.from_json, manifest_objects(m))}
        keys = [k for k in copies if k.layer == META_LAYER]
        if len(keys) != 1:
            raise NoValidCopyError(f"{model}: {len(keys)} DCP metadata objects for the step, want 1", model=model)
        return keys[0], copies

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The step's DCP metadata; with ``rank=`` (DCP's fallback) that rank's own ``use_collectives=False`` save.

        DCP swallows the error of the first call (it then tries ``rank=``); it
        is kept in ``metadata_error`` so that :func:`load` can raise it typed.
        """
        rank = kwargs.get("rank")
        model = self.model if rank is None else rank_model(self.model, int(rank))
        try:
            key, copies = self._pick(model)
        except TierStoreError as e:
            if rank is None:
                self.metadata_error = e
            raise
        shard = self.store.get_copy(copies[key])
        entry = shard.get(META_ENTRY)
        try:
            doc = json.loads(entry.numpy().tobytes()) if entry is not None else shard.metadata.get("dcp") or {}
        except ValueError as e:
            raise ManifestError(f"{key}: DCP metadata is not JSON: {e}") from e
        md = metadata_from_json(doc)
        self._loaded, self._copies = (key.model, key.step), copies
        md.storage_meta = md.storage_meta or StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if metadata.storage_data is None:
            raise ManifestError("DCP metadata without storage data")
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def _locate(self, index: MetadataIndex) -> tuple[ShardKey, dict]:
        loc = self.storage_data.get(index)
        if loc is None:
            raise ManifestError(f"{index.fqn}: not in the checkpoint's storage data")
        key = ShardKey.parse(loc["key"])
        if self._loaded is not None and (key.model, key.step) != self._loaded:
            raise ManifestError(f"{index.fqn}: metadata points outside the step it was read from ({key})")
        if key not in self._copies:
            raise ManifestError(f"{index.fqn}: {key} is not an object of the step's manifest")
        return key, loc

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_key: dict[ShardKey, list] = {}
        for req in plan.items:
            by_key.setdefault(self._locate(req.storage_index)[0], []).append(req)
        for key, reqs in by_key.items():  # one rank object at a time: memory is the largest object, not the sum
            shard = self.store.get_copy(self._copies[key])  # the copy the step committed
            for req in reqs:
                fqn = req.storage_index.fqn
                loc = self._locate(req.storage_index)[1]
                stored = shard.get(loc["name"])
                if stored is None:
                    raise ManifestError(f"{key}: no entry {loc['name']!r} for {fqn}", key=str(key))
                if req.type == LoadItemType.BYTE_IO:
                    if loc.get("type") != BYTES:
                        raise ManifestError(f"{fqn}: the planner asks for a value, the checkpoint holds a tensor")
                    value = restricted_load(stored.numpy().tobytes(), fqn=fqn, safe_globals=self.safe_globals)
                    planner.load_bytes(req, resave(value))
                    continue
                if loc.get("type", TENSOR) != TENSOR:
                    raise RestoreMismatchError(f"{fqn}: the target is a tensor, the checkpoint holds a non-tensor "
                                               "value", tensor=fqn)
                t = narrow(stored, req.storage_offsets, req.lengths)
                target = planner.resolve_tensor(req).detach()
                if target.size() != t.size():
                    raise RestoreMismatchError(f"{fqn}: size {tuple(t.size())} != target {tuple(target.size())}",
                                               tensor=fqn)
                target.copy_(t)
                planner.commit_tensor(req, target)
            del shard
        fut: Future = Future()
        fut.set_result(None)
        return fut
