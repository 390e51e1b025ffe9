"""PyTorch Lightning on tierstore: a ``CheckpointIO``, a ``ModelCheckpoint`` that lets policies apply, FSDP2.

Minimal adoption (the lines a training script adds)::

    from tierstore.interop.lightning import TierStoreCheckpoint
    trainer = L.Trainer(..., callbacks=[TierStoreCheckpoint(dirpath="ckpts", every_n_train_steps=100, save_last=True,
                                                            save_top_k=3, monitor="val_loss")])
    trainer.fit(model, data, ckpt_path="last")

Three pieces, each at the extension point Lightning offers:

* :class:`TierStoreCheckpointIO` (``Trainer(plugins=[...])``): Lightning's
  strategies hand it the checkpoint dict on rank 0 only (``is_global_zero``)
  and it saves it as the next step of the run's model (``dirpath``: one model per run, a checkpoint is a
  step of it, kept while its path names it: :mod:`tierstore.interop.pointer`),
  rank-local (``world_size=1``: no collective, so the other ranks never wait
  for it) and returns after the snapshot (``async_save``); on a background
  thread it waits until the step is committed, then writes a small JSON
  pointer at the path (the next save, a removal, a load and the end of the
  run wait for it). Lightning's own machinery (``ModelCheckpoint``'s
  top-k, version counters and ``save_last`` links, ``ckpt_path="last"``, which
  lists ``last*.ckpt`` files) works on the pointers unchanged.
  ``load_checkpoint`` reads the step back on every rank (read-only, no epoch
  taken); a path that holds no tierstore checkpoint raises
  :class:`~tierstore.errors.CheckpointNotFoundError` (a ``FileNotFoundError``);
  a file Lightning wrote itself is loaded by Lightning's ``TorchCheckpointIO``.
  ``remove_checkpoint`` (top-k rotation) deletes the pointer, then its pin:
  the step goes at the next collection. Host memory holds the newest step and
  the pinned steps not yet durable (durable pinned steps are kept in the
  durable tier only), whatever ``save_top_k`` is.
* :class:`TierStoreCheckpoint`, a ``ModelCheckpoint`` (same arguments) that
  installs the IO into the trainer's strategy and binds it to the trainer:
  where the checkpoint dict holds the LightningModule's own tensors (single
  device, DDP: checked tensor by tensor), the module and its optimizer go
  through the Checkpointer's layer path, so the ``policy`` applies
  (``differential``, ``layerwise``: they build on the run's previous step,
  whichever path it was saved at). Elsewhere (FSDP's gathered state dict) the dict is stored as is.
* :class:`TierStoreModelParallelStrategy`: Lightning's FSDP2 strategy (``fully_shard``), each rank's shards
  saved as one step or the gathered state on rank 0, restored on any world size (:mod:`.lightning_fsdp`).
  Lightning's FSDP1 ``FSDPStrategy`` loads without the IO (and needs a GPU): not supported.

Everything non-tensor in the dict (hyper-parameters, loop and callback
state) is stored as tagged JSON (:mod:`tierstore.train.values`); a value that
cannot be (an ``nn.Module`` passed to ``save_hyperparameters()``) is refused
at the save, naming it, with the fix.
"""

from __future__ import annotations

import inspect
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tierstore.errors import (
    CheckpointNotFoundError,
    CommitError,
    ConfigError,
    CorruptObjectError,
    MissingDependencyError,
    NoValidCopyError,
    TierStoreError,
    UnknownError,
)
from tierstore.interop.lightning_fsdp import ShardedSaves, live_optimizer_state
from tierstore.interop.pointer import (
    Found,
    Pointer,
    freshest,
    gone,
    model_name,
    named_store,
    next_step,
    pin,
    pinned_by,
    read_pointer,
    retire_older,
    store_of,
    unpin,
    unpin_gone,
    write_pointer,
)
from tierstore.interop.save_queue import SaveQueue
from tierstore.interop.store_ref import StoreRef
from tierstore.keys import validate_name
from tierstore.train.checkpointer import Checkpointer
from tierstore.train.plain import read_plain
from tierstore.train.policies import Policy
from tierstore.train.state import normalise_fqn

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.core.saving import _load_state
    from lightning.pytorch.strategies import ModelParallelStrategy
