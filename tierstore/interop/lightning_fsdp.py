"""Lightning's FSDP2 strategy on tierstore: each rank's shards saved as one step, and restored on any world size.

:class:`~tierstore.interop.lightning.TierStoreModelParallelStrategy` (Lightning's ``ModelParallelStrategy``,
``fully_shard`` in ``configure_model``) calls this module for what differs from the other strategies:

* **Sharded saves** (``save_distributed_checkpoint=True``): Lightning calls the strategy's ``save_checkpoint``
  on every rank. Each rank saves its own shards (the DTensor local shards of the module's parameters and of the
  optimizer's state, nothing gathered) through a Checkpointer of the run's model with every rank of the job
  (:class:`ShardedSaves`): one step, committed by the two-phase commit of all ranks, read back by the elastic
  restore (:mod:`tierstore.train.reshard`). The rest of Lightning's checkpoint dict (loops, callbacks,
  schedulers, hyper-parameters) is stored beside it as tagged JSON by every rank. Once the step is committed,
  rank 0 pins it and writes the pointer at the checkpoint's path (the IO's own completion:
  :meth:`~tierstore.interop.lightning.TierStoreCheckpointIO.save_checkpoint`), with ``layout: "sharded"``;
  during ``fit`` that runs in the background, as the IO's saves do (``async_save``), and the next save first
  agrees on every rank that the previous one completed everywhere.
  The strategy's ``lightning_module_state_dict`` and ``optimizer_state`` then hand Lightning the live sharded
  state (no gather, no copy to the CPU): the snapshot is the only copy a save makes.
* **Restore** of a sharded pointer (:meth:`ShardedSaves.load`, every rank): a read-only restore of its step
  into the live sharded module and optimizer (:func:`tierstore.train.checkpointer.load`), at any world size:
  each rank reads the parts of the saved shards its own shard holds, every byte verified. A pointer of the
  gathered layout (``save_distributed_checkpoint=False``: the full state dict saved on rank 0) is loaded by
  :func:`load_full`, into the sharded module and optimizers as Lightning loads its own full checkpoint files.
  Which one is read follows the pointer, not the strategy's setting, so a run may switch.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from tierstore.errors import (
    CheckpointGoneError,
    CheckpointNotFoundError,
    CommitError,
    ConfigError,
    MissingDependencyError,
    NoValidCopyError,
    TierStoreError,
)
from tierstore.interop.pointer import Pointer, model_name, next_step
from tierstore.train.checkpointer import Checkpointer, load

try:
    from lightning.fabric.strategies.model_parallel import _load_raw_module_state, _rekey_optimizer_state_if_needed
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.trainer.states import TrainerFn
except ImportError as e:  # pragma: no cover - the lightning extra is in the test extra
    raise MissingDependencyError("tierstore.interop.lightning_fsdp needs PyTorch Lightning 2.x: pip install "
                                 "'tierstore[lightning]'") from e

__all__ = ["SHARDED", "ShardedSaves", "live_optimizer_state", "load_full"]

log = logging.getLogger(__name__)

SHARDED = "sharded"  # the pointer's layout of a step every rank saved its own shards of


def live_optimizer_state(optimizer: Any) -> dict[str, Any]:
    """The optimizer's own state dict (its state tensors the optimizer's memory, DTensors unchanged): what a
    sharded save hands Lightning instead of a gathered or CPU-offloaded copy."""
    if isinstance(optimizer, LightningOptimizer):
        optimizer = optimizer._optimizer
    return optimizer.state_dict()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _same(a: Any, b: Any) -> bool:
    """Whether ``a`` is the live tensor ``b`` (the same local memory, shape and dtype)."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or type(a) is not type(b):
        return False
    la, lb = _local(a), _local(b)
    return la.data_ptr() == lb.data_ptr() and la.shape == lb.shape and la.dtype == lb.dtype


