"""The Hugging Face ``transformers`` Trainer on tierstore, met at its own save/resume flow.

Minimal adoption (the lines a training script adds)::

    from tierstore.interop.huggingface import TierStoreTrainer
    trainer = TierStoreTrainer(model=model, args=args, train_dataset=ds, store=store)   # was: Trainer(...)
    trainer.train(resume_from_checkpoint=True)

(``TierStoreTrainerMixin`` goes in front of another Trainer subclass: ``class T(TierStoreTrainerMixin, SFTTrainer)``.)

Where it hooks in, and why there: the Trainer's own ``_save_checkpoint``
writes a ``checkpoint-<global step>`` directory (weights, ``optimizer.pt``,
``scheduler.pt``, ``rng_state_<rank>.pth``, ``trainer_state.json``), and
``train(resume_from_checkpoint=...)`` restores from one: it reads
``trainer_state.json`` itself and from it restores the epoch, the data
position (skipping the batches the interrupted run consumed), the logging
counters and the callbacks' states, then calls ``_load_from_checkpoint``
(weights, before ``accelerator.prepare``), ``_load_optimizer_and_scheduler``
(after the optimizer exists) and ``_load_rng_state`` (at the point of the
epoch where the interrupted run saved its generators). Those private methods
are the Trainer's documented-in-code split of its resume flow, the ones
DeepSpeed, FSDP and SageMaker support override inside the Trainer itself
and subclasses such as TRL's keep; overriding them leaves every part the
Trainer restores by itself (``TrainerState``: epoch, data position, logging
counters) to the Trainer. A callback cannot: the Trainer has chosen its
data position before any callback runs.

So, per checkpoint directory:

* **save** (``save_model`` as ``_save_checkpoint`` calls it, on every rank):
  the next tierstore step of the run's model (``output_dir`` is one model,
  ``<name>.<output_dir's name>-<digest>``, and each ``checkpoint-N`` a step
  of it, pinned while the directory names it: :mod:`tierstore.interop.pointer`;
  one Checkpointer per run, so the policy builds on the previous checkpoint)
  holding the model, optimizer, scheduler,
  gradient scaler, this rank's RNG state and the ``TrainerState``, saved by
  every rank (``dedup()`` by default with several ranks: replicas stored
  once), committed, then rank 0 pins it and writes ``tierstore.json`` (the
  pointer) in the
  directory. The weight, optimizer, scheduler, scaler and RNG files are not
  written; the Trainer then writes ``trainer_state.json`` itself. A
  directory is complete when both files are there. With ``store_async``
  (the default) the save returns after the snapshot and the commit, the pin
  and the pointer follow on a background thread (the next save and the end
  of ``train()`` wait for it): a directory holding ``trainer_state.json``
  alone is a save that never committed, and a resume skips it.
* **resume** (``train(resume_from_checkpoint=True)`` or a directory): ``True``
  picks the newest *complete* ``checkpoint-N`` whose step still restores (HF
  would pick the newest number, even one a killed save left half-written;
  after a node reboot took a step that was not durable yet, an older
  directory's durable step: it logs which), and starts fresh with an info log
  where the run has no checkpoint yet; each load reads this rank's part of
  the step read-only (no collective, no epoch taken). A directory given
  explicitly whose step is gone raises
  :class:`~tierstore.errors.CheckpointGoneError` naming the newest that restores.
  Directories the Trainer wrote itself (no pointer) load as the Trainer loads them.
* **rotation** (``save_total_limit``): after the Trainer deletes old
  directories, the pins of the ``checkpoint-N`` directories that are gone
  from the run directory that holds the new checkpoint are dropped and their
  steps collected (the Trainer's ``rmtree`` is the evidence; a run directory
  that cannot be seen drops nothing). Host memory holds the newest step and
  the pinned ones not yet durable, whatever ``save_total_limit`` is.

A checkpoint directory as one ``from_pretrained`` reads (``model.safetensors``, ``config.json``):
:func:`tierstore.interop.hf_pretrained.export_pretrained`.

Not supported: ``load_best_model_at_end`` (refused at construction),
DeepSpeed, FSDP and SageMaker model parallelism (they save through their
own engines; refused at the first save), Accelerate's ``save_state``.
"""

from __future__ import annotations

