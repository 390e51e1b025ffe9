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

The fingerprint rule (writes the version counter does not see): a write
through ``p.data`` (WGAN's ``p.data.clamp_()``), a numpy view
(``t.numpy()[...] = x``) or ``t.untyped_storage()`` shares the tensor's
storage but not its version counter, so the version rule cannot see it. So
``save()`` also takes a :class:`Fingerprint` of the lazily copied tensors
(:meth:`UpdateGate.begin`, on the trainer's thread: for CUDA tensors its
kernels go on the trainer's stream, device side, no host sync), and
:meth:`LazySave.settle` takes it again of the live tensors once the copy is
complete and before the update may run (CPU: on the background thread right
after the copies; CUDA: at the update's gate on the trainer's stream ordered
after the copies' event, or on the copies' side stream once they completed,
compared on the background thread). Each fingerprint also holds the
tensors' data pointers, so a storage replaced behind the tensor
(``p.data = x``) differs too. The tensor did not change between
``save()`` and the end of its copy if both agree, so the copy holds the
values of ``save()``; a tensor whose fingerprints differ is treated as a
changed counter: the step is voted down with ``SnapshotChangedError``, and it
is copied at ``save()`` from then on. A write after the copy and before the
second fingerprint votes a step down that was in fact copied right (the safe
side). The kinds (``StoreConfig.lazy_check``):

* ``"sample"`` (default): ``lazy_check_samples`` elements per tensor (64), at
  a stride over the flattened tensor with a random offset drawn afresh per
  save (every element of a tensor that small), compared bitwise. It catches
  a write that changes any sampled element, so a write to a large part of a
  tensor (a clamp, a re-initialisation, a numpy/storage fill) always in
  practice; a write to ``m`` of ``n`` elements goes unseen with probability
  about ``(1 - m/n) ** 64`` per save (one element of a million: almost
  surely unseen). What it cannot see is committed.
* ``"full"``: xxh3-128 of every byte of each tensor (:func:`tensor_digest`),
  at ``save()`` and after the copy: a write that changes any byte is caught
  (short of a hash collision). It reads each tensor twice, so it costs about
  what the copy itself costs, on the trainer's thread at ``save()`` (CUDA:
  the digest reads the tensor to the host, a synchronising copy).
* ``"off"``: the version rule alone, as before.

Neither kind sees a write that is undone before the second fingerprint
(values changed and changed back), nor a write by another process to shared
memory in the middle of the copy that leaves the sampled bytes as they were.

A failure in the background votes the step down, releases the gate (the
trainer is never left blocked) and is raised, typed, by the next ``save()``,
``wait()`` or ``close()``.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from tierstore.errors import ConfigError, SnapshotChangedError
from tierstore.train.hashing import tensor_digest
from tierstore.train.layers import OPTIM, PARAM
from tierstore.train.view import STATE_LAYER, Collected

__all__ = ["CHECKS", "IN_FORWARD", "Fingerprint", "InPlaceChanges", "LazySave", "UpdateGate", "clone_eager",
           "lazily_copied"]

CHECKS = ("sample", "full", "off")  # StoreConfig.lazy_check: see the fingerprint rule
DEFAULT_SAMPLES = 64  # StoreConfig.lazy_check_samples

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
        "the optimizer's update (a module changing its parameters in forward, e.g. nn.Embedding(max_norm=...), "
        "or a write the version counter does not see, through .data, a numpy view or untyped_storage(), which "
        "the fingerprint taken at save() caught): the step is voted down, not committed with values the model "
        "did not have at save(); these tensors are copied at save() from now on, so the next save commits the "
        "state of its save()",
        step=step, rank=rank, tensors=tensors, layers=sorted({ln for ln, _ in names}))


