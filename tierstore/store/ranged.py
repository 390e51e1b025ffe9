"""The store's ranged reads: parts of an object's tensors from the fastest tier with a valid copy, verified.

Protocol::

    shard = store.open_ranged(key)        # None: no object under key
    shard.metadata, shard.tensors         # name -> (dtype, shape), as ``store.get(key)`` would give
    t = shard.read_box("param/w", offsets=(8, 0), sizes=(8, 32))   # a sub-box, verified
    shard.bytes_read                      # bytes fetched from the tiers for it (and its chain)

``open_ranged`` asks the index for the copy's physical name, size and
checksum, then opens it in the fastest tier that holds a copy whose trailer
matches the index (:class:`tierstore.codec.RangedObject`: header, table and
chunk table, a few KiB). A read fetches only the chunks that hold the box;
each chunk is checked against its digest before its bytes are used. A miss,
an unreachable tier or a bad chunk (checksum mismatch) falls back to the
next tier's copy for that read and the ones after it, logged; if no tier is
left, :class:`~tierstore.errors.NoValidCopyError` names the object and what
each tier said. Nothing unverified is ever returned, and ``out`` is written
only with verified bytes.

Refs are followed to their target (whose metadata the shard then has, as
:meth:`~tierstore.store.reading.ReadPath.get` does); a delta reads the box
from its base (recursively) and the matching bytes of the delta
(:func:`tierstore.delta.shuffled_starts`), at most ``max_delta_chain`` links.
Backends without ``ranged_get`` are read whole once per open copy.

:class:`RangedReadPath` is a mixin of :class:`tierstore.store.TierStore`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from backends.base import Backend
from consistency.index import Index, ObjectRecord
from tierstore import codec
from tierstore.config import StoreConfig
from tierstore.errors import (
    CorruptObjectError,
    InvalidKeyError,
    InvalidValueError,
    NoValidCopyError,
    TierStoreError,
)
from tierstore.keys import ShardKey
from tierstore.store.common import INTERNAL, UNREAD, check_key

if TYPE_CHECKING:
    import torch
else:  # torch is imported on first use (see tierstore.lazytorch)
    from tierstore.lazytorch import torch

__all__ = ["RangedReadPath", "RangedShard"]

log = logging.getLogger(__name__)


class _Miss(Exception):
    """The tier holds no copy (at open: try the next tier without calling it a failure)."""


def _fetcher(tier: Backend, name: str) -> Callable[[int, int], Any]:
    if tier.ranged_get:
        def fetch(offset: int, length: int) -> Any:
            got = tier.get_range(name, offset, length)
            if got is None:
                raise _Miss(name)
            return got
        return fetch
    whole: list[Any] = []

    def fetch_whole(offset: int, length: int) -> Any:
        if not whole:
            got = tier.get(name)
            if got is None:
                raise _Miss(name)
            whole.append(got)
        return whole[0][offset : offset + length]
    return fetch_whole


class _Copy:
    """One stored object opened in the fastest tier with a valid copy; a failed read moves to the next tier."""

    def __init__(self, tiers: Sequence[Backend], key: ShardKey, rec: ObjectRecord) -> None:
        self.key, self.rec = key, rec
        self._left = list(tiers)
        self.failures: list[str] = []
        self._spent = 0
        self.tier = ""
        self.obj = self._open()

    @property
    def bytes_read(self) -> int:
        return self._spent + self.obj.bytes_read

    def _open(self) -> codec.RangedObject:
        while self._left:
            tier = self._left.pop(0)
            try:
                obj = codec.RangedObject(_fetcher(tier, self.rec.name), self.rec.size, self.rec.checksum or None)
            except _Miss:
                continue
            except (InvalidKeyError, InvalidValueError):
                raise
            except TierStoreError as e:  # a bad copy (CorruptObjectError), an unreachable tier, ...
                log.warning("%s: no usable copy in the %s tier (%s); trying the next tier", self.key, tier.tier, e)
                self.failures.append(f"{tier.tier}: {e}")
                continue
            self.tier = tier.tier
            return obj
        raise NoValidCopyError(
            f"no valid copy of {self.key} in any tier ({'; '.join(self.failures) or 'no tier holds it'})",
            key=str(self.key), failures=list(self.failures))

    def run(self, read: Callable[[codec.RangedObject], Any]) -> Any:
        """``read(obj)`` on the current copy; on a bad chunk, a miss or an unreachable tier, on the next one."""
        while True:
            try:
                return read(self.obj)
            except (InvalidKeyError, InvalidValueError):
                raise
            except (TierStoreError, _Miss) as e:
                what = "gone" if isinstance(e, _Miss) else str(e)
                log.warning("%s: bad read in the %s tier (%s); trying the next tier", self.key, self.tier, what)
                self.failures.append(f"{self.tier}: {what}")
                self._spent += self.obj.bytes_read
                self.obj = self._open()


class RangedShard:
    """One object opened for ranged reads; see the module docstring.

    Attributes:
        key: the key opened (a ref's or delta's own key).
        metadata: the stored JSON metadata (the tierstore-internal entries removed).
        tensors: ``name -> (dtype name, shape)`` of the tensors it stands for.
    """

    key: ShardKey
    metadata: dict
    tensors: dict[str, tuple[str, tuple[int, ...]]]

    @property
    def bytes_read(self) -> int:
        raise NotImplementedError

    @property
    def failures(self) -> list[str]:
        """What went wrong with the copies tried and left so far (``"<key> <tier>: <why>"``), oldest first."""
        raise NotImplementedError

    def read_box(self, name: str, offsets: Sequence[int], sizes: Sequence[int],
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """The sub-box of tensor ``name`` at ``offsets`` of ``sizes``, verified: a new tensor, or copied into ``out``.

        Raises:
            NoValidCopyError: no tier holds a valid copy of a chunk it needs (``out`` is unchanged).
            InvalidValueError: no such tensor, a box outside it, or an ``out`` that does not fit.
        """
        raise NotImplementedError

    def box_writer(self, name: str, offsets: Sequence[int], sizes: Sequence[int]) -> Callable[[torch.Tensor], None]:
        """As :meth:`read_box`, verified now (every chunk of the box checked, a bad one read from the next
        tier), copied later: ``write(out)`` fills ``out`` (the box's shape and dtype) from the verified bytes.

        Raises:
            NoValidCopyError: no tier holds a valid copy of a chunk it needs (raised here, not by ``write``).
            InvalidValueError: no such tensor, or a box outside it.
        """
        got = self.read_box(name, offsets, sizes)

        def write(out: torch.Tensor) -> None:
            with torch.no_grad():
                out.copy_(got)
        return write


class _Full(RangedShard):
    def __init__(self, key: ShardKey, copy: _Copy) -> None:
        self.key, self._copy = key, copy
        self.metadata = {k: v for k, v in copy.obj.metadata.items() if k != INTERNAL}
        self.tensors = {e.name: (e.dtype, e.shape) for e in copy.obj.tensors}

    @property
    def bytes_read(self) -> int:
        return self._copy.bytes_read

    @property
    def failures(self) -> list[str]:
        return [f"{self.key} {f}" for f in self._copy.failures]

    def read_box(self, name: str, offsets: Sequence[int], sizes: Sequence[int],
                 out: torch.Tensor | None = None) -> torch.Tensor:
        return self._copy.run(lambda obj: obj.read_box(name, offsets, sizes, out))

    def box_writer(self, name: str, offsets: Sequence[int], sizes: Sequence[int]) -> Callable[[torch.Tensor], None]:
        return self._copy.run(lambda obj: obj.box_writer(name, offsets, sizes))


class _Delta(RangedShard):
    def __init__(self, key: ShardKey, copy: _Copy, base: RangedShard) -> None:
        self.key, self._copy, self._base = key, copy, base
        meta = copy.obj.metadata
        layout = meta.get("_delta") or {}
        self.metadata = {k: v for k, v in meta.items() if k not in (INTERNAL, "_delta")}
        self.tensors = dict(base.tensors)
        self._deltas: dict[str, int] = {}
        for e in copy.obj.tensors:
            if e.name not in base.tensors:
                raise CorruptObjectError(f"{key}: delta tensor {e.name!r} has no base in {base.key}", key=str(key))
            dtype, shape = base.tensors[e.name]
            spec = layout.get(e.name)
            if spec and (list(shape) != list(spec.get("shape", [])) or dtype != spec.get("dtype")):
                raise CorruptObjectError(f"{key}: base {base.key} of {e.name!r} has another shape or dtype")
            numel = int(np.prod(shape, dtype=np.int64))
            if e.dtype != "uint8" or e.shape != (numel * codec.ITEMSIZE[dtype],):
                raise CorruptObjectError(f"{key}: delta tensor {e.name!r} is {e.dtype}{list(e.shape)}, not the "
                                         f"{numel * codec.ITEMSIZE[dtype]} bytes of its base", key=str(key))
            self._deltas[e.name] = numel

    @property
    def bytes_read(self) -> int:
        return self._copy.bytes_read + self._base.bytes_read

    @property
    def failures(self) -> list[str]:
        return [*self._base.failures, *(f"{self.key} {f}" for f in self._copy.failures)]

    def read_box(self, name: str, offsets: Sequence[int], sizes: Sequence[int],
                 out: torch.Tensor | None = None) -> torch.Tensor:
        from tierstore.delta import apply_xor_delta, shuffled_starts  # lazy: delta imports torch

        if name not in self._deltas:
            return self._base.read_box(name, offsets, sizes, out)
        dtype, shape = self.tensors[name]
        box = self._base.read_box(name, offsets, sizes)
        starts, length = codec.box_runs(shape, [int(o) for o in offsets], [int(s) for s in sizes])
        where = shuffled_starts(starts, self._deltas[name], codec.ITEMSIZE[dtype])
        part = self._copy.run(lambda obj: obj.read_runs(name, where, length))
        delta = torch.frombuffer(part, dtype=torch.uint8) if len(part) else torch.empty(0, dtype=torch.uint8)
        got = apply_xor_delta(box, delta, out=box)
        if out is None:
            return got
        with torch.no_grad():
            out.copy_(got)
        return out


class RangedReadPath:
    """The ranged-read part of :class:`~tierstore.store.TierStore` (a mixin; the store owns what it uses)."""

    config: StoreConfig
    index: Index
    tiers: list[Backend]

    if TYPE_CHECKING:  # provided by TierStore
        def _check_open(self) -> None: ...

    def open_ranged(self, key: ShardKey | str, *, rec: Any = UNREAD) -> RangedShard | None:
        """Open ``key`` for ranged reads (see the module docstring); ``None`` if the index knows no such object.

        ``rec``: the index's record of ``key`` where the caller has read it already (one round trip for many).

        Raises:
            NoValidCopyError: no tier holds a copy whose header, tables and trailer verify (or one a ref or
                delta reaches is gone).
            CorruptObjectError: a delta/ref chain longer than ``max_delta_chain``, or a delta that does not
                fit its base.
        """
        key = check_key(key)
        self._check_open()
        return self._open_ranged(key, 0, rec)

    def _open_ranged(self, key: ShardKey, depth: int, rec: Any = UNREAD) -> RangedShard | None:
        if depth > self.config.max_delta_chain:
            raise CorruptObjectError(f"{key}: delta/ref chain longer than {self.config.max_delta_chain}", key=str(key))
        if rec is UNREAD:
            rec = self.index.get_object(key)
        if rec is None:
            return None
        copy = _Copy(self.tiers, key, rec)
        internal = copy.obj.metadata.get(INTERNAL) or {}
        kind = internal.get("kind", "full")
        if kind == "full":
            return _Full(key, copy)
        link = internal.get("target") if kind == "ref" else internal.get("base") if kind == "delta" else None
        if link is None:
            raise CorruptObjectError(f"{key}: unknown object kind {kind!r}", key=str(key))
        other = self._open_ranged(ShardKey.parse(link), depth + 1)
        if other is None:
            what = "refers to" if kind == "ref" else "is a delta on"
            raise NoValidCopyError(f"{key} {what} {link}, which is gone", key=str(key))
        return other if kind == "ref" else _Delta(key, copy, other)
