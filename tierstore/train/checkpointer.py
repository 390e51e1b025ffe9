"""The trainer-facing Checkpointer: save ``Stateful`` trainer state per step, restore it in place.

Protocol (every rank of the job, in the same order)::

    ckpt = Checkpointer(store, "gpt", state={"model": model, "optim": opt, "sched": sched,
                                             "data": loader, "rng": RNGState()},
                        policy=compose(layerwise(), differential(), dedup()))
    step, extra = ckpt.restore()       # (None, None) on a fresh job; takes the job's epoch
    for step in ...:
        train_step()
        ckpt.save(step)                # returns after the snapshot
    ckpt.wait()                        # "committed" / "aborted" / "skipped" of the last save
    ckpt.close()

Lazy snapshots (``Checkpointer(..., lazy=True)``, any policy): ``save(step)``
returns once the step is begun; the copy of the parameters and optimizer
state runs in the background while the trainer computes the next
forward/backward, and an optimizer step pre-hook installed by the
Checkpointer blocks the next ``optimizer.step()`` only until that copy is
done. A loop that changes parameters or optimizer state in place without an
optimizer's ``step()`` calls :meth:`Checkpointer.before_update` first. See
:mod:`tierstore.train.lazy`.

``Checkpointer(store, name, model, optimizer, policy)`` is ``state={"model":
model, "optim": optimizer}``. How the state becomes layers and JSON: :mod:`tierstore.train.view`.

``save(step, extra=None)`` on the calling thread, in this order:

1. *drain*: wait for the previous save's background work (at most one save
   is in flight; its error, typed, is raised here);
2. *collect*: re-read every entry's state (``state_dict()``: never a stale
   reference) and encode what is not a tensor. A value that cannot be
   stored raises :class:`~tierstore.errors.InvalidValueError` naming its key,
   before anything is written;
3. *open*: take the incarnation's epoch if this writer has none yet (the
   first save of a writer that never restored), ``store.begin_step`` (errors
   of the step itself surface here), record this rank's progress;
4. *select*: the layers the policy writes (``layerwise``: agreed across
   ranks by an ``all_reduce(MAX)``, after every rank began the step);
5. *snapshot*: the only step that reads tensor memory: copy into host-tier
   shared memory (``store.snapshot``) or staging copies. It takes only what
   *collect* and *select* produced; with ``lazy=True`` steps 4 and 5 run on
   the background thread, behind the optimizer pre-hook
   (:mod:`tierstore.train.lazy`), and only the tensors an update does not own
   (buffers, the ``_state`` layer) are copied here;
6. the rest runs on one background thread: retention, publishing, dedup and
   deltas, the vote with the JSON document. Any failure after *open* votes
   negatively: a step is never left ``preparing`` by this rank.

A step this rank voted for but another rank voted down (or abandoned) is
never a base for this rank's deltas or layer-wise comparisons: before each
*select*, the outcome of the earlier steps this rank's vote left undecided is
read, and an aborted one resets the policy's trackers (every layer full and
due again).

A rank that never calls ``save(step)``: every other rank raises
:class:`~tierstore.errors.CommitError` with ``missing_ranks`` once
``missing_rank_grace`` seconds passed since its own ``save(step)`` (in
:meth:`wait`, in the next ``save``, or before a collective), and votes the
step down.

Epochs: a writer's :meth:`restore` joins the job incarnation's epoch (the
first rank raises the model's epoch), so writes and votes of any older
incarnation are fenced; a writer that never restores joins at its first save.
Constructing a Checkpointer takes no epoch, and ``restore(read_only=True)``
never does: an evaluator can read the newest or a named step while the
trainer runs, without fencing it.
Collectives and rank discovery: :mod:`tierstore.train.ranks`. The restore side
(``restore``, ``read``, ``doc``): :mod:`tierstore.train.restore_side`, its
verification protocol: :mod:`tierstore.train.restoring`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any

import torch
from torch import nn

from tierstore import gchold
from tierstore.errors import (
    CommitError,
    ConfigError,
    IncompleteStepError,
    TierStoreError,
)
from tierstore.keys import ShardKey, validate_name
from tierstore.store.copies import DeviceCopies
from tierstore.train.lazy import InPlaceChanges, LazySave, UpdateGate, changed_error, clone_eager
from tierstore.train.policies import Policy, exact
from tierstore.train.ranks import Ranks, rank_from_env
from tierstore.train.restore_side import RestoreSide
from tierstore.train.restoring import PendingRestore
from tierstore.train.saveplan import SavePlan
from tierstore.train.view import Collected, Restored, RestoreReport, StateView
from tierstore.train.writing import SaveStats, Snapshot, nbytes, retain

__all__ = ["Checkpointer", "RestoreReport", "Restored", "SaveStats", "rank_from_env"]

log = logging.getLogger(__name__)


class Checkpointer(RestoreSide):
    """Saves the trainer ``state`` of this rank into ``store`` under ``model_name``; see the module docstring.

    Args:
        store: an open :class:`~tierstore.store.TierStore`.
        model_name: the key namespace of this job.
        module: with ``optimizer``, the convenience form ``state={"model": module, "optim": optimizer}``
            (a mapping as ``module`` is taken as ``state``).
        optimizer: the optimizer of ``module`` in the convenience form.
        policy: see :mod:`tierstore.train.policies` (default :func:`exact`).
        state: ``key -> Stateful or value`` (kept by reference, re-read at every save).
        rank: this process's rank (default: from ``torch.distributed``, else ``RANK``; see
            :mod:`tierstore.train.ranks`).
        world_size: the number of ranks (default: likewise, else ``WORLD_SIZE``).
        layer_fn: ``name -> layer name`` (default: the block, :func:`~tierstore.train.layers.default_layer_fn`).
        group: the gloo group for the Checkpointer's collectives.
        timeout: seconds :meth:`wait` waits for a commit decision.
        keep_last: retention, after each save (per tier, :mod:`consistency.gc`):
            the memory tiers keep the last ``keep_last`` committed steps and
            what their manifests reach (delta bases, refs, inherited layers),
            so shared-memory segments are recycled; the durable tier always
            keeps the newest durable step and what it reaches; steps in
            neither are retired. ``None`` keeps everything.
        preallocate: reserve and pre-fault the host tier's shared memory for
            the generations of this rank's full shards that retention cycles
            through (``keep_last + 2``; two with ``keep_last=None``) up front,
            within the reuse pool's budget (``StoreConfig.host_pool_bytes``).
        missing_rank_grace: seconds after its own ``save(step)`` before a rank
            reports the ranks that have not begun ``step``.
        lazy: ``save()`` returns before the copy; the copy overlaps the next
            forward/backward and the next ``optimizer.step()`` of every
            optimizer in the state waits for it (:meth:`before_update` in
            custom loops). Default ``False``: ``save()`` returns after the copy.
        hold_gc: hold Python's cyclic garbage collector off during ``save()``
            and ``restore()`` (:mod:`tierstore.gchold`; it runs again after, if it
            ran before): a save of thousands of tensors otherwise triggers dozens
            of collections, each walking every object of the process. Default:
            the store's ``StoreConfig.hold_gc`` (``True``).

    Memory bound (host tier, this rank): ``keep_last + 1`` generations of the
    saved shards between saves, ``keep_last + 2`` while a save copies (the
    oldest is retired once the new one is written, before its vote), plus the
    reuse pool.
    """

    def __init__(
        self,
        store: Any,
        model_name: str,
        module: nn.Module | MutableMapping[str, Any] | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        policy: Policy | None = None,
        *,
        state: MutableMapping[str, Any] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        layer_fn: Callable[[str], str] | None = None,
        group: Any = None,
        timeout: float = 120.0,
        keep_last: int | None = 3,
        preallocate: bool = True,
        missing_rank_grace: float = 30.0,
        lazy: bool = False,
        hold_gc: bool | None = None,
    ) -> None:
        if isinstance(module, Mapping):
            if state is not None or optimizer is not None:
                raise ConfigError("give either state= or (module, optimizer), not both", field="state")
            state, module = module, None  # type: ignore[assignment]
        if state is None:
            if module is None:
                raise ConfigError("a Checkpointer needs state={...} or a module", field="state")
            state = {"model": module}
            if optimizer is not None:
                state["optim"] = optimizer
        elif module is not None or optimizer is not None:
            raise ConfigError("give either state= or (module, optimizer), not both", field="state")
        self.store = store
        self.model = validate_name(model_name, "model")
        self.state = state
        self.view = StateView(state, layer_fn)
        self.policy = policy or exact()
        self.timeout = timeout
        self.ranks = Ranks(store, self.model, rank, world_size, group, timeout=timeout, grace=missing_rank_grace)
        try:  # a constructor that fails (an invalid state, a policy's refusal) releases the group it made
            self.rank, self.world_size, self.group = self.ranks.rank, self.ranks.world_size, self.ranks.group
            self.epoch: int | None = None
            self._passed: set[int] = set()  # committed steps newer than the one this incarnation restored, unjudged
            self._standing: dict[int, str] = {}  # of those, judged and kept (not proven lost): why
            self._unproven: dict[int, str] = {}  # of those, why one could not be judged (a tier did not answer)
            self._lost: dict[int, str] = {}  # of those, agreed lost by every rank and not yet superseded: why
            self._manifests: dict[int, dict] = {}  # retention's parsed manifests, for this epoch
            self._written: dict[int, dict[ShardKey, Any]] = {}  # this incarnation's records by step (retention)
            self.stats = SaveStats()
            self.report = RestoreReport()
            # the gate's hooks go on before replay's gradient capture, so they run first: lazy saves and restores
            # whose copies verify after they returned hold the next update back
            self.lazy = lazy
            self.hold_gc = bool(getattr(getattr(store, "config", None), "hold_gc", True) if hold_gc is None
                                else hold_gc)
            self._gate = UpdateGate(self.stats, getattr(store, "config", None))  # StoreConfig.lazy_check
            self._gate.watch(self._optimizers())
            self.in_forward = InPlaceChanges()  # parameters a forward pass changes in place: copied at save()
            self._restoring: PendingRestore | None = None  # a restore whose copies are still being verified
            self._undecided: list[int] = []  # steps this rank voted for that were still preparing
            # what each save writes, reads and remembers: the policy's parts (tierstore.train.saveplan)
            self.plan = SavePlan(self.policy, self, self.group)
            first = self.view.collect()  # validates the state up front and sizes the layers
            self.plan.arrange(first, self.rank, self.world_size)  # LayerCheck's smoothed I/O: forced saves spread
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tierstore-ckpt-{self.rank}")
            self._future: Future | None = None
            self._behind: Future | None = None  # a save close() left behind (it may still use the group)
            self._last_step: int | None = None
            self._last_t = 0.0
            self._skipped = False  # the last save was skipped (restore_side._begin): nothing of it was written
            self._pending_step: int | None = None  # the last save's step while its vote said "preparing"
            self.keep_last = keep_last
            self._retained: Any = None  # the windows the last retention pass acted on
            if preallocate and self.plan.direct_only and hasattr(store, "host"):
                self._preallocate(first)
        except BaseException:
            self.ranks.close()
            raise

    @property
    def saving(self) -> bool:
        """Whether the last save's background work (copy, publish, vote) is still running."""
        return self._future is not None and not self._future.done()

    @property
    def layers(self) -> list[str]:
        """The layers of the state as of now."""
        return sorted(self.view.collect().layers)

    def _preallocate(self, col: Collected) -> None:
        sizes = [self.store.snapshot_nbytes(col.layers[ln], col.metas[ln]) for ln in sorted(col.layers)]
        # at a save's copy the host tier holds keep_last + 1 committed generations (the oldest is retired only
        # at the save's finish, before its vote) and the new one: fewer, and that save faults its pages in
        generations = 2 if self.keep_last is None else max(1, self.keep_last) + 2
        try:
            self.store.host.preallocate(sizes * generations)
        except TierStoreError as e:  # a small host budget: saves will fault pages in as they go
            log.info("host tier pre-allocation skipped: %s", e)

    # ---- saving ----------------------------------------------------------------

    def save(self, step: int, extra: Any = None) -> None:
        """Snapshot the state after ``step`` and return; the rest runs in the background.

        Raises:
            InvalidValueError: a value of the state or ``extra`` cannot be stored (nothing written).
            CommitError: ranks did not save the previous step (``missing_ranks``), or the step failed.
            FencedError: a newer incarnation of the job took over.
            TierStoreError: the previous save failed in the background (its error, typed).
        """
        t_in = time.perf_counter()
        try:
            with gchold.held(self.hold_gc):
                self._save(step, extra)
        finally:
            self.stats.save_s += time.perf_counter() - t_in

    def _save(self, step: int, extra: Any) -> None:
        self._gate.run_hold()  # a restore still verifying: nothing unverified is saved
        self._restoring = None
        self._drain()
        self._check_pending()
        col = self.view.collect(extra)
        base, layout = self.plan.layout(step, col)
        t0 = time.monotonic()
        if self.epoch is None:
            self.epoch = self.ranks.join()
        if not self._begin(step, layout):
            self._last_step, self._last_t, self._skipped = step, t0, True  # wait() answers "skipped"
            self.stats.skipped += 1
            return
        self._skipped = False
        job = None
        try:
            self.ranks.note(step, self.epoch)
            self._gate.watch(self._optimizers())
            ptrs = self.in_forward.pointers(col) if self.lazy or self.plan.needs_pointers else set()
            self.plan.at_save(ptrs)
            if self.lazy:
                versions = clone_eager(col, ptrs)  # what a forward pass may change is copied now; the rest waits
                copies = DeviceCopies.after_current(t for ts in col.layers.values() for t in ts.values())
                job = self._gate.begin(step, versions, copies)
        except BaseException as e:
            self._vote_down(step, e)
            raise self._typed(step, e) from e
        self._last_step, self._last_t = step, t0
        self.stats.saves += 1
        if job is not None:
            self._future = self._pool.submit(self._lazy, job, step, col, base, layout["layers"], t0)
            return
        snap = self._prepare(step, col, base, layout["layers"], t0)
        self._future = self._pool.submit(self._finish, snap)

    def _prepare(self, step: int, col: Collected, base: bool, layers: list[str], t0: float,
                 copies: Any = None) -> Snapshot:
        """*select* and *snapshot*: on the caller's thread, or the background one when lazy."""
        try:
            self._forget_aborted()
            if self.plan.selects_together:
                self.ranks.await_ranks(step, self.epoch, t0)
            selected = self.plan.select(step, col, self.ranks.all_max_) if base else layers
            snap = self._snapshot(step, col, selected, base, copies)
        except BaseException as e:
            self._vote_down(step, e)
            raise self._typed(step, e) from e
        snap.vote_extra = {"state": col.doc, "policy": self.policy.name, **snap.vote_extra}
        return snap

    def _lazy(self, job: LazySave, step: int, col: Collected, base: bool, layers: list[str], t0: float) -> str:
        """The background part of a lazy save: copy, check the versions, release the gate, then the rest."""
        try:
            snap = self._prepare(step, col, base, layers, t0, job.copies)
            if job.copies is not None:
                job.copies.enqueued()
            else:
                job.settle()  # the copies are complete, the update still held back (tierstore.train.lazy)
        finally:
            job.release()
        if job.copies is not None:
            job.copies.synchronize()
            job.settle()  # unless the update's gate did it first
        if job.changed:  # never committed with values the model did not have at save()
            snap.abort()
            self.stats.changed_in_forward += 1
            self.in_forward.learn(job.changed)
            err = changed_error(step, job.changed, self.rank)
            self._vote_down(step, err)
            raise err
        return self._finish(snap)

    def before_update(self) -> float:
        """Block until the lazy save in flight no longer reads the live state; return the seconds blocked.

        Every optimizer of the state calls it from its step pre-hook; call it
        yourself before changing parameters or optimizer state in place any
        other way. A no-op without ``lazy`` or without a save in flight (or a restore verifying).
        """
        return self._gate.wait()

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        return [v for v in self.state.values() if isinstance(v, torch.optim.Optimizer)]

    def _forget_aborted(self) -> None:
        """Reset the trackers if a step this rank voted for was aborted by another rank's vote (or the grace)."""
        if not self._undecided:
            return
        still = []
        aborted = False
        for s in self._undecided:
            st = self.store.steps.state(self.model, s)
            if st == "aborted" or st is None:
                aborted = True
            elif st == "preparing":
                still.append(s)
        self._undecided = still
        if aborted:
            self._reset_trackers()

    def _snapshot(self, step: int, col: Collected, selected: list[str], base: bool, copies: Any = None) -> Snapshot:
        """Copy what the save writes (the part training waits for): host-tier objects or staging copies."""
        if not base:
            return self.plan.snapshot_log(step, col)
        snap = Snapshot(step, selected, collective=self.plan.collective)
        try:
            for ln in selected:
                live = col.layers[ln]
                if self.plan.direct(ln):
                    key = ShardKey(self.model, ln, step, self.rank)
                    snap.pendings.append((ln, self.store.snapshot(key, live, col.metas[ln], epoch=self.epoch,
                                                                  **({"copies": copies} if copies else {}))))
                else:
                    snap.staged[ln] = {n: t.clone() for n, t in live.items()}
                    snap.metas[ln] = col.metas[ln]
                self.plan.keep(snap, ln, live)
                self.stats.logical_bytes += nbytes(live)
        except BaseException:
            snap.abort()
            raise
        self.plan.snapshotted(step, snap)
        return snap

    def _typed(self, step: int, e: BaseException) -> BaseException:
        if isinstance(e, TierStoreError) or not isinstance(e, Exception):
            return e
        return CommitError(f"save of step {step} failed on rank {self.rank}: {e!r}", step=step, rank=self.rank)

    def _vote_down(self, step: int, e: BaseException) -> None:
        """The one failure path of a save: a negative vote, so the step is not left preparing."""
        self._reset_trackers()
        try:
            self.store.vote(self.model, step, self.rank, [], extra={"error": repr(e)[:500]}, ok=False,
                            epoch=self.epoch)
        except Exception as ve:  # noqa: BLE001 - the original error is what matters
            log.debug("negative vote for step %s failed: %r", step, ve)

    def _finish(self, snap: Snapshot) -> str:
        infos = []
        step = snap.step
        try:
            if snap.before_vote is not None:
                snap.before_vote(snap.vote_extra)
            self._retained = retain(self.store, self.model, self.rank, self.keep_last,
                                    self.policy.max_staleness or 0, self._retained, self.plan.floor, self._manifests,
                                    self._written)
            if snap.pendings:  # in order, with one index call per batch of objects (StoreConfig.publish_batch)
                infos.extend(self.store.finish_many([p for _, p in snap.pendings]))
                snap.pendings = []
            if snap.staged:  # in the order selected; layers written directly are not staged
                infos.extend(self.plan.write(self.store, self.model, self.rank, self.epoch, snap,
                                             lambda: self.ranks.await_ranks(step, self.epoch, self._last_t)))
        except BaseException as e:
            snap.abort()
            self._vote_down(step, e)
            raise self._typed(step, e) from e
        self.stats.record(step, infos)
        self.stats.layers_saved += len(snap.selected)
        if self.keep_last is not None:
            self._written.setdefault(step, {}).update((info.key, info) for info in infos)
        try:
            state = self.store.vote(self.model, step, self.rank, infos, extra=snap.vote_extra, epoch=self.epoch)
        except IncompleteStepError as e:  # what its deltas, refs or inherited layers read is gone from the index
            log.warning("save of step %d of %s aborted: %s; the next save writes full objects", step, self.model,
                        e.fields.get("reason") or e)
            self._reset_trackers()
            return "aborted"
        if state != "aborted":
            self.plan.remember(snap)
        return state

    def _drain(self) -> str | None:
        fut, self._future = self._future, None
        if fut is None:
            return None
        try:
            state = fut.result()
        except BaseException:
            self._pending_step = None
            self._reset_trackers()
            raise
        self._pending_step = self._last_step if state == "preparing" else None
        if state == "preparing" and self._last_step is not None:
            self._undecided = [*self._undecided[-7:], self._last_step]
        if state == "aborted":  # this rank's vote decided it: the next save starts from full objects
            self._reset_trackers()
        return state

    def _check_pending(self) -> None:
        """Raise for the previous step when it is still preparing past the grace because ranks never saved it."""
        step = self._pending_step
        if step is None or time.monotonic() - self._last_t < self.ranks.grace:
            return
        self._pending_step = None
        if self.store.steps.state(self.model, step) != "preparing":
            return
        missing = self.ranks.missing(step, self.epoch)
        if missing:
            err = self.ranks.missing_error(step, missing, time.monotonic() - self._last_t)
            self._vote_down(step, err)
            raise err

    def _reset_trackers(self) -> None:
        self._undecided = []
        self.plan.forget()

    def wait(self, timeout: float | None = None, *, durable: bool = False) -> str | None:
        """Wait for the last save: ``"committed"`` or ``"aborted"`` (``None`` if none), or ``"skipped"``: the
        save wrote nothing (a step of an earlier incarnation that was not proven lost stands in its place, see
        :meth:`~tierstore.train.restore_side.RestoreSide._begin`; its warning says until when).

        ``timeout`` (default: the Checkpointer's ``timeout``) bounds the whole wait. With ``durable``, a
        committed step is waited for until it is durable too (its durable manifest written; the store's
        :meth:`~tierstore.store.TierStore.wait_durable`), within the same bound.

        Raises:
            DurableTimeoutError: with ``durable``: the step is not durable within ``timeout``, or never
                will be (recorded memory-only); it names the tier, the step and what the migration is
                blocked in.
            TierStoreError: the background part of the save failed (typed).
            CommitError: undecided after ``timeout``; or ranks never began the
                step (``missing_ranks``) within ``missing_rank_grace``: the step is aborted.
        """
        step = self._last_step
        self._drain()
        if step is None:
            return None
        if self._skipped:
            return "skipped"
        self._pending_step = None
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        if self.world_size > 1 and self._last_t + self.ranks.grace < deadline:
            try:  # first until the grace: then ranks that never began the step are named
                state = self.store.wait_step(self.model, step,
                                             timeout=max(0.0, self._last_t + self.ranks.grace - time.monotonic()))
            except CommitError as e:
                if "state" not in e.fields:
                    raise
                missing = self.ranks.missing(step, self.epoch)
                if missing:
                    err = self.ranks.missing_error(step, missing, time.monotonic() - self._last_t)
                    self._vote_down(step, err)
                    raise err from None
                state = self.store.wait_step(self.model, step, timeout=max(0.0, deadline - time.monotonic()))
        else:
            state = self.store.wait_step(self.model, step, timeout=timeout)
        self._undecided = [s for s in self._undecided if s != step]
        if state == "aborted":
            self._reset_trackers()
        if durable and state == "committed":
            self.store.wait_durable(self.model, step, timeout=max(0.0, deadline - time.monotonic()))
        return "committed" if state in ("committed", "durable") else state

    @property
    def left_behind(self) -> bool:
        """A save :meth:`close` gave up waiting for is still running (it may still use the gloo group)."""
        return self._behind is not None and not self._behind.done()

    def close(self, timeout: float | None = -1.0) -> None:
        """Wait for the background work, then stop its thread (the store stays open).

        ``timeout``: how long the last save's background part is waited for (default the store's
        ``StoreConfig.close_timeout_s``, else 30 s; ``None``: unbounded). Past it (the index or a tier
        does not answer) the save is left behind, with a warning: it may still finish, or fail, unreported.

        Then the gloo group the Checkpointer made (none given, several ranks) is destroyed
        (:meth:`~tierstore.train.ranks.Ranks.close`: local, bounded), unless a save left behind may still run
        its collectives: then it is kept, with a warning. A ``group=`` the caller gave is never destroyed.
        Idempotent.
        """
        if timeout is not None and timeout < 0:
            timeout = getattr(getattr(self.store, "config", None), "close_timeout_s", 30.0)
        fut = self._future
        left_behind = False
        try:
            if fut is not None and not futures_wait([fut], timeout=timeout).done:
                left_behind = True
                self._future = None
                self._behind = fut
                log.warning("close: the background part of the save of step %s of %s did not finish within "
                            "%s s (the index or a tier is not answering); left behind", self._last_step,
                            self.model, timeout)
            else:
                self._drain()
        finally:
            self._abandon_restore()
            self._gate.close()
            self.plan.close()
            self._pool.shutdown(wait=not left_behind, cancel_futures=left_behind)
            behind = self.left_behind
            if not behind:
                self.ranks.close()  # the group it made, if any (a given one stays): local, bounded
            elif self.ranks.owns_group:  # its collectives (dedup, lazy's select) may still run
                log.warning("close: the gloo group of %s is kept for the save left behind", self.model)


def load(store: Any, model_name: str, state: MutableMapping[str, Any], step: int | None = None, *,
         only: Iterable[str] | None = None, policy: Policy | None = None, **kwargs: Any) -> Restored:
    """Read the newest (or committed ``step``) state of ``model_name`` into ``state``, read-only.

    For evaluation and inference: takes no epoch (a running trainer is not
    fenced) and writes nothing. ``state`` may be any subset of what was saved
    (``{"model": model}`` for the weights). Give the ``policy`` the job saved
    with when it was ``layerwise`` (its staleness bound) or ``replay``. With
    ``torch.distributed`` up and several ranks it is collective, as the
    Checkpointer's constructor is (pass ``group=`` to choose the ranks), unless
    ``world_size=1``: rank-local, no collective (``rank=r`` reads rank ``r``'s part).
    """
    ck = Checkpointer(store, model_name, state=state, policy=policy, preallocate=False, keep_last=None, **kwargs)
    try:
        return ck.restore(step, read_only=True, only=only)
    finally:
        ck.close()


__all__ += ["load"]
