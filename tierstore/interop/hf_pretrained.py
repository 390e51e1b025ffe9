"""A ``TierStoreTrainer`` checkpoint as a directory ``from_pretrained`` reads.

A ``checkpoint-N`` directory of :class:`~tierstore.interop.huggingface.TierStoreTrainer`
holds the pointer (``tierstore.json``) and ``trainer_state.json``; its weights
are a step in the store, so ``AutoModelForCausalLM.from_pretrained("out/checkpoint-8")``
finds nothing to load. :func:`export_pretrained` writes one that it does::

    from tierstore.interop.hf_pretrained import export_pretrained
    export_pretrained("out/checkpoint-8", "gpt-step8", config=model.config)
    AutoModelForCausalLM.from_pretrained("gpt-step8")

What it writes in ``out_dir``:

* the weights: the step the pointer names, read by
  :func:`~tierstore.interop.export.export_model` (``model_only``: the read path
  of a restore, every object checksum verified, every rank's part), as
  ``model.safetensors`` (or shards and their index past ``max_shard_size``).
  A tied weight (GPT-2's ``lm_head.weight``, the embedding's tensor) was
  saved once, under its first name, so it is in the file once, as
  ``save_pretrained`` writes it; ``from_pretrained`` ties it again (the
  config's ``tie_word_embeddings``). Optimizer, scheduler, RNG and
  ``TrainerState`` are not weights and are left out.
* the configuration and the files beside it (:data:`SIDE_FILES`:
  ``config.json``, ``generation_config.json``, the tokenizer's and
  processor's files), copied from the first of: the directory ``config``
  names; the checkpoint directory, where it holds a ``config.json``; the run
  directory above it (the Trainer's ``output_dir``, where
  ``trainer.save_model()`` writes them; the run is one tierstore model, so
  one architecture). ``config`` may instead be a ``transformers`` config
  (``model.config``), saved with its ``save_pretrained`` (no side files).
  A checkpoint of ``TierStoreTrainer`` holds no ``config.json`` itself: its
  save writes the pointer, not the Trainer's files.

With ``resumable=True`` it also writes what the Trainer's own resume reads besides the weights, so a plain
``transformers.Trainer`` (not ``TierStoreTrainer``) resumes from ``out_dir`` with
``train(resume_from_checkpoint=out_dir)``: ``optimizer.pt``, ``scheduler.pt`` and ``scaler.pt`` (the stored
state dicts, read by :func:`~tierstore.train.plain.read_plain`), the RNG state of every rank that saved
(``rng_state.pth`` for one process, ``rng_state_<rank>.pth`` for several: the Trainer's names and format) and
``trainer_state.json`` (copied from the checkpoint directory, where the Trainer wrote it after the save). A
checkpoint saved with ``save_only_model`` has no optimizer, scheduler or RNG state: refused
(:class:`~tierstore.errors.ConfigError`).

It writes nothing in the checkpoint directory or the store (``export_model``
takes no epoch and writes nothing to the store). The files go to a hidden
sibling of ``out_dir`` (``.<name>.partial-<hex>``), renamed to ``out_dir``
once complete: a failure leaves no ``out_dir`` (and no sibling).

Refusals (typed, before anything is written):
:class:`~tierstore.errors.CheckpointNotFoundError` (no pointer in the
directory, or its step is not in the store),
:class:`~tierstore.errors.CheckpointGoneError` (the step no tier restores:
names it and the newest checkpoint of the run that does),
:class:`~tierstore.errors.KeyExistsError` (``out_dir`` exists and is not an
empty directory), :class:`~tierstore.errors.ConfigError` (no configuration
found; ``out_dir`` inside the checkpoint directory).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import uuid
from typing import Any

import torch

from tierstore.errors import (
    CheckpointNotFoundError,
    ConfigError,
    KeyExistsError,
    MissingDependencyError,
    NoValidCopyError,
)
from tierstore.interop.export import Progress, export_model
from tierstore.interop.huggingface import POINTER_FILE, TRAINER_STATE, _gone, _in_store, _pointer
from tierstore.interop.pointer import named_store
from tierstore.interop.store_ref import StoreRef
from tierstore.train.plain import read_plain
from tierstore.train.state import _tuplify

try:
    from transformers import PretrainedConfig
except ImportError as e:  # pragma: no cover - the import of tierstore.interop.huggingface above raises first
    raise MissingDependencyError("tierstore.interop.hf_pretrained needs transformers: pip install 'tierstore[hf]'") from e

__all__ = ["CONFIG_FILE", "SIDE_FILES", "TRAINER_FILES", "export_pretrained"]

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
#: the files besides the weights that ``from_pretrained`` and ``AutoTokenizer`` / ``AutoProcessor`` read
SIDE_FILES = re.compile(r"^(config\.json|generation_config\.json|tokenizer(_config)?\.json|tokenizer\.model|"
                        r"special_tokens_map\.json|added_tokens\.json|vocab\.(json|txt)|merges\.txt|spiece\.model|"
                        r"sentencepiece\.bpe\.model|chat_template\.(jinja|json)|preprocessor_config\.json|"
                        r"processor_config\.json|video_preprocessor_config\.json)$")
#: the Trainer's resume files besides the weights (``resumable=True``), by the state entry each is read from
TRAINER_FILES = {"optim": "optimizer.pt", "sched": "scheduler.pt", "scaler": "scaler.pt"}
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def _refuse_taken(out: str) -> None:
    if os.path.lexists(out) and not (os.path.isdir(out) and not os.listdir(out)):
        what = "a directory that is not empty" if os.path.isdir(out) else "a file"
        raise KeyExistsError(f"{out} exists and is {what}: export_pretrained writes a new directory (or fills an "
                             "empty one); choose another out_dir", key=out)


def _config_source(checkpoint: str, config: Any) -> tuple[str | None, Any]:
    """Where the configuration comes from: ``(directory whose side files are copied, config object to save)``."""
    if isinstance(config, (str, os.PathLike)):
        d = os.path.abspath(os.fspath(config))
        if not os.path.isfile(os.path.join(d, CONFIG_FILE)):
            raise ConfigError(f"config={d}: no {CONFIG_FILE} there (give the directory trainer.save_model() or "
                              "save_pretrained() wrote, or model.config)", field="config")
        return d, None
    if config is not None:
        if not isinstance(config, PretrainedConfig):
            raise ConfigError(f"config must be a directory or a transformers config (model.config), got "
                              f"{type(config).__name__}", field="config")
        return None, config
    run = os.path.dirname(checkpoint)
    for d in (checkpoint, run):
        if os.path.isfile(os.path.join(d, CONFIG_FILE)):
            if d == run:
                log.info("%s holds no %s: taking the run directory's, %s", checkpoint, CONFIG_FILE, d)
            return d, None
    raise ConfigError(f"no {CONFIG_FILE} for {checkpoint}: neither it nor its run directory {run} holds one (the "
                      "run directory gets one from trainer.save_model()); pass config=model.config or a directory "
                      f"holding {CONFIG_FILE}", field="config")


def _fsync(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_side_files(tmp: str, source: str | None, config: Any) -> list[str]:
    if config is not None:
        config.save_pretrained(tmp)
        written = [CONFIG_FILE]
    else:
        assert source is not None
        written = sorted(n for n in os.listdir(source) if SIDE_FILES.match(n)
                         and os.path.isfile(os.path.join(source, n)))
        for name in written:
            shutil.copyfile(os.path.join(source, name), os.path.join(tmp, name))
    for name in written:
        _fsync(os.path.join(tmp, name))
    return written


def _rng_file(value: Any) -> dict[str, Any]:
    """A stored :class:`~tierstore.train.state.RNGState` value in the format of the Trainer's ``rng_state.pth``."""
    import numpy as np  # lazy: transformers' own dependency

    out: dict[str, Any] = {"python": _tuplify(value["python"]), "cpu": value["torch"]}
    if "numpy" in value:
        name, keys, pos, has_gauss, cached = value["numpy"]
        keys = keys.numpy() if isinstance(keys, torch.Tensor) else keys
        out["numpy"] = (name, np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached))
    if "cuda" in value:
        out["cuda"] = value["cuda"]
    return out


