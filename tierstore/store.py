"""The tier manager: ``tierstore.open()`` and :class:`TierStore`.

A put is copied once, straight into the host tier's shared-memory object (the
snapshot), sealed with its checksum, published under a physical name unique to
this write (:func:`~tierstore.keys.object_name`: the key plus a fresh tag,
create-once), recorded in the index (which refuses a stale epoch and any key
of a committed step), and queued for migration to the durable tier. A name is
never reused, so no writer (a fenced zombie, a retried attempt) can publish
over, or delete, the live copy of a key: it only ever touches its own. A delta
or ref that a reader could not follow (``max_delta_chain``) is written as a
full object instead. A get asks the index what it knows (the live copy's
name), then reads the fastest tier holding the object, verifies the checksum,
and falls back to the next tier on a miss, an unreachable tier or a mismatch;
refs and delta chains are resolved into full tensors.

The commit protocol (:meth:`TierStore.begin_step`, :meth:`vote`,
:meth:`wait_step`, :meth:`open_epoch`), garbage collection (:meth:`gc`) and
index rebuilds (:meth:`rebuild_index`) are delegated to :mod:`consistency`;
the read path (:meth:`resolve`) to :mod:`tierstore.readpath`. See ``DESIGN.md``.
"""

from __future__ import annotations

import builtins  # TierStore.list shadows the builtin inside the class
import logging
import secrets
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Self

from backends.base import Backend
from backends.host import HostBackend
from consistency.gc import GCReport, Retention, collect
from consistency.index import KINDS, Index, ObjectRecord
from consistency.rebuild import RebuildReport, rebuild_index
from consistency.twophase import StepProtocol
from tierstore import codec
from tierstore.background import lower_priority
from tierstore.chains import ChainDepths
from tierstore.config import StoreConfig
from tierstore.errors import (
    CorruptObjectError,
    FencedError,
    InvalidKeyError,
    InvalidValueError,
    KeyExistsError,
    NoValidCopyError,
    ObjectNotFoundError,
    RestoreMismatchError,
    TierFullError,
    TierStoreError,
    TierUnavailableError,
)
from tierstore.eviction import evict_host
from tierstore.keys import ShardKey, object_name, validate_name, validate_step
from tierstore.migration import Migrator
from tierstore.placement import Placement
from tierstore.readpath import Resolution, resolve

if TYPE_CHECKING:
    import torch

__all__ = ["KINDS", "ObjectRecord", "PendingObject", "TierStore"]

log = logging.getLogger(__name__)
_INTERNAL = "_ts"  # metadata entry holding kind/base/target, so objects describe themselves
_UNREAD = object()  # _get's record argument when the caller has not read the index yet


@dataclass
class PendingObject:
    """A snapshot copied into the host tier but not yet sealed and published.

    Call :meth:`finish` (from any thread) to seal, publish, index and queue
    migration; or :meth:`abort` to drop it.
    """

    store: TierStore
    key: ShardKey
    plan: Any
    reservation: Any
    kind: str
    base: ShardKey | None
    target: ShardKey | None
    epoch: int | None
    name: str = ""
    _done: bool = field(default=False, repr=False)

    def finish(self) -> ObjectRecord:
        if self._done:
            raise RuntimeError(f"{self.key} already finished")
        self._done = True
        return self.store._publish(self)

    def abort(self) -> None:
        if not self._done:
            self._done = True
            self.reservation.abort()


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


def _check_key(key: object) -> ShardKey:
    if isinstance(key, ShardKey):
        return key
    if isinstance(key, str):
        return ShardKey.parse(key)
    raise InvalidKeyError(f"a key must be a ShardKey or 'model/layer/step/rank', got {type(key).__name__}", field="key")


