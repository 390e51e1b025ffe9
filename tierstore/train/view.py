"""The whole trainer state as layers of tensors plus one JSON document, and back.

:class:`StateView` wraps the ``state`` mapping a Checkpointer is given
(``{"model": model, "optim": opt, "sched": sched, "data": loader, "rng":
RNGState()}``) and, at every save, re-reads it (:meth:`StateView.collect`):

* each ``nn.Module`` becomes a :class:`~tierstore.train.layers.StateMap`
  with the optimizer that holds its parameters (found by identity, each
  save), so its tensors land in per-block layers with their optimizer state;
* every other entry (a ``Stateful``'s ``state_dict()``, or a plain value)
  and the save's ``extra`` are encoded by :func:`~tierstore.train.state.encode`:
  JSON, with their tensors moved to the ``_state`` layer (``state/<key>/<n>``,
  ``extra/<n>``), saved at every step.

The JSON document (per rank, in the step's vote) is::

    {"entries": {key: {"kind": "module", "prefix": str, "layers": [...], "extra": {...}}
                    | {"kind": "optimizer", "module": key, "meta": {...}}
                    | {"kind": "stateful" | "value", "value": <encoded>}},
     "user": <encoded extra>}

Restore (:meth:`StateView.prepare`, then :meth:`StateView.apply`): every
targeted entry must be in the checkpoint; entries of the checkpoint that are
not targeted are skipped (a weights-only restore targets ``{"model": m}``).
Modules and optimizers are validated completely before anything changes;
then modules and optimizers are loaded, then the other entries in the order
of the mapping (``load_state_dict`` for ``Stateful`` objects; a plain tensor
is copied in place; any other plain value replaces the mapping's entry).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from tierstore.errors import InvalidValueError, RestoreMismatchError
from tierstore.train.layers import StateMap
from tierstore.train.state import decode, encode, is_stateful, optimizer_types

__all__ = ["STATE_LAYER", "Collected", "RestoreReport", "Restored", "StateView"]

STATE_LAYER = "_state"


class Restored(NamedTuple):
    """What :meth:`Checkpointer.restore` returns: the step restored (``None``: nothing) and the save's ``extra``."""

    step: int | None
    extra: Any


@dataclass
class RestoreReport:
    """What the last :meth:`Checkpointer.restore` did (``ckpt.report``).

    Attributes:
        step: the step restored (``None``: nothing committed).
        newest: the newest committed step of the model.
        read_only: whether the restore was read-only (no epoch taken).
        epoch: the writer's epoch after the restore.
        fell_back: ``step`` is older than ``newest``, and ``reason`` says why.
        base_step, replayed: gradient-log replay: the base and the log steps replayed.
        base_s, replay_s: seconds spent loading the state (the base) and replaying.
        resharded: layers read by ranges because this rank's layout differs from the saved one
            (another world size or sharding; :mod:`tierstore.train.reshard`).
        bytes_read: bytes this rank read from the tiers for its layers (objects read whole count whole).
        bad_copies: copies that a ranged read found corrupt or unreachable (it read another tier's instead).
        verify: how the copies were verified (``"before_update"``, ``"before_return"``, ``"in_pass"``:
            :mod:`tierstore.train.restoring`).
        verified_s: seconds from the start of the restore until every copy had verified (``None``: not
            yet known, or verified as it was copied).
        phases: seconds of each part of the restore on this rank, in order: ``"agree"`` (the verify mode,
            the epoch and the committed steps), ``"resolve"`` (the step every rank restores: a collective),
            ``"read"`` (this rank's copies read unverified, and the verdict every rank agrees on) and
            ``"load"`` (checked on every rank, a collective, then loaded in place); a restore verified as
            it reads (in pass, resharded) has ``"read+load"`` instead of the last two. A restore that reads
            again verified adds the parts of the second read to these.
    """

    step: int | None = None
    newest: int | None = None
    read_only: bool = False
    epoch: int | None = None
    fell_back: bool = False
    reason: str | None = None
    base_step: int | None = None
    replayed: list[int] = field(default_factory=list)
    base_s: float = 0.0
    replay_s: float = 0.0
    resharded: list[str] = field(default_factory=list)
    bytes_read: int = 0
    bad_copies: list[str] = field(default_factory=list)
    verify: str | None = None
    verified_s: float | None = None
    phases: dict[str, float] = field(default_factory=dict)