except ImportError as e:  # pragma: no cover - the lightning extra is in the test extra
    raise MissingDependencyError("tierstore.interop.lightning needs PyTorch Lightning 2.x: pip install "
                                 "'tierstore[lightning]'") from e

__all__ = ["TierStoreCheckpoint", "TierStoreCheckpointIO", "TierStoreModelParallelStrategy", "export_checkpoint",
           "load_from_checkpoint", "read_checkpoint"]

log = logging.getLogger(__name__)

FRAMEWORK = "lightning"


def _same_storage(a: Any, b: Any) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and type(a) is type(b)
            and a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype
            and a.stride() == b.stride())


def _holds_module(sd: Any, module: torch.nn.Module) -> bool:
    """Whether ``sd`` is ``module``'s own state dict: the same names, every tensor the module's own memory."""
    if not isinstance(sd, Mapping):
        return False
    live = module.state_dict()
    return sd.keys() == live.keys() and all(
        _same_storage(sd[k], v) if isinstance(v, torch.Tensor) else not isinstance(sd[k], torch.Tensor)
        for k, v in live.items())


def _holds_optimizer(osd: Any, opt: torch.optim.Optimizer) -> bool:
    """Whether ``osd`` is ``opt``'s own state dict (its state tensors are the optimizer's own memory)."""
    if not isinstance(osd, Mapping) or not isinstance(osd.get("state"), Mapping):
        return False
    live = opt.state_dict()
    if osd["state"].keys() != live["state"].keys() or len(osd.get("param_groups") or []) != len(live["param_groups"]):
        return False
    return all(_same_storage(osd["state"][i].get(k), v)
               for i, st in live["state"].items() for k, v in st.items() if isinstance(v, torch.Tensor))


