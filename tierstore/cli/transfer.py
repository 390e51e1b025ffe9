"""``tierstore export`` and ``tierstore import``: weights out to Hugging Face / torch.save, and in as a base.

    tierstore export MODEL [STEP] --format safetensors|torch --out DIR [--model-only] [--dtype bf16]
                     [--max-shard-size 5GB] [--max-staleness S] [--overwrite]
    tierstore export --pretrained CHECKPOINT_DIR --out DIR [--config DIR] [--max-shard-size 5GB] [--resumable]
    tierstore import SOURCE --model NAME [--module pkg.mod:factory] [--world-size N] [--dtype bf16]

Progress goes to stderr (a bar on a terminal, a line per tenth otherwise); the
summary to stdout (``--json``: one JSON object). The work is done by
:func:`tierstore.interop.export.export_model`,
:func:`tierstore.interop.hf_pretrained.export_pretrained` (``--pretrained``: a
``TierStoreTrainer`` checkpoint directory as one ``from_pretrained`` reads; needs
the ``hf`` extra) and :func:`tierstore.interop.importing.import_model`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import tierstore
from tierstore.cli.admin import _connection_parser
from tierstore.errors import ConfigError
from tierstore.interop.export import FORMATS, export_model
from tierstore.interop.importing import import_model

__all__ = ["export_main", "import_main"]


def _open(a: argparse.Namespace) -> Any:
    kw: dict[str, Any] = {}
    if getattr(a, "host_root", None):
        kw["host_root"] = a.host_root
    if getattr(a, "node", None):
        kw["node_id"] = a.node
    if getattr(a, "s3_endpoint", None):
        kw["s3_endpoint_url"] = a.s3_endpoint
    home = getattr(a, "home", None) or os.environ.get("TIERSTORE_HOME") or ".tierstore"
    return tierstore.open(home, redis=getattr(a, "redis", None), durable=getattr(a, "durable", None), **kw)


class _Bar:
    """Progress on stderr: a redrawn bar on a terminal, else a line at each tenth."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.tty = sys.stderr.isatty()
        self.t0 = time.monotonic()
        self.tenth = -1

    def __call__(self, done: int, total: int, nbytes: int = 0, total_bytes: int = 0) -> None:
        frac = done / total if total else 1.0
        rate = nbytes / max(time.monotonic() - self.t0, 1e-9) / 1e6
        size = f" {nbytes / 1e6:.1f}/{total_bytes / 1e6:.1f} MB {rate:.0f} MB/s" if total_bytes else ""
        bar = "#" * int(frac * 30)
        line = f"{self.what} [{bar:<30}] {done}/{total} layers{size}"
        if self.tty:
            sys.stderr.write("\r" + line + ("\n" if done == total else ""))
            sys.stderr.flush()
        elif int(frac * 10) > self.tenth:
            self.tenth = int(frac * 10)
            print(line, file=sys.stderr, flush=True)


def _print(report: Any, as_json: bool, lines: list[str]) -> None:
    if as_json:
        print(json.dumps(dataclasses.asdict(report), default=str))
    else:
        print("\n".join(lines))


def export_main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tierstore export", parents=[_connection_parser()],
                                description="Write a committed step of MODEL as Hugging Face safetensors "
                                            "(sharded, with an index) or one torch.save file; or, with "
                                            "--pretrained, a TierStoreTrainer checkpoint-N directory as a "
                                            "directory from_pretrained reads.")
    p.add_argument("model", nargs="?", help="the model (not with --pretrained)")
    p.add_argument("step", type=int, nargs="?", help="a committed step (default: the newest that can be rebuilt)")
    p.add_argument("--pretrained", metavar="CHECKPOINT_DIR", default=None,
                   help="a checkpoint-N directory of TierStoreTrainer: write --out (a new or empty directory) as "
                        "model.safetensors, config.json and the tokenizer's files; the store is the one its "
                        "pointer names unless a connection option says otherwise (needs tierstore[hf])")
    p.add_argument("--config", metavar="DIR", default=None,
                   help="with --pretrained: the directory holding config.json (default: the checkpoint "
                        "directory, else its run directory, where trainer.save_model() writes it)")
    p.add_argument("--resumable", action="store_true",
                   help="with --pretrained: also the Trainer's resume files (optimizer.pt, scheduler.pt, the RNG "
                        "states, trainer_state.json), so a plain transformers.Trainer resumes from --out")
    p.add_argument("--format", choices=FORMATS, default="safetensors")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--model-only", action="store_true", help="leave out optimizer state")
    p.add_argument("--dtype", default=None, help="cast the model's floating-point tensors: bf16, fp16, fp32, fp64")
    p.add_argument("--max-shard-size", default="5GB", help="most tensor bytes per safetensors file (default 5GB)")
    p.add_argument("--max-staleness", type=int, default=0, help="the job's layerwise staleness bound")
    p.add_argument("--overwrite", action="store_true", help="replace an export already in --out")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    a = p.parse_args(argv)
    if a.pretrained is not None:
        return _export_pretrained(p, a)
    if a.model is None:
        p.error("give MODEL, or --pretrained CHECKPOINT_DIR")
    if a.config is not None or a.resumable:
        p.error(f"{'--config' if a.config is not None else '--resumable'} goes with --pretrained")
    store = _open(a)
    try:
        bar = None if a.quiet else _Bar(f"export {a.model}")
        r = export_model(store, a.model, a.out, a.step, format=a.format, model_only=a.model_only, dtype=a.dtype,
                         max_shard_size=a.max_shard_size, max_staleness=a.max_staleness, overwrite=a.overwrite,
                         progress=bar)
    finally:
        store.close()
    _print(r, getattr(a, "json", False), [
        (f"exported {r.model} step {r.step} to {r.out}: {len(r.files)} file(s), {r.tensors} tensors, "
         f"{r.bytes / 1e6:.1f} MB in {r.seconds:.2f} s ({r.bytes / 1e6 / max(r.seconds, 1e-9):.0f} MB/s)"),
        f"  files: {', '.join(r.files[:4])}{' ...' if len(r.files) > 4 else ''}",
        f"  peak tensor memory {r.peak_bytes / 1e6:.1f} MB (largest layer {r.largest_layer_bytes / 1e6:.1f} MB)",
        *([f"  left out (not weights, or --model-only): {', '.join(r.skipped)}"] if r.skipped else []),
    ])
    return 0


