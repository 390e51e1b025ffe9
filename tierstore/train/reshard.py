"""Elastic restore: a step saved by N ranks restores on M ranks, each reading only the bytes its shard needs.

The Checkpointer's restore reads a step through :func:`read_for_restore`.
For each layer it opens the object of the rank this rank mirrors (``rank %
N``) for ranged reads (:meth:`~tierstore.store.TierStore.open_ranged`: a
few KiB of header and tables) and compares what is stored with the target:

* **the same layout** (every tensor's local shape, dtype and placement, and
  the optimizer state of the same parameters): the object is read whole, as
  before (:func:`~tierstore.train.gather.read_object`). DDP at any world
  size and FSDP2 at the same world size take this path;
* **another layout**: the layer is *resharded*. Each target tensor covers a
  box of the global tensor: the whole tensor for a plain tensor, its local
  shard for a ``DTensor`` (torch's chunking rule on its mesh coordinate,
  :func:`~tierstore.train.gather.shard_box`). The saved pieces are found the
  same way from the stored ``dist`` metadata (mesh, placements, global
  shape; meshes laid out as ``arange(N).reshape(mesh)``): a plain stored
  tensor is one whole piece; pieces that ``Replicate`` duplicates are read
  from one rank only (the target rank's namesake where it holds one, else
  spread by rank). Each overlap of the target box with a piece is read by
  :meth:`~tierstore.store.RangedShard.read_box`: only the chunks holding
  those bytes, each verified, from the fastest tier with a valid copy (a bad
  chunk falls back to the next tier; none left is
  :class:`~tierstore.errors.NoValidCopyError`). Deltas (differential), refs
  (dedup, whole or per part) and layer-wise versions resolve as for a whole
  read.

Optimizer state follows its parameter: for each parameter in this rank's
optimizer, its state is read from a rank whose saved optimizer held it
(rank-partitioned, ZeRO-1 style: the step's documents say which), shaped and
sharded like the parameter. When the param groups' members differ from what
this rank's namesake saved (another partition), the groups are rebuilt from
every saved rank's document (:func:`adapt_document`): each parameter must
have been in the same group.

What cannot be resharded is a different model, and raises
:class:`~tierstore.errors.RestoreMismatchError` naming what differs, before
anything is changed: tensor names (what the target has that the checkpoint
does not, and the reverse), a global shape, a dtype, a parameter in another
param group, a placement other than ``Shard(d)`` / ``Replicate()``.

Memory: the target's own tensors (new ones, handed to the usual load), plus
the chunks of one read at a time (the box rounded out to whole chunks) and
the last 2 chunks read of each object open for the layer (:mod:`tierstore.codec.ranged`).
"""

from __future__ import annotations

import copy as _copy
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from tierstore.codec import DTYPES
from tierstore.errors import RestoreMismatchError
from tierstore.keys import ShardKey
from tierstore.store.common import UNREAD
from tierstore.train.gather import mesh_coords, read_object, shard_box
from tierstore.train.layers import BUFFER, OPTIM, PARAM, StateMap, placement_of
from tierstore.train.pending import PendingTensor
from tierstore.train.pieces import Box, LayerSource, Sources, target_box, whole
from tierstore.train.view import StateView

__all__ = ["ReshardRead", "adapt_document", "read_for_restore"]


@dataclass
class ReshardRead:
    """What :func:`read_for_restore` read: shards for :meth:`StateView.prepare`, and how.

    Attributes:
        shards: ``layer -> (tensors, metadata)`` shaped for this rank's target.
        resharded: the layers read by ranges (the others were read whole).
        bytes_read: bytes fetched by the ranged reads (headers and tables included).
        whole_bytes: bytes of the objects read whole (as the index records them; deltas' bases included).
        bad_copies: copies a ranged read found bad or could not reach, and read from another tier instead.
    """

    shards: dict[str, tuple[dict[str, torch.Tensor], dict]] = field(default_factory=dict)
    resharded: list[str] = field(default_factory=list)
    bytes_read: int = 0
    whole_bytes: int = 0
    bad_copies: list[str] = field(default_factory=list)


def _names_error(layer: str, missing: list[str], extra: list[str]) -> RestoreMismatchError:
    parts = []
    if missing:
        parts.append(f"the target has {', '.join(repr(n) for n in missing[:4])}"
                     f"{' ...' if len(missing) > 4 else ''} that the checkpoint does not")
    if extra:
        parts.append(f"the checkpoint holds {', '.join(repr(n) for n in extra[:4])}"
                     f"{' ...' if len(extra) > 4 else ''} that the target does not")
    return RestoreMismatchError(f"layer {layer!r}: {'; '.join(parts)} (a different model, not another sharding)",
                                layer=layer, tensor=(missing or extra)[0])