def _write_trainer_files(store: Any, ptr: Any, ckpt: str, tmp: str) -> list[str]:
    """The Trainer's resume files of the pointer's step, written into ``tmp`` (see the module docstring)."""
    entries = list(ptr.info.get("entries") or [])
    written: list[str] = []
    plain = read_plain(store, ptr.model, ptr.step, only=[k for k in TRAINER_FILES if k in entries])
    for key, name in TRAINER_FILES.items():
        if key in plain.entries:
            torch.save(plain.entries[key], os.path.join(tmp, name))
            written.append(name)
    if "rng" in entries:
        world = int(ptr.info.get("world") or 1)
        for rank in range(world):
            value = read_plain(store, ptr.model, ptr.step, rank=rank, only=["rng"]).entries["rng"]
            name = "rng_state.pth" if world == 1 else f"rng_state_{rank}.pth"
            torch.save(_rng_file(value), os.path.join(tmp, name))
            written.append(name)
    state = os.path.join(ckpt, TRAINER_STATE)
    if not os.path.isfile(state):
        raise CheckpointNotFoundError(f"{ckpt} holds no {TRAINER_STATE} (the Trainer writes it after the save): "
                                      "nothing says where the run was; export it without resumable",
                                      what="checkpoint", path=ckpt)
    shutil.copyfile(state, os.path.join(tmp, TRAINER_STATE))
    written.append(TRAINER_STATE)
    for name in written:
        _fsync(os.path.join(tmp, name))
    return written


