"""Map a module's and an optimizer's state into layers of named tensors, and back.

A :class:`StateMap` is a view of one module (and the optimizer of its
parameters) built from their ``state_dict()`` *at the moment it is made*: the
Checkpointer makes a new one at every save, so a buffer reassigned each step,
a replaced ``nn.Parameter`` or buffers converted by ``.double()`` are always
seen as they are (no stale references). Names are the module's fully
qualified names with wrapper components removed (:func:`~tierstore.train.state.unwrap`,
:func:`~tierstore.train.state.normalise_fqn`), so a DDP-wrapped or compiled
model and the bare one map to the same layers.

A *layer* is the unit of a checkpoint shard: by default a block of the module
(:func:`default_layer_fn`), or whatever ``layer_fn(name)`` returns, made a
valid key name. A layer's shard holds, under these tensor names:

* ``param/<name>``: a parameter (its local shard for a DTensor),
* ``buffer/<name>``: any other tensor of the module's state dict,
* ``optim/<name>/<key>``: tensor-valued optimizer state of the parameter
  (Adam's ``exp_avg``, ``exp_avg_sq``, ``step``; SGD's ``momentum_buffer``; ...),

and JSON metadata ``{"optim_scalars": {name: {key: value}}, "dist": {tensor:
placement}}``: non-tensor per-parameter optimizer state, and for each DTensor
its mesh, placements and global shape. The optimizer's param groups
(hyper-parameters and the names of their parameters) are described by
:meth:`StateMap.optimizer_meta`; non-tensor entries of the module's state
dict (``_extra_state``) by :meth:`StateMap.extra_state`.

Restore protocol: :meth:`StateMap.prepare` validates every layer, tensor,
shape, dtype and placement (and the param groups) *before* anything changes;
a mismatch raises :class:`~tierstore.errors.RestoreMismatchError` naming the
layer and tensor. :meth:`StateMap.apply` then loads through the objects' own
``load_state_dict`` (in place for the module). :meth:`StateMap.load` does both.
What it is given is already shaped for this map: a checkpoint of another
world size or sharding is resharded into this rank's shapes and placements
first (:mod:`tierstore.train.reshard`), so a mismatch here is a different
model.
"""

from __future__ import annotations

import hashlib
import re
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tierstore.errors import InvalidValueError, RestoreMismatchError
from tierstore.keys import validate_name
from tierstore.train.pending import PendingTensor
from tierstore.train.state import decode, encode, normalise_fqn, unwrap

__all__ = [
    "BUFFER",
    "OPTIM",
    "PARAM",
    "LayerSpec",
    "StateMap",
    "default_layer_fn",
    "placement_of",
    "sanitize_layer_name",
]

PARAM = "param/"
BUFFER = "buffer/"
OPTIM = "optim/"
_BAD = re.compile(r"[^A-Za-z0-9._-]")


def sanitize_layer_name(name: str) -> str:
    """Turn any string into a valid key name (``[A-Za-z0-9._-]``, no ``..``)."""
    out = _BAD.sub("_", name) or "_"
    while ".." in out:
        out = out.replace("..", "._")
    if out == ".":
        out = "_"
    return validate_name(out[:200], "layer")


def default_layer_fn(name: str) -> str:
    """The block a parameter or buffer belongs to.

    The name up to its first container index (a numeric component that is not
    the first or the last): ``blocks.3.attn.w`` -> ``blocks.3``,
    ``transformer.h.3.attn.c_attn.weight`` -> ``transformer.h.3``,
    ``model.layers.12.mlp.up.weight`` -> ``model.layers.12``; without one, the
    first component: ``embed.weight`` -> ``embed``, ``transformer.wte.weight``
    -> ``transformer``, a top-level ``pos`` -> ``pos``.
    """
    parts = name.split(".")
    for i in range(1, len(parts) - 1):
        if parts[i].isdigit():
            return ".".join(parts[: i + 1])
    return parts[0]