def _fits(m: StateMap, layer: str, src: LayerSource) -> bool:
    """Whether ``src`` holds exactly what ``m`` holds of ``layer`` (then it is read whole, as before)."""
    spec = m.layers[layer]
    for names, prefix in ((spec.params, PARAM), (spec.buffers, BUFFER)):
        for n in names:
            if not _same(prefix + n, m.tensors[n], src):
                return False
    if m.optimizer is None:
        return True
    stored_opt = [n for n in src.tensors if n.startswith(OPTIM)]
    mine = set(m.opt_params)
    if {n[len(OPTIM):].rpartition("/")[0] for n in stored_opt} != {n for n in spec.params if n in mine}:
        return False  # another partition of the optimizer state (or none saved)
    for name in stored_opt:
        pname, _, key = name[len(OPTIM):].rpartition("/")
        cur = m.opt_state.get(pname, {}).get(key)
        if isinstance(cur, torch.Tensor):
            if not _same(name, cur, src):
                return False
            continue
        shape = src.tensors[name][1]
        param = m.tensors[pname]
        if shape and (tuple(shape) != _local_shape(param) or _spec(src, name) != _dist_of(param)):
            return False  # state shaped like its parameter, which is sharded otherwise now
    return True


def _spec(src: LayerSource, name: str) -> Any:
    spec = src.dist.get(name)
    return {**spec, "stride": None} if spec else None


def _local_shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.to_local().shape) if isinstance(t, DTensor) else tuple(t.shape)


def _dist_of(t: torch.Tensor) -> Any:
    return {**placement_of(t), "stride": None} if isinstance(t, DTensor) else None


def _same(name: str, t: torch.Tensor, src: LayerSource) -> bool:
    got = src.tensors.get(name)
    if got is None:
        return False
    dtype, shape = got
    return DTYPES.get(dtype) == t.dtype and tuple(shape) == _local_shape(t) and _spec(src, name) == _dist_of(t)


