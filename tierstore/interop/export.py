"""Export a committed step of a model as Hugging Face safetensors or one ``torch.save`` file.

Protocol: one process, after (or while) the job trains; it takes no epoch and
writes nothing to the store, so a running trainer is not disturbed::

    report = export_model(store, "gpt", "out/", step=None, format="safetensors",
                          model_only=True, dtype="bf16", max_shard_size="5GB")

1. *resolve*: ``store.resolve(model, max_staleness, step=step)``, the read
   path of a restore: the newest committed step that can be rebuilt, or the
   named ``step``, which must be committed (else
   :class:`~tierstore.errors.NoValidCopyError`, nothing written).
2. *plan*: the step's state document (the Checkpointer's vote) names each
   module of the trainer state and its layers; every one must be in the step
   (a gradient-log step of a ``replay`` run is not: export its base step).
   Non-module entries (scheduler, data loader, RNG, ``extra``) are not weights
   and are left out (``report.skipped``).
3. *stream*, layer by layer (natural order of the layer names): read every
   rank's object of the layer (each read verifies its checksum and falls
   back to the next tier on a bad copy, as a restore does), reassemble
   tensors split across ranks (:func:`~tierstore.train.gather.assemble_layer`),
   cast floating-point tensors to ``dtype``, hand each tensor to the writer
   (:mod:`tierstore.interop.weights_files`), drop the layer.

Names in the files: a module's tensors keep their normalised names
(``blocks.0.attn.qkv.weight``: wrapper prefixes such as ``module.`` and
``_orig_mod.`` were removed when saving), prefixed with ``<key>.`` when the
state held several modules. Optimizer state (unless ``model_only``) is
``optim/<param name>/<key>`` (``optim/blocks.0.attn.qkv.weight/exp_avg``);
non-tensor optimizer state and hyper-parameters are not exported.

Memory bound: the tensors held at once are at most two layers' worth (one
layer's objects of the lowest rank plus its reassembled tensors plus one other
rank's object: ``(1 + 2/world)`` x the largest layer for sharded layers, 1 x
for replicated ones), plus one cast tensor, plus the store's decode of the
object being read: ``peak <= 2 * largest_layer + largest_tensor``, whatever
the model's size. The writers hold no tensors (they spool to the output
directory). ``report.peak_bytes`` is the measured peak of what the export held.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tierstore.errors import InvalidValueError, NoValidCopyError
from tierstore.interop.weights_files import SafetensorsWriter, TorchWriter, parse_size
from tierstore.keys import validate_name
from tierstore.train.gather import Meter, assemble_layer, nbytes, read_object
from tierstore.train.layers import BUFFER, OPTIM, PARAM

__all__ = ["DTYPES", "FORMATS", "ExportReport", "export_model", "natural_key", "parse_dtype"]

FORMATS = ("safetensors", "torch")
DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "f16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "f32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "fp64": torch.float64, "f64": torch.float64, "float64": torch.float64, "double": torch.float64,
}

Progress = Callable[[int, int, int, int], None]
"""``progress(layers_done, layers, bytes_read, bytes_to_read)`` after each layer."""


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``bf16`` / ``fp16`` / ``fp32`` / ``fp64`` (or a floating torch dtype) -> torch dtype; ``None`` stays.

    Raises:
        InvalidValueError: anything else.
    """
    if dtype is None or isinstance(dtype, torch.dtype):
        if isinstance(dtype, torch.dtype) and not dtype.is_floating_point:
            raise InvalidValueError(f"cast to a floating dtype only, got {dtype}", key="dtype")
        return dtype
    got = DTYPES.get(str(dtype).lower().removeprefix("torch."))
    if got is None:
        raise InvalidValueError(f"unknown dtype {dtype!r} (one of {', '.join(sorted(DTYPES))})", key="dtype")
    return got


