"""The tier manager: ``tierstore.open()`` and :class:`TierStore`.

A put is copied once, straight into the host tier's shared-memory object (the
snapshot), sealed with its checksum, published under a physical name unique to
this write (:func:`~tierstore.keys.object_name`: the key plus a fresh tag,
create-once), recorded in the index (which refuses a stale epoch and any key
of a committed step), and queued for migration to the durable tier. A name is
never reused, so no writer (a fenced zombie, a retried attempt) can publish
over, or delete, the live copy of a key: it only ever touches its own. A delta
or ref that a reader could not follow (``max_delta_chain``) is written as a
full object instead. A get asks the index what it knows (the live copy's
name), then reads the fastest tier holding the object, verifies the checksum,
and falls back to the next tier on a miss, an unreachable tier or a mismatch;
refs and delta chains are resolved into full tensors.

:class:`TierStore` is the facade: it owns the tiers, the index client and the
background threads, and combines the write path (:mod:`tierstore.store.writing`:
snapshot, seal, publish, ``finish_async``) with the read path
(:mod:`tierstore.store.reading`: ``get``, ``get_many``, refs and deltas) and the
ranged reads (:mod:`tierstore.store.ranged`: ``open_ranged``, parts of tensors).
With ``StoreConfig.device_tier`` on (the default ``"auto"``, where CUDA tensors
are saved), snapshots land in reused device buffers first and are drained into
the host tier by ``finish()``; a rollback reads them back
(:mod:`tierstore.store.device_tier`).

The commit protocol (:meth:`TierStore.begin_step`, :meth:`vote`,
:meth:`wait_step`, :meth:`open_epoch`), garbage collection (:meth:`gc`) and
index rebuilds (:meth:`rebuild_index`) are delegated to :mod:`consistency`;
the read path (:meth:`resolve`) to :mod:`tierstore.readpath`. See ``DESIGN.md``.
"""

from __future__ import annotations

import builtins  # TierStore.list shadows the builtin inside the class
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any, Self

from backends.base import Backend
from backends.host import HostBackend
from consistency.gc import GCReport, Retention, collect
from consistency.index import KINDS, Index, ObjectRecord
from consistency.lifecycle import IDLE_S, ModelDeleteReport
from consistency.lifecycle import delete_model as _delete_model
from consistency.manifest import complete_entries
from consistency.rebuild import RebuildReport, rebuild_index
from consistency.twophase import StepProtocol
from tierstore.chains import ChainDepths
from tierstore.codec.head import set_table_cache_max
from tierstore.config import StoreConfig
from tierstore.errors import DurableTimeoutError, TierUnavailableError
from tierstore.eviction import evict_host
from tierstore.keys import ShardKey, validate_name, validate_step
from tierstore.migration import Migrator, Skipped
from tierstore.placement import Placement
from tierstore.readpath import Resolution, resolve
from tierstore.store.common import check_key
from tierstore.store.deferred import Verification, get_many_deferred
from tierstore.store.device_tier import DeviceTier
from tierstore.store.ranged import RangedReadPath, RangedShard
from tierstore.store.reading import ReadPath
from tierstore.store.writing import PendingObject, WritePath

__all__ = ["KINDS", "ObjectRecord", "PendingObject", "RangedShard", "TierStore"]

log = logging.getLogger(__name__)
_DELETE_ATTEMPTS = 8  # records of one key replaced by concurrent puts while a delete runs
TEMP_MAX_AGE_S = 3600.0  # gc removes temp files of the durable tier older than this (interrupted writes)


