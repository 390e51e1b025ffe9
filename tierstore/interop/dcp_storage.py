"""The DCP ``StorageWriter``/``StorageReader`` on tierstore; the protocol, call by call.

Users import these from :mod:`tierstore.interop.dcp` (usage there).

Write protocol (DCP's calls in order, who makes them, what tierstore does):

1. all ranks, ``set_up_storage_writer(is_coordinator, rank=, use_collectives=)``:
   remember what DCP passes. Rank, world size and the group are DCP's (so
   ``no_dist``, ``process_group=`` a subgroup and ``use_collectives=False``
   behave as with ``FileSystemWriter``); nothing is read from the default
   process group.
2. all ranks, ``prepare_local_plan``: refuse what the store cannot hold
   (dtypes, layouts) as a typed :class:`~tierstore.errors.TierStoreError`,
   before anything is written.
3. the coordinator, ``prepare_global_plan(plans)``: the world is
   ``len(plans)``; refuse a step already committed, durable or aborted
   (:class:`KeyExistsError` / :class:`StepAbortedError`) or being saved by a
   different world (:class:`CommitError`); tell each rank its slot and the
   world through ``plan.storage_data``.
4. all ranks, ``write_data``: every item goes into ONE object per rank,
   ``ShardKey(model, "dcp", step, rank)``: tensors (their projection, on
   CPU) as themselves, non-tensor values (``BYTE_IO``) as the bytes DCP's
   planner made with ``torch.save``, each first checked to load back with
   ``torch.load(weights_only=True)`` (refused otherwise). Then the rank
   votes for the step (``world + 1`` voters). Any failure here is a negative
   vote: the step is aborted at once, never left ``preparing``.
5. the coordinator, ``finish``: DCP's :class:`Metadata` as JSON (never
   pickled; :mod:`tierstore.interop.dcp_format`) in
   ``ShardKey(model, "dcp-metadata", step, world)``, voted by voter
   ``world``: the last vote, the commit point.

With ``use_collectives=False`` every rank saves alone, as
``FileSystemWriter`` does: rank ``r`` commits its own step of the model
``<model>.rank<r>`` (one data object and its metadata), and DCP's load falls
back to ``read_metadata(rank=r)``, which reads it.

Read protocol: ``read_metadata`` takes the given step only if it is
``committed`` or ``durable`` (else :class:`UnknownError`,
:class:`CommitError` or :class:`StepAbortedError`), or the newest committed
one (``store.resolve``); ``read_data`` reads each rank object once, narrows
each chunk to the request (any world size may read: DCP reshards by offsets)
and hands non-tensor values to the planner.

Unpickling: only through :func:`tierstore.interop.dcp_format.restricted_load`
(``weights_only=True``): in ``write_data`` (the check before a value is
stored) and in ``read_data``; :mod:`tierstore.interop.dcp` explains what DCP's
planner then does with the value.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index as narrow
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from tierstore.codec import DTYPES
from tierstore.config import StoreConfig
from tierstore.errors import (
    CommitError,
    InvalidValueError,
    KeyExistsError,
    ManifestError,
    NoValidCopyError,
    RestoreMismatchError,
    StepAbortedError,
    TierStoreError,
    UnknownError,
)
from tierstore.interop.dcp_format import (
    BYTES,
    SCHEMA,
    TENSOR,
    check_restricted,
    item_name,
    metadata_from_json,
    metadata_to_json,
    resave,
    restricted_load,
)
from tierstore.interop.store_ref import StoreRef
from tierstore.keys import ShardKey, validate_name
from tierstore.store import TierStore

__all__ = ["DATA_LAYER", "META_LAYER", "TierStoreReader", "TierStoreWriter", "check_tensor_props"]

log = logging.getLogger(__name__)

DATA_LAYER = "dcp"
META_LAYER = "dcp-metadata"
_META_ENTRY = "metadata.json"
_LAYOUT = {"layers": [DATA_LAYER, META_LAYER]}


@dataclasses.dataclass(frozen=True)
class _Slot:
    """What the coordinator tells each rank in ``plan.storage_data``: where its object goes."""

    model: str
    rank: int
    world: int


def _rank_model(model: str, rank: int) -> str:
    """The model a rank saves alone into (``use_collectives=False``)."""
    return validate_name(f"{model}.rank{rank}", "model")


def _parse_id(checkpoint_id: str | os.PathLike) -> tuple[str, int | None]:
    s = str(checkpoint_id)
    if not s.startswith("tierstore://"):
        raise InvalidValueError(f"not a tierstore checkpoint id: {s!r} (want tierstore://model[/step])")
    parts = s[len("tierstore://"):].strip("/").split("/")
    try:
        step = int(parts[1]) if len(parts) > 1 and parts[1] else None
    except ValueError:
        raise InvalidValueError(f"not a tierstore checkpoint id: {s!r} (the step must be an int)") from None
    return validate_name(parts[0], "model"), step


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise InvalidValueError(f"step must be a non-negative int, got {step!r}")
    return step


def check_tensor_props(fqn: str, dtype: torch.dtype, layout: Any = torch.strided) -> None:
    if layout != torch.strided:
        raise InvalidValueError(f"{fqn}: only dense strided tensors can be stored, not {layout}", tensor=fqn)
    if dtype not in DTYPES.values():
        raise InvalidValueError(f"{fqn}: dtype {dtype} cannot be stored (supported: {', '.join(DTYPES)})",
                                tensor=fqn)


# ------------------------------------------------------------------------------ writer


class TierStoreWriter(StorageWriter):
    """A DCP ``StorageWriter`` that saves step ``step`` of ``model``; see the module docstring.

    Args:
        store: a live TierStore, a StoreConfig, or a dict of :func:`tierstore.open` arguments.
        model: the model name the step is saved under.
        step: the step number; a checkpoint id ``tierstore://model/step`` passed to DCP wins.
        timeout: seconds the coordinator waits for the commit after its vote.
        safe_globals: classes/functions a non-tensor value may need besides PyTorch's
            ``weights_only`` set and ``io.BytesIO`` (the reader needs the same).
    """

    def __init__(self, store: TierStore | StoreConfig | Mapping[str, Any] | None, model: str, step: int, *,
                 timeout: float = 120.0, safe_globals: Iterable[Any] = ()) -> None:
        super().__init__()
        self._store = StoreRef(store)
        self.model = validate_name(model, "model")
        self.step = _check_step(step)
        self.timeout = timeout
        self.safe_globals = tuple(safe_globals)
        self.save_id = uuid.uuid4().hex
        self.rank = 0
        self.is_coordinator = True
        self.use_collectives = True
        self._slot: _Slot | None = None

    @property
    def store(self) -> TierStore:
        """The store, opened from its configuration on first use in this process."""
        return self._store.get()

    @property
    def checkpoint_id(self) -> str:
        return f"tierstore://{self.model}/{self.step}"

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            model, step = _parse_id(checkpoint_id)
            self.model = model
            if step is not None:
                self.step = step
        self.save_id = uuid.uuid4().hex
        self._slot = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return str(checkpoint_id).startswith("tierstore://")

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank") or 0)
        self.use_collectives = bool(kwargs.get("use_collectives", True))
        self._slot = None

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        for item in plan.items:
            if item.type != WriteItemType.BYTE_IO and item.tensor_data is not None:
                p = item.tensor_data.properties
                check_tensor_props(item.index.fqn, p.dtype, p.layout)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if self.use_collectives:
            model, slots = self.model, [(i, len(plans)) for i in range(len(plans))]
        else:  # every rank plans alone: its own commit, in its own model
            model, slots = _rank_model(self.model, self.rank), [(0, 1)]
        self._refuse_taken_step(model, slots[0][1] + 1)
        return [dataclasses.replace(p, storage_data=_Slot(model, r, w)) for p, (r, w) in zip(plans, slots)]

    def _refuse_taken_step(self, model: str, voters: int) -> None:
        (rec,) = self.store.steps.records(model, [self.step])
        if rec.state in ("committed", "durable"):
            raise KeyExistsError(f"step {self.step} of {model} is already saved ({rec.state}); a committed step "
                                 "is never overwritten: save under a new step number", model=model, step=self.step)
        if rec.state == "aborted":
            raise StepAbortedError(f"step {self.step} of {model} was aborted ({rec.reason}); save under a new "
                                   "step number", model=model, step=self.step)
        if rec.state == "preparing" and rec.world != voters:
            raise CommitError(f"step {self.step} of {model} is being saved by a world of {rec.world - 1} ranks, "
                              f"this save has {voters - 1}", model=model, step=self.step)

    def _vote(self, slot: _Slot, voter: int, records: list, ok: bool = True) -> str:
        self.store.begin_step(slot.model, self.step, slot.world + 1, layout=_LAYOUT)
        return self.store.vote(slot.model, self.step, voter, records, ok=ok)

    def _abort(self, slot: _Slot, voter: int, why: BaseException) -> None:
        """Vote no, so the step is aborted now instead of waiting out its timeout."""
        try:
            self._vote(slot, voter, [], ok=False)
        except TierStoreError as e:
            log.warning("step %d of %s: the negative vote after %r failed too: %s", self.step, slot.model, why, e)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        slot = plan.storage_data
        if not isinstance(slot, _Slot):
            raise InvalidValueError("this plan was not prepared by TierStoreWriter.prepare_global_plan")
        self._slot = slot
        key = ShardKey(slot.model, DATA_LAYER, self.step, slot.rank)
        try:
            tensors: dict[str, torch.Tensor] = {}
            results = []
            for seq, item in enumerate(plan.items):
                fqn = item.index.fqn
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    raw = data.getvalue() if hasattr(data, "getvalue") else bytes(data)
                    check_restricted(raw, fqn=fqn, safe_globals=self.safe_globals)
                    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
                    kind = BYTES
                else:
                    if not isinstance(data, torch.Tensor):
                        raise InvalidValueError(f"{fqn}: the planner resolved a {type(data).__name__}, not a tensor",
                                                tensor=fqn)
                    check_tensor_props(fqn, data.dtype, data.layout)
                    t = data.detach().to("cpu").contiguous()
                    kind = TENSOR
                name = item_name(fqn, item.index.offset, kind, seq)
                tensors[name] = t
                results.append(WriteResult(item.index, t.numel() * t.element_size(),
                                           {"key": str(key), "name": name, "type": kind}))
            record = self.store.put(key, tensors, {"dcp": {"rank": slot.rank, "world": slot.world}})
        except BaseException as e:
            self._abort(slot, slot.rank, e)
            raise
        state = self._vote(slot, slot.rank, [record])
        if state == "aborted":
            raise StepAbortedError(f"step {self.step} of {slot.model} was aborted (another rank failed)",
                                   model=slot.model, step=self.step, rank=slot.rank)
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        slot = self._slot
        if slot is None:
            raise CommitError("finish() before write_data() on the coordinator")
        try:
            md = Metadata(
                state_dict_metadata=metadata.state_dict_metadata,
                planner_data=metadata.planner_data,
                storage_data={r.index: r.storage_data for rs in results for r in rs},
                storage_meta=self.storage_meta(),
                version=metadata.version or CURRENT_DCP_VERSION,  # as FileSystemWriter records it
            )
            doc = json.dumps(metadata_to_json(md), separators=(",", ":")).encode()
            key = ShardKey(slot.model, META_LAYER, self.step, slot.world)
            record = self.store.put(key, {_META_ENTRY: torch.frombuffer(bytearray(doc), dtype=torch.uint8)},
                                    {"dcp": {"schema": SCHEMA, "entry": _META_ENTRY}})
        except BaseException as e:
            self._abort(slot, slot.world, e)
            raise
        state = self._vote(slot, slot.world, [record])
        if state == "preparing":
            state = self.store.wait_step(slot.model, self.step, timeout=self.timeout)
        if state == "aborted":
            raise StepAbortedError(f"DCP save of step {self.step} of {slot.model} was aborted",
                                   model=slot.model, step=self.step)
        if state not in ("committed", "durable"):
            raise CommitError(f"DCP save of step {self.step} of {slot.model} is {state}", step=self.step)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_slot"] = None
        return state


# ------------------------------------------------------------------------------ reader


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
        self.step = None if step is None else _check_step(step)
        self.safe_globals = tuple(safe_globals)
        self.storage_data: dict[MetadataIndex, dict] = {}
        self.load_id = uuid.uuid4().hex
        self._loaded: tuple[str, int] | None = None
        self.metadata_error: TierStoreError | None = None

    @property
    def store(self) -> TierStore:
        return self._store.get()

    @property
    def checkpoint_id(self) -> str:
        return f"tierstore://{self.model}" + ("" if self.step is None else f"/{self.step}")

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.model, self.step = _parse_id(checkpoint_id)
        self.storage_data = {}
        self.load_id = uuid.uuid4().hex

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return str(checkpoint_id).startswith("tierstore://")

    def _metadata_key(self, model: str) -> ShardKey:
        if self.step is None:
            res = self.store.resolve(model)
            keys = [info.key for (layer, _r), info in res.objects.items() if layer == META_LAYER]
        else:
            state = self.store.steps.state(model, self.step)
            if not state:
                raise UnknownError(f"no step {self.step} of {model} in the index", what=f"{model}/{self.step}")
            if state == "aborted":
                raise StepAbortedError(f"step {self.step} of {model} was aborted", model=model, step=self.step)
            if state not in ("committed", "durable"):
                raise CommitError(f"step {self.step} of {model} is {state}, not committed: nothing to load",
                                  model=model, step=self.step, state=state)
            keys = self.store.list(model, META_LAYER, self.step)
        if len(keys) != 1:
            raise NoValidCopyError(f"{model}: {len(keys)} DCP metadata objects for the step, want 1", model=model)
        return keys[0]

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The step's DCP metadata; with ``rank=`` (DCP's fallback) that rank's own ``use_collectives=False`` save.

        DCP swallows the error of the first call (it then tries ``rank=``); it
        is kept in ``metadata_error`` so that :func:`load` can raise it typed.
        """
        rank = kwargs.get("rank")
        model = self.model if rank is None else _rank_model(self.model, int(rank))
        try:
            key = self._metadata_key(model)
        except TierStoreError as e:
            if rank is None:
                self.metadata_error = e
            raise
        shard = self.store.get(key)
        if shard is None:
            raise NoValidCopyError(f"{key}: the DCP metadata is gone", key=str(key))
        entry = shard.get(_META_ENTRY)
        try:
            doc = json.loads(entry.numpy().tobytes()) if entry is not None else shard.metadata.get("dcp") or {}
        except ValueError as e:
            raise ManifestError(f"{key}: DCP metadata is not JSON: {e}") from e
        md = metadata_from_json(doc)
        self._loaded = (key.model, key.step)
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
        return key, loc

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_key: dict[ShardKey, list] = {}
        for req in plan.items:
            by_key.setdefault(self._locate(req.storage_index)[0], []).append(req)
        for key, reqs in by_key.items():  # one rank object at a time: memory is the largest object, not the sum
            shard = self.store.get(key)
            if shard is None:
                raise NoValidCopyError(f"{key}: DCP data is gone", key=str(key))
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
