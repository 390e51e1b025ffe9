"""Map a module's and an optimizer's state into layers of named tensors, and back.

A *layer* is the unit of a checkpoint shard: by default the module prefix of a
parameter (``blocks.3.attn.qkv.weight`` -> ``blocks.3``, ``embed.weight`` ->
``embed``), or whatever ``layer_fn(param_name)`` returns, made a valid key name.
A layer's shard holds, under these tensor names:

* ``param/<name>``: the parameter,
* ``buffer/<name>``: a buffer of the module,
* ``optim/<name>/<key>``: tensor-valued optimizer state of the parameter
  (Adam's ``exp_avg``, ``exp_avg_sq``, ``step``; SGD's ``momentum_buffer``; any
  other tensor),

and JSON metadata ``{"optim_scalars": {name: {key: value}}}`` for non-tensor
per-parameter state. The optimizer's param groups (hyper-parameters and the
names of their parameters) are described by :meth:`StateMap.optimizer_meta`,
which goes into the step's JSON ``extra``.

Restore protocol: :meth:`StateMap.load` validates every layer, tensor, shape and
dtype (and the param groups) *before* it changes anything; any mismatch raises
:class:`~tierstore.errors.RestoreMismatchError` naming the layer and tensor, and
leaves module and optimizer untouched. Only then it copies in place
(``param.copy_``), and creates optimizer state that does not exist yet (an
optimizer that has not stepped).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from tierstore.errors import InvalidValueError, RestoreMismatchError
from tierstore.keys import validate_name

__all__ = [
    "BUFFER",
    "OPTIM",
    "PARAM",
    "LayerSpec",
    "StateMap",
    "default_layer_fn",
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
    """The module prefix of a parameter or buffer name.

    ``blocks.3.attn.w`` -> ``blocks.3`` (a container index joins its parent),
    ``embed.weight`` -> ``embed``, a top-level ``pos`` -> ``pos``.
    """
    parts = name.split(".")
    if len(parts) == 1:
        return parts[0]
    if len(parts) >= 3 and parts[1].isdigit():
        return parts[0] + "." + parts[1]
    return parts[0]


def _jsonable(v: Any) -> bool:
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False


@dataclass
class LayerSpec:
    """The parameters and buffers of one layer (names as in the module)."""

    name: str
    params: list[str] = field(default_factory=list)
    buffers: list[str] = field(default_factory=list)


class StateMap:
    """The layer view of ``module`` (and ``optimizer``) state.

    Args:
        module: the model; parameters are taken once each (tied weights once).
        optimizer: optional; every parameter it holds must belong to ``module``.
        layer_fn: ``param_name -> layer name``; the result is sanitised.

    Raises:
        InvalidValueError: the optimizer holds a parameter not in the module.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        layer_fn: Callable[[str], str] | None = None,
    ) -> None:
        self.module = module
        self.optimizer = optimizer
        fn = layer_fn or default_layer_fn
        self.params: dict[str, torch.nn.Parameter] = dict(module.named_parameters())
        self.buffers: dict[str, torch.Tensor] = {
            n: b for n, b in module.named_buffers() if b is not None
        }
        self.layers: dict[str, LayerSpec] = {}
        self.layer_of: dict[str, str] = {}
        for kind, names in (("p", self.params), ("b", self.buffers)):
            for n in names:
                layer = sanitize_layer_name(fn(n))
                spec = self.layers.setdefault(layer, LayerSpec(layer))
                (spec.params if kind == "p" else spec.buffers).append(n)
                self.layer_of[n] = layer
        self._name_of: dict[int, str] = {id(p): n for n, p in self.params.items()}
        if optimizer is not None:
            for gi, group in enumerate(optimizer.param_groups):
                for p in group["params"]:
                    if id(p) not in self._name_of:
                        raise InvalidValueError(
                            f"optimizer param group {gi} holds a parameter that is not in the module",
                            group=gi,
                        )

    # ---- save side -------------------------------------------------------------

    def layer_tensors(self, layer: str) -> dict[str, torch.Tensor]:
        """The live tensors of ``layer`` (references, not copies), by shard name."""
        spec = self.layers[layer]
        out: dict[str, torch.Tensor] = {}
        for n in spec.params:
            out[PARAM + n] = self.params[n].detach()
        for n in spec.buffers:
            out[BUFFER + n] = self.buffers[n].detach()
        if self.optimizer is not None:
            for n in spec.params:
                for k, v in self.optimizer.state.get(self.params[n], {}).items():
                    if isinstance(v, torch.Tensor):
                        out[f"{OPTIM}{n}/{k}"] = v.detach()
        return out

    def param_tensors(self, layer: str) -> dict[str, torch.Tensor]:
        """Only the parameters of ``layer`` (live references)."""
        return {PARAM + n: self.params[n].detach() for n in self.layers[layer].params}

    def layer_meta(self, layer: str) -> dict:
        """JSON metadata of ``layer``: non-tensor optimizer state per parameter."""
        scalars: dict[str, dict[str, Any]] = {}
        if self.optimizer is not None:
            for n in self.layers[layer].params:
                st = self.optimizer.state.get(self.params[n], {})
                vals = {k: v for k, v in st.items() if not isinstance(v, torch.Tensor)}
                for k, v in vals.items():
                    if not _jsonable(v):
                        raise InvalidValueError(
                            f"optimizer state {k!r} of {n!r} is neither a tensor nor JSON", tensor=n
                        )
                if vals:
                    scalars[n] = vals
        return {"optim_scalars": scalars}

    def optimizer_meta(self) -> dict | None:
        """The param groups: hyper-parameters (JSON) and parameter names."""
        if self.optimizer is None:
            return None
        groups = []
        for g in self.optimizer.param_groups:
            hp = {}
            for k, v in g.items():
                if k == "params":
                    continue
                if isinstance(v, torch.Tensor):
                    v = v.item() if v.numel() == 1 else v.tolist()
                if _jsonable(v):
                    hp[k] = list(v) if isinstance(v, tuple) else v
            groups.append({"params": [self._name_of[id(p)] for p in g["params"]], "hp": hp})
        return {"type": type(self.optimizer).__name__, "groups": groups}

    def signature(self, layer: str | None = None) -> str:
        """A digest of the layout (names, shapes, dtypes) of one layer or all."""
        h = hashlib.blake2s(digest_size=8)
        for ln in [layer] if layer is not None else sorted(self.layers):
            for n, t in sorted(self.layer_tensors(ln).items()):
                h.update(f"{ln}|{n}|{tuple(t.shape)}|{t.dtype};".encode())
        return h.hexdigest()

    # ---- restore side ----------------------------------------------------------

    def _check(self, layer: str, name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if not isinstance(got, torch.Tensor):
            raise RestoreMismatchError(f"layer {layer!r} tensor {name!r}: not a tensor", layer=layer, tensor=name)
        if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
            raise RestoreMismatchError(
                f"layer {layer!r} tensor {name!r}: stored {got.dtype} {tuple(got.shape)}, "
                f"target {want.dtype} {tuple(want.shape)}",
                layer=layer,
                tensor=name,
            )

    def load(
        self,
        tensors: Mapping[str, Mapping[str, torch.Tensor]],
        metas: Mapping[str, dict] | None = None,
        optimizer_meta: dict | None = None,
    ) -> None:
        """Validate everything, then load in place.

        Args:
            tensors: layer -> shard tensors (as made by :meth:`layer_tensors`).
            metas: layer -> shard metadata (as made by :meth:`layer_meta`).
            optimizer_meta: as made by :meth:`optimizer_meta`; restores the
                param groups' hyper-parameters when given.

        Raises:
            RestoreMismatchError: a missing or unexpected layer or tensor, a
                shape or dtype mismatch, or different param groups; nothing
                was changed.
        """
        metas = metas or {}
        extra = sorted(set(tensors) - set(self.layers))
        if extra:
            raise RestoreMismatchError(
                f"stored layer {extra[0]!r} has no counterpart in the module", layer=extra[0], tensor=None
            )
        opt_plan: dict[str, dict[str, Any]] = {}
        for layer, spec in self.layers.items():
            if layer not in tensors:
                raise RestoreMismatchError(f"layer {layer!r} is missing from the checkpoint", layer=layer, tensor=None)
            stored = tensors[layer]
            expected: dict[str, torch.Tensor] = {PARAM + n: self.params[n] for n in spec.params}
            expected.update({BUFFER + n: self.buffers[n] for n in spec.buffers})
            for name, want in expected.items():
                if name not in stored:
                    raise RestoreMismatchError(
                        f"layer {layer!r} tensor {name!r} is missing from the checkpoint", layer=layer, tensor=name
                    )
                self._check(layer, name, stored[name], want)
            scalars = (metas.get(layer) or {}).get("optim_scalars", {})
            for name, t in stored.items():
                if name in expected:
                    continue
                if not name.startswith(OPTIM) or self.optimizer is None:
                    raise RestoreMismatchError(
                        f"layer {layer!r} tensor {name!r} has no counterpart in the target", layer=layer, tensor=name
                    )
                pname, _, key = name[len(OPTIM):].rpartition("/")
                if pname not in spec.params:
                    raise RestoreMismatchError(
                        f"layer {layer!r} tensor {name!r}: no parameter {pname!r} in this layer",
                        layer=layer,
                        tensor=name,
                    )
                cur = self.optimizer.state.get(self.params[pname], {}).get(key)
                if isinstance(cur, torch.Tensor):
                    self._check(layer, name, t, cur)
                elif t.dim() > 0 and tuple(t.shape) != tuple(self.params[pname].shape):
                    raise RestoreMismatchError(
                        f"layer {layer!r} tensor {name!r}: stored {tuple(t.shape)} does not fit parameter "
                        f"{tuple(self.params[pname].shape)}",
                        layer=layer,
                        tensor=name,
                    )
                opt_plan.setdefault(pname, {})[key] = t
            for pname, vals in scalars.items():
                if pname not in spec.params:
                    raise RestoreMismatchError(
                        f"layer {layer!r}: optimizer state of unknown parameter {pname!r}", layer=layer, tensor=pname
                    )
                opt_plan.setdefault(pname, {}).update(vals)
            if self.optimizer is not None:
                for n in spec.params:
                    opt_plan.setdefault(n, {})
        if optimizer_meta is not None and self.optimizer is not None:
            groups = optimizer_meta.get("groups", [])
            if len(groups) != len(self.optimizer.param_groups):
                raise RestoreMismatchError(
                    f"optimizer has {len(self.optimizer.param_groups)} param groups, checkpoint {len(groups)}",
                    layer=None,
                    tensor=None,
                )
            for gi, (g, sg) in enumerate(zip(self.optimizer.param_groups, groups)):
                names = [self._name_of[id(p)] for p in g["params"]]
                if names != sg.get("params"):
                    raise RestoreMismatchError(
                        f"optimizer param group {gi} holds different parameters than the checkpoint",
                        layer=None,
                        tensor=f"param_groups[{gi}]",
                    )
        # ---- nothing has been changed up to here; apply ----
        with torch.no_grad():
            for layer, spec in self.layers.items():
                stored = tensors[layer]
                for n in spec.params:
                    self.params[n].copy_(stored[PARAM + n])
                for n in spec.buffers:
                    self.buffers[n].copy_(stored[BUFFER + n])
            if self.optimizer is not None:
                for pname, vals in opt_plan.items():
                    p = self.params[pname]
                    old = self.optimizer.state.get(p, {})
                    new: dict[str, Any] = {}
                    for k, v in vals.items():
                        cur = old.get(k)
                        if isinstance(v, torch.Tensor):
                            if isinstance(cur, torch.Tensor) and cur.shape == v.shape and cur.dtype == v.dtype:
                                new[k] = cur.copy_(v)
                            else:
                                dev = p.device if v.dim() > 0 else torch.device("cpu")
                                new[k] = v.detach().to(dev, copy=True)
                        else:
                            new[k] = v
                    if new:
                        self.optimizer.state[p] = new
                    elif p in self.optimizer.state:
                        del self.optimizer.state[p]
                if optimizer_meta is not None:
                    for g, sg in zip(self.optimizer.param_groups, optimizer_meta.get("groups", [])):
                        for k, v in sg.get("hp", {}).items():
                            if isinstance(g.get(k), tuple) and isinstance(v, list):
                                v = tuple(v)
                            if isinstance(g.get(k), torch.Tensor):
                                g[k].fill_(v)
                            else:
                                g[k] = v