class _Layer:
    """Resharding one layer of one module into this rank's target."""

    def __init__(self, m: StateMap, layer: str, sources: Sources, src: int, rank: int,
                 holders: Mapping[str, list[int]]) -> None:
        self.m, self.layer, self.sources, self.src, self.rank, self.holders = m, layer, sources, src, rank, holders
        self.world = len(sources.ranks)
        self._boxes: dict[tuple, dict[Box, list[int]]] = {}

    def read(self) -> tuple[dict[str, Any], dict]:
        m, spec, base = self.m, self.m.layers[self.layer], self.sources.get(self.src)
        expected = {PARAM + n: n for n in spec.params}
        expected.update({BUFFER + n: n for n in spec.buffers})
        tied = {PARAM + a for a in m.tied} | {BUFFER + a for a in m.tied}  # stored by an older save: not loaded
        stored = {n for n in base.tensors if not n.startswith(OPTIM) and n not in tied}
        if set(expected) != stored:
            raise _names_error(self.layer, sorted(set(expected) - stored), sorted(stored - set(expected)))
        out = {name: self._assemble(name, m.tensors[n], base) for name, n in expected.items()}
        dist: dict[str, Any] = {}
        for name, n in expected.items():
            t = m.tensors[n]
            if isinstance(t, DTensor):
                dist[name] = placement_of(t)
        meta: dict[str, Any] = {"optim_scalars": {}}
        if m.optimizer is not None:
            mine = set(m.opt_params)
            for n in spec.params:
                if n not in mine:
                    continue  # another rank's optimizer holds it (rank-partitioned state)
                holder = self._holder(n, base)
                if holder is None:
                    continue  # no saved optimizer state of it (never stepped)
                for name in holder.optim_names(n):
                    key = name[len(OPTIM):].rpartition("/")[2]
                    cur = m.opt_state.get(n, {}).get(key)
                    stored_dim = len(holder.tensors[name][1])
                    like = cur if isinstance(cur, torch.Tensor) else (m.tensors[n] if stored_dim else None)
                    out[name] = self._assemble(name, like, holder, exact=isinstance(cur, torch.Tensor), later=True)
                    if isinstance(cur, DTensor):
                        dist[name] = placement_of(cur)
                scalars = (holder.meta.get("optim_scalars") or {}).get(n)
                if scalars is not None:
                    meta["optim_scalars"][n] = scalars
        if dist:
            meta["dist"] = dist
        return out, meta

    def _holder(self, param: str, base: LayerSource) -> LayerSource | None:
        """A saved rank whose object holds ``param``'s optimizer state: this rank's namesake first."""
        if base.optim_names(param):
            return base
        for r in self.holders.get(param, []):
            if r in self.sources.keys:
                src = self.sources.get(r)
                if src.optim_names(param):
                    return src
        return None

    def _pieces(self, name: str, primary: LayerSource) -> list[tuple[int, Box]]:
        """One saved rank per distinct box of ``name`` (replicas read once, spread over the target ranks)."""
        if name not in primary.dist:
            return [(primary.rank, primary.piece(name, self.world))]
        spec = primary.dist[name]
        mesh = [int(x) for x in spec["mesh"]]
        shape, placements = [int(x) for x in spec["shape"]], [str(p) for p in spec["placements"]]
        memo = (tuple(shape), tuple(mesh), tuple(placements))  # tensors sharded alike share their pieces
        by_box = self._boxes.get(memo)
        if by_box is None:
            if math.prod(mesh) != self.world:
                primary.piece(name, self.world)  # raises, naming the mesh
            by_box = {}
            for r in self.sources.ranks:
                off, size = shard_box(name, shape, mesh, placements, mesh_coords(r, mesh))
                by_box.setdefault(Box(tuple(off), tuple(size)), []).append(r)
            self._boxes[memo] = by_box
        out = []
        for box, ranks in by_box.items():
            r = self.rank if self.rank in ranks else ranks[self.rank % len(ranks)]
            out.append((r, box))
        return out

    def _assemble(self, name: str, like: torch.Tensor | None, primary: LayerSource, *, exact: bool = True,
                  later: bool = False) -> torch.Tensor | PendingTensor:
        """The target's part of ``name``, read from the saved pieces that overlap it, each verified now.

        ``later``: copied by the load instead (a :class:`PendingTensor`: the optimizer's state is copied
        straight into its own tensors there), no staging tensor."""
        dtype_s, local = primary.tensors[name]
        dtype = DTYPES[dtype_s]
        spec = primary.dist.get(name)
        gshape = tuple(int(x) for x in spec["shape"]) if spec else tuple(local)
        if like is None:
            box = whole(gshape)
        else:
            if tuple(like.shape) != gshape:
                raise RestoreMismatchError(
                    f"layer {self.layer!r} tensor {name!r}: the checkpoint's is {dtype} {gshape} (global shape), "
                    f"the target's {like.dtype} {tuple(like.shape)}: a different model, not another sharding",
                    layer=self.layer, tensor=name)
            if exact and like.dtype != dtype:
                raise RestoreMismatchError(
                    f"layer {self.layer!r} tensor {name!r}: the checkpoint holds {dtype}, the target {like.dtype}",
                    layer=self.layer, tensor=name)
            box = target_box(name, like)
        result = None if later else torch.empty(box.sizes, dtype=dtype)
        parts = []
        covered = 0
        for r, piece in self._pieces(name, primary):
            part = box.meet(piece)
            if part is None:
                continue
            src = self.sources.get(r)
            if name not in src.tensors or DTYPES[src.tensors[name][0]] != dtype or src.piece(name, self.world) != piece:
                raise RestoreMismatchError(f"layer {self.layer!r} tensor {name!r}: rank {r} saved it otherwise than "
                                           f"rank {primary.rank}", layer=self.layer, tensor=name)
            if result is None:
                parts.append((part.slices(box), src.box_writer(name, part.within(piece), part.sizes)))
            else:
                src.read_box(name, part.within(piece), part.sizes, out=result[part.slices(box)])
            covered += part.volume
        if covered != box.volume:
            raise RestoreMismatchError(f"layer {self.layer!r} tensor {name!r}: the saved shards cover {covered} of the "
                                       f"{box.volume} elements this rank needs", layer=self.layer, tensor=name)
        return result if result is not None else PendingTensor(box.sizes, dtype, parts)


def _holders(res: Any) -> dict[str, list[int]]:
    """``param -> saved ranks`` whose optimizer held it, from the step's documents."""
    out: dict[str, list[int]] = {}
    for r in sorted(res.extra, key=int):
        entries = ((res.extra.get(r) or {}).get("state") or {}).get("entries") or {}
        for e in entries.values():
            if isinstance(e, dict) and e.get("kind") == "optimizer":
                for g in (e.get("meta") or {}).get("groups") or []:
                    for p in g.get("params") or []:
                        out.setdefault(p, []).append(int(r))
    return out