def natural_key(name: str) -> list[Any]:
    """Sort key putting ``blocks.2`` before ``blocks.10``."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", name) if p]


@dataclass
class ExportReport:
    """What :func:`export_model` wrote.

    Attributes:
        model, step: what was exported. format: ``safetensors`` or ``torch``.
        out: the directory. files: the file names written in it.
        tensors, bytes: how many tensors and tensor bytes were written.
        peak_bytes: the most tensor bytes the export held at once (see the module's memory bound).
        largest_layer_bytes: the largest layer as reassembled (all its tensors, optimizer state included).
        skipped: state entries that are not weights and were left out.
        seconds: wall time.
    """

    model: str
    step: int
    format: str
    out: str
    files: list[str] = field(default_factory=list)
    tensors: int = 0
    bytes: int = 0
    peak_bytes: int = 0
    largest_layer_bytes: int = 0
    skipped: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _state_doc(res: Any) -> dict[str, Any]:
    for r in sorted(res.extra, key=int):
        extra = res.extra[r] or {}
        if isinstance(extra, dict) and isinstance(extra.get("state"), dict):
            return extra["state"]
    raise InvalidValueError(f"step {res.step} of {res.model!r} has no state document: it was not written by the "
                            "Checkpointer (a DCP checkpoint is read back with dcp.load)", key=res.model)


def _out_name(name: str, prefix: str) -> str:
    if name.startswith(OPTIM):
        return OPTIM + prefix + name[len(OPTIM):]
    for p in (PARAM, BUFFER):
        if name.startswith(p):
            return prefix + name[len(p):]
    return prefix + name


def export_model(
    store: Any,
    model: str,
    out: str | Path,
    step: int | None = None,
    *,
    format: str = "safetensors",
    model_only: bool = False,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    max_staleness: int = 0,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> ExportReport:
    """Write committed ``step`` (default: the newest that can be rebuilt) of ``model`` to ``out``.

    Args:
        store: an open store. model: the model name.
        out: the output directory (created).
        step: a committed step; ``None``: the newest committed step that can be rebuilt.
        format: ``safetensors`` (Hugging Face's sharded layout) or ``torch`` (one ``pytorch_model.bin``).
        model_only: leave out optimizer state.
        dtype: cast the module's floating-point tensors (``bf16``, ``fp16``, ``fp32``, ``fp64``);
            integer tensors and optimizer state (its step counts) keep their dtype.
        max_shard_size: the most tensor bytes per safetensors file (``5GB``, ``500MB``, bytes).
        max_staleness: the job's layer-wise staleness bound (``layerwise`` policy), as for restore.
        overwrite: replace an export already in ``out``.
        progress: called after each layer (see :data:`Progress`).

    Raises:
        NoValidCopyError: ``step`` is not committed, nothing is committed, or an
            object has no valid copy in any tier (naming it); nothing is left in ``out``.
        InvalidValueError: the step holds no module, a layer is not in the step,
            a placement cannot be reassembled, a dtype safetensors lacks.
        KeyExistsError: ``out`` already holds an export and ``overwrite`` is false.
    """
    t0 = time.perf_counter()
    validate_name(model, "model")
    if format not in FORMATS:
        raise InvalidValueError(f"format must be one of {FORMATS}, got {format!r}", key="format")
    cast = parse_dtype(dtype)
    shard_bytes = parse_size(max_shard_size)
    res = store.resolve(model, max_staleness=max_staleness, step=step)
    doc = _state_doc(res)
    entries = doc.get("entries") or {}
    plan: list[tuple[str, str]] = []
    for key, e in entries.items():
        if e.get("kind") == "module":
            plan.extend((ln, str(e.get("prefix") or "")) for ln in e.get("layers") or [])
    if not plan:
        raise InvalidValueError(f"step {res.step} of {model!r} holds no module", key=model)
    for ln, _ in plan:
        if ln not in res.layers:
            raise NoValidCopyError(f"layer {ln!r} is not in step {res.step} of {model!r} (a gradient-log step of a "
                                   "replay run holds no weights: export its base step)", layer=ln, step=res.step)
    plan.sort(key=lambda lp: natural_key(lp[0]))
    report = ExportReport(model, res.step, format, str(out))
    report.skipped = sorted(k for k, e in entries.items() if e.get("kind") not in ("module", "optimizer"))
    if model_only:
        report.skipped += sorted(k for k, e in entries.items() if e.get("kind") == "optimizer")
    if doc.get("user") is not None:
        report.skipped.append("extra")

    def keep(name: str) -> bool:
        return name.startswith((PARAM, BUFFER)) or (not model_only and name.startswith(OPTIM))

    ranks_of: dict[str, list[int]] = {}
    for ln, r in res.objects:
        ranks_of.setdefault(ln, []).append(r)
    to_read = sum(res.objects[(ln, r)].size for ln, _ in plan for r in ranks_of.get(ln, []))
    writer: SafetensorsWriter | TorchWriter
    if format == "safetensors":
        writer = SafetensorsWriter(Path(out), shard_bytes, {"tierstore_model": model, "tierstore_step": str(res.step)},
                                   overwrite=overwrite)
    else:
        writer = TorchWriter(Path(out), overwrite=overwrite)
    meter = Meter()
    done = 0
    try:
        for i, (ln, prefix) in enumerate(plan):
            ranks = sorted(ranks_of.get(ln, []))
            if not ranks:
                raise NoValidCopyError(f"layer {ln!r} has no object in step {res.step}", layer=ln, step=res.step)

            def read(r: int, ln: str = ln) -> tuple[dict[str, torch.Tensor], dict]:
                return read_object(store, model, ln, res.objects[(ln, r)].key)

            before = meter.held
            tensors = assemble_layer(read, ranks, keep, meter)
            report.largest_layer_bytes = max(report.largest_layer_bytes, meter.held - before)
            for name in sorted(tensors, key=natural_key):
                t = tensors.pop(name)
                if cast is not None and t.is_floating_point() and t.dtype != cast and not name.startswith(OPTIM):
                    t = t.to(cast)
                    meter.hold(nbytes({name: t}))
                    writer.add(_out_name(name, prefix), t)
                    meter.release(nbytes({name: t}))
                else:
                    writer.add(_out_name(name, prefix), t)
                report.tensors += 1
                report.bytes += t.numel() * t.element_size()
                del t
            del tensors
            meter.release(meter.held - before)
            done += sum(res.objects[(ln, r)].size for r in ranks)
            if progress is not None:
                progress(i + 1, len(plan), done, to_read)
        report.files = writer.close()
    except BaseException:
        writer.abort()
        raise
    report.peak_bytes = meter.peak
    report.seconds = time.perf_counter() - t0
    return report