@dataclass
class Collected:
    """One save's view of the state: live tensor references by layer, metadata, the JSON document."""

    maps: dict[str, StateMap]
    layers: dict[str, dict[str, torch.Tensor]]
    metas: dict[str, dict]
    doc: dict[str, Any]
    always: set[str] = field(default_factory=set)  # layers saved at every step whatever the policy

    def param_tensors(self, layer: str) -> dict[str, torch.Tensor]:
        for m in self.maps.values():
            if layer in m.layers:
                return m.param_tensors(layer)
        return {}


def _none_entry(key: str) -> InvalidValueError:
    return InvalidValueError(
        f"state entry {key!r} is None: the Checkpointer saves the objects it holds (re-read at every save), so an "
        "entry must hold its module, optimizer or Stateful when the Checkpointer is built and at every save. Build "
        "the Checkpointer once the object exists (the Hugging Face Trainer makes its optimizer and scheduler inside "
        "train(): use tierstore.interop.huggingface), or leave the entry out", key=key)


def _state_dict_of(key: str, v: Any) -> Any:
    """``v.state_dict()``, or a typed error naming the entry when it raises (an object that only looks Stateful)."""
    try:
        return v.state_dict()
    except Exception as e:  # any failure of a foreign state_dict() is reported, typed, with its cause
        fix = ""
        if isinstance(v, torch.utils.data.DataLoader):
            fix = (": a DataLoader is checkpointed through torchdata's StatefulDataLoader (Accelerate: "
                   "Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True)))")
        raise InvalidValueError(f"state entry {key!r}: {type(v).__qualname__}.state_dict() raised {e!r}{fix}",
                                key=key) from e


def _template(target: Any) -> Any:
    """What a restore of ``target`` decodes against (see :func:`~tierstore.train.values.decode`'s ``like``)."""
    if not is_stateful(target):
        return target
    try:
        return target.state_dict()
    except Exception:  # noqa: BLE001 - no template: enums and dataclasses decode to plain values
        return None


def _check_tensor(key: str, name: str, t: torch.Tensor) -> None:
    if t.layout != torch.strided or t.is_nested or t.is_quantized or t.device.type == "meta":
        raise InvalidValueError(f"state {key!r}: tensor {name!r} is not dense and strided", key=key, tensor=name)


def _check_optimizer(key: str, opt: Any, stored: Mapping[str, Any], m: StateMap) -> None:
    """Refuse another optimizer type, or param groups of another count or membership, before anything loads.

    The stored type is the entry's ``"class"`` (the innermost optimizer's qualname, since it was saved), else,
    in older checkpoints, ``meta["type"]`` (the class name of the object held, a wrapper's where wrapped).

    Raises:
        RestoreMismatchError: naming both types, or the group that differs.
    """
    meta = stored.get("meta") or {}
    mine = optimizer_types(opt)
    theirs = stored.get("class") or meta.get("type")
    if theirs is not None and theirs not in (mine if stored.get("class") is None else mine[:1]):
        raise RestoreMismatchError(
            f"optimizer {key!r} is a {mine[0]}, the checkpoint's a {theirs}: its state and hyper-parameters do not "
            "apply (restore(..., weights_only=True) loads the modules alone)", layer=None, tensor=key,
            stored=theirs, target=mine[0])
    groups = meta.get("groups")
    if groups is None:
        return
    if len(groups) != len(m.opt_groups):
        raise RestoreMismatchError(f"optimizer {key!r} has {len(m.opt_groups)} param groups, the checkpoint "
                                   f"{len(groups)}", layer=None, tensor=key)
    for gi, (g, sg) in enumerate(zip(m.opt_groups, groups)):
        n, sn = len(g["params"]), len(sg.get("params") or [])
        if n != sn:
            raise RestoreMismatchError(f"optimizer {key!r} param group {gi} holds {n} parameters, the checkpoint's "
                                       f"{sn}", layer=None, tensor=f"param_groups[{gi}]")