def _move(obj: Any, device: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _move(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_move(v, device) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_move(v, device) for v in obj)
    return obj


class TierStoreCheckpointIO(CheckpointIO):
    """Lightning checkpoints in a tierstore store; see the module docstring.

    Args:
        store: an open :class:`~tierstore.store.TierStore`, or a :class:`~tierstore.config.StoreConfig` / a dict
            of :func:`tierstore.open` arguments (opened once per process: ``ddp_spawn`` pickles the plugin).
        name: the models' name prefix: a run's model is ``<name>.<dirpath's name>-<digest of its absolute path>``.
        policy: the Checkpointer policy where the module's own tensors are saved (see :class:`TierStoreCheckpoint`).
        timeout: seconds a save waits for its step to commit.
        settle: at ``teardown`` (the end of ``fit``), wait for the saves' migration to the durable tier and
            collect the older steps it deferred (see :meth:`teardown`); ``False``: return at once, leaving them
            to the next run's re-saves.
        async_save: while the bound trainer runs (``fit``'s own saves), ``save_checkpoint`` returns once the
            state is copied (the snapshot); the wait for the commit, the pointer and the collection of older
            steps run on a background thread, as Lightning's ``AsyncCheckpointIO`` does. The next save, a
            ``remove_checkpoint``, a ``load_checkpoint`` and ``teardown`` wait for it first (at most
            ``timeout``) and raise its error. The pointer is still written only once its step is committed.
            ``False``: every save returns after its commit.
        lazy_save: with ``async_save``, where the checkpoint holds the module's own tensors and its one optimizer
            (the bound trainer's; see :class:`TierStoreCheckpoint`), a save returns before the copy: the module's
            parameters and the optimizer's state are copied on the background thread while the next batch's
            forward and backward run, and that optimizer's next ``step()`` waits for the copy (a lazy snapshot,
            :mod:`tierstore.train.lazy`). Everything else of the checkpoint (buffers, loops, callbacks,
            schedulers, hyper-parameters) is copied before the save returns. A parameter changed in place by
            anything but that optimizer before the copy read it (weight averaging swapped in for a validation,
            ``p.data`` writes, a second optimizer) fails that save with
            :class:`~tierstore.errors.SnapshotChangedError` (raised by the next save or the end of ``fit``; the
            checkpoint's pointer is not written): never a checkpoint with values the model did not have.
            Default ``False``: the save copies before it returns.
    """

    def __init__(self, store: Any = None, *, name: str = "lightning", policy: Policy | None = None,
                 timeout: float = 120.0, settle: bool = True, async_save: bool = True,
                 lazy_save: bool = False) -> None:
        self._ref = StoreRef(store)
        self.name = validate_name(name, "model name prefix")
        self.policy = policy
        self.timeout = timeout
        self.settle = settle
        self.async_save = async_save
        self.lazy_save = bool(lazy_save)
        self._saves = SaveQueue("tierstore-lightning-save")  # the background parts of saves (async_save)
        self._saved: set[str] = set()  # the models this run saved a step of (teardown settles them)
        self._trainer: Any = None
        self._cks: dict[str, tuple[Checkpointer, dict[str, Any]]] = {}
        self.latest: set[str] = set()  # paths Lightning's ckpt_path="last" chose among (TierStoreCheckpoint)
        self.like: dict[str, Any] = {}  # hyper-parameter templates where no trainer is bound (read_checkpoint)

    # ---- wiring -------------------------------------------------------------------------------
    @property
    def store(self) -> Any:
        return self._ref.get()

    def bind(self, trainer: Any) -> None:
        """Let saves see ``trainer``'s LightningModule and optimizers (policies apply); :class:`TierStoreCheckpoint`
        calls this in its ``setup``."""
        self._trainer = trainer

    def __getstate__(self) -> dict[str, Any]:  # ddp_spawn pickles the plugin: configuration only
        return {"_ref": self._ref, "name": self.name, "policy": self.policy, "timeout": self.timeout,
                "settle": self.settle, "async_save": self.async_save, "lazy_save": self.lazy_save}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.async_save = state.get("async_save", True)
        self.lazy_save = state.get("lazy_save", False)
        self._trainer, self._cks, self.latest, self.like, self._saved = None, {}, set(), {}, set()
        self._saves = SaveQueue("tierstore-lightning-save")

    # ---- save -----------------------------------------------------------------------------------
    def _state(self, checkpoint: dict[str, Any]) -> tuple[dict[str, Any], str]:
        """The Checkpointer state for one save, and how it was made (``"module"`` or ``"dict"``)."""
        t = self._trainer
        module = getattr(t, "lightning_module", None) if t is not None else None
        if module is None or not _holds_module(checkpoint.get("state_dict"), module):
            return {"lightning": dict(checkpoint)}, "dict"
        state: dict[str, Any] = {"model": module}
        rest = {k: v for k, v in checkpoint.items() if k != "state_dict"}
        opts = checkpoint.get("optimizer_states")
        optimizers = list(getattr(t, "optimizers", None) or [])
        if isinstance(opts, list) and len(opts) == 1 and len(optimizers) == 1 and _holds_optimizer(opts[0],
                                                                                                     optimizers[0]):
            state["optim"] = optimizers[0]
            rest.pop("optimizer_states")
        state["lightning"] = rest
        return state, "module"

    def _checkpointer(self, model: str, state: dict[str, Any]) -> Checkpointer:
        got = self._cks.get(model)
        if got is not None:
            ck, held = got
            if held.keys() == state.keys() and all(held[k] is state[k] for k in state if k != "lightning"):
                held["lightning"] = state["lightning"]  # the Checkpointer re-reads its state at every save
                return ck
            ck.close()
        # lazy only where the one optimizer that updates the module is in the state: its step() is the gate
        lazy = self.lazy_save and self.async_save and "optim" in state
        ck = Checkpointer(self.store, model, state=state, policy=self.policy, rank=0, world_size=1, keep_last=1,
                          preallocate=False, timeout=self.timeout, lazy=lazy)
        self._cks[model] = (ck, state)
        return ck

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Save ``checkpoint`` as the next step of ``path``'s model; once it is committed, write the pointer.

        Called by Lightning on rank 0 only; takes no collective. With ``async_save`` (the default) it returns
        after the snapshot, and the commit, the pointer and the collection run in the background.

        Raises:
            TypeError: ``storage_options`` (not supported, as for Lightning's own ``TorchCheckpointIO``).
            InvalidValueError: a value of the checkpoint cannot be stored (named; nothing written).
            CommitError: the step did not commit (the pointer at ``path`` is left as it was); with ``async_save``
                raised by the next call that waits for it (the next save, ``remove_checkpoint``,
                ``load_checkpoint``, ``teardown``).
        """
        self.wait()
        if storage_options is not None:
            raise TypeError(f"storage_options is not supported by {type(self).__name__}")
        rank = self._global_rank()
        if rank != 0:
            raise ConfigError(f"{type(self).__name__}.save_checkpoint called on rank {rank}: it saves the checkpoint "
                              "of global rank 0, as Lightning's own strategies call it (this strategy saves on every "
                              "rank: use its own checkpoint format)", field="strategy")
        full = os.path.abspath(os.fspath(path))
        model = model_name(self.name, os.path.dirname(full))  # the run (dirpath) is one model
        state, how = self._state(checkpoint)
        ck = self._checkpointer(model, state)
        step = next_step(self.store, model)
        info = {"global_step": checkpoint.get("global_step"), "epoch": checkpoint.get("epoch"), "layout": how,
                "pin": full}
        ck.save(step, extra={"path": full, **info})
        if not (self.async_save and self._fitting()):
            self._complete(ck, model, step, full, info)
            return
        self._saves.submit(self._complete, ck, model, step, full, info)

    def _fitting(self) -> bool:
        """Whether the bound trainer is running (``fit``'s own saves go on in the background); a save outside a
        run (``trainer.save_checkpoint(path)`` after ``fit``) returns with its pointer written."""
        status = getattr(getattr(self._trainer, "state", None), "status", None)
        return getattr(status, "value", status) == "running"

    def _complete(self, ck: Checkpointer, model: str, step: int, full: str, info: dict[str, Any]) -> None:
        """The part of a save after the snapshot: the commit, the pin, the pointer, then the collection of the
        steps no checkpoint of the run names any more."""
        outcome = ck.wait()
        if outcome != "committed":
            raise CommitError(f"the checkpoint at {full} (step {step} of {model}) was {outcome}", model=model,
                              step=step)
        store = self.store
        pin(store, model, full, step)  # first: the pointer only ever names a step retention keeps
        write_pointer(full, Pointer(model, step, full, FRAMEWORK, time.time(), info, store_of(store)))
        self._saved.add(model)
        unpin_gone(store, model, os.path.dirname(full))  # checkpoints removed behind the IO's back, or a crash
        retire_older(store, model)

    def wait(self) -> None:
        """Wait for the background part of the last save (``async_save``): its step committed and its pointer
        written, within the save's ``timeout`` (and its Checkpointer's, which bounds the commit wait).

        Raises:
            CommitError: that save did not commit (its pointer was not written); or it did not finish within
                ``timeout`` seconds.
            TierStoreError: its commit failed otherwise (typed, as the save itself would have raised it).
        """
        self._saves.wait(self.timeout + 60.0)  # the commit wait is bounded by timeout; the rest by the store

    def _global_rank(self) -> int:
        if self._trainer is not None:
            return int(self._trainer.global_rank)
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    # ---- load -----------------------------------------------------------------------------------
    def _pointer(self, path: Any) -> Pointer | None:
        try:
            return read_pointer(path)
        except FileNotFoundError as e:
            raise CheckpointNotFoundError(f"no checkpoint at {os.fspath(path)}: nothing was saved there (or it was "
                                          "removed)", what="checkpoint", path=os.fspath(path)) from e

    def _templates(self) -> dict[str, Any]:
        module = getattr(self._trainer, "lightning_module", None) if self._trainer is not None else None
        if module is None:
            return {"lightning": {"hyper_parameters": self.like}} if self.like else {}
        like: dict[str, Any] = {"hyper_parameters": dict(getattr(module, "hparams", {}) or {})}
        dm = getattr(self._trainer, "datamodule", None)
        if dm is not None:
            like["datamodule_hyper_parameters"] = dict(getattr(dm, "hparams", {}) or {})
        return {"lightning": like}

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint saved at ``path`` (read-only, on any rank); a file Lightning wrote itself is loaded by
        Lightning's ``TorchCheckpointIO``.

        Raises:
            CheckpointNotFoundError: nothing at ``path``, or its step is gone from the store.
            CorruptObjectError: a malformed pointer.
        """
        self.wait()  # a save in flight (async_save): its pointer is written once it is committed
        ptr = self._pointer(path)
        if ptr is None:
            log.info("%s is not a tierstore pointer: loading it with Lightning's TorchCheckpointIO", path)
            kwargs = {} if map_location is None else {"map_location": map_location}
            return TorchCheckpointIO().load_checkpoint(path, weights_only=weights_only, **kwargs)
        self._adopt_store(ptr)
        store = self.store
        recorded = {s for s, _ in store.steps.steps(ptr.model)}
        if not recorded:
            raise CheckpointNotFoundError(f"the checkpoint at {os.fspath(path)} names step {ptr.step} of "
                                          f"{ptr.model}, which this store does not hold (deleted, or another store)",
                                          what="checkpoint", path=os.fspath(path), model=ptr.model, step=ptr.step)
        try:  # the read path resolves (and verifies) the step itself
            if ptr.step not in recorded:  # collected: its pin was lost (an index rebuilt from the durable tier)
                raise NoValidCopyError(f"step {ptr.step} of {ptr.model} is no longer recorded (collected)",
                                       model=ptr.model, step=ptr.step)
            plain = read_plain(store, ptr.model, ptr.step, templates=self._templates())
        except NoValidCopyError as e:  # a node loss took it
            found = self._fallback(os.path.abspath(os.fspath(path)), ptr, f"{type(e).__name__}: {e}")
            plain = read_plain(store, found.model, found.step, templates=self._templates())
        ckpt = dict(plain.entries["lightning"])
        if "model" in plain.entries:
            ckpt["state_dict"] = self._names(plain.entries["model"])
        if "optim" in plain.entries:
            ckpt["optimizer_states"] = [plain.entries["optim"]]
        if map_location is not None:
            if callable(map_location) or isinstance(map_location, Mapping):
                raise TypeError("map_location: a device or a device string (tierstore reads into CPU memory)")
            ckpt = _move(ckpt, map_location)
        return ckpt

    def _adopt_store(self, ptr: Pointer) -> None:
        """With no store given (the default ``./.tierstore`` of the working directory), open the store the pointer
        names where it is another one: a script started from another directory finds its checkpoints' store."""
        args = named_store(self._ref, ptr)
        if args is not None:
            log.info("the checkpoint %s names the store at %s (not this directory's default): opening it",
                     ptr.path, args["home"])
            self._ref = StoreRef(args)

    def _fallback(self, full: str, ptr: Pointer, res: str) -> Found:
        """The step to read for the checkpoint at ``full`` whose own step no tier restores (``res``: why): the
        newest restorable step of the run (this directory's checkpoints) where ``ckpt_path="last"`` chose the
        path, else :class:`~tierstore.errors.CheckpointGoneError` naming that step."""
        store = self.store
        run = [ptr]
        directory = os.path.dirname(full)
        for f in sorted(os.listdir(directory)):
            p = os.path.join(directory, f)
            if p == full or not f.endswith(".ckpt") or not os.path.isfile(p):
                continue
            try:
                other = read_pointer(p)
            except (OSError, CorruptObjectError):
                continue
            if other is not None and other.framework == FRAMEWORK and other.model.startswith(f"{self.name}."):
                run.append(other)
        found = freshest(store, run)
        if full not in self.latest or found is None:
            raise gone(full, ptr, res, found, "pass it as ckpt_path, or ckpt_path=\"last\"")
        log.warning("ckpt_path=\"last\": %s names step %d of %s (global step %s), which no tier restores any more "
                    "(%s); resuming from the newest step that does: %s (step %d of %s, global step %s)", full,
                    ptr.step, ptr.model, ptr.info.get("global_step"), res, found.path, found.step, found.model,
                    found.global_step)
        return found

    def _names(self, sd: dict[str, Any]) -> dict[str, Any]:
        """``sd`` under the live module's own keys (tierstore stores names without wrapper parts)."""
        module = getattr(self._trainer, "lightning_module", None) if self._trainer is not None else None
        if module is None:
            return sd
        keys = {normalise_fqn(k): k for k in module.state_dict()}
        return {keys.get(k, k): v for k, v in sd.items()}

    # ---- remove ---------------------------------------------------------------------------------
    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint at ``path``: the pointer first, then its pin, then the run's steps that no
        checkpoint names any more are collected (the Checkpointer's window stays). A pointer written before runs
        were one model deletes its own model from every tier.

        A symbolic link (``save_last="link"``) or a copy of a pointer made elsewhere only loses its file: the step
        belongs to the path it was saved at. A file Lightning wrote itself is removed as Lightning would.
        """
        self.wait()  # a save in flight (async_save) may be of this path
        full = os.path.abspath(os.fspath(path))
        if os.path.islink(full):
            os.unlink(full)
            return
        if not os.path.exists(full):
            return
        ptr = read_pointer(full)
        if ptr is None:
            TorchCheckpointIO().remove_checkpoint(path)
            return
        os.remove(full)  # first: ckpt_path="last" can never pick a pointer to a deleted step
        if os.path.abspath(ptr.path) != full:
            return
        if pinned_by(ptr, full):  # a step of the run: Lightning's rotation is the evidence that it may go
            unpin(self.store, ptr.model, [full])
            retire_older(self.store, ptr.model)
            return
        got = self._cks.pop(ptr.model, None)
        self._saved.discard(ptr.model)
        if got is not None:
            got[0].close()
        try:  # Lightning asked: its own rotation is the evidence, and this process is the model's only writer
            self.store.delete_model(ptr.model, force=True)
        except UnknownError:
            pass

    def teardown(self) -> None:
        """Close the Checkpointers (every save waited for its commit); with ``settle``, wait for the saves'
        migration (:meth:`~tierstore.store.TierStore.flush`, bounded by ``StoreConfig.flush_timeout_s``) and
        collect the older steps of every path saved whose collection a re-save deferred while their migration
        ran, so nothing is left uncollected in the host tier after the last save. A save still in flight
        (``async_save``) is waited for first; its error is raised after the Checkpointers are closed."""
        failed: BaseException | None = None
        try:
            self.wait()
        except Exception as e:  # noqa: BLE001 - raised below, once everything is closed
            failed = e
        self._saves.close()
        cks, self._cks = list(self._cks.values()), {}
        for ck, _ in cks:
            ck.close()
        if failed is not None:
            raise failed
        saved, self._saved = self._saved, set()
        if not (self.settle and saved):
            return
        store = self.store
        try:
            store.flush()
        except TierStoreError as e:  # the steps stay as they are: a later run's re-saves collect them
            log.warning("the checkpoints' migration did not finish at the end of the run (%s): their older steps "
                        "are left for a later collection", e)
            return
        for model in sorted(saved):
            if store.steps.steps(model):  # not rotated away meanwhile
                retire_older(store, model)


class TierStoreCheckpoint(ModelCheckpoint):
    """A ``ModelCheckpoint`` (every argument of Lightning's) saving through :class:`TierStoreCheckpointIO`.

    In ``setup`` it installs its IO into the trainer's strategy (or takes the
    :class:`TierStoreCheckpointIO` already given as a plugin) and binds it to
    the trainer, so the module's own tensors go through the Checkpointer's
    layers and ``policy`` applies. ``ckpt_path="last"`` finds its ``last*.ckpt``
    pointers as it finds Lightning's files.

    Args:
        *args: ``ModelCheckpoint``'s positional arguments (``dirpath``, ``filename``, ``monitor``, ...).
        store: keyword-only, as the others below; see :class:`TierStoreCheckpointIO`.
        name: see :class:`TierStoreCheckpointIO`.
        policy: see :class:`TierStoreCheckpointIO`.
        timeout: see :class:`TierStoreCheckpointIO`.
        settle: see :class:`TierStoreCheckpointIO`.
        async_save: see :class:`TierStoreCheckpointIO`.
        lazy_save: see :class:`TierStoreCheckpointIO`.
        **kwargs: ``ModelCheckpoint``'s (``dirpath``, ``filename``, ``monitor``, ``save_top_k``,
            ``save_last``, ``every_n_train_steps``, ...).
    """

    def __init__(self, *args: Any, store: Any = None, name: str = "lightning", policy: Policy | None = None,
                 timeout: float = 120.0, settle: bool = True, async_save: bool = True, lazy_save: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # ModelCheckpoint's own arguments, positional ones included
        self.io = TierStoreCheckpointIO(store, name=name, policy=policy, timeout=timeout, settle=settle,
                                        async_save=async_save, lazy_save=lazy_save)

    def _find_last_checkpoints(self, trainer: pl.Trainer) -> set[str]:
        """Lightning's ``ckpt_path="last"`` lists these; the IO resumes one of them from the freshest restorable
        step of the run where a node loss took the step it names."""
        found = super()._find_last_checkpoints(trainer)
        self.io.latest |= {os.path.abspath(p) for p in found}
        return found

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Install the IO into ``trainer``'s strategy.

        Raises:
            ConfigError: ``trainer`` is not a ``lightning.pytorch.Trainer`` (the standalone ``pytorch_lightning``
                package's Trainer does not see this callback as a checkpoint callback: it would add its own,
                ``ckpt_path="last"`` would find nothing and the run would start fresh), before anything is
                restored or saved.
        """
        if not isinstance(trainer, pl.Trainer):
            kind = type(trainer)
            raise ConfigError(f"TierStoreCheckpoint works with lightning.pytorch's Trainer, not {kind.__module__}."
                              f"{kind.__qualname__}: import the Trainer and the LightningModule from "
                              "lightning.pytorch (`import lightning.pytorch as pl`), the same package as this "
                              "callback (with the standalone pytorch_lightning package, Lightning would ignore it "
                              "and start fresh)", field="trainer")
        super().setup(trainer, pl_module, stage)
        current = trainer.strategy.checkpoint_io
        if isinstance(current, TierStoreCheckpointIO):
            current.latest |= self.io.latest
            self.io = current
        else:
            trainer.strategy.checkpoint_io = self.io
        self.io.bind(trainer)


class TierStoreModelParallelStrategy(ModelParallelStrategy):
    """Lightning's FSDP2 strategy on tierstore. ``save_distributed_checkpoint=True``: each rank saves its own shards,
    one step of every rank (no gather); ``False`` (the default here): the full state dict gathered to rank 0, saved
    there through the IO. ``load_checkpoint`` restores either (the pointer says which), a sharded one on any world
    size; ``teardown`` runs the IO's (Lightning's skips it). See :mod:`tierstore.interop.lightning_fsdp`."""

    def __init__(self, *, save_distributed_checkpoint: bool = False, **kwargs: Any) -> None:
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint, **kwargs)
        self._shards = ShardedSaves()

    def _sharded(self) -> bool:
        return self._save_distributed_checkpoint and isinstance(self.checkpoint_io, TierStoreCheckpointIO)

    def lightning_module_state_dict(self) -> dict[str, Any]:  # sharded: the live shards, no copy
        if self._sharded() and self.model is not None:
            return self.model.state_dict()
        return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return live_optimizer_state(optimizer) if self._sharded() else super().optimizer_state(optimizer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if not self._sharded():
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        self._shards.save(self, self.checkpoint_io, checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        io = self.checkpoint_io
        path = Path(self.broadcast(checkpoint_path))
        ptr = read_pointer(path) if isinstance(io, TierStoreCheckpointIO) and path.is_file() else None
        if ptr is None:
            return super().load_checkpoint(path, weights_only=weights_only)
        return self._shards.load(self, io, path, ptr)

    def teardown(self) -> None:
        super().teardown()
        if isinstance(self.checkpoint_io, TierStoreCheckpointIO):
            self._shards.teardown(self.checkpoint_io, self.global_rank)


# ---- outside a Trainer: the pointer read as Lightning's checkpoint ------------------------------------------------

def _defaults(cls: Any) -> dict[str, Any]:
    """The default values of ``cls.__init__``'s parameters: the types a hyper-parameter decodes into."""
    try:
        params = inspect.signature(cls.__init__).parameters.values()
    except (TypeError, ValueError):
        return {}
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty and p.default is not None}


def read_checkpoint(path: str | os.PathLike[str], store: Any = None, *, cls: Any = None) -> dict[str, Any]:
    """The Lightning checkpoint dict (``state_dict``, ``optimizer_states``, ``hyper_parameters``, loops, ...) of
    the pointer at ``path``, read from the store (``store``; ``None``: the one the pointer names, else the
    default). What ``torch.load`` returns for a ``.ckpt`` file Lightning wrote; tensors in CPU memory.
    Hyper-parameters are tagged JSON (never unpickled): a value whose type ``cls.__init__``'s default of the
    same name has (an enum, a dataclass, a path) decodes into that type, the others into plain values.

    Raises:
        CheckpointNotFoundError: nothing at ``path``, its step is gone (:class:`~tierstore.errors.CheckpointGoneError`),
            or ``path`` is not a tierstore pointer (``torch.load`` reads that one).
    """
    full = os.fspath(path)
    io = TierStoreCheckpointIO(store)
    io.like = _defaults(cls) if cls is not None else {}
    if io._pointer(full) is None:
        raise CheckpointNotFoundError(f"{full} is not a tierstore pointer: torch.load (or Lightning's own "
                                      "load_from_checkpoint) reads it", what="checkpoint", path=full)
    return io.load_checkpoint(full)


def load_from_checkpoint(cls: Any, path: str | os.PathLike[str], *, store: Any = None, map_location: Any = None,
                         strict: bool | None = None, **kwargs: Any) -> Any:
    """``cls.load_from_checkpoint(path)`` for a tierstore pointer (Lightning's own reads the file with
    ``torch.load`` and fails on the JSON): the module built from the saved hyper-parameters (``kwargs``
    override them, as Lightning's do) with the saved weights, on ``map_location`` (default: CPU).

    Raises:
        CheckpointNotFoundError: see :func:`read_checkpoint`.
    """
    checkpoint = read_checkpoint(path, store, cls=cls)
    checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {})
    checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY].update(kwargs)
    model = _load_state(cls, checkpoint, strict=strict, **kwargs)  # as lightning.pytorch.core.saving does
    assert isinstance(model, pl.LightningModule)
    return model.to(map_location) if map_location is not None else model


def export_checkpoint(path: str | os.PathLike[str], out: str | os.PathLike[str], store: Any = None, *,
                      cls: Any = None) -> str:
    """Write the checkpoint of the pointer at ``path`` as a Lightning ``.ckpt`` file at ``out`` (``torch.save``
    of :func:`read_checkpoint`, written to a temporary file and renamed): what tools that ``torch.load`` a
    checkpoint or call ``Net.load_from_checkpoint`` read. Returns ``out``'s absolute path.

    ``cls``: the LightningModule class, whose defaults type the hyper-parameters (see :func:`read_checkpoint`).

    Raises:
        CheckpointNotFoundError: see :func:`read_checkpoint`.
    """
    checkpoint = read_checkpoint(path, store, cls=cls)
    target = os.path.abspath(os.fspath(out))
    os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
    tmp = f"{target}.tmp-{os.getpid()}"
    try:
        torch.save(checkpoint, tmp)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
