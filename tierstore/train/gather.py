"""Read a resolved step's shards, one rank's or every rank's, and reassemble tensors split across ranks.

The Checkpointer stores, per layer and rank, what that rank holds
(:mod:`tierstore.train.layers`): a plain tensor whole (data-parallel
replicas: every rank holds the same), a ``DTensor`` as its local shard, with
``{"mesh", "placements", "shape", "stride"}`` in the shard metadata's
``"dist"`` entry. Dedup may replace a rank's part (``state`` / ``optim``) by a
reference to another rank's object (``"_refs"``).

* :func:`read_object` and :func:`read_shards` read one rank's view of layers
  (references resolved); the Checkpointer's restore reads through them.
* :func:`shard_box` is torch's chunking rule (which part of a tensor a mesh
  coordinate holds), the one copy of it: export reassembles with it and
  :mod:`tierstore.train.reshard` reshards with it.
* :func:`assemble_layer` rebuilds one layer's full tensors from every rank:
  plain tensors from the lowest rank (replicas), DTensors by placing each
  rank's local shard at its offset. Placements ``Shard(d)`` (``S(d)``) and
  ``Replicate()`` (``R``) are reassembled on a mesh laid out as
  ``arange(world).reshape(mesh)`` (``init_device_mesh``'s default); others
  (``Partial``, strided shards) are refused, naming the tensor. Every element
  must be covered by some rank's shard.

Memory: :func:`assemble_layer` reads the lowest rank's object, then (only
when the layer holds DTensors) one other rank's object at a time; it holds at
most the lowest rank's object, the reassembled tensors and one other rank's
object.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from tierstore.errors import InvalidValueError, NoValidCopyError
from tierstore.keys import ShardKey
from tierstore.train.dedup import part_of

__all__ = ["Meter", "assemble_layer", "mesh_coords", "nbytes", "read_object", "read_shards", "shard_box"]

_SHARD = re.compile(r"^(?:S|Shard)\((?:dim=)?(\d+)\)$")
_REPLICATE = ("R", "Replicate()")


def nbytes(ts: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts.values())


def _tensors(shard: Any) -> dict[str, torch.Tensor]:
    """A shard's ``name -> tensor`` (``store.get`` returns a mapping; older stores a ``.tensors`` dict)."""
    return dict(shard.items()) if isinstance(shard, Mapping) else dict(shard.tensors)


