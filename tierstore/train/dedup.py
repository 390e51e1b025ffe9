"""Redundancy detection across a data-parallel group (AdaCheck).

Each rank splits a layer's shard into two parts judged separately, as AdaCheck
does (ZeRO-1 replicates parameters but not optimizer state):

* ``"state"``: parameters and buffers (``param/*``, ``buffer/*``),
* ``"optim"``: optimizer state (``optim/*``).

and digests each part (names, dtypes, shapes and bytes; xxh3-128 or blake2s).

Protocol, per save, on every rank of the group, in the same order:

1. ``all_gather`` of a fixed-size header (layer count, layout signature);
   ranks whose layouts differ are not compared (no dedup this save);
2. ``all_gather`` of the digests and byte counts, ``[layers, 2]`` entries;
3. every rank computes the same owner table (:func:`assign_owners`): ranks
   holding identical bytes form a class; each class gets one owner, chosen
   greedily to balance the bytes written per rank (largest classes first;
   both parts of a layer go to the same owner where their classes agree, so
   the others write one whole-shard ``ref``).

The owner table is cached per layer, keyed by its class structure and sizes:
when a layer's digests fall into the same classes as at its last save (the
usual case), the cached owners are reused, so owners do not move between
saves (deltas keep their bases) and only the digests travel (16 bytes per
part). A layer is reassigned, against the running byte load of the others,
when its layout (names, shapes) or its classes change.
No pickle: only fixed-size integer tensors travel.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from tierstore.train.hashing import tensor_digest

__all__ = ["PARTS", "DedupPlanner", "assign_owners", "part_digests", "part_of", "split_parts"]

PARTS = ("state", "optim")
_DIGEST_BYTES = 16


def part_of(name: str) -> str:
    """The part a shard tensor belongs to: ``optim`` for ``optim/*``, else ``state``."""
    return "optim" if name.startswith("optim/") else "state"


def split_parts(tensors: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {p: {} for p in PARTS}
    for n, t in tensors.items():
        out[part_of(n)][n] = t
    return out


def part_digests(tensors: Mapping[str, torch.Tensor], algo: str = "xxh3") -> dict[str, tuple[bytes, int]]:
    """``{part: (16-byte digest, nbytes)}`` over the sorted tensors of each part."""
    out = {}
    for part, ts in split_parts(tensors).items():
        h = hashlib.blake2s(digest_size=_DIGEST_BYTES)
        nbytes = 0
        for n in sorted(ts):
            h.update(n.encode() + b"\0" + tensor_digest(ts[n], algo).encode() + b"\0")
            nbytes += ts[n].numel() * ts[n].element_size()
        out[part] = (h.digest(), nbytes)
    return out


def assign_owners(
    table: Sequence[Mapping[str, Mapping[str, tuple[bytes, int]]]],
    load: list[int] | None = None,
) -> dict[str, dict[str, list[int]]]:
    """The owner of every rank's part of every layer.

    Args:
        table: per rank, ``{layer: {part: (digest, nbytes)}}``; every rank
            must list the same layers.
        load: bytes already owned per rank (updated in place), so that
            layers assigned later balance against earlier ones.

    Returns:
        ``{layer: {part: owners}}`` where ``owners[r]`` is the rank whose
        object holds rank ``r``'s bytes (``r`` itself when not redundant).
        Deterministic: every rank computes the same table. Classes are
        assigned largest first, each to its least-loaded member (lowest rank
        on a tie); both parts of a layer with the same members form one unit.
    """
    world = len(table)
    layers = sorted(table[0]) if table else []
    load = [0] * world if load is None else load
    owners: dict[str, dict[str, list[int]]] = {ln: {p: list(range(world)) for p in PARTS} for ln in layers}
    units: dict[tuple[str, tuple[int, ...]], tuple[list[str], int]] = {}
    for ln in layers:
        for part in PARTS:
            by_digest: dict[bytes, list[int]] = {}
            for r in range(world):
                by_digest.setdefault(table[r][ln][part][0], []).append(r)
            for members in by_digest.values():
                nbytes = table[members[0]][ln][part][1]
                if len(members) == 1:
                    load[members[0]] += nbytes
                    continue
                key = (ln, tuple(members))
                parts, nb = units.get(key, ([], 0))
                units[key] = ([*parts, part], nb + nbytes)
    for (uln, umembers), (uparts, unbytes) in sorted(units.items(), key=lambda kv: (-kv[1][1], kv[0])):
        owner = min(umembers, key=lambda r: (load[r], r))
        load[owner] += unbytes
        for part in uparts:
            for r in umembers:
                owners[uln][part][r] = owner
    return owners


def _classes(digests: Sequence[bytes]) -> list[int]:
    """For each rank, the lowest rank holding the same digest."""
    seen: dict[bytes, int] = {}
    return [seen.setdefault(d, r) for r, d in enumerate(digests)]


class DedupPlanner:
    """Runs the detection protocol over ``group`` and caches the owner table.

    Args:
        group: a gloo process group of the data-parallel ranks (``None``: the
            default group), used only by the thread that calls :meth:`plan`.
        algo: ``xxh3`` or ``blake2s``.
    """

    def __init__(self, group: Any = None, algo: str = "xxh3") -> None:
        self.group = group
        self.algo = algo
        self._load: list[int] = []
        self._layers: dict[str, tuple[Any, dict[str, list[int]], list[int]]] = {}
        self.detections = 0

    def plan(self, layers: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, dict[str, int]]:
        """Collective: ``{layer: {part: owner global rank}}`` for this rank.

        Every rank of the group must call it with the same layer names, in
        the same save order.
        """

        rank = dist.get_rank(self.group)
        world = dist.get_world_size(self.group)
        names = sorted(layers)
        sig = hashlib.blake2s(digest_size=7)
        for ln in names:
            for n, t in sorted(layers[ln].items()):
                sig.update(f"{ln}|{n}|{tuple(t.shape)}|{t.dtype};".encode())
        head = torch.tensor([len(names), int.from_bytes(sig.digest(), "little")], dtype=torch.int64)
        heads = [torch.empty_like(head) for _ in range(world)]
        dist.all_gather(heads, head, group=self.group)
        mine = {ln: part_digests(layers[ln], self.algo) for ln in names}
        if any(not torch.equal(h, head) for h in heads):
            return {ln: {p: rank for p in PARTS} for ln in names}
        dig = torch.zeros(len(names), len(PARTS), _DIGEST_BYTES, dtype=torch.uint8)
        nb = torch.zeros(len(names), len(PARTS), dtype=torch.int64)
        for i, ln in enumerate(names):
            for j, p in enumerate(PARTS):
                dgst, size = mine[ln][p]
                dig[i, j] = torch.frombuffer(bytearray(dgst), dtype=torch.uint8)
                nb[i, j] = size
        digs = [torch.empty_like(dig) for _ in range(world)]
        nbs = [torch.empty_like(nb) for _ in range(world)]
        dist.all_gather(digs, dig, group=self.group)
        dist.all_gather(nbs, nb, group=self.group)
        table = [
            {
                ln: {p: (bytes(digs[r][i, j].tolist()), int(nbs[r][i, j])) for j, p in enumerate(PARTS)}
                for i, ln in enumerate(names)
            }
            for r in range(world)
        ]
        if len(self._load) != world:
            self._load, self._layers = [0] * world, {}
        todo = []
        for ln in names:
            shape = tuple(
                (tuple(_classes([table[r][ln][p][0] for r in range(world)])), table[0][ln][p][1]) for p in PARTS
            )
            cached = self._layers.get(ln)
            if cached is None or cached[0] != shape:
                if cached is not None:
                    for r in range(world):
                        self._load[r] -= cached[2][r]
                todo.append((ln, shape))
        # assign new or changed layers, largest first, against the running load
        for ln, shape in sorted(todo, key=lambda x: (-sum(n for _, n in x[1]), x[0])):
            before = list(self._load)
            owners = assign_owners([{ln: table[r][ln]} for r in range(world)], self._load)[ln]
            self._layers[ln] = (shape, owners, [a - b for a, b in zip(self._load, before)])
            self.detections += 1
        ranks = dist.get_process_group_ranks(self.group) if self.group is not None else list(range(world))
        return {ln: {p: ranks[self._layers[ln][1][p][rank]] for p in PARTS} for ln in names}
