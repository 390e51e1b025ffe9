"""Lazy snapshots: ``save()`` returns at once, the copy overlaps the next forward/backward (DataStates-LLM).

Parameters and optimizer state do not change during the forward and
backward passes: only the optimizer's update mutates them. So with
``Checkpointer(..., lazy=True)`` a save copies them on the Checkpointer's
background thread while the trainer computes the next step, and the trainer
blocks only if the copy is not done when the next update is about to start.

Protocol (one :class:`UpdateGate` per Checkpointer):

1. The Checkpointer's constructor calls :meth:`UpdateGate.watch` with every
   optimizer of its state (and each save again, for optimizers put in the
   state later): a ``register_step_pre_hook`` per optimizer, installed before
   any other hook the Checkpointer's policies install (replay's gradient
   capture), so it runs first.
2. ``save(step)``, on the trainer's thread: collects the state, begins the
   step, and clones at once every tensor that something other than the
   optimizer's update may change (:func:`clone_eager`: module buffers, which
   a forward pass may update in place, e.g. BatchNorm's running statistics;
   the ``_state`` layer of other ``Stateful`` entries and ``extra``; and the
   parameters :class:`InPlaceChanges` knows a forward pass changes). It
   records the version counter of every tensor left to copy lazily. Then
   :meth:`UpdateGate.begin` opens a :class:`LazySave` and the rest of the
   save goes to the background thread. With CUDA tensors, ``save()`` also
   records an event on the trainer's stream (:class:`~tierstore.store.copies.DeviceCopies`):
   the background thread enqueues the device-to-host copies on a side stream
   that waits for it, so they read the state as of ``save()`` without a host sync.
3. The background thread, in order: the policy's choice of layers (the
   layerwise norms read the live parameters, and their collective), the
   copy of every selected layer into host-tier shared memory or staging
   copies (and the copies a policy's later pass reads: layerwise's parameter
   copies, the staged tensors that dedup hashes and differential XORs), then
   :meth:`LazySave.release` (the live state is no longer read); then
   sealing, publishing, dedup, deltas and the vote, which read only copies.
4. The optimizer step pre-hook (and :meth:`Checkpointer.before_update` for
   custom loops that change parameters or optimizer state without an
   optimizer's ``step()``) waits for the release. The update mutates every
   parameter and every optimizer-state tensor it holds, so each one of them
   is copied before it may run; nothing else of the state waits behind them
   (step 2 took it already). With CUDA copies the pre-hook makes the
   trainer's stream wait for the copies' event (only if they have not
   completed: a device-side wait, never a host sync). The next ``save()``,
   ``wait()``, ``restore()`` and ``close()`` wait for the whole previous
   save, as without ``lazy``.

The version rule (snapshots that cannot lie): some modules change their own
parameters in place during forward (``nn.Embedding(max_norm=...)``
renormalises the rows it looks up), so "only the optimizer changes them" is
checked, not trusted. PyTorch bumps a tensor's version counter (``t._version``)
on every in-place change; :meth:`LazySave.settle` compares each lazily copied
tensor's counter with the one recorded at ``save()``, at a moment when the
copy is known complete and before the optimizer may run (CPU: right after the
copies, before the release; CUDA: at the update's gate, or on the background
thread once the copies' event completed, whichever comes first: the version
moves when an in-place kernel is *enqueued*, so an unchanged counter then
proves that no kernel changed the tensor before the copy read it). A changed
tensor fails the step: it is voted down with
:class:`~tierstore.errors.SnapshotChangedError` naming the tensors (raised by
the next ``save()``, ``wait()`` or ``close()``, as every background failure),
never committed with values the model did not have at ``save()``; and
:class:`InPlaceChanges` learns them, so they are cloned at ``save()`` from
then on (the next save commits; a step number aborted in this incarnation
is not begun again, as for any aborted step). Modules known to change their
parameters in forward (:data:`IN_FORWARD`) are cloned at ``save()`` from the
first save, so they never cost a step. Why not redo the copy: the values of
``save()`` are gone once the tensor changed, and a copy made later would be a
state the model never had either. The check costs one integer comparison per
tensor; the normal path copies nothing more.

A failure in the background votes the step down, releases the gate (the
trainer is never left blocked) and is raised, typed, by the next ``save()``,
``wait()`` or ``close()``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from tierstore.errors import SnapshotChangedError
from tierstore.train.layers import OPTIM, PARAM
from tierstore.train.view import STATE_LAYER, Collected

__all__ = ["IN_FORWARD", "InPlaceChanges", "LazySave", "UpdateGate", "clone_eager", "lazily_copied"]

log = logging.getLogger(__name__)

# modules that change their own parameters in place during forward: (type, "does this instance", attribute)
IN_FORWARD: tuple[tuple[type[nn.Module], Callable[[Any], bool], str], ...] = (
    (nn.Embedding, lambda m: m.max_norm is not None, "weight"),  # renormalises the rows it looks up
    (nn.EmbeddingBag, lambda m: m.max_norm is not None, "weight"),
)


def lazily_copied(layer: str, name: str) -> bool:
    """Whether tensor ``name`` of ``layer`` changes only in an optimizer update (so its copy may wait)."""
    return layer != STATE_LAYER and name.startswith((PARAM, OPTIM))


def _ptr(t: torch.Tensor) -> int | None:
    return t.data_ptr() if t.numel() else None


class InPlaceChanges:
    """The parameters this Checkpointer copies at ``save()`` because a forward pass changes them in place.

    Those of modules in :data:`IN_FORWARD` (found at every save), and those the version rule caught
    (:meth:`learn`, by ``(layer, name)``). Matched by data pointer, so a tied weight is one tensor.
    """

    def __init__(self) -> None:
        self.learned: set[tuple[str, str]] = set()

    def learn(self, names: Iterable[tuple[str, str]]) -> None:
        new = set(names) - self.learned
        if new:
            self.learned |= new
            log.warning("tensors changed in place outside the optimizer's update (in forward?): %s; they are "
                        "copied at save() from now on", ", ".join(f"{ln}:{n}" for ln, n in sorted(new)))

    def pointers(self, col: Collected) -> set[int]:
        """Data pointers of the tensors of ``col`` to copy at ``save()``."""
        ptrs: set[int] = set()
        for m in col.maps.values():
            for mod in m.inner.modules():
                for kind, applies, attr in IN_FORWARD:
                    if isinstance(mod, kind) and applies(mod):
                        p = getattr(mod, attr, None)
                        if isinstance(p, torch.Tensor) and (q := _ptr(p)) is not None:
                            ptrs.add(q)
        for ln, n in self.learned:
            t = col.layers.get(ln, {}).get(n)
            if t is not None and (q := _ptr(t)) is not None:
                ptrs.add(q)
        return ptrs


Versions = list[tuple[str, str, torch.Tensor, int]]  # (layer, name, tensor, its version counter at save())


def clone_eager(col: Collected, in_forward: set[int] | None = None) -> Versions:
    """Replace, in ``col.layers``, every tensor that is not :func:`lazily_copied` (or whose data pointer is in
    ``in_forward``) by a copy; return the version counters of the tensors left to copy lazily."""
    versions: Versions = []
    eager = in_forward or set()
    add = versions.append
    with torch.no_grad():
        for ln, ts in col.layers.items():
            state = ln == STATE_LAYER
            for n, t in ts.items():
                if state or not n.startswith((PARAM, OPTIM)) or (eager and _ptr(t) in eager):
                    ts[n] = t.detach().clone()
                else:
                    add((ln, n, t, t._version))
    return versions


def changed(versions: Versions) -> list[tuple[str, str]]:
    """The ``(layer, name)`` of ``versions`` whose tensor changed in place since they were recorded."""
    return sorted((ln, n) for ln, n, t, v in versions if t._version != v)


def changed_error(step: int, names: list[tuple[str, str]], rank: int) -> SnapshotChangedError:
    tensors = [n for _, n in names]
    return SnapshotChangedError(
        f"step {step} (rank {rank}): {', '.join(tensors)} changed in place between save() and its copy, not by "
        "the optimizer's update (a module changing its parameters in forward, e.g. nn.Embedding(max_norm=...)): "
        "the step is voted down, not committed with values the model did not have at save(); these tensors are "
        "copied at save() from now on, so the next save commits the state of its save()",
        step=step, rank=rank, tensors=tensors, layers=sorted({ln for ln, _ in names}))


class LazySave:
    """One save whose snapshot may still read the live state; :meth:`release` once it no longer does.

    Args:
        step: the step saved.
        versions: the version counters recorded at ``save()`` (:func:`clone_eager`).
        copies: the save's asynchronous device-to-host copies (``None``: copies complete when made).
    """

    def __init__(self, step: int, versions: Versions | None = None, copies: Any = None) -> None:
        self.step = step
        self.copies = copies
        self._versions = versions or []
        self._released = threading.Event()
        self._lock = threading.Lock()
        self.changed: list[tuple[str, str]] | None = None

    def release(self) -> None:
        self._released.set()

    @property
    def released(self) -> bool:
        return self._released.is_set()

    def wait(self) -> None:
        self._released.wait()

    def settle(self) -> list[tuple[str, str]]:
        """Compare the version counters once (the first call decides; see the module docstring)."""
        with self._lock:
            if self.changed is None:
                self.changed = changed(self._versions)
                self._versions = []
            return self.changed


class UpdateGate:
    """Holds an update of the state back until the save in flight has copied it, and until a restore's copies
    verified (:meth:`hold`); see the module docstring.

    Args:
        stats: where the waits are counted (``wait_s``: seconds blocked in
            :meth:`wait`, in total; ``waits``: how many found the copy unfinished).
    """

    def __init__(self, stats: Any) -> None:
        self._hooks: dict[int, Any] = {}
        self._current: LazySave | None = None
        self._held: Callable[[], None] | None = None
        self.stats = stats

    def watch(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Install the step pre-hook on each optimizer not hooked yet.

        A wrapper that subclasses ``Optimizer`` without running its ``__init__`` (accelerate's
        ``AcceleratedOptimizer``, which the Hugging Face Trainer holds) has no hooks of its own: its ``step()``
        steps the optimizer it wraps (``.optimizer``), so the hook goes there.
        """
        for opt in optimizers:
            while not hasattr(opt, "_optimizer_step_pre_hooks") and isinstance(
                    inner := getattr(opt, "optimizer", None), torch.optim.Optimizer):
                opt = inner
            if id(opt) not in self._hooks:
                self._hooks[id(opt)] = opt.register_step_pre_hook(self._pre_step)

    def _pre_step(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        self.wait()

    def begin(self, step: int, versions: Versions | None = None, copies: Any = None) -> LazySave:
        """A new save in flight (the previous one is released: the Checkpointer drained it)."""
        job = LazySave(step, versions, copies)
        self._current = job
        return job

    def hold(self, until: Callable[[], None] | None) -> None:
        """Run ``until()`` before the next update (a restore's verification; it raises to refuse the update)."""
        self._held = until

    def run_hold(self) -> None:
        """Run (once) what :meth:`hold` set; it raises to refuse what was about to happen."""
        held, self._held = self._held, None
        if held is not None:
            held()

    def wait(self) -> float:
        """Block until the save in flight released the live state (and a held restore verified); return the
        seconds blocked."""
        self.run_hold()
        job = self._current
        if job is None:
            return 0.0
        waited = 0.0
        if not job.released:
            t0 = time.perf_counter()
            job.wait()
            waited = time.perf_counter() - t0
            self.stats.wait_s += waited
            self.stats.waits += 1
        if job.copies is not None:
            job.settle()  # before the update is enqueued: see the version rule
            job.copies.order_update()
        return waited

    def close(self) -> None:
        """Remove the hooks (after the last save was drained)."""
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()
        self._current = None
        self._held = None