class Fingerprint:
    """What ``save()`` saw of the lazily copied tensors, to compare with what they hold after the copy.

    Args:
        versions: the tensors (:func:`clone_eager`'s list).
        kind: ``"sample"`` or ``"full"`` (see the module docstring's fingerprint rule).
        samples: elements per tensor for ``"sample"``.

    ``take()`` fingerprints the tensors now, on the calling thread's current stream (device tensors: the
    sample's gathers are enqueued, nothing waits); :meth:`differ` compares two takes (it waits for them).
    """

    def __init__(self, versions: Versions, kind: str = "sample", samples: int = DEFAULT_SAMPLES) -> None:
        self.kind = kind
        self.names = [(ln, n) for ln, n, _t, _v in versions]
        self.tensors = [t for _ln, _n, t, _v in versions]
        # private generators: the trainer's RNG streams (random, torch's default generator) are never drawn
        # from, or a resumed run would not replay the lost one bitwise (its RNG state is saved before this)
        rnd = random.Random()
        gen: torch.Generator | None = None
        # per tensor: (offset, stride) over the flattened contiguous tensor (stride 0: all of it), or the random
        # indices per dim of a non-contiguous one
        self._plan: list[Any] = []
        for t in self.tensors:
            n = t.numel()
            if not t.is_contiguous():
                if n > samples and gen is None:
                    gen = torch.Generator().manual_seed(rnd.getrandbits(63))
                self._plan.append(tuple(torch.randint(d, (samples,), generator=gen) for d in t.shape)
                                  if n > samples else None)
            elif n <= samples:
                self._plan.append((0, 0))
            else:
                stride = n // samples
                self._plan.append((rnd.randrange(stride), stride))
        self.samples = samples

    def _part(self, t: torch.Tensor, plan: Any) -> torch.Tensor:
        if plan is None:
            return t.reshape(-1)  # non-contiguous and small: all of it
        if isinstance(plan[0], torch.Tensor):
            return t[plan]
        off, stride = plan
        if not stride:
            return t.view(-1)
        return torch.as_strided(t, (self.samples,), (stride,), t.storage_offset() + off)

    def _count(self, t: torch.Tensor, plan: Any) -> int:
        if plan is None or (not isinstance(plan[0], torch.Tensor) and not plan[1]):
            return t.numel()
        return self.samples

    def take(self) -> tuple[list[int], list[Any]]:
        """Fingerprint the tensors now: their data pointers (a tensor whose storage was replaced, ``p.data = x``,
        differs), and a digest per tensor (``"full"``) or (``"sample"``) the sampled elements, one host tensor
        per dtype and device (device tensors: gathered on the current stream and copied to page-locked host
        memory without waiting, so no GPU memory stays allocated; wait for an event recorded after this call
        before reading them)."""
        ptrs = [t.data_ptr() for t in self.tensors]
        if self.kind == "full":
            return ptrs, [tensor_digest(t) if t.numel() else "" for t in self.tensors]
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        with torch.no_grad():
            for t, plan in zip(self.tensors, self._plan):
                groups.setdefault((t.dtype, t.device), []).append(self._part(t.detach(), plan))
            out: list[Any] = []
            for (_dt, dev), parts in groups.items():
                cat = torch.cat(parts)
                if dev.type == "cuda":
                    host = torch.empty(cat.shape, dtype=cat.dtype, pin_memory=True)
                    host.copy_(cat, non_blocking=True)
                    cat = host
                out.append(cat)
        return ptrs, out

    def differ(self, before: tuple[list[int], list[Any]], after: tuple[list[int], list[Any]]) -> list[tuple[str, str]]:
        """The ``(layer, name)`` of the tensors whose fingerprints differ (bitwise; NaN equals itself)."""
        moved = {nm for nm, a, b in zip(self.names, before[0], after[0]) if a != b}
        if self.kind == "full":
            return sorted(moved | {nm for nm, a, b in zip(self.names, before[1], after[1]) if a != b})
        # the takes' layout: per (dtype, device) group in order of first appearance, each tensor's sample
        groups: dict[tuple[torch.dtype, torch.device], list[tuple[tuple[str, str], int]]] = {}
        for nm, t, plan in zip(self.names, self.tensors, self._plan):
            groups.setdefault((t.dtype, t.device), []).append((nm, self._count(t, plan)))
        for entries, a, b in zip(groups.values(), before[1], after[1]):
            at = 0
            for nm, n in entries:
                if not _same_bits(a[at:at + n], b[at:at + n]):
                    moved.add(nm)
                at += n
        return sorted(moved)


def _event_after(copies: Any) -> Any:
    """An event recorded on the calling thread's current stream of the copies' CUDA device (else ``None``)."""
    dev = getattr(copies, "device", None)
    if dev is None or torch.device(dev).type != "cuda":
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(dev))
    return ev


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0:
        return b.numel() == 0
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


