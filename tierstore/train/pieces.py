"""Where the pieces of a tensor are: the box a target rank holds, and the saved ranks' objects that hold the rest.

Used by :mod:`tierstore.train.reshard`. A :class:`Box` is a part of a global
tensor (offsets and sizes per dim). :func:`target_box` is the box a live
tensor holds: its local shard for a ``DTensor`` (torch's chunking rule at its
mesh coordinate, :func:`~tierstore.train.gather.shard_box`), else all of it.
A :class:`LayerSource` is one saved rank's object of a layer opened for
ranged reads (:meth:`~tierstore.store.TierStore.open_ranged`), dedup's
per-part refs resolved; :meth:`LayerSource.piece` is the box its copy of a
tensor holds, from the stored ``dist`` metadata (mesh laid out as
``arange(N).reshape(mesh)``) and checked against the stored local shape.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from tierstore.errors import InvalidValueError, NoValidCopyError, RestoreMismatchError
from tierstore.keys import ShardKey
from tierstore.store.common import UNREAD
from tierstore.train.dedup import part_of
from tierstore.train.gather import mesh_coords, shard_box
from tierstore.train.layers import OPTIM

__all__ = ["Box", "LayerSource", "Sources", "target_box", "whole"]


@dataclass(frozen=True)
class Box:
    """A box of a tensor: offsets and sizes per dim (a 0-dim tensor's box has none)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def volume(self) -> int:
        return math.prod(self.sizes)

    def meet(self, other: Box) -> Box | None:
        """The intersection, or ``None`` if it is empty."""
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets))
        hi = tuple(min(a + s, b + t) for a, s, b, t in zip(self.offsets, self.sizes, other.offsets, other.sizes))
        if any(h <= low for low, h in zip(lo, hi)):
            return None
        return Box(lo, tuple(h - low for low, h in zip(lo, hi)))

    def within(self, outer: Box) -> tuple[int, ...]:
        """This box's offsets relative to ``outer``'s."""
        return tuple(a - b for a, b in zip(self.offsets, outer.offsets))

    def slices(self, outer: Box) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.within(outer), self.sizes))


def whole(shape: Iterable[int]) -> Box:
    shape = tuple(int(x) for x in shape)
    return Box((0,) * len(shape), shape)


def target_box(name: str, t: torch.Tensor) -> Box:
    """The box of the global tensor that ``t`` holds: its local shard for a ``DTensor``, else all of it.

    Raises:
        RestoreMismatchError: a placement the chunking rule does not describe.
    """
    if not isinstance(t, DTensor):
        return whole(t.shape)
    mesh = t.device_mesh
    coords = mesh.get_coordinate()
    local = tuple(t.to_local().shape)
    try:
        off, size = shard_box(name, list(t.shape), list(mesh.shape), [str(p) for p in t.placements], list(coords or []))
    except InvalidValueError as e:
        raise RestoreMismatchError(f"target tensor {name!r}: {e}", tensor=name) from e
    if coords is None or tuple(size) != local:
        raise RestoreMismatchError(f"target tensor {name!r}: placements {[str(p) for p in t.placements]} on mesh "
                                   f"{list(mesh.shape)} hold {list(local)} locally, not the {size} torch's chunking "
                                   "rule gives: cannot reshard into it", tensor=name)
    return Box(tuple(off), tuple(size))


