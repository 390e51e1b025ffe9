"""A committed step read back as plain state dicts, without the live objects it was saved from.

The Checkpointer restores in place, into the modules and optimizers of its
``state``. A framework's load path sometimes needs the state *before* those
objects exist: Lightning's ``CheckpointIO.load_checkpoint`` returns a dict
(``state_dict``, ``optimizer_states``, ...) before the strategy has built
its optimizers, and loads it itself. :func:`read_plain` gives that dict's
parts from a step's layers and JSON document (:mod:`tierstore.train.view`):

* a module entry -> its ``state_dict()``: ``param/<name>`` and
  ``buffer/<name>`` tensors under their (normalised) names, plus its
  non-tensor entries (``_extra_state``);
* an optimizer entry -> its ``state_dict()``: ``{"state": {index: {key:
  value}}, "param_groups": [...]}`` with the indices of ``torch.optim``'s
  format, in the order of the stored param groups (the optimizer the
  training script builds over the same module holds its parameters in that
  order), tensor state from ``optim/<name>/<key>``, non-tensor state and
  hyper-parameters from the document;
* every other entry -> its decoded value (``templates`` give enums and
  dataclasses their classes, see :func:`tierstore.train.values.decode`).

One rank's view is read (``rank``): data-parallel replicas hold everything; a
layer saved sharded (DTensor placements in its metadata: FSDP2) is reassembled
from every rank's shards into full tensors
(:func:`~tierstore.train.gather.assemble_layer`), as a gathered state dict
holds them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tierstore.errors import RestoreMismatchError
from tierstore.train.gather import assemble_layer, read_object, read_shards
from tierstore.train.layers import BUFFER, OPTIM, PARAM
from tierstore.train.values import decode
from tierstore.train.view import STATE_LAYER

__all__ = ["PlainStep", "read_plain"]


@dataclass
class PlainStep:
    """A step as plain values: ``entries`` (state key -> state dict or value) and the save's ``extra``."""

    step: int
    entries: dict[str, Any]
    extra: Any


def read_plain(store: Any, model: str, step: int | None = None, *, rank: int = 0, max_staleness: int = 0,
               only: Iterable[str] | None = None, templates: Mapping[str, Any] | None = None) -> PlainStep:
    """Read committed ``step`` of ``model`` (the newest without one) as plain state dicts; see the module docstring.

    Takes no epoch and writes nothing.

    Raises:
        NoValidCopyError: ``step`` is not committed, or an object has no valid copy.
        RestoreMismatchError: an entry of ``only`` is not in the step.
    """
    res = store.resolve(model, max_staleness, step=step)
    src = rank if rank < res.world_size else rank % res.world_size
    doc = (res.extra.get(src) or res.extra.get(str(src)) or {}).get("state") or {}
    entries = doc.get("entries") or {}
    keys = list(entries) if only is None else list(only)
    for k in keys:
        if k not in entries:
            raise RestoreMismatchError(f"state entry {k!r} is not in step {res.step} of {model} (it holds "
                                       f"{sorted(entries)})", layer=None, tensor=k)
    want = {STATE_LAYER}
    for k in keys:
        e = entries[k]
        if e.get("kind") == "optimizer":
            want.update(entries.get(e.get("module"), {}).get("layers") or [])
        want.update(e.get("layers") or [])
    shards = read_shards(store, model, res, src, [ln for ln in res.layers if ln in want])
    for ln, (ts, meta) in list(shards.items()):
        if meta.get("dist"):  # sharded: every rank's shards, reassembled
            shards[ln] = (_assembled(store, model, res, ln, src, (ts, meta)), meta)
    loose = {n: t.clone() for n, t in (shards.get(STATE_LAYER) or ({}, {}))[0].items()}
    templates = templates or {}
    out: dict[str, Any] = {}
    for k in keys:
        e = entries[k]
        kind = e.get("kind")
        if kind == "module":
            out[k] = _module_sd(k, e, shards, loose)
        elif kind == "optimizer":
            out[k] = _optimizer_sd(k, e, entries.get(e.get("module")) or {}, shards)
        else:
            out[k] = decode(e.get("value"), loose, k, **({"like": templates[k]} if k in templates else {}))
    return PlainStep(res.step, out, decode(doc.get("user"), loose, "extra"))


def _assembled(store: Any, model: str, res: Any, layer: str, src: int,
               have: tuple[dict[str, torch.Tensor], dict]) -> dict[str, torch.Tensor]:
    """The full tensors of a sharded ``layer`` (``have``: rank ``src``'s object, already read)."""
    def read(r: int) -> tuple[dict[str, torch.Tensor], dict]:
        return (dict(have[0]), have[1]) if r == src else read_object(store, model, layer, res.objects[(layer, r)].key)

    return assemble_layer(read, sorted(r for ln, r in res.objects if ln == layer), lambda _n: True)


def _layers(key: str, entry: Mapping[str, Any], shards: Mapping[str, Any]) -> list[str]:
    layers = list(entry.get("layers") or [])
    missing = [ln for ln in layers if ln not in shards]
    if missing:
        raise RestoreMismatchError(f"layer {missing[0]!r} of {key!r} was not read", layer=missing[0], tensor=None)
    return layers


def _module_sd(key: str, entry: Mapping[str, Any], shards: Mapping[str, Any],
               loose: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    sd: dict[str, Any] = {}
    for ln in _layers(key, entry, shards):
        for name, t in shards[ln][0].items():
            for prefix in (PARAM, BUFFER):
                if name.startswith(prefix):
                    sd[name[len(prefix):]] = t
    tied = entry.get("tied") or {}
    for alias, source in tied.items() if isinstance(tied, dict) else ():  # stored once: both names, one tensor
        if isinstance(alias, str) and source in sd:
            sd[alias] = sd[source]
    for name, v in (entry.get("extra") or {}).items():
        sd[name] = decode(v, loose, f"{key}.{name}")
    return sd


def _optimizer_sd(key: str, entry: Mapping[str, Any], module: Mapping[str, Any],
                  shards: Mapping[str, Any]) -> dict[str, Any]:
    meta = entry.get("meta") or {}
    groups = meta.get("groups") or []
    names = [n for g in groups for n in g.get("params") or []]
    index = {n: i for i, n in enumerate(names)}
    state: dict[int, dict[str, Any]] = {}
    for ln in _layers(str(entry.get("module")), module, shards):
        tensors, lmeta = shards[ln]
        for name, t in tensors.items():
            if name.startswith(OPTIM):
                pname, _, k = name[len(OPTIM):].rpartition("/")
                if pname in index:
                    state.setdefault(index[pname], {})[k] = t
        for pname, vals in ((lmeta or {}).get("optim_scalars") or {}).items():
            if pname in index:
                state.setdefault(index[pname], {}).update(decode(vals, {}, f"{key}.state[{pname}]"))
    out_groups = []
    start = 0
    for gi, g in enumerate(groups):
        hp: dict[str, Any] = {}
        for k, v in (g.get("hp") or {}).items():
            if isinstance(v, dict) and set(v) == {"__hp_tensor__"}:
                v = torch.tensor(v["__hp_tensor__"])
            else:
                v = decode(v, {}, f"{key}.param_groups[{gi}].{k}")
            hp[k] = v
        n = len(g.get("params") or [])
        out_groups.append({**hp, "params": list(range(start, start + n))})
        start += n
    return {"state": {i: state[i] for i in sorted(state)}, "param_groups": out_groups}