def _rewritten(checkpoint: Mapping[str, Any], module: torch.nn.Module, optimizers: list[Any]) -> str | None:
    """What of ``checkpoint``'s state dicts is not the live module's and optimizers' own state (a hook rewrote
    it); ``None``: all of it is."""
    sd, live = checkpoint.get("state_dict"), module.state_dict()
    if not isinstance(sd, Mapping) or sd.keys() != live.keys():
        return "checkpoint['state_dict'] does not hold the names of the module's state_dict()"
    for k, v in live.items():
        if isinstance(v, torch.Tensor) and not _same(sd[k], v):
            return f"checkpoint['state_dict'][{k!r}] is not the module's own tensor"
    if "optimizer_states" not in checkpoint:
        return None
    osds = checkpoint["optimizer_states"]
    if not isinstance(osds, list) or len(osds) != len(optimizers):
        return "checkpoint['optimizer_states'] does not hold one state dict per optimizer"
    for i, (osd, opt) in enumerate(zip(osds, optimizers)):
        own = opt.state_dict()["state"]
        st = osd.get("state") if isinstance(osd, Mapping) else None
        if not isinstance(st, Mapping) or st.keys() != own.keys():
            return f"checkpoint['optimizer_states'][{i}] does not hold the optimizer's state"
        for pid, s in own.items():
            for k, v in s.items():
                if isinstance(v, torch.Tensor) and not _same(st[pid].get(k), v):
                    return f"checkpoint['optimizer_states'][{i}]['state'][{pid}][{k!r}] is not the optimizer's own"
    return None


def _fitting(strategy: Any) -> bool:
    """Whether ``fit`` is running (its saves complete in the background, as the IO's do)."""
    status = getattr(getattr(getattr(strategy.lightning_module, "_trainer", None), "state", None), "status", None)
    return getattr(status, "value", status) == "running"


def _one_optimizer(optimizers: list[Any]) -> Any:
    if len(optimizers) > 1:
        raise ConfigError(f"a sharded tierstore checkpoint holds one optimizer per module, this run has "
                          f"{len(optimizers)}: use save_distributed_checkpoint=False (the full state dict, gathered "
                          "to rank 0, stored as it is)", field="save_distributed_checkpoint")
    return optimizers[0] if optimizers else None


def _committed(ck: Checkpointer, model: str, step: int, full: str) -> None:
    """A rank's part of a sharded save after its snapshot, on every rank but 0 (rank 0 writes the pointer)."""
    outcome = ck.wait()
    if outcome != "committed":
        raise CommitError(f"the checkpoint at {full} (step {step} of {model}) was {outcome}", model=model, step=step)


