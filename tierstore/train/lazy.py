"""Lazy snapshots: ``save()`` returns at once, the copy overlaps the next forward/backward (DataStates-LLM).

Parameters and optimizer state do not change during the forward and
backward passes: only the optimizer's update mutates them. So with
``Checkpointer(..., lazy=True)`` a save copies them on the Checkpointer's
background thread while the trainer computes the next step, and the trainer
blocks only if the copy is not done when the next update is about to start.

Protocol (one :class:`UpdateGate` per lazy Checkpointer):

1. The Checkpointer's constructor calls :meth:`UpdateGate.watch` with every
   optimizer of its state (and each save again, for optimizers put in the
   state later): a ``register_step_pre_hook`` per optimizer, installed before
   any other hook the Checkpointer's policies install (replay's gradient
   capture), so it runs first.
2. ``save(step)``, on the trainer's thread: collects the state, begins the
   step, and clones at once every tensor that something other than the
   optimizer's update may change (:func:`clone_eager`: module buffers, which
   a forward pass may update in place, e.g. BatchNorm's running statistics;
   the ``_state`` layer of other ``Stateful`` entries and ``extra``). Then
   :meth:`UpdateGate.begin` opens a :class:`LazySave` and the rest of the
   save goes to the background thread.
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
   (step 2 took it already). The next ``save()``, ``wait()``, ``restore()``
   and ``close()`` wait for the whole previous save, as without ``lazy``.

A failure in the background votes the step down, releases the gate (the
trainer is never left blocked) and is raised, typed, by the next ``save()``,
``wait()`` or ``close()``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any

import torch

from tierstore.train.layers import OPTIM, PARAM
from tierstore.train.view import STATE_LAYER, Collected

__all__ = ["LazySave", "UpdateGate", "clone_eager", "lazily_copied"]


def lazily_copied(layer: str, name: str) -> bool:
    """Whether tensor ``name`` of ``layer`` changes only in an optimizer update (so its copy may wait)."""
    return layer != STATE_LAYER and name.startswith((PARAM, OPTIM))


def clone_eager(col: Collected) -> int:
    """Replace, in ``col.layers``, every tensor that is not :func:`lazily_copied` by a copy; return its bytes."""
    copied = 0
    with torch.no_grad():
        for ln, ts in col.layers.items():
            for n, t in ts.items():
                if not lazily_copied(ln, n):
                    ts[n] = t.detach().clone()
                    copied += t.numel() * t.element_size()
    return copied


class LazySave:
    """One save whose snapshot may still read the live state; :meth:`release` once it no longer does."""

    def __init__(self, step: int) -> None:
        self.step = step
        self._released = threading.Event()

    def release(self) -> None:
        self._released.set()

    @property
    def released(self) -> bool:
        return self._released.is_set()

    def wait(self) -> None:
        self._released.wait()


class UpdateGate:
    """Holds an update of the state back until the save in flight has copied it; see the module docstring.

    Args:
        stats: where the waits are counted (``wait_s``: seconds blocked in
            :meth:`wait`, in total; ``waits``: how many found the copy unfinished).
    """

    def __init__(self, stats: Any) -> None:
        self._hooks: dict[int, Any] = {}
        self._current: LazySave | None = None
        self.stats = stats

    def watch(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Install the step pre-hook on each optimizer not hooked yet."""
        for opt in optimizers:
            if id(opt) not in self._hooks:
                self._hooks[id(opt)] = opt.register_step_pre_hook(self._pre_step)

    def _pre_step(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        self.wait()

    def begin(self, step: int) -> LazySave:
        """A new save in flight (the previous one is released: the Checkpointer drained it)."""
        job = LazySave(step)
        self._current = job
        return job

    def wait(self) -> float:
        """Block until the save in flight released the live state; return the seconds blocked."""
        job = self._current
        if job is None or job.released:
            return 0.0
        t0 = time.perf_counter()
        job.wait()
        waited = time.perf_counter() - t0
        self.stats.wait_s += waited
        self.stats.waits += 1
        return waited

    def close(self) -> None:
        """Remove the hooks (after the last save was drained)."""
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()
        self._current = None