class LayerSource:
    """One saved rank's object of a layer, opened for ranged reads, with dedup's per-part refs resolved.

    Attributes:
        rank: the saved rank.
        tensors: ``name -> (dtype name, local shape)``.
        meta: the layer metadata (``optim_scalars``, ``dist``).
    """

    def __init__(self, store: Any, model: str, layer: str, key: ShardKey, rec: Any = UNREAD) -> None:
        self.rank = key.rank
        own = store.open_ranged(key, rec=rec)
        if own is None:
            raise NoValidCopyError(f"layer {layer!r}: object {key} is gone", key=str(key), layer=layer)
        self._opened = [own]
        self.meta = dict(own.metadata)
        self._of: dict[str, Any] = dict.fromkeys(own.tensors, own)
        self.tensors = dict(own.tensors)
        for part, owner in (self.meta.pop("_refs", None) or {}).items():
            other = store.open_ranged(ShardKey(model, layer, key.step, int(owner)))
            if other is None:
                raise NoValidCopyError(f"layer {layer!r}: {part} of rank {key.rank} refers to rank {owner}, whose "
                                       "object is gone", key=str(key), layer=layer)
            self._opened.append(other)
            for n, info in other.tensors.items():
                if part_of(n) == part:
                    self._of[n], self.tensors[n] = other, info
        self.dist: dict[str, Any] = self.meta.get("dist") or {}

    @property
    def bytes_read(self) -> int:
        return sum(s.bytes_read for s in self._opened)

    @property
    def failures(self) -> list[str]:
        return [f for s in self._opened for f in s.failures]

    def read_box(self, name: str, offsets: tuple[int, ...], sizes: tuple[int, ...], out: torch.Tensor) -> None:
        self._of[name].read_box(name, offsets, sizes, out)

    def box_writer(self, name: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Any:
        """The box verified now, copied by the returned ``write(out)`` later (:meth:`RangedShard.box_writer`)."""
        return self._of[name].box_writer(name, offsets, sizes)

    def optim_names(self, param: str) -> list[str]:
        """The stored optimizer-state tensors of ``param`` (``optim/<param>/<key>``)."""
        return [n for n in self.tensors if n.startswith(OPTIM) and n[len(OPTIM):].rpartition("/")[0] == param]

    def piece(self, name: str, world: int) -> Box:
        """The box of the global tensor this rank's copy of ``name`` holds (placement checked against its shape).

        Raises:
            RestoreMismatchError: a mesh that does not span the saved ranks, a placement that cannot be
                resharded, or a local shape its placement does not give.
        """
        _dtype, local = self.tensors[name]
        spec = self.dist.get(name)
        if spec is None:
            return whole(local)
        mesh = [int(x) for x in spec["mesh"]]
        if math.prod(mesh) != world:
            raise RestoreMismatchError(f"tensor {name!r} was saved on mesh {mesh}, which does not span the step's "
                                       f"{world} ranks: cannot reshard it", tensor=name)
        try:
            off, size = shard_box(name, [int(x) for x in spec["shape"]], mesh, [str(p) for p in spec["placements"]],
                                  mesh_coords(self.rank, mesh))
        except InvalidValueError as e:
            raise RestoreMismatchError(str(e), tensor=name) from e
        if tuple(size) != tuple(local):
            raise RestoreMismatchError(f"tensor {name!r}: rank {self.rank} saved {list(local)}, its placement "
                                       f"{spec['placements']} on mesh {mesh} says {size}", tensor=name)
        return Box(tuple(off), tuple(size))


class Sources:
    """The saved ranks' objects of one layer (``keys``: saved rank -> key), opened on first use.

    ``records``: the index's records of those keys where the caller has read them already (a key missing
    from it is looked up when opened).
    """

    def __init__(self, store: Any, model: str, layer: str, keys: dict[int, ShardKey],
                 records: Mapping[ShardKey, Any] | None = None) -> None:
        self.store, self.model, self.layer = store, model, layer
        self.keys = keys
        self.ranks = sorted(self.keys)
        self._records = records or {}
        self._open: dict[int, LayerSource] = {}

    def get(self, rank: int) -> LayerSource:
        if rank not in self._open:
            key = self.keys[rank]
            self._open[rank] = LayerSource(self.store, self.model, self.layer, key, self._records.get(key, UNREAD))
        return self._open[rank]

    @property
    def bytes_read(self) -> int:
        return sum(s.bytes_read for s in self._open.values())

    @property
    def failures(self) -> list[str]:
        return [f for s in self._open.values() for f in s.failures]