import logging
import os
import re
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tierstore.errors import (
    CheckpointGoneError,
    CheckpointNotFoundError,
    CommitError,
    ConfigError,
    MissingDependencyError,
    NoValidCopyError,
    TierStoreError,
)
from tierstore.interop.pointer import (
    Found,
    Pointer,
    gone,
    model_name,
    named_store,
    next_step,
    pin,
    read_pointer,
    restores,
    retire_older,
    store_of,
    unpin_gone,
    write_pointer,
)
from tierstore.interop.save_queue import SaveQueue
from tierstore.interop.store_ref import StoreRef
from tierstore.keys import validate_name
from tierstore.train.checkpointer import Checkpointer, load
from tierstore.train.policies import Policy, dedup, exact
from tierstore.train.state import RNGState

try:
    from transformers import Trainer
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as e:  # pragma: no cover - the hf extra is in the test extra
    raise MissingDependencyError("tierstore.interop.huggingface needs transformers: pip install 'tierstore[hf]'") from e

__all__ = ["POINTER_FILE", "TierStoreTrainer", "TierStoreTrainerMixin", "last_checkpoint"]

log = logging.getLogger(__name__)

POINTER_FILE = "tierstore.json"
TRAINER_STATE = "trainer_state.json"
FRAMEWORK = "transformers"
_CHECKPOINT_RE = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


def _pointer(checkpoint_dir: str | os.PathLike[str]) -> Pointer | None:
    p = os.path.join(os.fspath(checkpoint_dir), POINTER_FILE)
    return read_pointer(p) if os.path.isfile(p) else None


def _numbered(run: str) -> list[str]:
    """``run``'s ``checkpoint-N`` directories, the highest ``N`` first."""
    if not os.path.isdir(run):
        return []
    found = sorted(((int(m.group(1)), d) for d in os.listdir(run) if (m := _CHECKPOINT_RE.match(d))), reverse=True)
    return [os.path.join(run, d) for _, d in found]


def _pending(checkpoint_dir: str) -> bool:
    """Whether ``checkpoint_dir`` holds ``trainer_state.json`` and nothing else of a checkpoint: a save of this
    integration whose commit had not finished (``store_async``) when the process stopped, or failed."""
    names = [n for n in os.listdir(checkpoint_dir) if not n.startswith(".")]
    return names == [TRAINER_STATE]


def last_checkpoint(run_dir: str | os.PathLike[str], store: Any | None = None, *, say: bool = True) -> str | None:
    """The newest complete ``checkpoint-N`` directory of ``run_dir``: its pointer and ``trainer_state.json`` are
    there, and (given ``store``) the step it names still restores through the read path (memory, peer, durable:
    after a node reboot took a step that was not durable yet, an older directory's durable step). Directories the
    Trainer wrote itself (no pointer) count when their ``trainer_state.json`` is there and something else (its
    weights); a directory holding ``trainer_state.json`` alone is a save whose commit never finished, skipped.
    ``say``: log the newer ones skipped and which one it took. ``None``: none."""
    skipped: list[str] = []
    for full in _numbered(os.fspath(run_dir)):
        if not os.path.isfile(os.path.join(full, TRAINER_STATE)):
            continue
        ptr = _pointer(full)
        if ptr is None and _pending(full):
            skipped.append(f"{os.path.basename(full)} (its save never committed: no pointer, no weights)")
            continue
        if ptr is not None and store is not None:
            res = restores(store, ptr.model, ptr.step)
            if isinstance(res, str):
                skipped.append(f"{os.path.basename(full)} ({res})")
                continue
        if skipped and say:
            log.warning("resume_from_checkpoint=True: %s no longer restore; resuming from the newest checkpoint "
                        "that does: %s", "; ".join(skipped), full)
        return full
    return None


def _in_store(store: Any, checkpoint: str, ptr: Pointer) -> None:
    """Raise :class:`~tierstore.errors.CheckpointNotFoundError` where the step ``ptr`` (read in ``checkpoint``)
    names is not a committed step of ``store``: deleted, or another store."""
    if ptr.step not in {s for s, st in store.steps.steps(ptr.model) if st in ("committed", "durable")}:
        raise CheckpointNotFoundError(f"{checkpoint}: its step {ptr.step} of {ptr.model} is not in this store "
                                      "(deleted, or another store)", what="checkpoint", path=checkpoint)