def _export_pretrained(p: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    """``tierstore export --pretrained CHECKPOINT_DIR --out DIR``: :func:`~tierstore.interop.hf_pretrained.export_pretrained`."""
    given = [f for f, v in (("MODEL", a.model), ("--format torch", a.format != "safetensors"),
                            ("--model-only", a.model_only), ("--dtype", a.dtype), ("--overwrite", a.overwrite),
                            ("--max-staleness", a.max_staleness)) if v]
    if given:
        p.error(f"--pretrained exports the checkpoint's own step, model only, as safetensors, into a new directory: "
                f"not with {', '.join(given)}")
    from tierstore.interop.hf_pretrained import export_pretrained  # lazy: needs transformers (tierstore[hf])

    named = any(getattr(a, k, None) for k in ("home", "redis", "durable", "s3_endpoint", "host_root", "node"))
    store = _open(a) if named else None  # else the store the pointer names
    t0 = time.perf_counter()
    try:
        out = export_pretrained(a.pretrained, a.out, store=store, config=a.config, max_shard_size=a.max_shard_size,
                                progress=None if a.quiet else _Bar(f"export {a.pretrained}"), resumable=a.resumable)
    finally:
        if store is not None:
            store.close()
    files = sorted(os.listdir(out))
    if getattr(a, "json", False):
        print(json.dumps({"checkpoint": os.path.abspath(a.pretrained), "out": out, "files": files,
                          "seconds": time.perf_counter() - t0}))
    else:
        print(f"exported {a.pretrained} to {out} in {time.perf_counter() - t0:.2f} s: {', '.join(files)}")
    return 0


def _factory(spec: str) -> Any:
    """Call ``pkg.mod:factory``. The module is looked up as ``python -m`` would: the current directory first
    (a console script's ``sys.path`` does not hold it), then the installed packages."""
    mod, _, attr = spec.partition(":")
    if not mod or not attr:
        raise ConfigError(f"--module takes pkg.mod:factory, got {spec!r}", field="module")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        obj: Any = importlib.import_module(mod)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"--module {spec}: {e}", field="module") from e
    return obj()


def import_main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tierstore import", parents=[_connection_parser()],
                                description="Make step 0 of a new model from a safetensors directory or file "
                                            "(sharded with an index, or single) or a torch.save file.")
    p.add_argument("source", help="directory or file")
    p.add_argument("--model", required=True, help="the new model's name")
    p.add_argument("--module", default=None,
                   help="pkg.mod:factory returning the nn.Module the weights are for (names and shapes checked "
                        "before anything is written; buffers laid out as buffers); found in the current "
                        "directory or the installed packages")
    p.add_argument("--world-size", type=int, default=1, help="data-parallel ranks that will restore it")
    p.add_argument("--dtype", default=None, help="without --module: cast floating-point tensors (bf16, ...)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    a = p.parse_args(argv)
    module = _factory(a.module) if a.module else None
    store = _open(a)
    try:
        bar = None if a.quiet else _Bar(f"import {a.model}")
        r = import_model(store, a.source, a.model, module=module, world_size=a.world_size, dtype=a.dtype,
                         progress=bar)
    finally:
        store.close()  # flushes the migration of step 0 to the durable tier
    _print(r, getattr(a, "json", False), [
        (f"imported {a.source} as step {r.step} of {r.model}: {r.layers} layers, {r.tensors} tensors, "
         f"{r.bytes / 1e6:.1f} MB in {r.seconds:.2f} s"),
        *([f"  {len(r.renamed)} name(s) normalised (e.g. {next(iter(r.renamed.items()))})"] if r.renamed else []),
        *([f"  {len(r.skipped)} optimizer tensor(s) skipped"] if r.skipped else []),
        *([f"  {len(r.cast)} tensor(s) cast"] if r.cast else []),
        *([f"  read {r.note}"] if r.note else []),
    ])
    return 0