def _plain(v: Any, where: str) -> Any:
    """:func:`encode` for values that must not hold tensors (they would have nowhere to go)."""
    table: dict[str, torch.Tensor] = {}
    out = encode(v, table, "", where)
    if table:
        raise InvalidValueError(f"state {where!r} holds tensors inside a non-tensor value; store them as "
                                "tensors of their own", key=where)
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _in_place_target(cur: Any, v: torch.Tensor | PendingTensor, p: torch.Tensor, dev: torch.device,
                     reused: set[int]) -> torch.Tensor | None:
    """The optimizer's current state tensor to copy ``v`` into, or ``None`` (a new tensor is made).

    Only one of the same kind, local shape, dtype, device and placements as what loading ``v`` would
    make, contiguous, with storage of its own (not a view of something else), and not already a target of
    this load (``reused``: the data pointers taken): so copying into it is what ``load_state_dict`` would
    have left, without faulting in new pages (``dcp.load`` loads into the same tensors).
    """
    if not isinstance(cur, torch.Tensor) or cur.requires_grad:
        return None
    sharded = isinstance(p, DTensor) and v.dim() > 0
    if isinstance(cur, DTensor) != sharded:
        return None
    if (sharded and isinstance(cur, DTensor) and isinstance(p, DTensor)
            and (cur.device_mesh != p.device_mesh or cur.placements != p.placements
                 or tuple(cur.shape) != tuple(p.shape))):
        return None
    loc = _local(cur)
    if (loc.device != dev or loc.dtype != v.dtype or tuple(loc.shape) != tuple(v.shape)
            or not loc.is_contiguous() or loc._base is not None):
        return None
    ptr = loc.data_ptr()
    if loc.numel() and ptr in reused:
        return None
    reused.add(ptr)
    return cur