class TierStore(WritePath, ReadPath, RangedReadPath):
    """Tiered, versioned storage of checkpoint shards. Build it with :func:`open`.

    Thread-safe. Owns its index client, backends and migration threads;
    :meth:`close` releases them (it does not stop the embedded server).
    """

    def __init__(
        self,
        config: StoreConfig,
        index: Index,
        host: HostBackend,
        durable: Backend | None = None,
        *,
        peer: Backend | None = None,
    ) -> None:
        self.config = config
        set_table_cache_max(config.table_cache)
        self.index = index
        self.host = host
        self.peer = peer
        self.durable = durable
        self.tiers: list[Backend] = [t for t in (host, peer, durable) if t is not None]
        self._migrator = (
            Migrator(host, durable, index, maxsize=config.migration_queue, workers=config.migration_workers,
                     retries=config.migration_retries, backoff_s=config.migration_backoff_s,
                     backoff_max_s=config.migration_backoff_max_s, nice=config.background_nice,
                     decided=lambda model, step: self.steps.state(model, step), reach=self._reach,
                     stall_s=config.durable_stall_s, kept=lambda model: self.steps.pinned_steps(model))
            if durable is not None and config.migrate
            else None
        )
        self.placement = Placement(config.peer_replicas if peer is not None else 0, config.durable_every)
        self._replicator = (
            Migrator(host, peer, index, maxsize=config.migration_queue, workers=1, name="replicate",
                     retries=config.migration_retries, backoff_s=config.migration_backoff_s,
                     backoff_max_s=config.migration_backoff_max_s, nice=config.background_nice,
                     stall_s=config.durable_stall_s)
            if peer is not None
            else None
        )
        self._lock = threading.Lock()
        self._closed = False
        self.memory_only_at_close: list[tuple[str, int]] = []  # steps whose migration close() abandoned
        self._sealing: set[Any] = set()  # finish_async's futures not done (close waits for them, bounded)
        self._sealer: ThreadPoolExecutor | None = None  # finish_async's thread, started on first use
        self.chains = ChainDepths(index, config.max_delta_chain)
        self.steps = StepProtocol(index, durable, on_lost=self._on_lost if config.rebuild_index_on_loss else None,
                                  retry=config.retry)
        self.device_tier = DeviceTier.from_mode(config.device_tier, config.device_capacity_bytes)

    def _on_lost(self, model: str) -> None:
        report = self.rebuild_index(model)
        log.warning("index rebuilt for %s from the durable tier: %s", model, report.to_json())


    def delete(self, key: ShardKey | str) -> bool:
        """Delete an object from every tier and the index; return whether it existed anywhere.

        The record goes first, and only while it still names the copy read
        (:meth:`Index.delete_object` with ``name``); then that copy goes from
        every tier. So a background migration (or replication) of the copy
        that finishes after this finds no record (``add_tier`` refuses) and
        removes what it wrote, and one that finished before had its copy
        removed here: no copy outlives the delete, whatever the order. A
        record replaced meanwhile (a new put of the key) is deleted in turn.
        A crash between the two steps leaves unindexed copies (as garbage
        collection's does), never a record without copies.
        """
        key = check_key(key)
        self._check_open()
        for attempt in range(_DELETE_ATTEMPTS):
            rec = self.index.get_object(key)
            if rec is None:
                if attempt:
                    return True  # deleted here (another delete removed a replacing record)
                existed = False  # no record: a copy under the plain key (written before names carried a tag)
                for tier in self.tiers:
                    existed = tier.delete(str(key)) or existed
                return existed
            gone = self.index.delete_object(key, name=rec.name)
            for tier in self.tiers:
                tier.delete(rec.name)
            if gone:
                return True
        return True  # every record read was deleted, but puts of the key keep replacing it

    def _collect(self, items: builtins.list[tuple[ShardKey, str]]) -> builtins.list[bool]:
        """For each ``(key, name)``: delete the record of ``key`` if it still names the copy ``name``, then that
        copy (garbage collection); the records in a few index scripts. A record replaced meanwhile (a new
        write of the key) is left alone, and so is its copy. Returns whether each record went."""
        gone = self.index.delete_objects(items)
        for (_key, name), went in zip(items, gone):
            if went:
                self._drop_copy(name)
        return gone

    def release(self, key: ShardKey, rec: ObjectRecord) -> bool:
        """Drop the memory tiers' copies of ``key`` (the copy ``rec`` names), keeping its durable copy.

        Only while the index records a durable copy of that same copy: never the last copy of anything.
        The index stops naming each tier before its copy goes. Returns whether a copy went.
        """
        if self.durable is None or self.durable.tier not in rec.tiers:
            return False
        dropped = False
        for tier in self.tiers:
            if tier is self.durable or tier.tier not in rec.tiers:
                continue
            if self.index.remove_tier(key, tier.tier, name=rec.name):
                try:
                    dropped = tier.delete(rec.name) or dropped
                except TierUnavailableError as e:  # unindexed now: an orphan copy, never a lost one
                    log.warning("could not drop %s from the %s tier: %s", rec.name, tier.tier, e)
        return dropped

    def list(self, model: str, layer: str | None = None, step: int | None = None) -> list[ShardKey]:
        """Keys of ``model`` recorded in the index, optionally of one layer and/or step."""
        validate_name(model, "model")
        if layer is not None:
            validate_name(layer, "layer")
        if step is not None:
            validate_step(step)
        return self.index.list_objects(model, layer, step)

    def models(self) -> builtins.list[str]:
        return self.index.models()

    def delete_model(self, model: str, *, force: bool = False, dry_run: bool = False,
                     idle_s: float = IDLE_S) -> ModelDeleteReport:
        """Delete ``model`` everywhere: its index records, every copy in every tier, its durable manifests
        and durable epoch records; see :mod:`consistency.lifecycle` (the order, and what counts as a live writer).

        Args:
            force: delete even while a writer of the model looks live.
            dry_run: only report what would go.
            idle_s: seconds since the model's newest step during which its writer counts as live.

        Raises:
            UnknownError: nothing of ``model`` is in the index or in any tier.
            ModelInUseError: a writer looks live (nothing deleted); pass ``force=True`` to delete anyway.
        """
        self._check_open()
        report = _delete_model(self.steps, model, self.tiers, dry_run=dry_run, force=force, idle_s=idle_s)
        if not dry_run:
            self.chains.forget(model)
        return report

    # -- steps (two-phase commit), delegated -------------------------------------
    def open_epoch(self, model: str) -> int:
        """Start a new incarnation of ``model``'s job; writes of older epochs are fenced.

        The epoch is recorded in the durable tier too, so it never goes backwards.

        Raises:
            IndexLostError: the index lost ``model`` (its durable tier holds steps the index does not know).
        """
        return self.steps.open_epoch(model)

    def begin_step(self, model: str, step: int, world_size: int, *, layout: dict | None = None,
                   epoch: int | None = None) -> None:
        """Begin (prepare) ``step``: call on every rank before writing its objects.

        Raises:
            StepCommittedError: ``step`` is already committed (nothing was written).
            IndexLostError: the index lost ``model`` (nothing was written).
            FencedError: ``epoch`` is stale.
        """
        self.steps.begin(model, step, world_size, layout=layout, epoch=epoch)

    def vote(self, model: str, step: int, rank: int, objects: builtins.list[ObjectRecord], *, extra: dict | None = None,
             ok: bool = True, epoch: int | None = None, attempt: str | None = None) -> str:
        """Vote for ``step`` with this rank's objects; the last vote of the world commits it.

        ``attempt``: the writer's token of its claim of the step (``store.steps.claim``, see
        :mod:`consistency.attempts`). Then, where the step goes to the durable tier, this rank's part of it
        is handed to the migrator (newest committed step first: :mod:`tierstore.migration`); a step whose
        objects the placement keeps in memory is recorded memory-only, with why.
        """
        state = self.steps.vote(model, step, rank, objects, extra=extra, ok=ok, epoch=epoch, attempt=attempt)
        if not ok or self._migrator is None or self.steps.durable is None:
            return state
        if all(self.placement.to_durable(o.kind, o.key.step) for o in objects):
            def migrated(failures: builtins.list) -> None:
                skipped = [f for f in failures if isinstance(f[1], Skipped)]
                if skipped and len(skipped) == len(failures):
                    self.steps.mark_memory_only(model, step, f"not migrated: {skipped[0][1]}")
                    return
                self.steps.mark_migrated(model, step, rank, [f for f in failures if f not in skipped],
                                         epoch=epoch)

            self._migrator.when_done([(o.key, o.name) for o in objects], migrated, step=(model, step, rank))
        else:
            self.steps.mark_memory_only(model, step, f"placement: durable_every={self.placement.durable_every} "
                                        "keeps its deltas in memory")
        return state

    def _reach(self, model: str, step: int, rank: int) -> builtins.list[tuple[ShardKey, str, str]]:
        """The copies of ``rank`` that committed ``step``'s manifest reaches (with the steps it requires),
        held in this store's host tier and not yet by the durable tier (what the migrator adds to the step's
        migration)."""
        m = self.steps.manifest(model, step)
        if m is None or self.durable is None:
            return []
        keys = [ShardKey.parse(o["key"]) for o in [*complete_entries(m), *(self.steps.required_entries(model, m) or [])]]
        keys = [k for k in keys if k.rank == rank]
        out = []
        for key, rec in zip(keys, self.index.get_objects(keys)):
            if rec is not None and self.durable.tier not in rec.tiers and self.host.exists(rec.name):
                out.append((key, rec.checksum, rec.name))
        return out

    def migrating_steps(self, model: str) -> set[int]:
        """Steps of ``model`` whose migration this store has started and not finished."""
        return self._migrator.migrating_steps(model) if self._migrator is not None else set()

    def wait_step(self, model: str, step: int, timeout: float | None = None) -> str:
        return self.steps.wait(model, step, timeout=timeout)

    def resolve(self, model: str, max_staleness: int = 0, *, step: int | None = None,
                verify: str | None = None, at_most: int | None = None,
                part: tuple[int, int] | None = None) -> Resolution:
        """The freshest consistent layer set of ``model`` that verifies; see :mod:`tierstore.readpath`.

        Args:
            step: resolve this committed step (no fallback to another).
            verify: how copies are checked (default ``config.restore_verify``); ``"trailer"`` for a
                reader that hashes the copies it reads itself (:mod:`tierstore.store.deferred`).
            at_most: try no step newer than this.
            part: ``(i, n)``: check only the copies of saved ranks ``s % n == i``, one share of a
                collective restore whose ranks agree after (:mod:`tierstore.readpath`); ``None``: all.
        """
        c = self.config
        return resolve(self.steps, self.tiers, model, max_staleness=max_staleness, max_chain=c.max_delta_chain,
                       step=step, verify=verify or c.restore_verify, retry=c.retry, at_most=at_most, part=part)

    def get_many_deferred(self, keys: builtins.list[ShardKey | str], *, outs: Any = None,
                          copy: bool = True, eager: bool = False) -> tuple[builtins.list[Any], Verification]:
        """:meth:`get_many` with the checksum pass after the copy, on a thread of its own.

        Returns the shards and a :class:`~tierstore.store.deferred.Verification`:
        nothing read may be used for anything permanent (an update, a save)
        before ``verification.wait()`` returned ``[]``. See :mod:`tierstore.store.deferred`.
        """
        return get_many_deferred(self, keys, outs=outs, copy=copy, eager=eager)

    def rebuild_index(self, model: str | None = None) -> RebuildReport:
        """Rebuild a lost index from the durable manifests; see :mod:`consistency.rebuild`."""
        return rebuild_index(self.steps, model, host=self.host)

    def gc(self, model: str, retention: Retention | None = None, *, dry_run: bool = True,
           max_staleness: int = 0) -> GCReport:
        """Apply ``retention`` (per tier) to ``model``; see :mod:`consistency.gc`.

        Committed steps newer than the newest durable step whose migration may still finish are left for
        a later pass (their objects reported as deferred). A local durable directory's temp files older
        than an hour (interrupted writes) are removed too (``temp_removed``).
        """
        report = collect(self.steps, model, retention or Retention(), delete=self._collect, release=self.release,
                         drop=self._drop_copy, dry_run=dry_run, max_staleness=max_staleness,
                         migrating=self.durable is not None and self.config.migrate)
        sweep = getattr(self.durable, "cleanup_temp", None)  # a local durable directory's interrupted writes
        if sweep is not None and not dry_run:
            report.temp_removed = sweep(max_age_s=TEMP_MAX_AGE_S, prefix=f"{model}/")
        return report

    # -- host-tier eviction ----------------------------------------------------------
    def evict_host(self, nbytes: int) -> int:
        """Free at least ``nbytes`` in the host tier by dropping host copies that are durable.

        Never drops the only copy of anything (the durable copy must verify
        first), nor a copy of a model's newest committed step. Raises
        :class:`TierFullError` when not enough can be freed.
        """
        return evict_host(self.host, self.durable, self.index, self.steps, nbytes)

    # -- lifecycle -----------------------------------------------------------------
    def rewire(
        self,
        *,
        tier: Callable[[Backend], Backend] | None = None,
        index: Callable[[Index], Index] | None = None,
        before_migrate: Callable[[ShardKey], None] | None = None,
    ) -> None:
        """Wrap this store's tiers and index (fault injection, tracing), before it is used from other threads.

        Args:
            tier: returns the backend to use in place of each tier.
            index: returns the index to use in place of the current one.
            before_migrate: called before each object migrates to the durable tier.
        """
        if tier is not None:
            self.host = tier(self.host)  # type: ignore[assignment]
            self.peer = tier(self.peer) if self.peer is not None else None
            self.durable = tier(self.durable) if self.durable is not None else None
            self.tiers = [t for t in (self.host, self.peer, self.durable) if t is not None]
        if index is not None:
            self.index = index(self.index)
            self.chains.index = self.index
        self.steps = StepProtocol(self.index, self.durable, step_timeout_s=self.steps.step_timeout_s,
                                  on_lost=self.steps.on_lost, retry=self.config.retry,
                                  pin_record_timeout_s=self.steps.pin_record_timeout_s)
        for mover, target in ((self._migrator, self.durable), (self._replicator, self.peer)):
            if mover is not None and target is not None:
                mover.source, mover.target, mover.index = self.host, target, self.index
        if before_migrate is not None and self._migrator is not None:
            self._migrator.before_each = before_migrate

    def flush(self, timeout: float | None = -1.0) -> None:
        """Wait for background migration; raise the first error it met.

        ``timeout``: seconds in all (default ``config.flush_timeout_s``; ``None``: unbounded).

        Raises:
            DurableTimeoutError: not done in time; names the tier, the steps still memory-only and what
                the migration is blocked in (the migration goes on).
            MigrationError: objects failed to migrate.
        """
        if timeout is not None and timeout < 0:
            timeout = self.config.flush_timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        bound = "StoreConfig.flush_timeout_s" if timeout == self.config.flush_timeout_s else "timeout"
        for mover in (self._replicator, self._migrator):
            if mover is not None:
                mover.flush(None if deadline is None else max(0.0, deadline - time.monotonic()), bound=bound)

    def durable_stalled(self) -> builtins.list[tuple[ShardKey, str, float]]:
        """Objects whose migration to the durable tier has not finished for ``config.durable_stall_s`` or
        more: ``(key, what it is blocked in, seconds)`` (each is also logged once, as a warning)."""
        return self._migrator.stalled() if self._migrator is not None else []

    def wait_durable(self, model: str, step: int, timeout: float | None = -1.0) -> None:
        """Return once committed ``step`` of ``model`` is durable (its durable manifest written).

        ``timeout``: seconds (default ``config.flush_timeout_s``; ``None``: unbounded).

        Raises:
            DurableTimeoutError: not durable within ``timeout``, or it never will be (recorded
                memory-only, or aborted): names the tier, the step, and what the migration is blocked in.
        """
        if timeout is not None and timeout < 0:
            timeout = self.config.flush_timeout_s
        tier = self.durable.tier if self.durable is not None else "durable"
        t0 = time.monotonic()
        pause = 0.01
        while True:
            recs = [r for r in self.steps.records(model) if r.step == step]
            rec = recs[0] if recs else None
            if rec is not None and rec.state == "durable":
                return
            waited = time.monotonic() - t0
            never = (None if self.durable is not None and self.config.migrate else "no durable tier migrates") \
                if rec is not None else "the step is not recorded"
            if rec is not None and rec.memory_only is not None:
                never = f"it stays memory-only: {rec.memory_only}"
            elif rec is not None and rec.state == "aborted":
                never = "it was aborted"
            over = timeout is not None and waited >= timeout
            if never is not None or over:
                stalled = [(str(k), p, a) for k, p, a in self.durable_stalled() if k.model == model]
                blocked = "; ".join(f"{k} blocked in {p} for {a:.1f} s" for k, p, a in stalled[:3])
                why = never or (f"not durable after {waited:.1f} s (bound: "
                                f"{'StoreConfig.flush_timeout_s' if timeout == self.config.flush_timeout_s else 'timeout'})")
                raise DurableTimeoutError(
                    f"step {step} of {model} is not durable in the {tier} tier: {why}"
                    + (f" ({blocked})" if blocked else ""),
                    what=f"step {step} of {model} durable", tier=tier, model=model, step=step, steps=[(model, step)],
                    waited_s=waited, bound="timeout", stalled=stalled)
            time.sleep(min(pause, max(0.0, timeout - waited)) if timeout is not None else pause)
            pause = min(pause * 2, 0.25)

    def _check_open(self) -> None:
        if self._closed:
            raise TierUnavailableError("this TierStore is closed")

    def close(self, timeout: float | None = -1.0) -> builtins.list[tuple[str, int]]:
        """Flush, then release everything this store owns, within ``timeout`` seconds in all (default
        ``config.close_timeout_s``; ``None``: unbounded). Idempotent.

        Returns (and keeps in :attr:`memory_only_at_close`) the ``(model, step)`` whose migration did not
        finish in time: they stay memory-only (a warning names them). A migration error met in time is
        raised (:class:`MigrationError`), after everything was released.
        """
        if self._closed:
            return self.memory_only_at_close
        if timeout is not None and timeout < 0:
            timeout = self.config.close_timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        error: BaseException | None = None
        try:
            self.flush(left())
        except DurableTimeoutError as e:
            log.warning("close: %s", e)
        except BaseException as e:  # noqa: BLE001 - raised below, once everything is released
            error = e
        self._closed = True
        abandoned: set[tuple[str, int]] = set()
        try:
            if self._sealer is not None:
                with self._lock:
                    sealing = builtins.list(self._sealing)
                _done, pending = futures_wait(sealing, timeout=left())
                if pending:
                    log.warning("close: %d finish_async batch(es) still running after the bound (the index "
                                "or a tier is not answering); left behind", len(pending))
                self._sealer.shutdown(wait=not pending, cancel_futures=True)
            if self._replicator is not None:
                unreplicated = self._replicator.close(left())
                if unreplicated:
                    log.warning("close: the replication to peers of %d step(s) did not finish in time: %s",
                                len(unreplicated), ", ".join(f"{m}@{s}" for m, s in unreplicated[:20]))
            if self._migrator is not None:
                abandoned |= set(self._migrator.close(left()))
            for t in self.tiers:
                t.close()
            if self.device_tier is not None:
                self.device_tier.close()
            self.index.close()
        finally:
            self.memory_only_at_close = sorted(abandoned)
            if abandoned:
                shown = ", ".join(f"{m}@{s}" for m, s in self.memory_only_at_close[:20])
                log.warning("close: the migration of %d step(s) did not finish within %s s; they stay "
                            "memory-only (lost with this node's memory): %s", len(abandoned),
                            "no bound" if timeout is None else f"{timeout:g}", shown)
        if error is not None:
            raise error
        return self.memory_only_at_close

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<TierStore tiers={[t.tier for t in self.tiers]} node={self.config.node_id!r}>"