def _check_extra(key: str, m: StateMap, stored: Mapping[str, Any]) -> None:
    """Refuse a module whose non-tensor state (``_extra_state``) the checkpoint lacks, or holds more of."""
    missing, unexpected = sorted(set(m.extra) - set(stored)), sorted(set(stored) - set(m.extra))
    if missing or unexpected:
        raise RestoreMismatchError(f"module {key!r}: missing keys {missing}, unexpected keys {unexpected} (its "
                                   "non-tensor state)", layer=None, tensor=(missing or unexpected)[0])


def _check_state_keys(key: str, m: StateMap, plan: Mapping[str, Mapping[str, Any]]) -> None:
    """Refuse optimizer state whose keys differ from the target's, for each parameter both hold state of."""
    for pname, vals in plan.items():
        cur = m.opt_state.get(pname) or {}
        if cur and set(cur) != set(vals):
            raise RestoreMismatchError(
                f"optimizer {key!r} state of {pname!r}: the checkpoint holds {sorted(vals)}, the target "
                f"{sorted(cur)}", layer=None, tensor=pname)


class StateView:
    """The trainer state of one rank; see the module docstring.

    Args:
        state: ``key -> Stateful object or plain value``; kept by reference
            (its entries are re-read at every save, and plain values are
            replaced in it by a restore).
        layer_fn: ``name -> layer name`` for the modules' tensors.

    Raises:
        InvalidValueError: a key that is not a non-empty str.
    """

    def __init__(self, state: MutableMapping[str, Any], layer_fn: Callable[[str], str] | None = None) -> None:
        for k in state:
            if not isinstance(k, str) or not k or "/" in k:
                raise InvalidValueError(f"state keys must be non-empty str without '/', got {k!r}", key=str(k))
        self.state = state
        self.layer_fn = layer_fn

    def _modules(self) -> list[str]:
        return [k for k, v in self.state.items() if isinstance(v, nn.Module)]

    def _optimizers(self) -> list[str]:
        return [k for k, v in self.state.items() if isinstance(v, torch.optim.Optimizer)]

    def maps(self, keys: Iterable[str] | None = None) -> dict[str, StateMap]:
        """A fresh :class:`StateMap` per module (of ``keys``), each with the optimizer of its parameters.

        Raises:
            InvalidValueError: an optimizer whose parameters are not all in one module,
                or two optimizers over one module.
        """
        modules = self._modules()
        wanted = set(self.state if keys is None else keys)
        prefix = {k: ("" if len(modules) == 1 else f"{k}.") for k in modules}
        owner: dict[str, str] = {}
        for ok in self._optimizers():
            if ok not in wanted:
                continue
            params = [p for g in self.state[ok].param_groups for p in g["params"]]
            for mk in modules:
                ids = {id(p) for p in self.state[mk].parameters()}
                if all(id(p) in ids for p in params):
                    if mk in owner.values():
                        raise InvalidValueError(f"two optimizers ({ok!r} and another) hold parameters of module "
                                                f"{mk!r}; one optimizer per module is supported", key=ok)
                    owner[ok] = mk
                    break
            else:
                raise InvalidValueError(f"optimizer {ok!r} holds parameters that are not all in one module of the "
                                        f"state ({modules})", key=ok)
        opt_of = {mk: self.state[ok] for ok, mk in owner.items()}
        self.owner = owner
        return {mk: StateMap(self.state[mk], opt_of.get(mk), self.layer_fn, prefix=prefix[mk])
                for mk in modules if mk in wanted}

    # ---- save side ----------------------------------------------------------------------

    def collect(self, extra: Any = None) -> Collected:
        """Re-read every entry: live tensor references by layer and the JSON document. Writes nothing.

        Raises:
            InvalidValueError: a value that cannot be stored (naming its key), a
                tensor that is not dense, or a layer name used twice.
        """
        maps = self.maps()
        layers: dict[str, dict[str, torch.Tensor]] = {}
        metas: dict[str, dict] = {}
        entries: dict[str, Any] = {}
        loose: dict[str, torch.Tensor] = {}
        for mk, m in maps.items():
            for ln in m.layers:
                if ln in layers or ln == STATE_LAYER:
                    raise InvalidValueError(f"layer {ln!r} of module {mk!r} is used twice", key=mk, layer=ln)
                layers[ln] = m.layer_tensors(ln)
                for n, t in layers[ln].items():
                    _check_tensor(mk, n, t)
                metas[ln] = m.layer_meta(ln)
            entries[mk] = {"kind": "module", "prefix": "" if len(maps) == 1 else f"{mk}.",
                           "layers": sorted(m.layers), "extra": m.extra_state(loose, f"state/{mk}/")}
            if m.tied:  # tied tensors are stored once, under the first name (restore and plain reads re-tie them)
                entries[mk]["tied"] = dict(m.tied)
            if m.optimizer is not None:
                ok = next(k for k, v in self.owner.items() if v == mk)
                entries[ok] = {"kind": "optimizer", "module": mk, "meta": m.optimizer_meta(),
                               "class": optimizer_types(self.state[ok])[0]}
        for key, v in self.state.items():
            if key in entries:
                continue
            if isinstance(v, nn.Module | torch.optim.Optimizer):
                continue  # an optimizer over no module was refused by maps()
            if v is None:
                raise _none_entry(key)
            if is_stateful(v):
                entries[key] = {"kind": "stateful", "value": encode(_state_dict_of(key, v), loose,
                                                                    f"state/{key}/", key)}
            else:
                entries[key] = {"kind": "value", "value": encode(v, loose, f"state/{key}/", key)}
        user = encode(extra, loose, "extra/", "extra")
        for n, t in loose.items():
            _check_tensor(n.split("/")[1], n, t)
        always = set()
        if loose:
            layers[STATE_LAYER] = loose
            metas[STATE_LAYER] = {}
            always.add(STATE_LAYER)
        return Collected(maps, layers, metas, {"entries": entries, "user": user}, always)

    # ---- restore side ---------------------------------------------------------------------

    @staticmethod
    def layers_for(layers: Iterable[str], doc: Mapping[str, Any], only: Iterable[str] | None) -> list[str]:
        """Of a step's ``layers``, those a restore of the keys ``only`` reads (all without ``only``)."""
        if only is None:
            return list(layers)
        entries = doc.get("entries") or {}
        want = {STATE_LAYER}  # the non-tensor entries' tensors and the save's extra
        for k in only:
            e = entries.get(k) or {}
            if e.get("kind") == "module":
                want.update(e.get("layers") or [])
        return [ln for ln in layers if ln in want]

    def prepare(
        self,
        shards: Mapping[str, tuple[Mapping[str, torch.Tensor], dict]],
        doc: Mapping[str, Any],
        only: Iterable[str] | None = None,
        *,
        modules: bool = True,
        rest: bool = True,
    ) -> dict[str, Any]:
        """Validate what a restore loads; return the plan for :meth:`apply`. Changes nothing.

        Args:
            shards: layer -> (tensors, metadata) of this rank at the restored step.
            doc: the JSON document of that step (this rank's).
            only: the keys to load (default: every key of the state).
            modules: load modules and optimizers; rest: load the other entries
                (gradient-log replay takes them from different steps).

        Raises:
            RestoreMismatchError: a targeted entry is not in the checkpoint or
                does not fit (naming the layer and tensor).
        """
        keys = list(self.state) if only is None else list(only)
        for k in keys:
            if k not in self.state:
                raise InvalidValueError(f"{k!r} is not a key of the state ({sorted(self.state)})", key=k)
        entries = doc.get("entries") or {}
        for k in keys:
            if k not in entries:
                raise RestoreMismatchError(f"state entry {k!r} is not in the checkpoint (it holds "
                                           f"{sorted(entries)})", layer=None, tensor=k)
        plan: dict[str, Any] = {"maps": [], "rest": [], "groups": []}
        loose = {n: t.clone() for n, t in (shards.get(STATE_LAYER) or ({}, {}))[0].items()}
        if modules:
            for mk, m in self.maps(keys).items():
                stored = entries[mk]
                if stored.get("kind") != "module":
                    raise RestoreMismatchError(f"state entry {mk!r} is a module here, a {stored.get('kind')} "
                                               "in the checkpoint", layer=None, tensor=mk)
                opt_meta = None
                if m.optimizer is not None:
                    ok = next(k for k, v in self.owner.items() if v == mk)
                    if entries[ok].get("kind") != "optimizer" or entries[ok].get("module") != mk:
                        raise RestoreMismatchError(f"state entry {ok!r} is not the optimizer of {mk!r} in the "
                                                   "checkpoint", layer=None, tensor=ok)
                    opt_meta = entries[ok].get("meta")
                    _check_optimizer(ok, self.state[ok], entries[ok], m)
                _check_extra(mk, m, stored.get("extra") or {})
                tensors = {ln: shards[ln][0] for ln in stored.get("layers", []) if ln in shards}
                missing = [ln for ln in stored.get("layers", []) if ln not in shards]
                if missing:
                    raise RestoreMismatchError(f"layer {missing[0]!r} of {mk!r} was not read", layer=missing[0],
                                               tensor=None)
                metas = {ln: shards[ln][1] for ln in tensors}
                p = m.prepare(tensors, metas, opt_meta, stored.get("extra"), loose, stored.get("tied"))
                if m.optimizer is not None:
                    _check_state_keys(next(k for k, v in self.owner.items() if v == mk), m, p["optim"])
                plan["maps"].append((m, p))
        if rest and not modules:  # the hyper-parameters ride with the rest (a learning-rate schedule)
            for mk, m in self.maps(keys).items():
                if m.optimizer is not None:
                    ok = next(k for k, v in self.owner.items() if v == mk)
                    meta = entries[ok].get("meta")
                    if meta is not None:
                        m._plan_groups(meta)  # validate now
                        plan["groups"].append((m, meta))
        if rest:
            for k in keys:
                v = self.state[k]
                if isinstance(v, nn.Module | torch.optim.Optimizer):
                    continue
                stored = entries[k]
                if stored.get("kind") not in ("stateful", "value"):
                    raise RestoreMismatchError(f"state entry {k!r} is a {stored.get('kind')} in the checkpoint",
                                               layer=None, tensor=k)
                plan["rest"].append((k, decode(stored.get("value"), loose, k, like=_template(v))))
            plan["user"] = decode(doc.get("user"), loose, "extra")
        return plan

    def apply(self, plan: Mapping[str, Any]) -> None:
        """Load a plan made by :meth:`prepare`."""
        for m, p in plan["maps"]:
            m.apply(p)
        for m, meta in plan["groups"]:
            m.apply_groups(meta)
        for k, value in plan["rest"]:
            target = self.state[k]
            if is_stateful(target):
                target.load_state_dict(value)
            elif (isinstance(target, torch.Tensor) and isinstance(value, torch.Tensor)
                  and target.shape == value.shape and target.dtype == value.dtype):
                with torch.no_grad():
                    target.copy_(value)
            else:
                self.state[k] = value