class LazySave:
    """One save whose snapshot may still read the live state; :meth:`release` once it no longer does.

    Args:
        step: the step saved.
        versions: the version counters recorded at ``save()`` (:func:`clone_eager`).
        copies: the save's asynchronous device-to-host copies (``None``: copies complete when made).
    """

    def __init__(self, step: int, versions: Versions | None = None, copies: Any = None,
                 fingerprint: Fingerprint | None = None) -> None:
        self.step = step
        self.copies = copies
        self._versions = versions or []
        self._released = threading.Event()
        self._lock = threading.Lock()
        self.changed: list[tuple[str, str]] | None = None
        self._fp = fingerprint
        self._at_save = fingerprint.take() if fingerprint is not None else None
        self._at_save_ev = _event_after(copies) if fingerprint is not None else None
        self._after: tuple[Any, Any] | None = None  # the second take, enqueued at the gate, and its event
        self._gate_thread = threading.current_thread()  # the trainer's (save()); its update's gate settles there

    def release(self) -> None:
        self._released.set()

    @property
    def released(self) -> bool:
        return self._released.is_set()

    def wait(self) -> None:
        self._released.wait()

    def settle(self) -> list[tuple[str, str]]:
        """Compare the version counters once and the fingerprints once (see the module docstring).

        The first call decides the version counters and takes the second fingerprint: of CPU tensors (the
        background thread, the copies complete) it compares at once; at the update's gate (CUDA) it is
        enqueued on the trainer's stream after the copies, and the background thread's call (after the
        copies completed) compares it. Returns what changed, as far as decided.
        """
        with self._lock:
            if self.changed is None:
                self.changed = changed(self._versions)
                self._versions = []
                if self._fp is not None:
                    self._second_take()
            if self._after is not None and not self._on_gate_thread():
                after, ev = self._after
                self._after = None
                if ev is not None:
                    ev.synchronize()
                self._compare(after)
            return self.changed

    def _on_gate_thread(self) -> bool:
        return threading.current_thread() is self._gate_thread

    def _second_take(self) -> None:
        copies = self.copies
        if copies is None:  # CPU: the copies are complete (the background thread, before the release)
            self._compare(self._fp.take())  # type: ignore[union-attr]
            return
        if not self._on_gate_thread():  # the background thread, once the copies completed: their side stream
            with copies.stream_context():
                after = self._fp.take()  # type: ignore[union-attr]
                ev = _event_after(copies)
            if ev is not None:
                ev.synchronize()
            self._compare(after)
            return
        copies.order_update()  # the trainer's stream waits for the copies, then reads the tensors again
        after = self._fp.take()  # type: ignore[union-attr]
        self._after = (after, _event_after(copies))

    def _compare(self, after: Any) -> None:
        fp, before = self._fp, self._at_save
        self._fp = self._at_save = None
        if fp is None or before is None:
            return
        if self._at_save_ev is not None:
            self._at_save_ev.synchronize()  # the take of save() (the trainer's stream) completed
        bypass = fp.differ(before, after)
        if bypass:
            log.warning("step %d: %s changed between save() and its copy without moving the version counter "
                        "(a write through .data, a numpy view or untyped_storage()?)", self.step,
                        ", ".join(f"{ln}:{n}" for ln, n in bypass))
            self.changed = sorted(set(self.changed or []) | set(bypass))


class UpdateGate:
    """Holds an update of the state back until the save in flight has copied it, and until a restore's copies
    verified (:meth:`hold`); see the module docstring.

    Args:
        stats: where the waits are counted (``wait_s``: seconds blocked in
            :meth:`wait`, in total; ``waits``: how many found the copy unfinished).
    """

    def __init__(self, stats: Any, config: Any = None) -> None:
        self._hooks: dict[int, Any] = {}
        self._current: LazySave | None = None
        self._held: Callable[[], None] | None = None
        self.stats = stats
        self.check = getattr(config, "lazy_check", "sample")
        self.samples = getattr(config, "lazy_check_samples", DEFAULT_SAMPLES)
        if self.check not in CHECKS:
            raise ConfigError(f"lazy_check must be one of {CHECKS}, got {self.check!r}", field="lazy_check")
        if isinstance(self.samples, bool) or not isinstance(self.samples, int) or self.samples < 1:
            raise ConfigError(f"lazy_check_samples must be a positive int, got {self.samples!r}",
                              field="lazy_check_samples")

    def watch(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Install the step pre-hook on each optimizer not hooked yet.

        A wrapper that is an ``Optimizer`` without the hook machinery (Accelerate's ``AcceleratedOptimizer``
        never runs ``Optimizer.__init__``) is hooked through the optimizer it wraps (``.optimizer``), whose
        ``step()`` it calls; one that wraps nothing hookable is said once (call :meth:`wait` yourself, the
        Checkpointer's ``before_update``, before its updates).
        """
        for opt in optimizers:
            inner: Any = opt
            while not hasattr(inner, "_optimizer_step_pre_hooks") and hasattr(inner, "optimizer"):
                inner = inner.optimizer
            if id(inner) in self._hooks:
                continue
            if not hasattr(inner, "_optimizer_step_pre_hooks"):
                log.warning("cannot hook %s's step(): call ckpt.before_update() before each of its updates",
                            type(opt).__name__)
                self._hooks[id(inner)] = None
                continue
            self._hooks[id(inner)] = inner.register_step_pre_hook(self._pre_step)

    def _pre_step(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        self.wait()

    def begin(self, step: int, versions: Versions | None = None, copies: Any = None) -> LazySave:
        """A new save in flight (the previous one is released: the Checkpointer drained it); on the trainer's
        thread, in ``save()``: it takes the fingerprint of ``save()`` (the fingerprint rule)."""
        fp = Fingerprint(versions, self.check, self.samples) if versions and self.check != "off" else None
        job = LazySave(step, versions, copies, fp)
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
            if handle is not None:
                handle.remove()
        self._hooks.clear()
        self._current = None
        self._held = None
