"""The store's write path: snapshot into the host tier, then seal, publish, index and queue migration.

Protocol (who calls what, in which order): the trainer's thread calls
:meth:`WritePath.snapshot` (the copy into a host-tier reservation: the only part
a trainer waits for) and gets a :class:`PendingObject`; then, from any thread,
``PendingObject.finish()`` seals it (the checksum trailer), publishes it under a
physical name unique to this write (create-once), records it in the index (which
refuses a stale epoch and any key of a committed step) and queues it for
replication and migration. :meth:`WritePath.finish_many` finishes several in
order with one index call per ``StoreConfig.publish_batch`` consecutive host
objects of a model (the outcome of finishing them one by one);
:meth:`WritePath.finish_async` runs it on the store's background thread;
:meth:`WritePath.put` is snapshot-then-finish.

With a device tier (:mod:`tierstore.store.device_tier`), ``snapshot`` copies a
full object into reused device buffers instead, and ``finish`` first drains
them into the host reservation.

CUDA tensors: the host reservation they are copied into (by ``snapshot`` or by
a device tier's drain) is page-locked first where ``pin_host_bytes`` allows
(:meth:`backends.host.HostBackend.pin`). With ``copies=`` (a lazy save's
:class:`~tierstore.store.copies.DeviceCopies`), ``snapshot`` skips the device
tier (no GPU memory) and enqueues the copies on the save's side stream,
``non_blocking``; ``finish`` and ``abort`` wait for them before sealing or
letting the reservation go.

:class:`WritePath` is a mixin of :class:`tierstore.store.TierStore` (the facade
that owns the tiers, index and threads it uses).
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from backends.base import Backend
from backends.host import HostBackend
from consistency.index import KINDS, Index, ObjectRecord
from tierstore import codec, gchold
from tierstore.background import lower_priority
from tierstore.chains import ChainDepths
from tierstore.config import StoreConfig
from tierstore.errors import (
    FencedError,
    InvalidValueError,
    KeyExistsError,
    NoValidCopyError,
    TierFullError,
    TierStoreError,
)
from tierstore.keys import ShardKey, object_name
from tierstore.migration import Migrator
from tierstore.placement import Placement
from tierstore.store.common import INTERNAL, check_key
from tierstore.store.device_tier import DeviceTier, StagedCopy

if TYPE_CHECKING:
    import torch

__all__ = ["PendingObject", "WritePath"]

log = logging.getLogger(__name__)


def _with_internal(key: Any, metadata: Mapping[str, Any] | None, kind: str, base: ShardKey | None,
                   target: ShardKey | None) -> dict[str, Any]:
    """``metadata`` with the store's own entry (:data:`INTERNAL`: the kind and links), as an object holds it."""
    meta = dict(metadata or {})
    if INTERNAL in meta:
        raise InvalidValueError(f"{key}: metadata key {INTERNAL!r} is reserved")
    meta[INTERNAL] = {
        "kind": kind,
        "base": str(check_key(base)) if base else None,
        "target": str(check_key(target)) if target else None,
    }
    return meta


@dataclass
class PendingObject:
    """A snapshot copied into the host tier (or the device tier) but not yet sealed and published.

    Call :meth:`finish` (from any thread) to drain a device copy into the host
    tier, seal, publish, index and queue migration; or :meth:`abort` to drop it.
    """

    store: WritePath
    key: ShardKey
    plan: Any
    reservation: Any
    kind: str
    base: ShardKey | None
    target: ShardKey | None
    epoch: int | None
    name: str = ""
    staged: StagedCopy | None = None  # in the device tier; drained into a host reservation by finish()
    attempt: str | None = None  # the writer's attempt token (see consistency.attempts)
    copied: Any = None  # DeviceCopies still writing into the reservation (tierstore.store.copies)
    _done: bool = field(default=False, repr=False)

    def finish(self) -> ObjectRecord:
        if self._done:
            raise RuntimeError(f"{self.key} already finished")
        self._done = True
        return self.store._publish(self)

    def abort(self) -> None:
        if not self._done:
            self._done = True
            if self.copied is not None:
                self.copied.synchronize()  # no copy may still write into a reservation let go
            if self.reservation is not None:
                self.reservation.abort()
            if self.staged is not None:
                self.staged.release()