class ShardedSaves:
    """The sharded saves and restores of one strategy: a Checkpointer per run (the run's model), every rank."""

    def __init__(self) -> None:
        self._cks: dict[str, tuple[Checkpointer, dict[str, Any]]] = {}
        self._saved = False

    # ---- save -----------------------------------------------------------------------------------
    def save(self, strategy: Any, io: Any, checkpoint: dict[str, Any], filepath: Any,
             storage_options: Any = None) -> None:
        """Save this rank's shards of ``checkpoint`` as the next step of the run's model (every rank calls this);
        once the step is committed, rank 0 writes the pointer at ``filepath``.

        Raises:
            TypeError: ``storage_options`` (not supported, as for Lightning's own ``TorchCheckpointIO``).
            IsADirectoryError: ``filepath`` is a directory (a sharded checkpoint Lightning wrote itself).
            ConfigError: ``checkpoint``'s state dicts are not the live module's and optimizer's (a hook rewrote
                them), or there are several optimizers; on every rank, before anything is written.
            CommitError: the previous save did not complete on some rank (every rank raises it; this one is not
                begun), or this step did not commit (with ``async_save``: raised by the next save or the end of
                ``fit``; its pointer is never written).
        """
        if storage_options is not None:
            raise TypeError(f"storage_options is not supported by {type(strategy).__name__}")
        path = Path(strategy.broadcast(filepath))
        if path.is_dir():
            raise IsADirectoryError(f"the checkpoint path {path} is a directory (a sharded checkpoint Lightning "
                                    "wrote itself?): remove it, or save elsewhere")
        full = os.path.abspath(path)
        module, optimizers = strategy.model, list(strategy.optimizers)
        why = _rewritten(checkpoint, module, optimizers)
        if why is not None:
            raise ConfigError(f"{why}: a sharded save stores the live module's and optimizer's shards (an "
                              "on_save_checkpoint hook changed them?); use save_distributed_checkpoint=False to store "
                              "the dict as it is", field="save_distributed_checkpoint")
        state: dict[str, Any] = {"model": module}
        opt = _one_optimizer(optimizers) if "optimizer_states" in checkpoint else None
        if opt is not None:
            state["optim"] = opt
        state["lightning"] = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        model = model_name(io.name, os.path.dirname(full))  # the run (dirpath) is one model
        ck = self._checkpointer(strategy, io, model, state)
        self._agree_previous(io, ck)
        # every rank reads the index before any begins the step (the collective): they agree on its number
        step = int(ck.ranks.all_max_(torch.tensor([next_step(io.store, model)], dtype=torch.int64))[0])
        info = {"global_step": checkpoint.get("global_step"), "epoch": checkpoint.get("epoch"), "layout": SHARDED,
                "world_size": ck.world_size, "pin": full}
        ck.save(step, extra={"path": full, **info})
        self._saved = True
        if ck.rank == 0:
            part: tuple[Any, ...] = (io._complete, ck, model, step, full, info)  # the pin, then the pointer
        else:
            part = (_committed, ck, model, step, full)
        if io.async_save and _fitting(strategy):
            io._saves.submit(*part)
        else:
            part[0](*part[1:])

    def _checkpointer(self, strategy: Any, io: Any, model: str, state: dict[str, Any]) -> Checkpointer:
        """The run's Checkpointer over every rank (its constructor is collective: every rank saves alike)."""
        got = self._cks.get(model)
        if got is not None:
            ck, held = got
            if held.keys() == state.keys() and all(held[k] is state[k] for k in state if k != "lightning"):
                held["lightning"] = state["lightning"]  # the Checkpointer re-reads its state at every save
                return ck
            ck.close()
        ck = Checkpointer(io.store, model, state=state, policy=io.policy, rank=strategy.global_rank,
                          world_size=strategy.world_size, keep_last=1, preallocate=False, timeout=io.timeout)
        self._cks[model] = (ck, state)
        return ck

    @staticmethod
    def _agree_previous(io: Any, ck: Checkpointer) -> None:
        """Wait for the previous save's background part on this rank, then agree with every rank (collective)
        that it completed everywhere: a save is begun by all ranks or by none.

        Raises:
            TierStoreError: this rank's previous save failed (its own error).
            CommitError: another rank's did (``failed_ranks``, ``reasons``).
        """
        err: Exception | None = None
        try:
            io.wait()
        except Exception as e:  # noqa: BLE001 - every rank hears of it (below), then it is raised here
            err = e
        verdicts = ck.ranks.gather(0 if err else 1, "" if err is None else f"{type(err).__name__}: {err}"[:400])
        if err is not None:
            raise err
        failed = {r: why for r, ok, why in verdicts if not ok}
        if failed:
            raise CommitError(f"the previous checkpoint of {ck.model} did not complete on rank(s) {sorted(failed)} "
                              f"({'; '.join(f'rank {r}: {w}' for r, w in sorted(failed.items()))}): this save is not "
                              "begun on any rank", model=ck.model, failed_ranks=sorted(failed), reasons=failed)

    # ---- restore --------------------------------------------------------------------------------
    def load(self, strategy: Any, io: Any, path: Path, ptr: Pointer) -> dict[str, Any]:
        """Restore the checkpoint of the pointer ``ptr`` (read at ``path``) into the strategy's live module and
        optimizers, on every rank; returns the rest of Lightning's checkpoint dict (loops, callbacks,
        schedulers) for Lightning to restore.

        Raises:
            CheckpointNotFoundError: the store holds no step of the pointer's model.
            CheckpointGoneError: no tier restores the pointer's step (and ``ckpt_path="last"`` did not choose it:
                then the run's freshest restorable checkpoint is restored instead, with a warning).
            RestoreMismatchError: another model (modules and optimizers are unchanged, on every rank).
        """
        if ptr.info.get("layout") != SHARDED:
            return load_full(strategy, io, path)
        io.wait()  # a save in flight: its pointer is written once it is committed
        io._adopt_store(ptr)
        store, full = io.store, os.path.abspath(path)
        recorded = {s for s, _ in store.steps.steps(ptr.model)}  # one index: every rank reads the same
        if not recorded:
            raise CheckpointNotFoundError(f"the checkpoint at {full} names step {ptr.step} of {ptr.model}, which "
                                          "this store does not hold (deleted, or another store)", what="checkpoint",
                                          path=full, model=ptr.model, step=ptr.step)
        state: dict[str, Any] = {"model": strategy.model}
        if strategy.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            opt = _one_optimizer(list(strategy.optimizers))
            if opt is not None:
                state["optim"] = opt
        state["lightning"] = io._templates().get("lightning", {})  # what hyper-parameters decode into

        def restore(model: str, step: int) -> None:
            load(store, model, state, step, rank=strategy.global_rank, world_size=strategy.world_size,
                 timeout=io.timeout)

        try:
            if ptr.step not in recorded:  # collected: its pin was lost (an index rebuilt from the durable tier)
                raise NoValidCopyError(f"step {ptr.step} of {ptr.model} is no longer recorded (collected)",
                                       model=ptr.model, step=ptr.step)
            restore(ptr.model, ptr.step)  # every rank raises alike: they agree on what they read (collective)
        except NoValidCopyError as e:  # a node loss took it
            restore(*self._fallback(strategy, io, full, ptr, f"{type(e).__name__}: {e}"))
        return dict(state["lightning"])

    @staticmethod
    def _fallback(strategy: Any, io: Any, full: str, ptr: Pointer, res: str) -> tuple[str, int]:
        """The step every rank restores instead of the pointer's (gone): rank 0's choice, broadcast.

        Raises:
            CheckpointGoneError: ``full`` was given explicitly (or no checkpoint of the run restores).
        """
        choice: tuple[str | None, int, str] = (None, -1, "")
        err: CheckpointNotFoundError | None = None
        if strategy.global_rank == 0:
            try:
                found = io._fallback(full, ptr, res)
                choice = (found.model, found.step, "")
            except CheckpointNotFoundError as e:
                choice, err = (None, -1, str(e)), e
        model, step, why = strategy.broadcast(choice)
        if strategy.global_rank == 0 and err is not None:
            raise err
        if model is None:
            raise CheckpointGoneError(f"rank 0: {why}", what="checkpoint", path=full, model=ptr.model, step=ptr.step)
        return str(model), int(step)

    # ---- the end of a run -----------------------------------------------------------------------
    def teardown(self, io: Any, rank: int) -> None:
        """The end of a run on this rank: the IO's ``teardown`` (it waits for the last save and raises its error;
        rank 0's settles its saves and collects), then close the Checkpointers; with the IO's ``settle``, wait for
        this rank's migration to the durable tier."""
        try:
            io.teardown()
        finally:
            self._close(io, rank)

    def _close(self, io: Any, rank: int) -> None:
        cks, self._cks = list(self._cks.values()), {}
        for ck, _ in cks:
            ck.close()
        saved, self._saved = self._saved, False
        if not (saved and io.settle and rank != 0):
            return
        try:
            io.store.flush()
        except TierStoreError as e:  # the steps stay as they are: a later run's re-saves collect them
            log.warning("rank %d: the checkpoints' migration did not finish at the end of the run (%s)", rank, e)


def load_full(strategy: Any, io: Any, path: Path) -> dict[str, Any]:
    """Load the gathered checkpoint at ``path`` (every rank reads the full state dict through the IO) into the
    sharded module and optimizers, as ``lightning.fabric.strategies.model_parallel._load_checkpoint`` loads a full
    checkpoint file (``broadcast_from_rank0``)."""
    checkpoint = io.load_checkpoint(path)
    assert strategy.lightning_module is not None and strategy.model is not None
    strict = strategy.lightning_module.strict_loading
    _load_raw_module_state(checkpoint.pop("state_dict"), strategy.model, strict=strict)
    if strategy.lightning_module.trainer.state.fn != TrainerFn.FITTING or "optimizer_states" not in checkpoint:
        return checkpoint
    from torch.distributed.checkpoint.state_dict import (  # lazy: only a resume loads optimizers
        StateDictOptions,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(broadcast_from_rank0=True, full_state_dict=True, strict=strict)
    for optimizer, state in zip(strategy.optimizers, checkpoint["optimizer_states"]):
        if state.get("state"):
            state = _rekey_optimizer_state_if_needed(state, strategy.model)
        set_optimizer_state_dict(strategy.model, optimizer, optim_state_dict=state, options=options)
    return checkpoint