class TierStore:
    """Tiered, versioned storage of checkpoint shards. Build it with :func:`open`.

    Thread-safe. Owns its index client, backends and migration threads;
    :meth:`close` releases them (it does not stop the embedded server).
    """

    def __init__(
        self,
        config: StoreConfig,
        index: Index,
        host: HostBackend,
        durable: Backend | None = None,
        *,
        peer: Backend | None = None,
    ) -> None:
        self.config = config
        self.index = index
        self.host = host
        self.peer = peer
        self.durable = durable
        self.tiers: list[Backend] = [t for t in (host, peer, durable) if t is not None]
        self._migrator = (
            Migrator(host, durable, index, maxsize=config.migration_queue, workers=config.migration_workers,
                     retries=config.migration_retries, backoff_s=config.migration_backoff_s,
                     backoff_max_s=config.migration_backoff_max_s, nice=config.background_nice)
            if durable is not None and config.migrate
            else None
        )
        self.placement = Placement(config.peer_replicas if peer is not None else 0, config.durable_every)
        self._replicator = (
            Migrator(host, peer, index, maxsize=config.migration_queue, workers=1, name="replicate",
                     retries=config.migration_retries, backoff_s=config.migration_backoff_s,
                     backoff_max_s=config.migration_backoff_max_s, nice=config.background_nice)
            if peer is not None
            else None
        )
        self._lock = threading.Lock()
        self._closed = False
        self._sealer: ThreadPoolExecutor | None = None  # finish_async's thread, started on first use
        self.chains = ChainDepths(index, config.max_delta_chain)
        self.steps = StepProtocol(index, durable, on_lost=self._on_lost if config.rebuild_index_on_loss else None)

    def _on_lost(self, model: str) -> None:
        report = self.rebuild_index(model)
        log.warning("index rebuilt for %s from the durable tier: %s", model, report.to_json())

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
    ) -> PendingObject:
        """Copy ``tensors`` into the host tier (the only part a trainer waits for).

        Returns a :class:`PendingObject`; the tensors may change as soon as
        this returns. Nothing is visible to readers until ``finish()``.

        ``compress``: ``"auto"`` copies full objects raw (dense floats do not
        compress; the copy is the whole stall) and compresses other kinds with
        lz4 or zstd where a sample shows it pays (:mod:`tierstore.codec.compression`);
        ``"always"`` / ``"never"`` force it.

        Raises:
            InvalidKeyError, InvalidValueError: bad key, kind or values.
            TierFullError: no room in the host tier even after eviction.
        """
        key = _check_key(key)
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
        meta = dict(metadata or {})
        if _INTERNAL in meta:
            raise InvalidValueError(f"{key}: metadata key {_INTERNAL!r} is reserved")
        meta[_INTERNAL] = {
            "kind": kind,
            "base": str(_check_key(base)) if base else None,
            "target": str(_check_key(target)) if target else None,
        }
        link = _check_key(base) if kind == "delta" else _check_key(target) if kind == "ref" else None
        if link is not None and self.chains.depth(link) + 1 > self.config.max_delta_chain:
            # a reader follows at most max_delta_chain links: this object would be unreadable, so the chain
            # is cut here and the object written as a new base (a full object with the same contents)
            tensors, meta = self._rebased(key, link, tensors, meta, ref=kind == "ref")
            kind, base, target = "full", None, None
            meta[_INTERNAL] = {"kind": "full", "base": None, "target": None}
        name = object_name(key, _tag(epoch))
        if compress == "never" or (compress == "auto" and kind == "full"):
            plan = codec.plan(tensors, meta)
            res = self._reserve(key, name, plan.nbytes)
            try:
                plan.write(res.buffer)
            except BaseException:
                res.abort()
                raise
            return PendingObject(self, key, plan, res, kind, base, target, epoch, name)
        # deltas (byte-shuffled XOR) compress; dense full objects rarely do, so they skip the sampling
        blob = codec.encode(tensors, meta, compress="always" if compress == "always" else "auto")
        res = self._reserve(key, name, len(blob))
        try:
            res.buffer[:] = blob
        except BaseException:
            res.abort()
            raise
        return PendingObject(self, key, _Sealed(blob), res, kind, base, target, epoch, name)

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

    def _reserve(self, key: ShardKey, name: str, nbytes: int):
        try:
            return self.host.reserve(name, nbytes)
        except TierFullError:
            freed = self.evict_host(nbytes)
            log.info("host tier full: evicted %d bytes for %s", freed, key)
            return self.host.reserve(name, nbytes)

    def _publish(self, p: PendingObject) -> ObjectRecord:
        checksum = p.plan.seal(p.reservation.buffer)
        size = p.plan.nbytes
        if p.epoch is not None and p.epoch >= 0:
            current = self.index.epoch(p.key.model)
            if p.epoch < current:  # fenced: refused early (the fresh name is what makes a late publish harmless)
                p.reservation.abort()
                raise FencedError(f"put of {p.key}: epoch {p.epoch} is fenced (now {current})", epoch=current)
        try:
            p.reservation.commit(if_absent=True)  # a fresh name: create-once, never over another copy
        except KeyExistsError:
            raise  # not ours (a tag collision): leave it
        except TierStoreError:
            self._drop_copy(p.name)  # a torn publish may have left our own copy behind
            raise
        try:
            old = self.index.record_object(
                p.key, kind=p.kind, size=size, checksum=checksum, tiers=[self.host.tier],
                base=p.base, target=p.target, epoch=p.epoch, name=p.name,
            )
        except TierStoreError:
            self._drop_copy(p.name)  # fenced, committed or index gone: our own copy must not linger unindexed
            raise
        if old is not None:
            self._drop_copy(old)  # the copy of the record this one replaced (of an uncommitted step)
        self.chains.published(p.key, p.base if p.kind == "delta" else p.target if p.kind == "ref" else None)
        if self._replicator is not None and self.placement.to_peer(p.kind, p.key.step):
            self._replicator.enqueue(p.key, checksum, p.name)
        if self._migrator is not None and self.placement.to_durable(p.kind, p.key.step):
            self._migrator.enqueue(p.key, checksum, p.name)
        return ObjectRecord(p.key, p.kind, size, checksum, p.base, p.target, p.epoch if p.epoch is not None else 0,
                            tiers=frozenset((self.host.tier,)), name=p.name)

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
            return self._sealer.submit(self._finish_all, items)

    @staticmethod
    def _finish_all(items: list[PendingObject]) -> list[ObjectRecord]:
        done: list[ObjectRecord] = []
        try:
            for p in items:
                done.append(p.finish())
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
    ) -> ObjectRecord:
        """Store one shard; it is in the host tier when this returns, durable later (see :meth:`flush`)."""
        return self.snapshot(key, tensors, metadata, kind=kind, base=base, target=target, epoch=epoch,
                             compress=compress).finish()

    # -- reading -------------------------------------------------------------------
    def get(
        self,
        key: ShardKey | str,
        *,
        out: Mapping[str, torch.Tensor] | None = None,
        raw: bool = False,
    ) -> codec.Shard | None:
        """Read a shard from the fastest tier holding a valid copy; ``None`` if it is unknown.

        Returns:
            A :class:`~tierstore.codec.Shard` (exported as ``tierstore.Shard``): a
            read-only mapping of names to tensors (``shard["w"]``, ``"w" in
            shard``, iteration) with the stored JSON in ``shard.metadata``; or
            ``None`` when no object is stored under ``key``, as ``dict.get``
            does. ``store[key]`` raises :class:`ObjectNotFoundError` (a
            ``KeyError``) instead.

        Args:
            out: preallocated tensors to read into in place (shape and dtype must match).
            raw: return delta/ref objects as stored instead of resolving them.

        A copy is verified in the same pass that copies it into ``out`` (or
        into new tensors): 1 MiB chunks are hashed, then copied while in the
        cache. If the checksum then fails, ``out`` holds some of that bad copy;
        the next tier's copy is read into it in full, and the call returns
        only once a copy verified. If none does, :class:`NoValidCopyError` is
        raised and the contents of ``out`` are unspecified: never a success
        with bad bytes.

        Raises:
            NoValidCopyError: the object is known but no tier has a copy that passes its checksum.
            RestoreMismatchError: ``out`` does not fit the stored tensors (nothing was copied).
        """
        key = _check_key(key)
        self._check_open()
        return self._get(key, out, raw, depth=0)

    def __getitem__(self, key: ShardKey | str) -> codec.Shard:
        """``store[key]``: :meth:`get`, but a missing object raises instead of returning ``None``.

        Raises:
            ObjectNotFoundError: no object is stored under ``key`` (a ``KeyError``).
            NoValidCopyError: the object is known but no tier has a valid copy.
        """
        shard = self.get(key)
        if shard is None:
            raise ObjectNotFoundError(f"no object stored under {key}", key=str(key))
        return shard

    def __contains__(self, key: object) -> bool:
        """``key in store``: :meth:`exists` (a malformed key is an error, not ``False``)."""
        return self.exists(key)  # type: ignore[arg-type]  # _check_key names what is wrong

    def get_many(
        self,
        keys: Sequence[ShardKey | str],
        *,
        outs: Sequence[Mapping[str, torch.Tensor] | None] | None = None,
        raw: bool = False,
    ) -> list[codec.Shard | None]:
        """:meth:`get` of each key (into ``outs[i]`` where given), with one index round trip for all.

        Raises:
            InvalidValueError: ``outs`` is not as long as ``keys``.
            NoValidCopyError, RestoreMismatchError: as :meth:`get`, for the first key that fails.
        """
        parsed = [_check_key(k) for k in keys]
        self._check_open()
        targets = list(outs) if outs is not None else [None] * len(parsed)
        if len(targets) != len(parsed):
            raise InvalidValueError(f"outs has {len(targets)} entries for {len(parsed)} keys")
        records = self.index.get_objects(parsed)
        return [self._get(k, o, raw, depth=0, rec=r) for k, o, r in zip(parsed, targets, records)]

    def _read_blob(self, key: ShardKey, rec: ObjectRecord | None, consume):
        """``consume(copy)`` of the first valid copy of ``key``, as (result, tier); ``None`` if no tier has any.

        Per tier, fastest first: the copy's trailer is compared with the
        index's checksum (header and trailer only), then ``consume`` reads it,
        verifying the checksum over the whole copy as it goes (it raises
        :class:`CorruptObjectError` for a bad copy, possibly after writing part
        of it into the caller's ``out`` tensors: the next tier's copy then
        overwrites them). A miss, an unreachable tier or a bad copy falls back
        to the next tier.
        """
        failures: list[str] = []
        name = rec.name if rec is not None else str(key)
        for tier in self.tiers:
            try:
                blob = tier.get(name)
            except TierStoreError as e:
                failures.append(f"{tier.tier}: {e}")
                continue
            if blob is None:
                continue
            try:
                if rec is not None and rec.checksum:
                    stored = codec.checksum(blob)
                    if stored != rec.checksum:
                        raise CorruptObjectError(f"checksum {stored} differs from the index's {rec.checksum}")
                return consume(blob), tier.tier
            except CorruptObjectError as e:
                log.warning("%s: bad copy in the %s tier (%s); trying the next tier", key, tier.tier, e)
                failures.append(f"{tier.tier}: {e}")
                continue
            finally:
                del blob  # a host-tier view pins its segment until released
        if failures or rec is not None:
            raise NoValidCopyError(
                f"no valid copy of {key} in any tier ({'; '.join(failures) or 'no tier holds it'})",
                key=str(key),
                failures=failures,
            )
        return None

    def _get(self, key: ShardKey, out, raw: bool, depth: int, rec: Any = _UNREAD) -> codec.Shard | None:
        if depth > self.config.max_delta_chain:
            raise CorruptObjectError(f"{key}: delta/ref chain longer than {self.config.max_delta_chain}", key=str(key))
        if rec is _UNREAD:
            rec = self.index.get_object(key)

        def consume(blob):
            obj = codec.open_object(blob)  # header and table, bounded; verified by decode below
            internal = obj.metadata.get(_INTERNAL) or {}
            kind = internal.get("kind", "full")
            if raw or kind == "full":  # verified in the same pass as the copy into out / new tensors
                return kind, internal, obj.decode(out=out if not raw or kind == "full" else None)
            return kind, internal, obj.decode()  # a delta or ref: verified before its fields are used

        found = self._read_blob(key, rec, consume)
        if found is None:
            return None
        (kind, internal, stored), _tier = found
        shard: codec.Shard | None
        if raw or kind == "full":
            shard = stored
        elif kind == "ref":
            shard = self._get(ShardKey.parse(internal["target"]), out, False, depth + 1)
            if shard is None:
                raise NoValidCopyError(f"{key} refers to {internal['target']}, which is gone", key=str(key))
        elif kind == "delta":
            shard = self._apply_delta(key, stored, ShardKey.parse(internal["base"]), out, depth)
        else:
            raise CorruptObjectError(f"{key}: unknown object kind {kind!r}", key=str(key))
        shard.metadata.pop(_INTERNAL, None)
        return shard

    def _apply_delta(self, key: ShardKey, stored: codec.Shard, base_key: ShardKey, out, depth: int) -> codec.Shard:
        from tierstore.delta import apply_xor_delta  # lazy: delta imports torch; the admin commands run without it

        base = self._get(base_key, None, False, depth + 1)
        if base is None:
            raise NoValidCopyError(f"{key} is a delta on {base_key}, which is gone", key=str(key))
        layout = stored.metadata.get("_delta") or {}
        result: dict[str, torch.Tensor] = {}
        for name, delta in stored.tensors.items():
            if name not in base.tensors:
                raise CorruptObjectError(f"{key}: delta tensor {name!r} has no base in {base_key}", key=str(key))
            target = out.get(name) if out else None
            spec = layout.get(name)
            b = base.tensors[name]
            if spec and (list(b.shape) != list(spec["shape"]) or str(b.dtype).removeprefix("torch.") != spec["dtype"]):
                raise CorruptObjectError(f"{key}: base {base_key} of {name!r} has another shape or dtype")
            if target is not None and (target.shape != b.shape or target.dtype != b.dtype):
                raise RestoreMismatchError(
                    f"{key}: tensor {name!r} is {tuple(b.shape)} {b.dtype}, target is {tuple(target.shape)} {target.dtype}",
                    key=str(key), tensor=name,
                )
            result[name] = apply_xor_delta(b, delta, out=target)
        for name, t in base.tensors.items():
            if name not in result:
                result[name] = t if out is None or name not in out else out[name].copy_(t)
        meta = {k: v for k, v in stored.metadata.items() if k != "_delta"}
        return codec.Shard(result, meta)

    def info(self, key: ShardKey | str) -> ObjectRecord | None:
        """What the index records of ``key`` (kind, size, checksum, tiers), or ``None``."""
        return self.index.get_object(_check_key(key))

    def exists(self, key: ShardKey | str) -> bool:
        key = _check_key(key)
        rec = self.index.get_object(key)
        if rec is not None:
            return True
        return any(self._safe_exists(t, key) for t in self.tiers)

    @staticmethod
    def _safe_exists(tier: Backend, key: ShardKey) -> bool:
        try:
            return tier.exists(str(key))
        except TierUnavailableError:
            return False

    def delete(self, key: ShardKey | str) -> bool:
        """Delete an object from every tier and the index; return whether it existed anywhere."""
        key = _check_key(key)
        self._check_open()
        rec = self.index.get_object(key)
        existed = rec is not None
        names = [rec.name] if rec is not None else [str(key)]  # no record: a copy under the plain key
        for tier in self.tiers:
            for name in names:
                existed = tier.delete(name) or existed
        self.index.delete_object(key)
        return existed

    def _collect(self, key: ShardKey, name: str) -> bool:
        """Delete the record of ``key`` if it still names the copy ``name``, then that copy (garbage collection).

        A record replaced meanwhile (a new write of the key) is left alone, and so is its copy.
        """
        if not self.index.delete_object(key, name=name):
            return False
        self._drop_copy(name)
        return True

    def list(self, model: str, layer: str | None = None, step: int | None = None) -> list[ShardKey]:
        """Keys of ``model`` recorded in the index, optionally of one layer and/or step."""
        validate_name(model, "model")
        if layer is not None:
            validate_name(layer, "layer")
        if step is not None:
            validate_step(step)
        return self.index.list_objects(model, layer, step)

    def models(self) -> builtins.list[str]:
        return self.index.models()

    # -- steps (two-phase commit), delegated -------------------------------------
    def open_epoch(self, model: str) -> int:
        """Start a new incarnation of ``model``'s job; writes of older epochs are fenced.

        The epoch is recorded in the durable tier too, so it never goes backwards.

        Raises:
            IndexLostError: the index lost ``model`` (its durable tier holds steps the index does not know).
        """
        return self.steps.open_epoch(model)

    def begin_step(self, model: str, step: int, world_size: int, *, layout: dict | None = None,
                   epoch: int | None = None) -> None:
        """Begin (prepare) ``step``: call on every rank before writing its objects.

        Raises:
            StepCommittedError: ``step`` is already committed (nothing was written).
            IndexLostError: the index lost ``model`` (nothing was written).
            FencedError: ``epoch`` is stale.
        """
        self.steps.begin(model, step, world_size, layout=layout, epoch=epoch)

    def vote(self, model: str, step: int, rank: int, objects: builtins.list[ObjectRecord], *, extra: dict | None = None,
             ok: bool = True, epoch: int | None = None) -> str:
        """Vote for ``step`` with this rank's objects; the last vote of the world commits it."""
        state = self.steps.vote(model, step, rank, objects, extra=extra, ok=ok, epoch=epoch)
        if (ok and self._migrator is not None and self.steps.durable is not None
                and all(self.placement.to_durable(o.kind, o.key.step) for o in objects)):
            self._migrator.when_done([(o.key, o.name) for o in objects],
                                     lambda failures: self.steps.mark_migrated(model, step, rank, failures, epoch=epoch))
        return state

    def wait_step(self, model: str, step: int, timeout: float | None = None) -> str:
        return self.steps.wait(model, step, timeout=timeout)

    def resolve(self, model: str, max_staleness: int = 0, *, step: int | None = None) -> Resolution:
        """The freshest consistent layer set of ``model`` that verifies; see :mod:`tierstore.readpath`.

        Args:
            step: resolve this committed step (no fallback to another).
        """
        return resolve(self.steps, self.tiers, model, max_staleness=max_staleness,
                       max_chain=self.config.max_delta_chain, step=step, verify=self.config.restore_verify)

    def rebuild_index(self, model: str | None = None) -> RebuildReport:
        """Rebuild a lost index from the durable manifests; see :mod:`consistency.rebuild`."""
        return rebuild_index(self.steps, model, host=self.host)

    def gc(self, model: str, retention: Retention | None = None, *, dry_run: bool = True,
           max_staleness: int = 0) -> GCReport:
        """Collect what ``retention`` does not keep of ``model``; see :mod:`consistency.gc`.

        Objects still queued for migration are left for a later pass (reported as deferred).
        """
        durable_tier = self.durable.tier if self._migrator is not None and self.durable is not None else None

        def still_migrating(rec: ObjectRecord) -> bool:
            return durable_tier not in rec.tiers

        return collect(self.steps, model, retention or Retention(), delete=self._collect, dry_run=dry_run,
                       max_staleness=max_staleness,
                       still_migrating=still_migrating if durable_tier is not None else None)

    # -- host-tier eviction ----------------------------------------------------------
    def evict_host(self, nbytes: int) -> int:
        """Free at least ``nbytes`` in the host tier by dropping host copies that are durable.

        Never drops the only copy of anything (the durable copy must verify
        first), nor a copy of a model's newest committed step. Raises
        :class:`TierFullError` when not enough can be freed.
        """
        return evict_host(self.host, self.durable, self.index, self.steps, nbytes)

    # -- lifecycle -----------------------------------------------------------------
    def rewire(
        self,
        *,
        tier: Callable[[Backend], Backend] | None = None,
        index: Callable[[Index], Index] | None = None,
        before_migrate: Callable[[ShardKey], None] | None = None,
    ) -> None:
        """Wrap this store's tiers and index (fault injection, tracing), before it is used from other threads.

        Args:
            tier: returns the backend to use in place of each tier.
            index: returns the index to use in place of the current one.
            before_migrate: called before each object migrates to the durable tier.
        """
        if tier is not None:
            self.host = tier(self.host)  # type: ignore[assignment]
            self.peer = tier(self.peer) if self.peer is not None else None
            self.durable = tier(self.durable) if self.durable is not None else None
            self.tiers = [t for t in (self.host, self.peer, self.durable) if t is not None]
        if index is not None:
            self.index = index(self.index)
            self.chains.index = self.index
        self.steps = StepProtocol(self.index, self.durable, step_timeout_s=self.steps.step_timeout_s,
                                  on_lost=self.steps.on_lost)
        for mover, target in ((self._migrator, self.durable), (self._replicator, self.peer)):
            if mover is not None and target is not None:
                mover.source, mover.target, mover.index = self.host, target, self.index
        if before_migrate is not None and self._migrator is not None:
            self._migrator.before_each = before_migrate

    def flush(self) -> None:
        """Wait for background migration; raise the first error it met."""
        for mover in (self._replicator, self._migrator):
            if mover is not None:
                mover.flush()

    def _check_open(self) -> None:
        if self._closed:
            raise TierUnavailableError("this TierStore is closed")

    def close(self) -> None:
        """Flush, then release everything this store owns. Idempotent."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            if self._sealer is not None:
                self._sealer.shutdown(wait=True)
            for mover in (self._replicator, self._migrator):
                if mover is not None:
                    mover.close()
            for t in self.tiers:
                t.close()
            self.index.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<TierStore tiers={[t.tier for t in self.tiers]} node={self.config.node_id!r}>"

