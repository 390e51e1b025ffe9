"""The store's read path: the index's record, then the fastest tier holding a valid copy.

Protocol: :meth:`ReadPath.get` (and :meth:`ReadPath.get_many`, one index round
trip for many keys; :meth:`ReadPath.get_copy` reads the copy a manifest entry
names instead) asks the index for the live copy's physical name and
checksum, then reads the tiers fastest first (:meth:`ReadPath._read_blob`):
the copy's trailer is compared with the index, the copy is verified in the
same pass that decodes it, and a miss, an unreachable tier or a bad copy falls
back to the next tier. Refs and delta chains are resolved into full tensors
(at most ``max_delta_chain`` links). With a device tier, a full object whose
device copy is the one the index records is read from it first
(:mod:`tierstore.store.device_tier`).

:class:`ReadPath` is a mixin of :class:`tierstore.store.TierStore` (the facade
that owns the tiers and index it uses).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from backends.base import Backend
from consistency.index import Index, ObjectRecord
from tierstore import codec, gchold
from tierstore.config import StoreConfig
from tierstore.errors import (
    CorruptObjectError,
    InvalidValueError,
    NoValidCopyError,
    ObjectNotFoundError,
    RestoreMismatchError,
    TierStoreError,
    TierUnavailableError,
)
from tierstore.keys import ShardKey
from tierstore.store.common import INTERNAL, UNREAD, check_key
from tierstore.store.device_tier import DeviceTier

if TYPE_CHECKING:
    import torch

__all__ = ["ReadPath"]

log = logging.getLogger(__name__)


class ReadPath:
    """The read half of :class:`~tierstore.store.TierStore` (a mixin; the store owns the state it uses)."""

    config: StoreConfig
    index: Index
    tiers: list[Backend]
    device_tier: DeviceTier | None

    if TYPE_CHECKING:  # provided by TierStore
        def _check_open(self) -> None: ...

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
        key = check_key(key)
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
        parsed = [check_key(k) for k in keys]
        self._check_open()
        targets = list(outs) if outs is not None else [None] * len(parsed)
        if len(targets) != len(parsed):
            raise InvalidValueError(f"outs has {len(targets)} entries for {len(parsed)} keys")
        records = self.index.get_objects(parsed)
        with gchold.held(self.config.hold_gc):  # thousands of small objects: no collections midway
            return [self._get(k, o, raw, depth=0, rec=r) for k, o, r in zip(parsed, targets, records)]

    def get_copy(self, record: ObjectRecord, *, out: Mapping[str, torch.Tensor] | None = None) -> codec.Shard:
        """Read the copy ``record`` names (its physical name and checksum), whatever the index records now.

        For a reader that holds a committed manifest's entry (a DCP load):
        it reads what the step committed, from the fastest tier holding that
        copy, verified against the entry's checksum. Deltas and refs are
        resolved as :meth:`get` does (their bases through the index).

        Raises:
            NoValidCopyError: no tier holds that copy with that checksum.
            RestoreMismatchError: ``out`` does not fit the stored tensors.
        """
        if not isinstance(record, ObjectRecord):
            raise InvalidValueError(f"get_copy takes an ObjectRecord, not a {type(record).__name__}")
        self._check_open()
        shard = self._get(record.key, out, False, depth=0, rec=record)
        if shard is None:  # not reached: a known record either reads or raises
            raise NoValidCopyError(f"no tier holds {record.name}", key=str(record.key))
        return shard

    def _read_blob(self, key: ShardKey, rec: ObjectRecord | None, consume):
        """``consume(copy)`` of the first valid copy of ``key``, as (result, tier); ``None`` if no tier has any.

        Per tier, fastest first: the copy's trailer is compared with the
        index's checksum (header and trailer only), then ``consume`` reads it,
        verifying the checksum over the whole copy as it goes (it raises
        :class:`CorruptObjectError` for a bad copy, possibly after writing part
        of it into the caller's ``out`` tensors: the next tier's copy then
        overwrites them). A miss, an unreachable tier or a bad copy falls back
        to the next tier; tiers that did not answer (:class:`TierUnavailableError`)
        are asked again with the migration's backoff before the read gives up. The
        :class:`NoValidCopyError` then says ``evidence="lost"`` only when every tier
        answered a miss or a bad copy (``"unknown"``, naming ``unreachable``, otherwise).
        """
        name = rec.name if rec is not None else str(key)
        answers: dict[str, str] = {}
        todo = list(self.tiers)
        retry = self.config.retry
        delays = retry.delays()
        while True:
            unanswered = []
            for tier in todo:
                try:
                    blob = tier.get(name)
                except TierUnavailableError as e:  # asked again below: a blip is not a lost copy
                    answers[tier.tier] = f"unreachable: {e}"
                    unanswered.append(tier)
                    continue
                except TierStoreError as e:
                    answers[tier.tier] = f"unreadable: {e}"
                    continue
                if blob is None:
                    answers.pop(tier.tier, None)
                    continue
                try:
                    if rec is not None and rec.checksum:
                        stored = codec.checksum(blob)
                        if stored != rec.checksum:
                            raise CorruptObjectError(f"checksum {stored} differs from the index's {rec.checksum}")
                    return consume(blob), tier.tier
                except CorruptObjectError as e:
                    log.warning("%s: bad copy in the %s tier (%s); trying the next tier", key, tier.tier, e)
                    answers[tier.tier] = str(e)
                    continue
                finally:
                    del blob  # a host-tier view pins its segment until released
            delay = next(delays, None) if unanswered else None
            if delay is None:
                break
            log.info("%s: %s did not answer; asking again in %.2f s", key, ", ".join(t.tier for t in unanswered), delay)
            retry.sleep(delay)
            todo = unanswered
        failures = [f"{t}: {why}" for t, why in answers.items()]
        if failures or rec is not None:
            unknown = sorted(t for t, why in answers.items() if why.startswith(("unreachable", "unreadable")))
            raise NoValidCopyError(
                f"no valid copy of {key} in any tier ({'; '.join(failures) or 'no tier holds it'})"
                + (f"; {', '.join(unknown)} did not answer: the copy there may be intact" if unknown else ""),
                key=str(key),
                failures=failures,
                evidence="unknown" if unknown else "lost",
                unreachable=unknown,
            )
        return None

    def get_aliased(self, key: ShardKey | str, *, rec: Any = UNREAD) -> codec.Shard | None:
        """:meth:`get`, verified whole before it returns, with the tensors of a full object aliasing the copy read.

        For a reader that copies the tensors somewhere at once and drops them (a restore's load): no new
        tensor is allocated for a full object (fresh memory costs a page fault per 4 KiB, more than the copy
        itself), and the copy is hashed once, whole, before any tensor is made. The tensors are read-only by
        contract and valid while referenced (a host-tier copy's segment is not recycled while a view of it
        lives); deltas and refs resolve into new tensors as :meth:`get`'s do. Internal: never hand these
        tensors to a user. ``rec``: the index's record of ``key`` where the caller has read it already.

        Raises:
            NoValidCopyError: as :meth:`get`.
        """
        key = check_key(key)
        self._check_open()
        return self._get(key, None, False, depth=0, rec=rec, copy=False)

    def _get(self, key: ShardKey, out, raw: bool, depth: int, rec: Any = UNREAD, *,
             copy: bool = True) -> codec.Shard | None:
        if depth > self.config.max_delta_chain:
            raise CorruptObjectError(f"{key}: delta/ref chain longer than {self.config.max_delta_chain}", key=str(key))
        if rec is UNREAD:
            rec = self.index.get_object(key)
        if self.device_tier is not None and rec is not None and rec.kind == "full":
            held = self.device_tier.read(key, rec, out)  # a rollback of the newest copy: device memory first
            if held is not None:
                held.metadata.pop(INTERNAL, None)
                return held

        def consume(blob):
            obj = codec.open_object(blob)  # header and table, bounded; verified by decode below
            internal = obj.metadata.get(INTERNAL) or {}
            kind = internal.get("kind", "full")
            if raw or kind == "full":  # verified in the same pass as the copy into out / new tensors
                if not copy and out is None and kind == "full":  # verified whole, then aliased
                    return kind, internal, obj.decode(copy=False)
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
            shard = self._get(ShardKey.parse(internal["target"]), out, False, depth + 1, copy=copy)
            if shard is None:
                raise NoValidCopyError(f"{key} refers to {internal['target']}, which is gone", key=str(key),
                                       evidence="lost")
        elif kind == "delta":
            shard = self._apply_delta(key, stored, ShardKey.parse(internal["base"]), out, depth)
        else:
            raise CorruptObjectError(f"{key}: unknown object kind {kind!r}", key=str(key))
        shard.metadata.pop(INTERNAL, None)
        return shard

    def _apply_delta(self, key: ShardKey, stored: codec.Shard, base_key: ShardKey, out, depth: int) -> codec.Shard:
        from tierstore.delta import apply_xor_delta  # lazy: delta imports torch; the admin commands run without it

        base = self._get(base_key, None, False, depth + 1)
        if base is None:
            raise NoValidCopyError(f"{key} is a delta on {base_key}, which is gone", key=str(key), evidence="lost")
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
        return self.index.get_object(check_key(key))

    def exists(self, key: ShardKey | str) -> bool:
        key = check_key(key)
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