class _Sealed:
    """An object encoded (and checksummed) up front, standing in for an EncodePlan."""

    def __init__(self, blob: bytes):
        self.nbytes = len(blob)
        self._checksum = codec.checksum(blob)

    def seal(self, buf: memoryview) -> str:
        return self._checksum


def _tag(epoch: int | None) -> str:
    """A fresh tag for one write's physical name (the writer's epoch, for a person reading the tiers)."""
    rand = secrets.token_hex(6)
    return f"e{epoch}-{rand}" if epoch is not None and epoch >= 0 else rand


class WritePath:
    """The write half of :class:`~tierstore.store.TierStore` (a mixin; the store owns the state it uses)."""

    config: StoreConfig
    index: Index
    host: HostBackend
    tiers: list[Backend]
    chains: ChainDepths
    placement: Placement
    _migrator: Migrator | None
    _replicator: Migrator | None
    _lock: threading.Lock
    _sealer: ThreadPoolExecutor | None
    _sealing: set[Any]
    device_tier: DeviceTier | None

    if TYPE_CHECKING:  # provided by TierStore and ReadPath
        def _check_open(self) -> None: ...
        def evict_host(self, nbytes: int) -> int: ...
        def _get(self, key: ShardKey, out: Any, raw: bool, depth: int, rec: Any = ..., *,
                 copy: bool = ...) -> codec.Shard | None: ...

    # -- writing -------------------------------------------------------------------
    def snapshot(
        self,
        key: ShardKey | str,
        tensors: Mapping[str, torch.Tensor],
        metadata: Mapping[str, Any] | None = None,
        *,
        kind: str = "full",
        base: ShardKey | None = None,
        target: ShardKey | None = None,
        epoch: int | None = None,
        compress: str = "auto",
        attempt: str | None = None,
        copies: Any = None,
    ) -> PendingObject:
        """Copy ``tensors`` into the host tier (the only part a trainer waits for).

        Returns a :class:`PendingObject`; the tensors may change as soon as
        this returns (with ``copies``: once the copies' event completed, which
        the caller orders). Nothing is visible to readers until ``finish()``.

        ``copies``: a :class:`~tierstore.store.copies.DeviceCopies`: CUDA
        tensors are copied asynchronously on its side stream into page-locked
        host memory, never through the device tier.

        ``compress``: ``"auto"`` copies full objects raw (dense floats do not
        compress; the copy is the whole stall) and compresses other kinds with
        lz4 or zstd where a sample shows it pays (:mod:`tierstore.codec.compression`);
        ``"always"`` / ``"never"`` force it.

        ``attempt``: the writer's token of its claim of the key's step
        (:meth:`consistency.twophase.StepProtocol.claim`): the index refuses the
        write (``finish()`` raises :class:`StepBusyError`) unless that attempt
        holds the step; without it, unless no claimed attempt holds it.

        Raises:
            InvalidKeyError, InvalidValueError: bad key, kind or values.
            TierFullError: no room in the host tier even after eviction.
        """
        key = check_key(key)
        self._check_open()
        if kind not in KINDS:
            raise InvalidValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if compress not in ("auto", "always", "never"):
            raise InvalidValueError(f"compress must be 'auto', 'always' or 'never', got {compress!r}")
        if kind == "delta" and base is None:
            raise InvalidValueError(f"{key}: a delta object needs its base")
        if kind == "ref" and target is None:
            raise InvalidValueError(f"{key}: a ref object needs its target")
        if not isinstance(tensors, Mapping):
            raise InvalidValueError(f"{key}: tensors must be a mapping of names to tensors, got {type(tensors).__name__}")
        meta = _with_internal(key, metadata, kind, base, target)
        link = check_key(base) if kind == "delta" else check_key(target) if kind == "ref" else None
        if link is not None and self.chains.depth(link) + 1 > self.config.max_delta_chain:
            # a reader follows at most max_delta_chain links: this object would be unreadable, so the chain
            # is cut here and the object written as a new base (a full object with the same contents)
            tensors, meta = self._rebased(key, link, tensors, meta, ref=kind == "ref")
            kind, base, target = "full", None, None
            meta[INTERNAL] = {"kind": "full", "base": None, "target": None}
        name = object_name(key, _tag(epoch))
        if compress == "never" or (compress == "auto" and kind == "full"):
            plan = codec.plan(tensors, meta)
            staged = (self.device_tier.stage(key, tensors)
                      if self.device_tier is not None and copies is None else None)
            if staged is not None:  # in device buffers: the host reservation and its copy are finish()'s
                return PendingObject(self, key, codec.plan(staged.tensors, meta), None, kind, base, target, epoch,
                                     name, staged, attempt=attempt)
            res = self._reserve(key, name, plan.nbytes)
            try:
                self._pin_for(res, tensors)
                dests = res.views(plan.geometry, plan.dest_views)  # a reused segment's, where it kept them
                if copies is not None:
                    with copies.stream_context():
                        plan.write(res.buffer, non_blocking=True, dests=dests)
                else:
                    plan.write(res.buffer, dests=dests)
            except BaseException:
                if copies is not None:
                    copies.synchronize()
                res.abort()
                raise
            return PendingObject(self, key, plan, res, kind, base, target, epoch, name, attempt=attempt, copied=copies)
        # deltas (byte-shuffled XOR) compress; dense full objects rarely do, so they skip the sampling
        blob = codec.encode(tensors, meta, compress="always" if compress == "always" else "auto")
        res = self._reserve(key, name, len(blob))
        try:
            res.buffer[:] = blob
        except BaseException:
            res.abort()
            raise
        return PendingObject(self, key, _Sealed(blob), res, kind, base, target, epoch, name, attempt=attempt)

    def snapshot_many(
        self,
        items: Sequence[tuple[ShardKey | str, Mapping[str, torch.Tensor], Mapping[str, Any] | None]],
        **kwargs: Any,
    ) -> list[PendingObject]:
        """:meth:`snapshot` of each ``(key, tensors, metadata)``, in order, with the same keyword arguments.

        The cyclic garbage collector is held off for the loop (``config.hold_gc``, :mod:`tierstore.gchold`):
        a thousand objects allocate tens of thousands of small ones, and the collections they trigger walk
        every object of the process. If one fails, the ones before it are aborted and its error is raised.

        Raises:
            as :meth:`snapshot`.
        """
        out: list[PendingObject] = []
        with gchold.held(self.config.hold_gc):
            try:
                for key, tensors, metadata in items:
                    out.append(self.snapshot(key, tensors, metadata, **kwargs))
            except BaseException:
                for p in out:
                    p.abort()
                raise
        return out

    def snapshot_nbytes(self, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, Any] | None = None) -> int:
        """The host-tier bytes :meth:`snapshot` of a full object of ``tensors`` and ``metadata`` takes (what
        ``host.preallocate`` needs to pre-fault segments that the first saves reuse exactly).

        Raises:
            InvalidValueError: as :meth:`snapshot`.
        """
        return codec.plan(tensors, _with_internal("snapshot_nbytes", metadata, "full", None, None)).nbytes

    def _rebased(self, key: ShardKey, base: ShardKey, deltas: Mapping[str, torch.Tensor],
                 meta: dict, *, ref: bool = False) -> tuple[dict[str, torch.Tensor], dict]:
        """The full tensors (and metadata) a delta on ``base``, or a ref to it, stands for."""
        old = self._get(base, None, False, 0)
        if old is None:
            raise NoValidCopyError(f"{key} is a delta on (or ref to) {base}, which is gone", key=str(key))
        if ref:
            return dict(old.tensors), dict(old.metadata)
        from tierstore.delta import apply_xor_delta  # lazy: delta imports torch; the admin commands run without it

        layout = meta.get("_delta") or {}
        full: dict[str, torch.Tensor] = {}
        for name, b in old.tensors.items():
            full[name] = apply_xor_delta(b, deltas[name]) if name in deltas else b
        for name in deltas:
            if name not in old.tensors or (name in layout and list(old.tensors[name].shape) != list(layout[name]["shape"])):
                raise InvalidValueError(f"{key}: delta tensor {name!r} does not fit its base {base}", entry=name)
        return full, {k: v for k, v in meta.items() if k != "_delta"}

    def _pin_for(self, res: Any, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Page-lock ``res``'s segment if CUDA tensors are copied into it (within the budget; best effort)."""
        pin = getattr(self.host, "pin", None)
        if pin is None or not any(t.is_cuda for t in tensors.values()):
            return False
        return bool(pin(res.buffer))

    def _reserve(self, key: ShardKey, name: str, nbytes: int):
        try:
            return self.host.reserve(name, nbytes)
        except TierFullError:
            freed = self.evict_host(nbytes)
            log.info("host tier full: evicted %d bytes for %s", freed, key)
            return self.host.reserve(name, nbytes)

    def _publish(self, p: PendingObject) -> ObjectRecord:
        if p.staged is None:
            return self._publish_host(p)
        staged = p.staged
        try:
            res = self._reserve(p.key, p.name, p.plan.nbytes)  # the drain: device buffers into the host tier
            try:
                staged.wait()
                self._pin_for(res, staged.tensors)
                p.plan.write(res.buffer)
            except BaseException:
                res.abort()
                raise
            p.reservation = res
            meta = codec.open_object(res.buffer).metadata  # as a reader of the host copy would get it
            record = self._publish_host(p)
        except BaseException:
            staged.release()
            raise
        if self.device_tier is not None:
            self.device_tier.published(staged, p.name, record.checksum, meta)
        else:
            staged.release()
        return record

    def _publish_host(self, p: PendingObject) -> ObjectRecord:
        checksum = self._seal_commit(p, self.index.epoch(p.key.model) if p.epoch is not None and p.epoch >= 0
                                     else None)
        try:
            old = self.index.record_object(
                p.key, kind=p.kind, size=p.plan.nbytes, checksum=checksum, tiers=[self.host.tier],
                base=p.base, target=p.target, epoch=p.epoch, name=p.name, attempt=p.attempt,
            )
        except TierStoreError:
            self._drop_copy(p.name)  # fenced, committed, busy or index gone: our own copy must not linger unindexed
            raise
        return self._recorded(p, checksum, old)

    def _seal_commit(self, p: PendingObject, current: int | None) -> str:
        """Seal ``p``'s host reservation and publish it under its fresh name (not indexed yet); its checksum.

        ``current``: the model's epoch as last read (``None``: not checked here); a stale ``p.epoch`` is
        refused early (the index refuses it anyway)."""
        if p.copied is not None:
            p.copied.synchronize()  # the device-to-host copies into the reservation are done
        checksum = p.plan.seal(p.reservation.buffer)
        if current is not None and p.epoch is not None and 0 <= p.epoch < current:
            # fenced: refused early (the fresh name is what makes a late publish harmless)
            p.reservation.abort()
            raise FencedError(f"put of {p.key}: epoch {p.epoch} is fenced (now {current})", epoch=current)
        try:
            p.reservation.commit(if_absent=True)  # a fresh name: create-once, never over another copy
        except KeyExistsError:
            raise  # not ours (a tag collision): leave it
        except TierStoreError:
            self._drop_copy(p.name)  # a torn publish may have left our own copy behind
            raise
        return checksum

    def _recorded(self, p: PendingObject, checksum: str, old: str | None) -> ObjectRecord:
        """After ``p``'s record is in the index: drop the copy it replaced, queue replication and migration."""
        size = p.plan.nbytes
        if old is not None:
            self._drop_copy(old)  # the copy of the record this one replaced (of an uncommitted step)
        self.chains.published(p.key, p.base if p.kind == "delta" else p.target if p.kind == "ref" else None)
        if self._replicator is not None and self.placement.to_peer(p.kind, p.key.step):
            self._replicator.enqueue(p.key, checksum, p.name)
        if self._migrator is not None and self.placement.to_durable(p.kind, p.key.step):
            self._migrator.enqueue(p.key, checksum, p.name)
        return ObjectRecord(p.key, p.kind, size, checksum, p.base, p.target, p.epoch if p.epoch is not None else 0,
                            tiers=frozenset((self.host.tier,)), name=p.name)

    def _publish_batch(self, batch: list[PendingObject]) -> list[ObjectRecord]:
        """Finish ``batch`` (host reservations of one model, in order) with one index round trip for all.

        Each object is sealed and published under its fresh name, then every one is recorded by one
        :meth:`~consistency.objects.ObjectIndex.record_objects` call, in order; the result is the one
        finishing them one by one gives: on the first failure, those before it are finished (recorded,
        their replaced copies dropped, queued for migration), its copy and the copies of those after it
        that were published are dropped (none of them is indexed), and its error is raised; those not
        yet sealed stay pending for the caller to abort.
        """
        current = self.index.epoch(batch[0].key.model) if any(
            p.epoch is not None and p.epoch >= 0 for p in batch) else None
        published: list[tuple[PendingObject, str]] = []
        failed: BaseException | None = None
        for p in batch:
            p._done = True
            try:
                published.append((p, self._seal_commit(p, current)))
            except BaseException as e:  # noqa: BLE001 - those before it are recorded first, then it is raised
                failed = e
                break
        if not published:
            assert failed is not None
            raise failed
        entries = [{"key": p.key, "kind": p.kind, "size": p.plan.nbytes, "checksum": checksum,
                    "tiers": [self.host.tier], "base": p.base, "target": p.target, "epoch": p.epoch,
                    "name": p.name, "attempt": p.attempt} for p, checksum in published]
        try:
            olds, refused = self.index.record_objects(entries)
        except TierStoreError:
            for p, _ in published:
                self._drop_copy(p.name)  # the index is gone: no copy of ours lingers unindexed
            raise
        records = [self._recorded(p, checksum, old) for (p, checksum), old in zip(published, olds)]
        if refused is not None:
            for p, _ in published[len(olds):]:
                self._drop_copy(p.name)  # refused, or after the one refused: never indexed
            raise refused
        if failed is not None:
            raise failed
        return records

    def _drop_copy(self, name: str) -> None:
        """Delete the copy ``name`` from every tier, best effort (a name belongs to one write only)."""
        for tier in self.tiers:
            try:
                tier.delete(name)
            except TierStoreError as e:
                log.warning("could not delete %s from the %s tier: %s", name, tier.tier, e)

    def finish_async(self, pendings: Sequence[PendingObject]) -> Future[list[ObjectRecord]]:
        """Seal, publish and index ``pendings`` in order on the store's background thread.

        The thread runs ``config.background_nice`` nicer than the trainer
        (:mod:`tierstore.background`). The future holds the objects' infos; if
        one fails, the rest are aborted and the future holds its error.
        """
        self._check_open()
        items = list(pendings)
        with self._lock:
            if self._sealer is None:
                self._sealer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierstore-seal",
                                                  initializer=lower_priority, initargs=(self.config.background_nice,))
            fut = self._sealer.submit(self._finish_all, items)
            self._sealing.add(fut)  # close() waits for it, within its bound
            fut.add_done_callback(self._sealing.discard)
            return fut

    def _finish_all(self, items: list[PendingObject]) -> list[ObjectRecord]:
        return self.finish_many(items)

    def finish_many(self, pendings: Sequence[PendingObject]) -> list[ObjectRecord]:
        """``[p.finish() for p in pendings]``, in order, in this thread, with fewer index round trips.

        Consecutive host-tier objects of one model (not in the device tier) are finished in batches of
        at most ``config.publish_batch``, each recorded in the index by one call
        (:meth:`_publish_batch`); the outcome is the one finishing them one by one gives. If one
        fails, those before it are finished, the rest are aborted, and its error is raised.
        """
        items = list(pendings)
        size = max(1, int(self.config.publish_batch))
        done: list[ObjectRecord] = []
        try:
            i = 0
            while i < len(items):
                j = i
                while (j < len(items) and j - i < size and items[j].staged is None and not items[j]._done
                       and items[j].reservation is not None and items[j].key.model == items[i].key.model):
                    j += 1
                if j - i <= 1:
                    done.append(items[i].finish())
                    i += 1
                    continue
                done.extend(self._publish_batch(items[i:j]))
                i = j
        except BaseException:
            for p in items[len(done):]:
                p.abort()
            raise
        return done

    def put(
        self,
        key: ShardKey | str,
        tensors: Mapping[str, torch.Tensor],
        metadata: Mapping[str, Any] | None = None,
        *,
        kind: str = "full",
        base: ShardKey | None = None,
        target: ShardKey | None = None,
        epoch: int | None = None,
        compress: str = "auto",
        attempt: str | None = None,
    ) -> ObjectRecord:
        """Store one shard; it is in the host tier when this returns, durable later (see :meth:`flush`).

        ``attempt``: as for :meth:`snapshot`.
        """
        return self.snapshot(key, tensors, metadata, kind=kind, base=base, target=target, epoch=epoch,
                             compress=compress, attempt=attempt).finish()

