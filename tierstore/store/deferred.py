"""Reads whose checksum pass runs after the copy, beside the caller: restore at the copy's speed.

:meth:`ReadPath.get <tierstore.store.reading.ReadPath.get>` verifies a copy in
the same pass that copies it (1 MiB chunks hashed, then copied while in the
cache): safe, but the hash is on the restore's critical path (1.3x a plain
copy here). :func:`get_many_deferred` copies first, at the copy's speed, and
hands the checksums to a :class:`Verification` that hashes the very copies
read, on a thread of its own, while the caller goes on (a trainer's first
forward/backward after a restore). The caller must not let those bytes reach
anything permanent before :meth:`Verification.wait` says every copy verified
(the Checkpointer holds the first optimizer update back until then:
:mod:`tierstore.train.restoring`).

Protocol:

1. ``shards, v = get_many_deferred(store, keys, outs=..., copy=...)``: per
   key, the index's record, then the fastest tier that serves zero-copy reads
   (the host tier) whose copy's trailer matches the index: its tensors are
   copied into ``outs[i]`` (or, with ``copy=False``, alias the copy, read-only
   by contract) without hashing; the copy is added to ``v``, which starts
   hashing it at once. A key whose copy is elsewhere, a delta or a ref, or
   one held by the device tier, is read by the verified path as before (its
   checksum is checked before this returns); a device tier's copy is read
   from device memory, as ``get`` does.
2. ``v.wait()`` returns the failures (``[]``: every copy matched its
   checksum); each names the key, the tier and why. A copy stays referenced
   (its host-tier segment cannot be recycled) until it is hashed.
3. On a failure the caller drops the bad copies (:meth:`Verification.drop_bad_copies`:
   a checksum mismatch is proof) and reads the key again through the verified
   path (``store.get(key, out=...)``: the next tier's copy), or restores again;
   the bytes already copied are not to be used.

Memory: no more than the verified path (the copies read are the host tier's
own segments, mapped, not copied; with ``copy=False`` nothing is allocated).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from consistency.index import ObjectRecord
from tierstore import codec, gchold
from tierstore.background import lower_priority
from tierstore.errors import CorruptObjectError, InvalidValueError, TierStoreError
from tierstore.keys import ShardKey
from tierstore.store.common import INTERNAL, check_key

if TYPE_CHECKING:
    import torch

__all__ = ["DeferredReads", "Failure", "Verification", "cores_per_local_rank", "get_many_deferred", "hash_threads"]

log = logging.getLogger(__name__)


def cores_per_local_rank(world_size: int = 1) -> int:
    """The CPUs this process may run on over the ranks of this node (``LOCAL_WORLD_SIZE``, else
    ``world_size``), at least 1: the one count :func:`hash_threads` and the Checkpointer's "a core is free"
    (:func:`tierstore.train.restoring.core_free`) read."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or world_size))
    except ValueError:
        local = max(1, world_size)
    return max(1, cpus // local)


def hash_threads() -> int:
    """How many threads a :class:`Verification` hashes with once the copies are done: the cores per local
    rank (:func:`cores_per_local_rank`), 1 to 4."""
    return min(4, cores_per_local_rank())


@dataclass(frozen=True)
class Failure:
    """A copy that did not verify: ``key``, the ``tier`` it was read from, its physical ``name``, and why."""

    key: ShardKey
    tier: str
    name: str
    reason: str


class Verification:
    """The checksums of copies already read, hashed on a thread of its own, in the order added.

    :meth:`add` a copy (the reader's thread), :meth:`close` once every copy of the read is added;
    :meth:`wait` blocks until all are hashed and returns the :class:`Failure` list.

    Args:
        eager: start hashing at the first :meth:`add`, beside the copies that follow (fastest to a verdict
            where a core is idle); ``False`` (default): at :meth:`close`, once the copies are done, so
            they run at full speed and the hashing overlaps what the caller does next (a trainer's first
            forward/backward) instead.
        nice: the hashing thread runs this much nicer than the caller (``StoreConfig.background_nice``:
            on a node whose cores are all busy, the copies and the trainer come first; a caller waiting
            for the verdict leaves its core to it).
        threads: at most this many threads hash at once once the copies are done (:meth:`close`), each a
            whole copy at a time (xxh3 releases the GIL); one while copies may still follow (``eager``).
            Default :func:`hash_threads`: the cores per local rank.
    """

    def __init__(self, *, eager: bool = False, nice: int = 0, threads: int | None = None) -> None:
        self.eager = eager
        self.nice = nice
        self.threads = max(1, int(threads if threads is not None else hash_threads()))
        self._todo: deque[tuple[ShardKey, str, str, str, Any]] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._done = threading.Event()
        self.failures: list[Failure] = []
        self.verified = 0
        self.bytes = 0
        self._thread: threading.Thread | None = None  # the first hashing thread
        self._running = 0  # hashing threads not yet finished (under _cond)
        self.t_done: float | None = None  # perf_counter when the last copy was hashed

    def add(self, key: ShardKey, tier: str, name: str, checksum: str, blob: Any) -> None:
        """Hash ``blob`` (the copy ``name`` of ``key`` in ``tier``, kept referenced until then) against ``checksum``."""
        with self._cond:
            if self._closed:
                raise RuntimeError("verification already closed")
            self._todo.append((key, tier, name, checksum, blob))
            self._cond.notify()
            if self._thread is None and self.eager:
                self._start()

    def _start(self) -> None:
        """Start one more hashing thread (called with ``_cond`` held)."""
        t = threading.Thread(target=self._run, name="tierstore-verify", daemon=True)
        self._running += 1
        if self._thread is None:
            self._thread = t
        t.start()

    def close(self) -> None:
        """No more copies: :meth:`wait` returns once those added are hashed (by up to ``threads`` threads)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            if self._running == 0 and self._thread is None and not self._done.is_set() and not self._todo:
                self.t_done = time.perf_counter()
                self._done.set()
                return
            while self._running < min(self.threads, self._running + len(self._todo)):
                self._start()

    def _run(self) -> None:
        if self.nice:
            lower_priority(self.nice)
        while True:
            with self._cond:
                while not self._todo and not self._closed:
                    self._cond.wait()
                if not self._todo:
                    break
                key, tier, name, checksum, blob = self._todo.popleft()
            failure: Failure | None = None
            try:
                got = codec.verify(blob)
                if got != checksum:
                    failure = Failure(key, tier, name, f"checksum {got} is not the index's {checksum}")
            except CorruptObjectError as e:
                failure = Failure(key, tier, name, f"corrupt: {e}")
            except Exception as e:  # noqa: BLE001 - never "verified" on an error
                failure = Failure(key, tier, name, f"could not be verified: {e!r}")
            size = len(memoryview(blob))
            del blob
            with self._cond:
                if failure is not None:
                    self.failures.append(failure)
                else:
                    self.verified += 1
                self.bytes += size
        with self._cond:
            self._running -= 1
            last = self._running == 0
        if last:
            self.t_done = time.perf_counter()
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> list[Failure]:
        """Block until every copy added is hashed; return the failures (``[]``: all verified).

        Raises:
            TimeoutError: not done within ``timeout`` seconds.
        """
        self.close()
        if not self._done.wait(timeout):
            raise TimeoutError("the restore's copies are still being verified")
        return list(self.failures)

    def drop_bad_copies(self, store: Any) -> int:
        """Delete, from its tier only, each copy that failed its checksum; return how many.

        Positive evidence: the copy's bytes do not hash to the checksum the index records for it (a
        physical name belongs to one write and is never rewritten, and a host-tier segment is not
        recycled while it is read). The object stays readable from the tiers whose copy is good, and the
        next read (or restore, after a restart) goes there instead of failing on the same copy again.
        Copies that could not be hashed (an error, not a mismatch) are left alone.
        """
        dropped = 0
        for f in self.failures:
            if not f.reason.startswith(("checksum", "corrupt")):
                continue
            for tier in store.tiers:
                if tier.tier == f.tier:
                    try:
                        if tier.delete(f.name):
                            dropped += 1
                            log.warning("%s: dropped its bad copy %s from the %s tier (%s)", f.key, f.name, f.tier,
                                        f.reason)
                    except TierStoreError as e:
                        log.warning("%s: could not drop its bad copy from the %s tier: %s", f.key, f.tier, e)
        return dropped


def _opened(store: Any, rec: ObjectRecord | None) -> tuple[str, Any, codec.EncodedObject] | None:
    """``(tier, blob, object)``: the copy ``rec`` names in the first zero-copy tier whose trailer matches the
    index, opened (header and table parsed, bounded; not hashed); ``None``: for the verified path."""
    if rec is None or rec.kind != "full" or not rec.checksum:
        return None
    for tier in store.tiers:
        if not tier.zero_copy_get:
            return None  # the rest is read (and hashed) whole anyway: the verified path
        try:
            blob = tier.get(rec.name)
        except TierStoreError:
            continue
        if blob is None:
            continue
        try:
            if codec.checksum(blob) != rec.checksum:
                continue  # a stale or bad copy: the verified path reads the next tier's
            obj = codec.open_object(blob)
        except CorruptObjectError:
            continue
        internal = obj.metadata.get(INTERNAL) or {}
        if internal.get("kind", "full") != "full" or obj.flags:
            return None
        return tier.tier, blob, obj
    return None


def _kept_views(store: Any, tier: str, blob: Any, obj: codec.EncodedObject) -> Any:
    """The host tier's kept views of ``blob``'s tensors (its segment's, made when it was written or last
    read in this process), made and kept now if it has none; ``None`` for other tiers or unkept memory."""
    views_of = getattr(store.host, "views_of", None) if tier == "host" else None
    if views_of is None:
        return None
    geometry = obj.geometry
    return views_of(blob, geometry, lambda buf: codec.geometry_views(buf, geometry))


def _read_one(store: Any, key: ShardKey, rec: ObjectRecord | None, out: Mapping[str, torch.Tensor] | None,
              copy: bool, v: Verification) -> codec.Shard | None:
    if rec is not None and rec.kind == "full" and store.device_tier is not None:
        held = store.device_tier.read(key, rec, out)  # a rollback from device memory (not re-hashed)
        if held is not None:
            held.metadata.pop(INTERNAL, None)
            return held
    opened = _opened(store, rec)
    if opened is not None and rec is not None:
        tier, blob, obj = opened
        try:
            shard = obj.decode(out=out, copy=copy, verify=False, sources=_kept_views(store, tier, blob, obj))
        except CorruptObjectError:
            shard = None
        if shard is not None:
            v.add(key, tier, rec.name, rec.checksum, blob)
            shard.metadata.pop(INTERNAL, None)
            return shard
    return store._get(key, out, False, 0, rec)  # verified as it is copied, falling back tier by tier


class DeferredReads:
    """One read of many keys with the checksum pass after the copy: :meth:`get` per key, one :attr:`verification`.

    Args:
        store: the :class:`~tierstore.store.TierStore`.
        copy: as :func:`get_many_deferred`'s.
    """

    def __init__(self, store: Any, *, copy: bool = False, eager: bool = False) -> None:
        store._check_open()
        self.store = store
        self.copy = copy
        self.verification = Verification(eager=eager, nice=store.config.background_nice)

    def get(self, key: ShardKey | str, *, out: Mapping[str, torch.Tensor] | None = None,
            rec: Any = None) -> codec.Shard | None:
        """``store.get(key, out=out)`` with the checksum pass after the copy (``None``: no such object)."""
        key = check_key(key)
        if rec is None:
            rec = self.store.index.get_object(key)
        return _read_one(self.store, key, rec, out, self.copy, self.verification)

    def close(self) -> Verification:
        """Every key is read: the verification finishes with what it was given."""
        self.verification.close()
        return self.verification


def get_many_deferred(
    store: Any,
    keys: Sequence[ShardKey | str],
    *,
    outs: Sequence[Mapping[str, torch.Tensor] | None] | None = None,
    copy: bool = True,
    eager: bool = False,
) -> tuple[list[codec.Shard | None], Verification]:
    """:meth:`~tierstore.store.reading.ReadPath.get_many`, with the checksum pass after the copy; see the module.

    Args:
        outs: tensors to read into in place, per key (shapes and dtypes checked first, as ``get``).
        copy: ``False``: tensors not in ``outs`` alias the tier's copy (valid while it is referenced;
            never to be written), no copy at all.
        eager: hash beside the copies rather than after them (:class:`Verification`).

    Raises:
        NoValidCopyError, RestoreMismatchError: as ``get_many`` (for keys read by the verified path, or
            an ``out`` that does not fit).
    """
    parsed = [check_key(k) for k in keys]
    store._check_open()
    targets = list(outs) if outs is not None else [None] * len(parsed)
    if len(targets) != len(parsed):
        raise InvalidValueError(f"outs has {len(targets)} entries for {len(parsed)} keys")
    records = store.index.get_objects(parsed)
    v = Verification(eager=eager, nice=store.config.background_nice)
    # each object opened just before its copies, on this thread: opening them ahead on another thread (as
    # this did) made each copy wait for the GIL behind it (measured 1.2-1.5x slower, 200 or 4,000 tensors)
    try:
        with gchold.held(store.config.hold_gc):  # thousands of small objects: no collections midway
            shards = [_read_one(store, k, r, o, copy, v) for k, r, o in zip(parsed, records, targets)]
    finally:
        v.close()
    return shards, v