def adapt_document(doc: dict[str, Any], res: Any, view: StateView, only: Iterable[str] | None) -> dict[str, Any]:
    """``doc`` with each targeted optimizer's param groups rebuilt for this rank's members where they differ.

    A rank-partitioned optimizer (ZeRO-1 style) restored on another number
    of ranks holds other parameters than this rank's namesake saved: each
    group keeps its saved hyper-parameters and takes this rank's members,
    each of which some saved rank held in the same group.

    Raises:
        RestoreMismatchError: another number of groups, or a parameter no saved rank held in that group.
    """
    entries = doc.get("entries") or {}
    maps = view.maps(only)
    out = doc
    for mk, m in maps.items():
        if m.optimizer is None:
            continue
        ok = next(k for k, v in view.owner.items() if v == mk)
        stored = entries.get(ok) or {}
        groups = (stored.get("meta") or {}).get("groups")
        if stored.get("kind") != "optimizer" or groups is None:
            continue  # prepare names what is wrong
        mine = [[m.opt_params[i] for i in g["params"]] for g in m.opt_groups]
        if len(groups) == len(mine) and all(g.get("params") == names for g, names in zip(groups, mine)):
            continue
        if len(groups) != len(mine):
            raise RestoreMismatchError(f"optimizer {ok!r} has {len(mine)} param groups, the checkpoint {len(groups)}",
                                       layer=None, tensor=ok)
        saved: list[set[str]] = [set() for _ in groups]
        for r in res.extra:
            e = (((res.extra.get(r) or {}).get("state") or {}).get("entries") or {}).get(ok) or {}
            for gi, g in enumerate((e.get("meta") or {}).get("groups") or []):
                if gi < len(saved):
                    saved[gi].update(g.get("params") or [])
        for gi, names in enumerate(mine):  # a parameter of a layer the checkpoint lacks: prepare names the layer
            lost = [n for n in names if n not in saved[gi] and m.layer_of.get(n) in res.layers]
            if lost:
                where = [gj for gj, s in enumerate(saved) if lost[0] in s]
                said = f"group {where[0]}" if where else "no group"
                raise RestoreMismatchError(f"optimizer {ok!r} param group {gi} holds {lost[0]!r}, which the checkpoint "
                                           f"has in {said}", layer=None, tensor=f"param_groups[{gi}]")
        if out is doc:
            out = _copy.deepcopy(doc)
        out["entries"][ok]["meta"]["groups"] = [{**g, "params": names} for g, names in zip(groups, mine)]
    return out


def _whole_size(store: Any, key: ShardKey, records: Mapping[ShardKey, Any] | None = None) -> int:
    """Bytes a whole read of ``key`` reads: the object, and the objects its ref or delta chain reaches
    (``records``: the index's records already read, by key; the others are looked up)."""
    total, seen = 0, set()
    todo: list[ShardKey] = [key]
    while todo:
        k = todo.pop()
        rec = None if k in seen else records[k] if records is not None and k in records else store.info(k)
        seen.add(k)
        if rec is None:
            continue
        total += rec.size
        todo += [x for x in (rec.base, rec.target) if x is not None]
    return total


def read_for_restore(store: Any, model: str, res: Any, view: StateView, rank: int, src: int,
                     layers: Iterable[str], only: Iterable[str] | None = None,
                     get: Callable[[ShardKey, Any], Any] | None = None) -> ReshardRead:
    """This rank's shards of ``layers`` of a resolution: whole where the layout matches, resharded where not.

    Args:
        res: the resolution (its objects, world size and documents).
        view: the target state (its modules and optimizers say what this rank holds).
        rank: this rank; ``src``: the saved rank it mirrors (``rank % N``).
        only: the state keys restored (``None``: all).
        get: how an object read whole is read, ``get(key, rec)`` with the index's record of ``key`` read
            already (or ``UNREAD``: look it up); default ``store.get``: verified, into new tensors. The records
            of every object of ``layers`` are read in one round trip first.

    Raises:
        RestoreMismatchError: a layer that cannot be resharded (see the module docstring).
        NoValidCopyError: an object it needs has no valid copy in any tier.
    """
    out = ReshardRead()
    maps = view.maps(only)
    owner = {ln: m for m in maps.values() for ln in m.layers}
    holders: dict[str, list[int]] | None = None
    wanted = set(layers)
    order = [ln for ln in owner if ln in wanted] + sorted(wanted - set(owner))  # the modules' order, as prepare
    keys: dict[str, dict[int, ShardKey]] = {}
    for (ln, r), info in res.objects.items():
        if ln in wanted:
            keys.setdefault(ln, {})[r] = info.key
    every = [k for by_rank in keys.values() for k in by_rank.values()]
    records = dict(zip(every, store.index.get_objects(every))) if every else {}  # one round trip for all

    def whole_get(k: ShardKey) -> Any:
        return get(k, records.get(k, UNREAD)) if get is not None else store.get(k)

    for ln in order:
        sources = Sources(store, model, ln, keys.get(ln, {}), records)
        if not sources.ranks:
            continue
        here = src if src in sources.keys else sources.ranks[rank % len(sources.ranks)]
        m = owner.get(ln)
        if m is None or _fits(m, ln, sources.get(here)):
            key = sources.keys[here]
            out.shards[ln] = read_object(store, model, ln, key, whole_get)
            out.whole_bytes += _whole_size(store, key, records)
        else:
            if holders is None:
                holders = _holders(res)
            out.shards[ln] = _Layer(m, ln, sources, here, rank, holders).read()
            out.resharded.append(ln)
        out.bytes_read += sources.bytes_read
        out.bad_copies += sources.failures
    return out