def export_pretrained(checkpoint_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], *,
                      store: Any = None, config: Any = None, max_shard_size: int | str = "5GB",
                      progress: Progress | None = None, resumable: bool = False) -> str:
    """Write the ``checkpoint-N`` directory ``checkpoint_dir`` of ``TierStoreTrainer`` as ``out_dir``, a directory
    ``from_pretrained`` reads (``model.safetensors``, ``config.json`` and the files beside it); see the module
    docstring. Returns ``out_dir`` (absolute).

    Args:
        store: the store holding the step; ``None``: the one the pointer names (else ``tierstore.open()``'s
            default), opened and closed here.
        config: where ``config.json`` comes from: a directory holding it (its side files are copied too), or a
            transformers config (``model.config``); ``None``: the checkpoint directory, else its run directory.
        max_shard_size: the most tensor bytes per safetensors file (as ``save_pretrained``'s).
        progress: called after each layer (:data:`tierstore.interop.export.Progress`).
        resumable: also the Trainer's resume files (optimizer, scheduler, scaler, RNG, ``trainer_state.json``),
            so a plain ``transformers.Trainer`` resumes from ``out_dir``.

    Raises:
        CheckpointNotFoundError: ``checkpoint_dir`` holds no pointer (never saved by tierstore, or the Trainer's
            own checkpoint), or the step it names is not in the store.
        CheckpointGoneError: no tier restores the step (or an object of it): names the step and the newest
            checkpoint of the run that restores.
        KeyExistsError: ``out_dir`` exists and is not an empty directory.
        ConfigError: no ``config.json`` found, a ``config`` of another kind, ``out_dir`` inside ``checkpoint_dir``;
            ``resumable`` for a checkpoint saved with ``save_only_model``.
    """
    ckpt = os.path.abspath(os.fspath(checkpoint_dir))
    out = os.path.abspath(os.fspath(out_dir))
    if not os.path.isdir(ckpt):
        raise CheckpointNotFoundError(f"{ckpt} is not a directory: give a checkpoint-N directory", what="checkpoint",
                                      path=ckpt)
    ptr = _pointer(ckpt)
    if ptr is None:
        own = [n for n in _WEIGHTS if os.path.isfile(os.path.join(ckpt, n))]
        why = (f"it holds the Trainer's own weights ({own[0]}): from_pretrained reads it as it is" if own else
               "it was not saved by TierStoreTrainer, or its save never committed")
        raise CheckpointNotFoundError(f"{ckpt} holds no {POINTER_FILE}: {why}", what="checkpoint", path=ckpt)
    if out == ckpt or out.startswith(ckpt + os.sep):
        raise ConfigError(f"out_dir {out} is inside the checkpoint directory {ckpt}: export_pretrained writes "
                          "nothing there; choose a directory outside it", field="out_dir")
    _refuse_taken(out)
    entries = list(ptr.info.get("entries") or [])
    if resumable and "optim" not in entries:
        raise ConfigError(f"{ckpt} was saved with save_only_model (it holds {entries}): there is no optimizer, "
                          "scheduler or RNG state to resume from; export it without resumable", field="resumable")
    source, cfg = _config_source(ckpt, config)
    opened = None
    if store is None:
        import tierstore  # lazy: only an export without a store opens one

        store = opened = tierstore.open(**(named_store(StoreRef(None), ptr) or {}))
    try:
        _in_store(store, ckpt, ptr)
        parent = os.path.dirname(out)
        os.makedirs(parent, exist_ok=True)
        tmp = os.path.join(parent, f".{os.path.basename(out)}.partial-{uuid.uuid4().hex[:8]}")
        os.mkdir(tmp)  # the mode a plain mkdir gives (mkdtemp's is 0700)
        try:
            try:
                report = export_model(store, ptr.model, tmp, ptr.step, model_only=True, max_shard_size=max_shard_size,
                                      progress=progress)
            except NoValidCopyError as e:
                raise _gone(store, ckpt, ptr, e, "export that one instead") from e
            side = _write_side_files(tmp, source, cfg)
            if resumable:
                try:
                    side += _write_trainer_files(store, ptr, ckpt, tmp)
                except NoValidCopyError as e:
                    raise _gone(store, ckpt, ptr, e, "export that one instead") from e
            _fsync(tmp)
            try:
                os.rename(tmp, out)  # replaces an empty directory, never one with files
            except OSError as e:
                if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                    raise KeyExistsError(f"{out} was filled (or made a file) while the export ran; the export is "
                                         "discarded", key=out) from e
                raise
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _fsync(parent)
    finally:
        if opened is not None:
            opened.close()
    log.info("exported %s (step %d of %s) to %s: %s, %d tensors, and %s", ckpt, ptr.step, ptr.model, out,
             ", ".join(report.files), report.tensors, ", ".join(side))
    return out