def _gone(store: Any, checkpoint: str, ptr: Pointer, e: BaseException, hint: str) -> CheckpointGoneError:
    """The typed error for ``checkpoint`` whose step the read path could not rebuild (``e``: a node loss took
    it), naming the newest checkpoint of its run that restores (``hint``: what to do with that one)."""
    newest = last_checkpoint(os.path.dirname(os.path.abspath(checkpoint)), store, say=False)
    np = _pointer(newest) if newest is not None else None
    found = None if newest is None or np is None else Found(newest, np.model, np.step, np.info.get("global_step"))
    return gone(os.path.abspath(checkpoint), ptr, f"{type(e).__name__}: {e}", found, hint)


class TierStoreTrainerMixin:
    """Checkpoints of a ``transformers.Trainer`` (subclass) in tierstore; see the module docstring.

    Keyword arguments (besides the Trainer's):
        store: an open :class:`~tierstore.store.TierStore` (or a :class:`~tierstore.config.StoreConfig` / a
            dict of :func:`tierstore.open` arguments).
        store_name: the models' name prefix (default ``"hf"``): a run's model is
            ``<store_name>.<output_dir's name>-<digest of its absolute path>``.
        store_policy: the Checkpointer policy (default ``dedup()`` with several ranks, else ``exact()``).
        store_timeout: seconds a save waits for its step to commit.
        store_async: a checkpoint save returns once every rank's state is copied (the snapshot); the wait for
            the commit, the pin, the pointer and the collection run on a background thread, as Lightning's
            ``AsyncCheckpointIO`` does. The next save and the end of ``train()`` wait for it first (at most
            ``store_timeout`` + 60 s) and raise its error. The pointer is still written only once its step is
            committed: until then the directory holds ``trainer_state.json`` alone, which a resume skips.
            ``False``: a save returns after its commit.
        store_lazy: with ``store_async``, a save returns before the copy of the model's parameters and the
            optimizer's state: they are copied on the background thread while the next step's forward and
            backward run, and the optimizer's next ``step()`` waits for the copy (a lazy snapshot,
            :mod:`tierstore.train.lazy`). The scheduler, the scaler, the RNG, the Trainer's state and the
            model's buffers are copied before the save returns. A parameter changed in place by anything but the
            optimizer before the copy read it fails that save with :class:`~tierstore.errors.SnapshotChangedError`
            (raised by the next save or the end of ``train()``; no pointer is written): never a checkpoint with
            values the model did not have. Default ``False``; without the optimizer in the checkpoint
            (``save_only_model``) the save copies before it returns.
        store_settle: at the end of ``train()``, every rank waits for its saves' migration to the durable tier
            (:meth:`~tierstore.store.TierStore.flush`, bounded by ``store_timeout``; one that does not finish is
            logged, never raised), then rank 0 collects the older steps, so the host tier holds the
            newest step alone after the last save; ``False``: ``train()`` returns without waiting, and the older
            steps whose migration was still running are left to the next run's saves.
    """

    def __init__(self, *args: Any, store: Any = None, store_name: str = "hf", store_policy: Policy | None = None,
                 store_timeout: float = 120.0, store_async: bool = True, store_lazy: bool = False,
                 store_settle: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        if self.args.load_best_model_at_end:
            raise ConfigError("TierStoreTrainer does not support load_best_model_at_end yet (the best checkpoint's "
                              "weights are in tierstore, and the Trainer reads weight files)",
                              field="load_best_model_at_end")
        self._ts_ref = StoreRef(store)
        self._ts_name = validate_name(store_name, "model name prefix")
        self._ts_policy = store_policy
        self._ts_timeout = store_timeout
        self._ts_saving = False
        self._ts_group: Any = None
        self._ts_ck: tuple[Any, dict[str, Any]] | None = None  # the run's Checkpointer, kept across saves
        self._ts_async = bool(store_async)
        self._ts_lazy = bool(store_lazy)
        self._ts_settle = bool(store_settle)
        self._ts_saves = SaveQueue("tierstore-hf-save")  # the background parts of saves (store_async)

    args: Any
    state: Any
    model: Any
    optimizer: Any
    lr_scheduler: Any
    accelerator: Any

    @property
    def store(self) -> Any:
        return self._ts_ref.get()

    # ---- resume -----------------------------------------------------------------------------------
    def _ts_adopt(self, checkpoint: str | None) -> None:
        """With no store given, open the store the checkpoint's pointer names (a script started from another
        working directory, whose default ``./.tierstore`` is another store)."""
        ptr = _pointer(checkpoint) if checkpoint is not None and os.path.isdir(checkpoint) else None
        args = named_store(self._ts_ref, ptr) if ptr is not None else None
        if args is not None:
            log.info("%s names the store at %s (not this directory's default): opening it", checkpoint,
                     args["home"])
            self._ts_ref = StoreRef(args)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        if isinstance(resume_from_checkpoint, str):
            self._ts_adopt(resume_from_checkpoint)
        elif resume_from_checkpoint is True:
            saved = [d for d in _numbered(os.fspath(self.args.output_dir)) if _pointer(d) is not None]
            self._ts_adopt(saved[0] if saved else None)
        if resume_from_checkpoint is True:
            found = last_checkpoint(self.args.output_dir, self.store)
            saved = [d for d in _numbered(os.fspath(self.args.output_dir)) if _pointer(d) is not None]
            if found is None and saved:  # checkpoints were saved, none restores: never a silent fresh start
                ptr = _pointer(saved[0])
                assert ptr is not None
                why = ("no tier holds a copy of it" if self.store.steps.steps(ptr.model) else
                       "its model is not in this store: deleted, or another store")
                raise gone(saved[0], ptr, why, None, "")
            if found is None:
                log.info("resume_from_checkpoint=True: %s holds no checkpoint yet; starting fresh",
                         self.args.output_dir)
            resume_from_checkpoint = found
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]
        finally:
            self._ts_close()

    def _ts_wait(self) -> None:
        """Wait for the background parts of the saves so far (``store_async``): committed, pinned, pointer written.

        Raises:
            CommitError: a save did not commit (its pointer was not written), or did not finish in time.
            TierStoreError: its commit failed otherwise (typed, as the save itself would have raised it).
        """
        self._ts_saves.wait(self._ts_timeout + 60.0)  # the commit wait is bounded by store_timeout; the rest by the store

    def _ts_close(self) -> None:
        """Wait for the last save, close the run's Checkpointer and collect what no checkpoint names. With several
        ranks, every rank returns once every rank's saves finished (the last pointer is written), with one
        verdict: a save that failed on any rank raises on every rank."""
        got, self._ts_ck = self._ts_ck, None
        if got is None:
            return
        failed: BaseException | None = None
        try:
            self._ts_wait()
        except BaseException as e:  # noqa: BLE001 - raised below, once every rank knows
            failed = e
        self._ts_saves.close()
        ck, _ = got
        ck.close()
        if failed is None and self._ts_settle:  # before the collective: rank 0 collects after every rank settled
            try:  # bounded below the group's timeout (store_timeout + 120 s), so every rank reaches the collective
                self.store.flush(timeout=self._ts_timeout)
            except TierStoreError as e:  # the steps stay as they are: a later run's saves collect them
                log.warning("the checkpoints' migration did not finish at the end of the run (%s): their older "
                            "steps are left for a later collection", e)
        if self._ts_group is not None:  # bounded by the group's timeout (store_timeout + 120 s)
            flag = torch.tensor([0 if failed is None else 1], dtype=torch.int64)
            try:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._ts_group)
            finally:
                self._ts_release_group(ck)
            if failed is None and int(flag):
                failed = CommitError(f"a checkpoint save of {ck.model} failed on another rank (its error is raised "
                                     "there); the last checkpoint's pointer may be missing", model=ck.model)
        if failed is not None:
            raise failed
        if self.args.should_save:
            try:
                retire_older(self.store, ck.model)
            except Exception as e:  # noqa: BLE001 - best effort: the next run's saves collect them
                log.warning("collecting the older steps of %s at the end of the run failed (%s: %s)", ck.model,
                            type(e).__name__, e)

    def _ts_release_group(self, ck: Any) -> None:
        """Destroy the run's gloo group (made by :meth:`_ts_world`, one per run: a Trainer trained again makes a new
        one), unless a save ``ck.close()`` gave up on may still run its collectives on it (then it is kept, with
        a warning). Local and bounded, as :meth:`tierstore.train.ranks.Ranks.close`; never raises."""
        group, self._ts_group = self._ts_group, None
        if group is None or not dist.is_initialized():
            return
        if ck.left_behind:
            log.warning("the gloo group of %s is kept for the save left behind", ck.model)
            return
        try:
            dist.destroy_process_group(group)
        except Exception as e:  # noqa: BLE001 - a release that failed must not fail the end of training
            log.warning("destroying the gloo group of %s failed: %s: %s", ck.model, type(e).__name__, e)

    def _ts_load(self, checkpoint: str, state: dict[str, Any], only: list[str]) -> bool:
        ptr = _pointer(checkpoint)
        if ptr is None:
            return False
        _in_store(self.store, checkpoint, ptr)
        try:  # the read path resolves (and verifies) the step itself
            load(self.store, ptr.model, state, ptr.step, only=only, rank=self.args.process_index, world_size=1)
        except NoValidCopyError as e:  # a node loss took it: name the newest checkpoint of the run that restores
            raise _gone(self.store, checkpoint, ptr, e,
                        "pass it as resume_from_checkpoint, or resume_from_checkpoint=True") from e
        return True

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if not self._ts_load(resume_from_checkpoint, {"model": model or self.model}, ["model"]):
            super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        ptr = _pointer(checkpoint)
        if ptr is None:
            super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
            return
        state, only = self._ts_state(saving=False)
        saved = ptr.info.get("entries") or []
        only = [k for k in only if k in saved]
        if "optim" in only:
            self._ts_load(checkpoint, {k: state[k] for k in ["model", *only]}, ["model", *only])

    def _load_scaler(self, checkpoint: str | None) -> None:
        if checkpoint is not None and _pointer(checkpoint) is not None:
            return  # loaded with the optimizer
        super()._load_scaler(checkpoint)  # type: ignore[misc]

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        ptr = _pointer(checkpoint)
        if ptr is None:
            super()._load_rng_state(checkpoint)  # type: ignore[misc]
        elif "rng" in (ptr.info.get("entries") or []):
            self._ts_load(checkpoint, {"rng": RNGState()}, ["rng"])
        else:  # save_only_model: as the Trainer does without its RNG file
            log.info("%s holds no RNG state (save_only_model): reproducibility is not guaranteed", checkpoint)

    # ---- save -------------------------------------------------------------------------------------
    def _ts_state(self, *, saving: bool) -> tuple[dict[str, Any], list[str]]:
        """The Checkpointer state of a save (and the keys besides the model that a resume loads)."""
        state: dict[str, Any] = {"model": self.model}
        rest: list[str] = []
        if not self.args.save_only_model:
            if self.optimizer is not None:
                state["optim"] = self.optimizer
                rest.append("optim")
            if self.lr_scheduler is not None:
                state["sched"] = self.lr_scheduler
                rest.append("sched")
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None:
                state["scaler"] = scaler
                rest.append("scaler")
            state["rng"] = RNGState()
        if saving:
            state["trainer_state"] = self.state
        return state, rest

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        self._ts_saving = True
        try:
            super()._save_checkpoint(model, trial)  # type: ignore[misc]
        finally:
            self._ts_saving = False
        if self.args.should_save and self._ts_last_dir is not None:
            self._ts_later(self._ts_collect_rotated, os.path.dirname(self._ts_last_dir))

    _ts_last_dir: str | None = None

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if not (self._ts_saving and _internal_call and output_dir is not None):
            super().save_model(output_dir, _internal_call)  # type: ignore[misc]
            return
        if getattr(self, "is_deepspeed_enabled", False) or getattr(self, "is_fsdp_enabled", False):
            raise ConfigError("TierStoreTrainer does not checkpoint DeepSpeed or FSDP engines (they save through "
                              "their own formats); use the Trainer's own checkpoints there", field="strategy")
        self._ts_save(output_dir)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self._ts_saving:
            super()._save_optimizer_and_scheduler(output_dir)  # type: ignore[misc]

    def _save_scaler(self, output_dir: str) -> None:
        if not self._ts_saving:
            super()._save_scaler(output_dir)  # type: ignore[misc]

    def _save_rng_state(self, output_dir: str) -> None:
        if not self._ts_saving:
            super()._save_rng_state(output_dir)  # type: ignore[misc]

    def _ts_world(self) -> tuple[int, int, Any]:
        world, rank = int(self.args.world_size), int(self.args.process_index)
        if world > 1 and self._ts_group is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise ConfigError(f"{world} processes without torch.distributed", field="world_size")
            self._ts_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self._ts_timeout + 120.0))  # every rank saves together: a collective
        return world, rank, self._ts_group

    def _ts_checkpointer(self, model: str, state: dict[str, Any], world: int, rank: int, group: Any) -> Any:
        """The run's Checkpointer (one per run, kept across saves, so the policies build on the previous step);
        made again where the state's objects changed (a new optimizer)."""
        if self._ts_ck is not None:
            ck, held = self._ts_ck
            if ck.model == model and held.keys() == state.keys() and all(
                    held[k] is state[k] for k in state if k != "rng"):
                return ck
            self._ts_ck = None
            ck.close()
        policy = self._ts_policy or (dedup() if world > 1 else exact())
        lazy = self._ts_lazy and self._ts_async and "optim" in state  # the optimizer's step() is the gate
        ck = Checkpointer(self.store, model, state=state, policy=policy, rank=rank, world_size=world, group=group,
                          keep_last=1, preallocate=False, timeout=self._ts_timeout, lazy=lazy)
        self._ts_ck = (ck, state)
        return ck

    def _ts_later(self, fn: Any, *args: Any) -> None:
        """Run ``fn(*args)`` after the background parts before it (``store_async``), else now."""
        if not self._ts_async:
            fn(*args)
            return
        self._ts_saves.submit(fn, *args)

    def _ts_save(self, output_dir: str) -> None:
        """One step of the run's model (``output_dir``'s parent) from every rank; once it is committed (in the
        background with ``store_async``), rank 0 pins it and writes the pointer in ``output_dir``."""
        self._ts_wait()  # the previous save's commit and pointer first: its error surfaces here
        full = os.path.abspath(output_dir)
        world, rank, group = self._ts_world()
        model = model_name(self._ts_name, os.path.dirname(full))  # the run (output_dir) is one model
        step = torch.tensor([next_step(self.store, model) if rank == 0 else 0], dtype=torch.int64)
        if group is not None:  # every rank takes the number rank 0 chose
            dist.broadcast(step, src=dist.get_global_rank(group, 0), group=group)
        state, _ = self._ts_state(saving=True)
        ck = self._ts_checkpointer(model, state, world, rank, group)
        try:
            ck.save(int(step), extra={"dir": full, "global_step": self.state.global_step})
        except BaseException:
            self._ts_ck = None
            ck.close()
            raise
        self._ts_last_dir = full
        if self.args.should_save:  # the Trainer writes trainer_state.json into it next, as after its own files
            os.makedirs(full, exist_ok=True)
        info = {"global_step": self.state.global_step, "epoch": self.state.epoch, "world": world,
                "entries": sorted(state), "pin": full}
        self._ts_later(self._ts_complete, ck, model, int(step), full, info)

    def _ts_complete(self, ck: Any, model: str, step: int, full: str, info: dict[str, Any]) -> None:
        """The part of a save after the snapshot: the commit, then (rank 0) the pin and the pointer."""
        outcome = ck.wait()
        if outcome != "committed":
            raise CommitError(f"the checkpoint {full} (step {step} of {model}) was {outcome}", model=model,
                              step=step)
        if self.args.should_save:
            pin(self.store, model, full, step)  # first: the pointer only ever names a step retention keeps
            write_pointer(os.path.join(full, POINTER_FILE), Pointer(model, step, full, FRAMEWORK, time.time(), info,
                                                                   store_of(self.store)))

    def _ts_collect_rotated(self, run_dir: str) -> None:
        """After the Trainer's rotation: drop the pins of the ``checkpoint-N`` directories of ``run_dir`` it removed,
        collect the run's steps no checkpoint names, and delete the models of removed directories saved before
        runs were one model (one model per directory)."""
        if self._ts_last_dir is None or not os.path.isdir(self._ts_last_dir):
            return  # the run directory that holds the new checkpoint is not visible here: delete nothing
        model = model_name(self._ts_name, run_dir)
        unpin_gone(self.store, model, run_dir, lambda d: os.path.join(d, POINTER_FILE))
        retire_older(self.store, model)
        prefix = f"{self._ts_name}.{PREFIX_CHECKPOINT_DIR}-"
        for m in self.store.models():
            if not m.startswith(prefix):
                continue
            number = m[len(prefix):].split("-", 1)[0]
            if not number.isdigit():
                continue
            d = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{number}")
            if model_name(self._ts_name, d) == m and not os.path.isdir(d):
                log.info("checkpoint %s was rotated away: deleting its model %s", d, m)
                self.store.delete_model(m, force=True)


class TierStoreTrainer(TierStoreTrainerMixin, Trainer):
    """``transformers.Trainer`` checkpointing in tierstore; see :class:`TierStoreTrainerMixin`."""
