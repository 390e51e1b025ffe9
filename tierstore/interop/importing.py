"""Import pretrained weights (safetensors or ``torch.save``) as step 0 of a new model, a base for training.

Protocol: one process, before the job's Checkpointer is constructed::

    report = import_model(store, "weights/", "gpt", module=GPT(cfg))   # step 0 of "gpt", committed
    ckpt = Checkpointer(store, "gpt", state={"model": model, "optim": opt, ...}, policy=...)
    step, _ = ckpt.restore()                                           # 0: the imported weights

:func:`import_model`, in this order:

1. *read the headers* (:func:`~tierstore.interop.weights_files.open_source`):
   names, shapes and dtypes, no tensor data;
2. *normalise names*: a ``module.`` prefix on every name (a DDP
   ``state_dict``) is dropped, and wrapper components (``_orig_mod``, ...) as
   the Checkpointer drops them; optimizer state of a tierstore export
   (``optim/...``) is skipped;
3. *check against the module* when one is given: every name of the file must
   be a tensor of the module's ``state_dict`` and the reverse, with the same
   shape; otherwise :class:`ImportMismatchError` lists the unexpected,
   missing and misshapen names **before anything is written**. Tensors are
   laid out as the Checkpointer lays out that module (parameters and
   buffers, its ``layer_fn``), and floating-point tensors are cast to the
   module's dtype. Without a module every tensor is taken for a parameter,
   in the layer :func:`~tierstore.train.layers.default_layer_fn` names;
4. *write step 0*: a new epoch, ``begin_step``, per layer one full object
   of rank 0 (read and written one layer at a time: memory is one layer) and,
   for ``world_size > 1``, a reference to it per other rank (data-parallel
   replicas), then one vote per rank with the state document
   ``{"entries": {"model": <module entry>}, "imported": {...}}``. Any failure
   votes the step down (``aborted``).

A model that already has steps is refused (:class:`~tierstore.errors.KeyExistsError`).

The Checkpointer side (:mod:`tierstore.train.imported`): a
restore that lands on an imported step loads its one module into the
state's one module and leaves every other entry (optimizer, scheduler, data,
RNG) as constructed; and a writer's restore seeds the policy's trackers with
the imported tensors, so the first ``differential`` save of a layer is a delta
against the imported base and a ``layerwise`` save skips the layers that have
not moved. A layer whose tensors change set (the optimizer state that appears
with the first step) is written full once: a delta object only holds tensors
its base has.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tierstore.errors import KeyExistsError, RestoreMismatchError
from tierstore.interop.export import natural_key, parse_dtype
from tierstore.interop.weights_files import open_source
from tierstore.keys import ShardKey, validate_name
from tierstore.train.imported import IMPORT_STEP, MODULE_KEY
from tierstore.train.layers import BUFFER, OPTIM, PARAM, StateMap, default_layer_fn, sanitize_layer_name
from tierstore.train.state import normalise_fqn

__all__ = ["IMPORT_STEP", "ImportMismatchError", "ImportReport", "import_model"]



class ImportMismatchError(RestoreMismatchError):
    """The file's names or shapes do not match the module; nothing was written.

    Fields: ``unexpected`` (in the file, not the module), ``missing`` (in the
    module, not the file), ``shapes`` (``[name, file shape, module shape]``).
    """


@dataclass
class ImportReport:
    """What :func:`import_model` wrote.

    Attributes:
        model, step: the model and its new step (0). source: what was read (``safetensors`` / ``torch``).
        files: the files read. layers, tensors, bytes: what was written (rank 0).
        world_size: ranks laid out (ranks > 0 refer to rank 0's objects).
        renamed: ``original -> normalised`` names. skipped: names left out (optimizer state).
        cast: names cast to another dtype. note: how the tensors were found in a torch.save file.
        seconds: wall time.
    """

    model: str
    step: int
    source: str
    files: list[str] = field(default_factory=list)
    layers: int = 0
    tensors: int = 0
    bytes: int = 0
    world_size: int = 1
    renamed: dict[str, str] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    cast: list[str] = field(default_factory=list)
    note: str = ""
    seconds: float = 0.0


def _normalise(names: Iterable[str]) -> tuple[dict[str, str], list[str]]:
    """``normalised -> original`` for the weights, and the names skipped (optimizer state)."""
    names = list(names)
    skipped = [n for n in names if n.startswith(OPTIM)]
    names = [n for n in names if not n.startswith(OPTIM)]
    ddp = bool(names) and all(n.startswith("module.") for n in names)
    out: dict[str, str] = {}
    for n in names:
        fq = normalise_fqn(n[len("module."):] if ddp else n)
        if fq in out:
            raise ImportMismatchError(f"{out[fq]!r} and {n!r} are the same tensor {fq!r} once wrapper prefixes are "
                                      "removed", layer=None, tensor=fq, unexpected=[n], missing=[], shapes=[])
        out[fq] = n
    return out, skipped


def _layout(specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]], module: nn.Module | None,
            layer_fn: Callable[[str], str] | None, cast: torch.dtype | None,
            ) -> tuple[dict[str, dict[str, str]], dict[str, torch.dtype]]:
    """``layer -> {shard name: normalised name}`` and the dtype each cast name goes to; checks the module."""
    layers: dict[str, dict[str, str]] = {}
    to: dict[str, torch.dtype] = {}
    if module is None:
        fn = layer_fn or default_layer_fn
        for fq, (_shape, dt) in specs.items():
            layers.setdefault(sanitize_layer_name(fn(fq)), {})[PARAM + fq] = fq
            if cast is not None and dt.is_floating_point and dt != cast:
                to[fq] = cast
        return layers, to
    sm = StateMap(module, None, layer_fn)
    unexpected = sorted((n for n in specs if n not in sm.tensors), key=natural_key)
    missing = sorted((n for n in sm.tensors if n not in specs), key=natural_key)
    shapes: list[list[Any]] = [[n, list(specs[n][0]), list(sm.tensors[n].shape)] for n in sorted(specs, key=natural_key)
              if n in sm.tensors and tuple(specs[n][0]) != tuple(sm.tensors[n].shape)]
    odd: list[list[Any]] = [[n, str(specs[n][1]), str(sm.tensors[n].dtype)] for n in specs if n in sm.tensors
           and specs[n][1] != sm.tensors[n].dtype and not (specs[n][1].is_floating_point
                                                            and sm.tensors[n].dtype.is_floating_point)]
    if unexpected or missing or shapes or odd:
        parts = [f"{len(unexpected)} unexpected (e.g. {unexpected[:3]})" if unexpected else "",
                 f"{len(missing)} missing (e.g. {missing[:3]})" if missing else "",
                 f"{len(shapes)} of another shape (e.g. {shapes[:2]})" if shapes else "",
                 f"{len(odd)} of another kind of dtype (e.g. {odd[:2]})" if odd else ""]
        first = str((unexpected or missing or [str(s[0]) for s in shapes + odd])[0])
        raise ImportMismatchError("the file does not match the module: " + "; ".join(p for p in parts if p)
                                  + "; nothing was written", layer=sm.layer_of.get(first), tensor=first,
                                  unexpected=unexpected, missing=missing, shapes=shapes + odd)
    for ln, spec in sm.layers.items():
        layers[ln] = {PARAM + n: n for n in spec.params} | {BUFFER + n: n for n in spec.buffers}
    for fq, (_shape, dt) in specs.items():
        want = sm.tensors[fq].dtype
        if dt != want and dt.is_floating_point:
            to[fq] = want
    return layers, to


def import_model(
    store: Any,
    source: str | os.PathLike,
    model: str,
    *,
    module: nn.Module | None = None,
    layer_fn: Callable[[str], str] | None = None,
    world_size: int = 1,
    dtype: str | torch.dtype | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ImportReport:
    """Write the weights in ``source`` as committed step 0 of the new model ``model``; see the module docstring.

    Args:
        store: an open store. source: a directory or file (safetensors, sharded or not; torch.save).
        model: the new model's name.
        module: the model the weights are for: names and shapes are checked, the
            layout (layers, parameters vs buffers, dtypes) follows it. Strongly advised.
        layer_fn: the Checkpointer's ``layer_fn``, if the job gives one.
        world_size: the data-parallel world that will restore it (ranks > 0 refer to rank 0's objects).
        dtype: without ``module``: cast floating-point tensors (``bf16``, ...).
        progress: ``progress(layers_done, layers)`` after each layer.

    Raises:
        ImportMismatchError: names or shapes that do not match ``module`` (nothing written).
        KeyExistsError: ``model`` already has steps.
        MissingDependencyError: safetensors files without the ``safetensors`` package.
        CorruptObjectError, InvalidValueError: an unreadable source.
        CommitError, TierStoreError: the write or the commit failed (the step is voted down).
    """
    t0 = time.perf_counter()
    validate_name(model, "model")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise RestoreMismatchError(f"world_size must be an int >= 1, got {world_size!r}", layer=None, tensor=None)
    cast = parse_dtype(dtype)
    src = open_source(source)
    try:
        names, skipped = _normalise(src.specs)
        specs = {fq: src.specs[orig] for fq, orig in names.items()}
        layers, to = _layout(specs, module, layer_fn, cast)
        if store.steps.steps(model):
            raise KeyExistsError(f"model {model!r} already has steps; import makes step {IMPORT_STEP} of a new model",
                                 key=model)
        report = ImportReport(model, IMPORT_STEP, src.kind, src.files, world_size=world_size, skipped=skipped,
                              note=src.note, renamed={o: fq for fq, o in names.items() if o != fq},
                              cast=sorted(to, key=natural_key))
        _write(store, model, src.get, names, layers, to, world_size, report, progress)
    finally:
        src.close()
    report.seconds = time.perf_counter() - t0
    return report


def _write(store: Any, model: str, get: Callable[[str], torch.Tensor], names: Mapping[str, str],
           layers: Mapping[str, Mapping[str, str]], to: Mapping[str, torch.dtype], world: int,
           report: ImportReport, progress: Callable[[int, int], None] | None) -> None:
    order = sorted(layers, key=natural_key)
    epoch = store.open_epoch(model)
    store.begin_step(model, IMPORT_STEP, world, layout={"layers": order}, epoch=epoch)
    doc = {"entries": {MODULE_KEY: {"kind": "module", "prefix": "", "layers": order, "extra": {}}},
           "user": None, "imported": {"module": MODULE_KEY, "files": report.files}}
    infos: list[list[Any]] = [[] for _ in range(world)]
    try:
        for i, ln in enumerate(order):
            tensors: dict[str, torch.Tensor] = {}
            for shard_name, fq in layers[ln].items():
                t = get(names[fq])
                tensors[shard_name] = t.to(to[fq]) if fq in to else t
            key = ShardKey(model, ln, IMPORT_STEP, 0)
            infos[0].append(store.put(key, tensors, {"optim_scalars": {}}, epoch=epoch))
            report.tensors += len(tensors)
            report.bytes += sum(t.numel() * t.element_size() for t in tensors.values())
            del tensors
            for r in range(1, world):
                infos[r].append(store.put(ShardKey(model, ln, IMPORT_STEP, r), {}, None, kind="ref", target=key,
                                          epoch=epoch))
            if progress is not None:
                progress(i + 1, len(order))
        state = ""
        for r in range(world):
            state = store.vote(model, IMPORT_STEP, r, infos[r], extra={"state": doc, "policy": "import"},
                               epoch=epoch)
    except BaseException as e:
        for r in range(world):
            try:
                store.vote(model, IMPORT_STEP, r, [], extra={"error": repr(e)[:500]}, ok=False, epoch=epoch)
            except Exception:  # noqa: BLE001, S110 - the original error is what matters
                pass
        raise
    report.layers = len(order)
    if state not in ("committed", "durable"):
        state = store.wait_step(model, IMPORT_STEP, timeout=60.0)
    if state not in ("committed", "durable"):
        raise RestoreMismatchError(f"step {IMPORT_STEP} of {model!r} ended {state}", layer=None, tensor=None)