def read_object(store: Any, model: str, layer: str, key: ShardKey,
                get: Callable[[ShardKey], Any] | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """One object's tensors and metadata, with parts referring to other ranks' objects (dedup) filled in.

    ``get``: how an object is read (default ``store.get``; a restore at copy speed passes
    :meth:`~tierstore.store.deferred.DeferredReads.get`).

    Raises:
        NoValidCopyError: the object (or one it refers to) is gone, or no tier holds a valid copy.
    """
    get = get or store.get
    shard = get(key)
    if shard is None:
        raise NoValidCopyError(f"layer {layer!r}: object {key} is gone", key=str(key), layer=layer)
    ts = _tensors(shard)
    meta = dict(shard.metadata)
    for part, owner in (meta.pop("_refs", None) or {}).items():
        other = get(ShardKey(model, layer, key.step, int(owner)))
        if other is None:
            raise NoValidCopyError(
                f"layer {layer!r}: {part} of rank {key.rank} refers to rank {owner}, whose object is gone",
                key=str(key), layer=layer)
        ts.update({n: t for n, t in _tensors(other).items() if part_of(n) == part})
    return ts, meta


def read_shards(store: Any, model: str, res: Any, src: int, layers: Iterable[str] | None = None,
                get: Callable[[ShardKey], Any] | None = None) -> dict[str, tuple[dict[str, torch.Tensor], dict]]:
    """Rank ``src``'s shards of a resolution (``layer -> (tensors, metadata)``); layers it lacks are left out."""
    out: dict[str, tuple[dict[str, torch.Tensor], dict]] = {}
    for ln in sorted(res.layers if layers is None else layers):
        info = res.objects.get((ln, src))
        if info is not None:
            out[ln] = read_object(store, model, ln, info.key, get)
    return out


class Meter:
    """Bytes of tensors a reader holds now and at most (``peak``): the measured side of a memory bound."""

    def __init__(self) -> None:
        self.held = 0
        self.peak = 0

    def hold(self, n: int) -> None:
        self.held += n
        self.peak = max(self.peak, self.held)

    def release(self, n: int) -> None:
        self.held -= n


def mesh_coords(rank: int, mesh: list[int]) -> list[int]:
    """The coordinates of ``rank`` on a mesh laid out as ``arange(world).reshape(mesh)``."""
    out = []
    for size in reversed(mesh):
        out.append(rank % size)
        rank //= size
    return out[::-1]


def shard_box(name: str, shape: list[int], mesh: list[int], placements: list[str],
              coords: list[int]) -> tuple[list[int], list[int]]:
    """(offset, size) per dim of the local shard at mesh ``coords`` of a tensor of global ``shape``.

    torch's chunking rule, mesh dim by mesh dim: ``Shard(d)`` cuts what is
    left of dim ``d`` into ``ceil(n / mesh[i])`` pieces (the last ones
    shorter or empty); ``Replicate()`` keeps it.

    Raises:
        InvalidValueError: a placement other than ``Shard(d)`` and ``Replicate()`` (``Partial``, strided
            shards), or a dim the tensor does not have.
    """
    off, size = [0] * len(shape), list(shape)
    for i, p in enumerate(placements):
        if p in _REPLICATE:
            continue
        m = _SHARD.match(str(p))
        if m is None or int(m.group(1)) >= len(shape):
            raise InvalidValueError(f"tensor {name!r}: placement {p} cannot be reassembled or resharded (Shard(d) "
                                    "and Replicate() can)", key=name)
        d = int(m.group(1))
        chunk = -(-size[d] // mesh[i])
        start = min(coords[i] * chunk, size[d])
        off[d] += start
        size[d] = max(0, min(size[d], start + chunk) - start)
    return off, size


def _slice_of(name: str, spec: Mapping[str, Any], rank: int, world: int) -> tuple[list[int], list[int]]:
    """(offset, size) per dim of ``rank``'s local shard of a DTensor (torch's chunking rule)."""
    mesh = [int(x) for x in spec["mesh"]]
    if math.prod(mesh) != world:
        raise InvalidValueError(f"tensor {name!r}: mesh {mesh} does not span the step's {world} ranks "
                                "(export reads meshes over the whole world only)", key=name)
    return shard_box(name, [int(x) for x in spec["shape"]], mesh, [str(p) for p in spec["placements"]],
                     mesh_coords(rank, mesh))


def assemble_layer(read: Callable[[int], tuple[dict[str, torch.Tensor], dict]], ranks: list[int],
                   keep: Callable[[str], bool], meter: Meter | None = None) -> dict[str, torch.Tensor]:
    """The full tensors of one layer (those ``keep(name)`` accepts); see the module docstring.

    Args:
        read: ``rank -> (tensors, metadata)`` of that rank's object of the layer.
        ranks: the ranks holding the layer (the step's world), ascending.
        keep: which shard tensor names to return.
        meter: counts the bytes held (objects read, tensors built).

    Raises:
        InvalidValueError: a placement that cannot be reassembled, or shards
            that do not cover their tensor.
    """
    meter = meter or Meter()
    first, meta = read(ranks[0])
    held0 = nbytes(first)
    meter.hold(held0)
    dist = {n: s for n, s in (meta.get("dist") or {}).items() if n in first and keep(n)}
    out = {n: t for n, t in first.items() if keep(n) and n not in dist}
    if not dist:
        return out
    world = len(ranks)
    covered: dict[str, dict[tuple[int, ...], int]] = {}
    for n, spec in dist.items():
        out[n] = torch.empty([int(x) for x in spec["shape"]], dtype=first[n].dtype)
        meter.hold(nbytes({n: out[n]}))
        covered[n] = {}

    def place(rank: int, ts: Mapping[str, torch.Tensor]) -> None:
        for n, spec in dist.items():
            if n not in ts:
                raise InvalidValueError(f"tensor {n!r} is missing from rank {rank}'s shard", key=n, rank=rank)
            off, size = _slice_of(n, spec, rank, world)
            piece = ts[n]
            if list(piece.shape) != size or piece.dtype != out[n].dtype:
                raise InvalidValueError(f"tensor {n!r}: rank {rank} holds {piece.dtype} {list(piece.shape)}, its "
                                        f"placement {spec['placements']} says {size}", key=n, rank=rank)
            if piece.numel():
                out[n][tuple(slice(o, o + s) for o, s in zip(off, size))].copy_(piece)
            covered[n][tuple(off)] = piece.numel()

    place(ranks[0], first)
    for n in dist:
        del first[n]  # the reassembled tensor replaces this rank's piece
    for r in ranks[1:]:
        ts, _meta = read(r)
        held = nbytes(ts)
        meter.hold(held)
        place(r, ts)
        del ts
        meter.release(held)
    for n in dist:
        if sum(covered[n].values()) != out[n].numel():
            raise InvalidValueError(f"tensor {n!r}: the ranks' shards cover {sum(covered[n].values())} of "
                                    f"{out[n].numel()} elements", key=n)
    return out