def tied_key(t: torch.Tensor) -> tuple | None:
    """What makes two state-dict entries one tensor (tied weights): the same storage, offset, shape, strides
    and dtype. ``None`` where it cannot tell (a DTensor, an empty or meta tensor): never tied."""
    if isinstance(t, DTensor) or t.numel() == 0 or t.device.type == "meta":
        return None
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    if not ptr:
        return None
    return (t.device, ptr, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def placement_of(t: DTensor) -> dict[str, Any]:
    """The ``dist`` metadata of a DTensor: its mesh shape, placements, global shape and stride."""
    return {"mesh": list(t.device_mesh.shape), "placements": [str(p) for p in t.placements],
            "shape": list(t.shape), "stride": list(t.stride())}


@dataclass
class LayerSpec:
    """The parameters and buffers of one layer (normalised names)."""

    name: str
    params: list[str] = field(default_factory=list)
    buffers: list[str] = field(default_factory=list)


class StateMap:
    """The layer view of ``module`` (and ``optimizer``) state, as of construction.

    Args:
        module: the model (DDP / compile wrappers are looked through).
        optimizer: optional; every parameter it holds must belong to ``module``.
        layer_fn: ``name -> layer name``; the result is sanitised.
        prefix: prepended to every layer name (several modules in one state).

    Raises:
        InvalidValueError: the optimizer holds a parameter not in the module.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        layer_fn: Callable[[str], str] | None = None,
        *,
        prefix: str = "",
    ) -> None:
        self.module = module
        self.inner = unwrap(module)
        self.optimizer = optimizer
        fn = layer_fn or default_layer_fn
        self._sd = self.inner.state_dict()
        self._key: dict[str, str] = {}  # normalised name -> key of inner.state_dict()
        self.tensors: dict[str, torch.Tensor] = {}
        self.extra: dict[str, Any] = {}
        self._name_of: dict[int, str] = {}
        param_names: set[str] = set()
        for n, p in self.inner.named_parameters(remove_duplicate=False):
            fq = normalise_fqn(n)
            param_names.add(fq)
            self._name_of.setdefault(id(p), fq)
        self.layers: dict[str, LayerSpec] = {}
        self.layer_of: dict[str, str] = {}
        #: tied tensors (an ``lm_head`` sharing the embedding's weight): the later name -> the first name of the
        #: same tensor; stored once, under the first (see :func:`tied_key`)
        self.tied: dict[str, str] = {}
        first: dict[tuple, str] = {}
        for k, v in self._sd.items():
            fq = normalise_fqn(k)
            self._key[fq] = k
            if not isinstance(v, torch.Tensor):
                self.extra[fq] = v
                continue
            same = tied_key(v)
            if same is not None:
                if same in first:
                    self.tied[fq] = first[same]
                    continue
                first[same] = fq
            self.tensors[fq] = v
            layer = sanitize_layer_name(prefix + fn(fq))
            spec = self.layers.setdefault(layer, LayerSpec(layer))
            (spec.params if fq in param_names else spec.buffers).append(fq)
            self.layer_of[fq] = layer
        self._name_of = {i: self.tied.get(n, n) for i, n in self._name_of.items()}  # a tied parameter: its first name
        self.params: dict[str, torch.Tensor] = {n: self.tensors[n] for s in self.layers.values() for n in s.params}
        self.opt_params: list[str] = []
        self.opt_state: dict[str, dict[str, Any]] = {}
        self.opt_groups: list[dict[str, Any]] = []
        if optimizer is not None:
            for gi, group in enumerate(optimizer.param_groups):
                for p in group["params"]:
                    name = self._name_of.get(id(p))
                    name = self.tied.get(name, name) if name is not None else None
                    if name is None or name not in self.layer_of:
                        raise InvalidValueError(
                            f"optimizer param group {gi} holds a parameter that is not in the module's state dict",
                            group=gi, key=f"param_groups[{gi}]",
                        )
                    self.opt_params.append(name)
            osd = optimizer.state_dict()
            self.opt_state = {self.opt_params[i]: st for i, st in osd["state"].items()}
            self.opt_groups = osd["param_groups"]

    # ---- save side -------------------------------------------------------------

    def name_of(self, param: torch.Tensor) -> str | None:
        """The normalised name of a parameter of the module (``None`` if it is not one)."""
        return self._name_of.get(id(param))

    def layer_tensors(self, layer: str) -> dict[str, torch.Tensor]:
        """The live tensors of ``layer`` (references, not copies; local shards of DTensors), by shard name."""
        spec = self.layers[layer]
        out: dict[str, torch.Tensor] = {}
        for n in spec.params:
            out[PARAM + n] = _local(self.tensors[n])
        for n in spec.buffers:
            out[BUFFER + n] = _local(self.tensors[n])
        for n in spec.params:
            for k, v in self.opt_state.get(n, {}).items():
                if isinstance(v, torch.Tensor):
                    out[f"{OPTIM}{n}/{k}"] = _local(v)
        return out

    def param_tensors(self, layer: str) -> dict[str, torch.Tensor]:
        """Only the parameters of ``layer`` (live references)."""
        return {PARAM + n: _local(self.tensors[n]) for n in self.layers[layer].params}

    def layer_meta(self, layer: str) -> dict:
        """JSON metadata of ``layer``: non-tensor optimizer state per parameter, DTensor placements.

        Raises:
            InvalidValueError: a non-tensor optimizer state value that cannot be stored.
        """
        spec = self.layers[layer]
        scalars: dict[str, dict[str, Any]] = {}
        dist_meta: dict[str, Any] = {}
        for n in spec.params:
            vals = {k: v for k, v in self.opt_state.get(n, {}).items() if not isinstance(v, torch.Tensor)}
            if vals:
                scalars[n] = _plain(vals, f"optim.state[{n}]")
        for n in spec.params + spec.buffers:
            t = self.tensors[n]
            if isinstance(t, DTensor):
                dist_meta[(PARAM if n in spec.params else BUFFER) + n] = placement_of(t)
            for k, v in self.opt_state.get(n, {}).items():
                if isinstance(v, DTensor):
                    dist_meta[f"{OPTIM}{n}/{k}"] = placement_of(v)
        meta: dict[str, Any] = {"optim_scalars": scalars}
        if dist_meta:
            meta["dist"] = dist_meta
        return meta

    def optimizer_meta(self) -> dict | None:
        """The param groups: hyper-parameters (encoded JSON) and the names of their parameters.

        Raises:
            InvalidValueError: a hyper-parameter that cannot be stored.
        """
        if self.optimizer is None:
            return None
        groups = []
        for gi, g in enumerate(self.opt_groups):
            hp = {}
            for k, v in g.items():
                if k == "params":
                    continue
                if isinstance(v, torch.Tensor):  # e.g. a tensor lr: its value, filled back in place
                    hp[k] = {"__hp_tensor__": v.item() if v.numel() == 1 else v.tolist()}
                else:
                    hp[k] = _plain(v, f"optim.param_groups[{gi}].{k}")
            groups.append({"params": [self.opt_params[i] for i in g["params"]], "hp": hp})
        return {"type": type(self.optimizer).__name__, "groups": groups}

    def extra_state(self, tensors: dict[str, torch.Tensor] | None = None, prefix: str = "") -> dict[str, Any]:
        """Non-tensor entries of the module's state dict (``_extra_state``), encoded.

        Tensors inside them go into ``tensors`` under ``prefix`` (refused without a table).

        Raises:
            InvalidValueError: one that cannot be stored.
        """
        if tensors is None:
            return {n: _plain(v, f"module.{n}") for n, v in self.extra.items()}
        return {n: encode(v, tensors, prefix, f"module.{n}") for n, v in self.extra.items()}

    def signature(self, layer: str | None = None) -> str:
        """A digest of the layout (names, shapes, dtypes) of one layer or all."""
        h = hashlib.blake2s(digest_size=8)
        for ln in [layer] if layer is not None else sorted(self.layers):
            for n, t in sorted(self.layer_tensors(ln).items()):
                h.update(f"{ln}|{n}|{tuple(t.shape)}|{t.dtype};".encode())
        return h.hexdigest()

    # ---- restore side ----------------------------------------------------------

    @staticmethod
    def _check(layer: str, name: str, got: Any, want: torch.Tensor, meta: dict | None = None) -> None:
        if not isinstance(got, torch.Tensor | PendingTensor):
            raise RestoreMismatchError(f"layer {layer!r} tensor {name!r}: not a tensor", layer=layer, tensor=name)
        local = _local(want)
        if tuple(got.shape) != tuple(local.shape) or got.dtype != local.dtype:
            raise RestoreMismatchError(
                f"layer {layer!r} tensor {name!r}: stored {got.dtype} {tuple(got.shape)}, "
                f"target {local.dtype} {tuple(local.shape)}",
                layer=layer, tensor=name,
            )
        stored = ((meta or {}).get("dist") or {}).get(name)
        mine = placement_of(want) if isinstance(want, DTensor) else None
        if stored != mine and not (stored and mine and {**stored, "stride": None} == {**mine, "stride": None}):
            raise RestoreMismatchError(
                f"layer {layer!r} tensor {name!r}: stored placement {stored}, target {mine}",
                layer=layer, tensor=name,
            )

    def prepare(
        self,
        tensors: Mapping[str, Mapping[str, torch.Tensor]],
        metas: Mapping[str, dict] | None = None,
        optimizer_meta: dict | None = None,
        extra_state: Mapping[str, Any] | None = None,
        loose: Mapping[str, torch.Tensor] | None = None,
        stored_tied: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """Validate everything; return the plan for :meth:`apply`. Changes nothing.

        Args:
            tensors: layer -> shard tensors (as made by :meth:`layer_tensors`).
            metas: layer -> shard metadata (as made by :meth:`layer_meta`).
            optimizer_meta: as made by :meth:`optimizer_meta`; restores the param
                groups' hyper-parameters when given.
            extra_state: as made by :meth:`extra_state`.
            loose: the tensors :meth:`extra_state` put in its table.
            stored_tied: the checkpoint's tied names (its module entry's ``"tied"``: alias -> the name it is
                stored under); a name this module does not tie is filled from its stored source.

        Optimizer tensors in ``tensors`` are ignored when this map has no optimizer
        (a weights-only restore).

        Raises:
            RestoreMismatchError: a missing or unexpected layer or tensor, a
                shape, dtype or placement mismatch, or different param groups.
        """
        metas = metas or {}
        mine_tied = {PARAM + a for a in self.tied} | {BUFFER + a for a in self.tied}
        # a stored layer of nothing but names this module ties (a checkpoint that stored both): nothing to load
        extra = sorted(ln for ln in set(tensors) - set(self.layers)
                       if not (mine_tied and tensors[ln]
                               and all(n in mine_tied or n.startswith(OPTIM) for n in tensors[ln])))
        if extra:
            raise RestoreMismatchError(
                f"stored layer {extra[0]!r} has no counterpart in the module", layer=extra[0], tensor=None
            )
        model_sd: dict[str, Any] = {}
        opt_plan: dict[str, dict[str, Any]] = {}
        tied = dict(stored_tied or {})
        for layer, spec in self.layers.items():
            expected: dict[str, str] = {PARAM + n: n for n in spec.params}
            expected.update({BUFFER + n: n for n in spec.buffers})
            if layer not in tensors and not all(n in tied for n in expected.values()):
                raise RestoreMismatchError(f"layer {layer!r} is missing from the checkpoint", layer=layer, tensor=None)
            stored, meta = tensors.get(layer) or {}, metas.get(layer) or {}
            for name, n in expected.items():
                got = stored.get(name)
                if got is None and n in tied:  # the checkpoint stored it once, under the name it is tied to
                    got = self._tied_source(name, tied[n], tensors)
                if got is None:
                    raise RestoreMismatchError(
                        f"layer {layer!r} tensor {name!r} is missing from the checkpoint", layer=layer, tensor=name
                    )
                self._check(layer, name, got, self.tensors[n], meta)
                model_sd[n] = got
            for name, t in stored.items():
                if name in expected or name in mine_tied:
                    continue
                if not name.startswith(OPTIM):
                    raise RestoreMismatchError(
                        f"layer {layer!r} tensor {name!r} has no counterpart in the target", layer=layer, tensor=name
                    )
                if self.optimizer is None:
                    continue
                pname, _, key = name[len(OPTIM):].rpartition("/")
                if pname not in spec.params:
                    raise RestoreMismatchError(
                        f"layer {layer!r} tensor {name!r}: no parameter {pname!r} in this layer",
                        layer=layer, tensor=name,
                    )
                cur = self.opt_state.get(pname, {}).get(key)
                if isinstance(cur, torch.Tensor):
                    self._check(layer, name, t, cur, meta)
                elif t.dim() > 0 and tuple(t.shape) != tuple(_local(self.tensors[pname]).shape):
                    raise RestoreMismatchError(
                        f"layer {layer!r} tensor {name!r}: stored {tuple(t.shape)} does not fit parameter "
                        f"{tuple(_local(self.tensors[pname]).shape)}",
                        layer=layer, tensor=name,
                    )
                opt_plan.setdefault(pname, {})[key] = t
            if self.optimizer is not None:
                for pname, vals in (meta.get("optim_scalars") or {}).items():
                    if pname not in spec.params:
                        raise RestoreMismatchError(
                            f"layer {layer!r}: optimizer state of unknown parameter {pname!r}",
                            layer=layer, tensor=pname,
                        )
                    opt_plan.setdefault(pname, {}).update(decode(vals, {}))
        want_extra = set(self.extra)
        got_extra = set(extra_state or {})
        if want_extra - got_extra:
            n = sorted(want_extra - got_extra)[0]
            raise RestoreMismatchError(f"module state {n!r} is missing from the checkpoint", layer=None, tensor=n)
        groups = None
        if self.optimizer is not None:
            groups = self._plan_groups(optimizer_meta)
        return {"model": model_sd,
                "extra": {n: decode(extra_state[n], loose or {}) for n in want_extra} if extra_state else {},
                "optim": opt_plan, "groups": groups}

    def _tied_source(self, name: str, source: str, tensors: Mapping[str, Mapping[str, torch.Tensor]]) -> Any:
        """The stored tensor a tied ``name`` (``param/...`` or ``buffer/...``) was stored under: ``source``."""
        kind = PARAM if name.startswith(PARAM) else BUFFER
        for stored in tensors.values():
            if kind + source in stored:
                return stored[kind + source]
        return None

    def _plan_groups(self, optimizer_meta: dict | None) -> list[dict[str, Any]]:
        assert self.optimizer is not None
        current = [{k: v for k, v in g.items() if k != "params"} for g in self.opt_groups]
        if optimizer_meta is None:
            return current
        groups = optimizer_meta.get("groups", [])
        if len(groups) != len(self.opt_groups):
            raise RestoreMismatchError(
                f"optimizer has {len(self.opt_groups)} param groups, checkpoint {len(groups)}",
                layer=None, tensor=None,
            )
        out = []
        for gi, (g, sg) in enumerate(zip(self.opt_groups, groups)):
            names = [self.opt_params[i] for i in g["params"]]
            if names != sg.get("params"):
                raise RestoreMismatchError(
                    f"optimizer param group {gi} holds different parameters than the checkpoint",
                    layer=None, tensor=f"param_groups[{gi}]",
                )
            hp = dict(current[gi])
            for k, v in (sg.get("hp") or {}).items():
                if isinstance(v, dict) and set(v) == {"__hp_tensor__"}:
                    cur = hp.get(k)
                    if isinstance(cur, torch.Tensor):
                        v = cur.detach().clone().fill_(v["__hp_tensor__"]) if cur.numel() == 1 else torch.tensor(
                            v["__hp_tensor__"], dtype=cur.dtype, device=cur.device)
                    else:
                        v = v["__hp_tensor__"]
                else:
                    v = decode(v, {})
                    if isinstance(hp.get(k), tuple) and isinstance(v, list):
                        v = tuple(v)
                hp[k] = v
            out.append(hp)
        return out

    def apply(self, plan: dict[str, Any]) -> None:
        """Load a plan made by :meth:`prepare`: the module in place, the optimizer through ``load_state_dict``."""
        sd: OrderedDict[str, Any] = OrderedDict()
        for n, t in plan["model"].items():
            cur = self.tensors[n]
            sd[self._key[n]] = (DTensor.from_local(t, cur.device_mesh, cur.placements, run_check=False,
                                                   shape=cur.shape, stride=cur.stride())
                                if isinstance(cur, DTensor) else t)
        for alias, source in self.tied.items():  # the same tensor under its other name (load_state_dict wants both)
            if source in plan["model"]:
                sd[self._key[alias]] = sd[self._key[source]]
        for n, v in plan["extra"].items():
            sd[self._key[n]] = v
        sd._metadata = getattr(self._sd, "_metadata", OrderedDict())  # type: ignore[attr-defined]
        self.inner.load_state_dict(sd, strict=True)
        if self.optimizer is None:
            return
        index = {n: i for i, n in enumerate(self.opt_params)}
        state: dict[int, dict[str, Any]] = {}
        objs = [q for g in self.optimizer.param_groups for q in g["params"]]  # in the order of opt_params
        current = self.optimizer.state
        reused: set[int] = set()
        for pname, vals in plan["optim"].items():
            p = self.tensors[pname]
            i = index.get(pname)
            held = current.get(objs[i]) if i is not None and i < len(objs) else None
            entry: dict[str, Any] = {}
            for k, v in vals.items():
                if isinstance(v, torch.Tensor | PendingTensor):
                    dev = _local(p).device if v.dim() > 0 else torch.device("cpu")
                    into = _in_place_target(held.get(k) if isinstance(held, dict) else None, v, p, dev, reused)
                    if into is not None:  # the optimizer's own tensor, its pages already there: no new memory
                        if isinstance(v, PendingTensor):
                            v.fill(_local(into))
                        else:
                            with torch.no_grad():
                                _local(into).copy_(v.detach())
                        entry[k] = into
                        continue
                    v = v.tensor(dev) if isinstance(v, PendingTensor) else v.detach().to(dev, copy=True)
                    if isinstance(p, DTensor) and v.dim() > 0:  # state shaped like its parameter: sharded alike
                        v = DTensor.from_local(v, p.device_mesh, p.placements, run_check=False,
                                               shape=p.shape, stride=p.stride())
                entry[k] = v
            if entry and pname in index:
                state[index[pname]] = entry
        groups = []
        for g, hp in zip(self.opt_groups, plan["groups"]):
            groups.append({**hp, "params": list(g["params"])})
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})

    def apply_groups(self, optimizer_meta: dict) -> None:
        """Set the param groups' hyper-parameters from ``optimizer_meta`` (validated first), state untouched.

        Raises:
            RestoreMismatchError: different param groups.
        """
        if self.optimizer is None:
            return
        for g, hp in zip(self.optimizer.param_groups, self._plan_groups(optimizer_meta)):
            for k, v in hp.items():
                cur = g.get(k)
                if isinstance(cur, torch.Tensor) and isinstance(v, torch.Tensor) and cur.shape == v.shape:
                    cur.copy_(v)
                else:
                    g[k] = v

    def load(
        self,
        tensors: Mapping[str, Mapping[str, torch.Tensor]],
        metas: Mapping[str, dict] | None = None,
        optimizer_meta: dict | None = None,
        extra_state: Mapping[str, Any] | None = None,
    ) -> None:
        """:meth:`prepare` (validate everything), then :meth:`apply`."""
        self.apply(self.prepare(tensors, metas, optimizer_meta, extra_state))
