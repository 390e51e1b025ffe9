"""The DCP ``StorageWriter`` on tierstore, and the protocol of writer and reader, call by call.

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
   ``len(plans)``; the coordinator *claims* the step for this save alone
   (``store.steps.claim`` with a fresh attempt token, see
   :mod:`consistency.attempts`), before any rank writes: a step already
   committed or durable is refused (:class:`KeyExistsError`), and so is one
   another writer's attempt is still saving (:class:`StepBusyError`, the
   second of two concurrent saves); a step whose earlier attempt was aborted,
   or is past its timeout (``step_timeout``), or whose lease lapsed, is saved
   again as a new attempt (logged, naming why the earlier one ended). Each rank
   learns its slot, the world and the attempt token through ``plan.storage_data``.

   The claim is a *lease* (``lease``, 10 s by default): the coordinator renews
   it from a daemon thread (:class:`consistency.attempts.Lease`, every
   ``lease / 3``) from the claim until ``finish`` returns (or its write fails),
   whatever the write is doing, so a slow write keeps it. A coordinator that
   dies (SIGKILL, a lost node) stops renewing, and the lease lapses within
   ``lease`` seconds: a job restarted at once saves the same step number again
   (its claim waits up to ``claim_wait``, default one lease, for a leased
   attempt to lapse, and is refused at once when it sees the holder renew:
   two live writers are still refused). The renewals stop by themselves once
   the step is decided or past its timeout.
4. all ranks, ``write_data``: every item goes into ONE object per rank,
   ``ShardKey(model, "dcp", step, rank)``: tensors (their projection, on
   CPU) as themselves, non-tensor values (``BYTE_IO``) as the bytes DCP's
   planner made with ``torch.save``, each first checked to load back with
   ``torch.load(weights_only=True)`` (refused otherwise). Then the rank
   votes for the step (``world + 1`` voters). The write and the vote carry
   the attempt token: the index refuses them (:class:`StepBusyError`) once
   another attempt holds the step (a rank of an attempt that was taken
   over). Any failure here is a negative vote: the step is aborted at once,
   never left ``preparing``.
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
one (``store.resolve``), and reads the copies that step's manifest names
(``store.get_copy``), never whatever the index records for a key now;
``read_data`` reads each rank object once, narrows each chunk to the request
(any world size may read: DCP reshards by offsets) and hands non-tensor
values to the planner.

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
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from consistency.attempts import DEFAULT_LEASE_S, Lease
from tierstore.codec import DTYPES
from tierstore.config import StoreConfig
from tierstore.errors import (
    CommitError,
    InvalidValueError,
    KeyExistsError,
    StepAbortedError,
    StepCommittedError,
    TierStoreError,
)
from tierstore.interop.dcp_format import (
    BYTES,
    SCHEMA,
    TENSOR,
    check_restricted,
    item_name,
    metadata_to_json,
)
from tierstore.interop.store_ref import StoreRef
from tierstore.keys import ShardKey, validate_name
from tierstore.store import TierStore

__all__ = ["DATA_LAYER", "META_ENTRY", "META_LAYER", "TierStoreWriter", "check_step", "check_tensor_props", "parse_id",
           "rank_model"]

log = logging.getLogger(__name__)

DATA_LAYER = "dcp"
META_LAYER = "dcp-metadata"
META_ENTRY = "metadata.json"
_LAYOUT = {"layers": [DATA_LAYER, META_LAYER]}


@dataclasses.dataclass(frozen=True)
class _Slot:
    """What the coordinator tells each rank in ``plan.storage_data``: where its object goes, under which attempt."""

    model: str
    rank: int
    world: int
    attempt: str  # the token of the coordinator's claim of the step: every write and vote of this save carries it


def rank_model(model: str, rank: int) -> str:
    """The model a rank saves alone into (``use_collectives=False``)."""
    return validate_name(f"{model}.rank{rank}", "model")


def parse_id(checkpoint_id: str | os.PathLike) -> tuple[str, int | None]:
    s = str(checkpoint_id)
    if not s.startswith("tierstore://"):
        raise InvalidValueError(f"not a tierstore checkpoint id: {s!r} (want tierstore://model[/step])")
    parts = s[len("tierstore://"):].strip("/").split("/")
    try:
        step = int(parts[1]) if len(parts) > 1 and parts[1] else None
    except ValueError:
        raise InvalidValueError(f"not a tierstore checkpoint id: {s!r} (the step must be an int)") from None
    return validate_name(parts[0], "model"), step


def check_step(step: Any) -> int:
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
        step_timeout: seconds this save's attempt may stay uncommitted; past it, another save of
            the step takes it over as a new attempt (default: the store's step timeout, 600 s;
            0: never).
        epoch: the job incarnation's epoch (e.g. ``store.open_epoch(model)`` taken once when the
            job starts, the same on every rank): writes and votes of older epochs are fenced, and
            an attempt of an older epoch is taken over at once, without waiting for its timeout.
        lease: seconds the coordinator's claim of the step outlives its last renewal (renewed every
            ``lease / 3`` while the writer lives; see the module docstring); 0: no lease (the attempt
            holds the step until it is decided or times out).
        claim_wait: seconds a claim refused by another writer's leased attempt waits for that lease to
            lapse (default: one ``lease``; 0: refuse at once); a holder seen renewing is refused at once.

    After a save, the coordinator's writer holds ``attempt`` (the attempt's
    number) and ``previous_attempt`` (why the attempt before it ended, or
    ``None``).
    """

    def __init__(self, store: TierStore | StoreConfig | Mapping[str, Any] | None, model: str, step: int, *,
                 timeout: float = 120.0, safe_globals: Iterable[Any] = (), step_timeout: float | None = None,
                 epoch: int | None = None, lease: float = DEFAULT_LEASE_S,
                 claim_wait: float | None = None) -> None:
        super().__init__()
        self._store = StoreRef(store)
        self.model = validate_name(model, "model")
        self.step = check_step(step)
        self.timeout = timeout
        self.safe_globals = tuple(safe_globals)
        if step_timeout is not None and (isinstance(step_timeout, bool) or not isinstance(step_timeout, (int, float))
                                         or not step_timeout >= 0):
            raise InvalidValueError(f"step_timeout must be a non-negative number of seconds, got {step_timeout!r}")
        self.step_timeout = step_timeout
        if epoch is not None and (isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0):
            raise InvalidValueError(f"epoch must be a non-negative int, got {epoch!r}")
        self.epoch = epoch
        for what, v in (("lease", lease), ("claim_wait", claim_wait)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0):
                raise InvalidValueError(f"{what} must be a non-negative number of seconds, got {v!r}")
        self.lease = float(lease)
        self.claim_wait = self.lease if claim_wait is None else float(claim_wait)
        self._lease: Lease | None = None
        self.attempt: int | None = None
        self.previous_attempt: str | None = None
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
            model, step = parse_id(checkpoint_id)
            self.model = model
            if step is not None:
                self.step = step
        self.save_id = uuid.uuid4().hex
        self._slot = None
        self._release()

    def _release(self) -> None:
        """Stop renewing this writer's claim (its save finished, failed, or a new one begins)."""
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.stop()

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
        self._release()
        self.attempt = self.previous_attempt = None

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
            model, slots = rank_model(self.model, self.rank), [(0, 1)]
        token = uuid.uuid4().hex  # this save's attempt: fresh per save, handed to every rank in its plan
        self._claim(model, slots[0][1] + 1, token)
        return [dataclasses.replace(p, storage_data=_Slot(model, r, w, token)) for p, (r, w) in zip(plans, slots)]

    def _claim(self, model: str, voters: int, token: str) -> None:
        """Take the step for this save alone, before any rank writes (see the module docstring)."""
        try:
            claim = self.store.steps.claim(model, self.step, voters, token, layout=_LAYOUT, epoch=self.epoch,
                                           timeout_s=self.step_timeout, lease_s=self.lease,
                                           wait_s=self.claim_wait if self.lease > 0 else 0.0)
        except StepCommittedError as e:
            raise KeyExistsError(f"step {self.step} of {model} is already saved; a committed step is never "
                                 "overwritten: save under a new step number", model=model, step=self.step) from e
        self._release()
        if self.lease > 0:
            self._lease = Lease(self.store.steps, model, self.step, token, self.lease)
        self.attempt, self.previous_attempt = claim.attempt, claim.previous
        if claim.retried:
            log.warning("step %d of %s: attempt %d did not commit (%s); saving the step again as attempt %d",
                        self.step, model, claim.attempt - 1, claim.previous, claim.attempt)

    def _vote(self, slot: _Slot, voter: int, records: list, ok: bool = True) -> str:
        return self.store.vote(slot.model, self.step, voter, records, ok=ok, epoch=self.epoch, attempt=slot.attempt)

    def _aborted(self, slot: _Slot, what: str, **fields: Any) -> StepAbortedError:
        (rec,) = self.store.steps.records(slot.model, [self.step])
        why = f": {rec.reason}" if rec.reason else ""
        return StepAbortedError(f"{what} of step {self.step} of {slot.model} was aborted{why}", model=slot.model,
                                step=self.step, reason=rec.reason, **fields)

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
            record = self.store.put(key, tensors, {"dcp": {"rank": slot.rank, "world": slot.world}}, epoch=self.epoch,
                                    attempt=slot.attempt)
        except BaseException as e:
            self._abort(slot, slot.rank, e)
            self._release()
            raise
        state = self._vote(slot, slot.rank, [record])
        if state == "aborted":
            raise self._aborted(slot, f"the vote of rank {slot.rank}", rank=slot.rank)
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        slot = self._slot
        if slot is None:
            raise CommitError("finish() before write_data() on the coordinator")
        try:
            self._finish(slot, metadata, results)
        finally:
            self._release()

    def _finish(self, slot: _Slot, metadata: Metadata, results: list[list[WriteResult]]) -> None:
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
            record = self.store.put(key, {META_ENTRY: torch.frombuffer(bytearray(doc), dtype=torch.uint8)},
                                    {"dcp": {"schema": SCHEMA, "entry": META_ENTRY}}, epoch=self.epoch,
                                    attempt=slot.attempt)
        except BaseException as e:
            self._abort(slot, slot.world, e)
            raise
        state = self._vote(slot, slot.world, [record])
        if state == "preparing":
            state = self.store.wait_step(slot.model, self.step, timeout=self.timeout)
        if state == "aborted":
            raise self._aborted(slot, "the DCP save")
        if state not in ("committed", "durable"):
            raise CommitError(f"DCP save of step {self.step} of {slot.model} is {state}", step=self.step)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_slot"] = None
        state["_lease"] = None  # the renewals stay with the process that claimed (they end with the step)
        return state
