"""The trainer-facing Checkpointer: save a module and optimizer per step, restore in place.

Protocol (every rank of the job, in the same order)::

    ckpt = Checkpointer(store, "gpt", model, opt, policy=compose(layerwise(), differential(), dedup()))
    step, extra = ckpt.restore()       # (None, None) on a fresh job; bumps the job's epoch
    for step in ...:
        train_step()
        ckpt.save(step, extra={"data_pos": ...})   # returns after the snapshot
    ckpt.wait()                        # "committed" / "aborted" of the last save
    ckpt.close()

``save(step)`` does, on the calling thread: wait for the previous save's
background work (at most one save is in flight), pick the layers the policy
wants (for ``layerwise``, agreed across ranks by an ``all_reduce(MAX)``), and
copy them: straight into host-tier shared memory (``store.snapshot``) for
plain full objects, or into reused staging buffers when the object depends on
what the other ranks hold (dedup) or on the previous version (deltas). The
rest runs on one background thread: ``begin_step``, redundancy detection,
delta encoding, sealing and publishing, and the vote that carries the JSON
``extra`` (the user's, the optimizer's param groups, the policy).

Collectives: with ``torch.distributed`` initialised and more than one rank, the
Checkpointer uses its own gloo group (``group``, else one made by
``dist.new_group`` in the constructor, which is itself a collective: every
rank constructs its Checkpointer). The training loop's own collectives are
never mixed with it.

Rank and world size come from the arguments, else ``torch.distributed`` when
initialised, else the launcher's ``RANK``/``WORLD_SIZE`` environment
(:func:`rank_from_env`, the one place that reads it), else 0 and 1. Without
``torch.distributed`` there are no collectives: layerwise decisions are local
(identical replicas decide alike), dedup is off, and restore does not bump the
epoch when the world is larger than one (no rank could tell the others).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from consistency.gc import reachable
from tierstore import codec
from tierstore.delta import xor_delta
from tierstore.errors import (
    CommitError,
    NoValidCopyError,
    RestoreMismatchError,
    TierStoreError,
)
from tierstore.keys import ShardKey, validate_name
from tierstore.train.dedup import DedupPlanner, part_of
from tierstore.train.layers import PARAM, StateMap
from tierstore.train.policies import DiffTracker, LayerwiseTracker, Policy, exact
from tierstore.train.stagger import balanced_slots, shifted

__all__ = ["Checkpointer", "SaveStats", "rank_from_env"]

log = logging.getLogger(__name__)


def rank_from_env(env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """``(RANK, WORLD_SIZE)`` from ``env`` (default ``os.environ``), else ``(0, 1)``."""
    env = os.environ if env is None else env
    return int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))


class SaveStats:
    """Counters of what this rank wrote: bytes and objects per kind, and stall time."""

    def __init__(self) -> None:
        self.bytes = 0
        self.logical_bytes = 0
        self.objects = {"full": 0, "delta": 0, "ref": 0}
        self.saves = 0
        self.layers_saved = 0
        self.per_step: dict[int, int] = {}

    def as_dict(self) -> dict[str, Any]:
        return {
            "bytes": self.bytes,
            "logical_bytes": self.logical_bytes,
            "objects": dict(self.objects),
            "saves": self.saves,
            "layers_saved": self.layers_saved,
        }


def _nbytes(ts: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts.values())


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


class Checkpointer:
    """Saves ``module`` (and ``optimizer``) of this rank into ``store`` under ``model_name``.

    Args:
        store: an open :class:`~tierstore.store.TierStore`.
        model_name: the key namespace of this job.
        module: the model; its parameters and buffers are saved by layer.
        optimizer: optional; per-parameter state and param groups are saved.
        policy: see :mod:`tierstore.train.policies` (default :func:`exact`).
        rank, world_size: default from ``torch.distributed``, else 0 and 1.
        layer_fn: ``param_name -> layer name`` (default: module prefix).
        group: the gloo group for the Checkpointer's collectives.
        timeout: seconds :meth:`wait` waits for a commit decision.
        keep_last: retention: after each save, this rank's objects that no
            manifest of the last ``keep_last`` committed steps reaches (through
            delta bases and refs) are deleted from every tier, so shared-memory
            segments are recycled; ``None`` keeps everything.
        preallocate: reserve and pre-fault the host tier's shared memory for
            two generations of this rank's full shards up front, so the first
            saves copy at memory speed (fresh shared memory faults every page).

    Memory bound (host tier, this rank): at most ``keep_last + 1`` generations
    of the saved shards, plus the reuse pool.
    """

    def __init__(
        self,
        store: Any,
        model_name: str,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        policy: Policy | None = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        layer_fn: Callable[[str], str] | None = None,
        group: Any = None,
        timeout: float = 120.0,
        keep_last: int | None = 3,
        preallocate: bool = True,
    ) -> None:

        self.store = store
        self.model = validate_name(model_name, "model")
        self.map = StateMap(module, optimizer, layer_fn)
        self.policy = policy or exact()
        dist_on = dist.is_available() and dist.is_initialized()
        env_rank, env_world = rank_from_env() if not dist_on else (0, 1)
        self.rank = rank if rank is not None else (dist.get_rank() if dist_on else env_rank)
        self.world_size = world_size if world_size is not None else (dist.get_world_size() if dist_on else env_world)
        self.group = None
        if dist_on and dist.get_world_size() > 1:
            self.group = group if group is not None else dist.new_group(backend="gloo")
        self.timeout = timeout
        self.epoch: int | None = None
        self.stats = SaveStats()
        self._lw = LayerwiseTracker(self.policy.tau, self.policy.max_staleness) if self.policy.tau is not None else None
        self._diff = DiffTracker(self.policy.base_every, self.policy.chain_limit) if self.policy.base_every else None
        self._dedup = None
        if self.policy.dedup and self.group is not None:
            self._dedup = DedupPlanner(self.policy.dedup_group or self.group, self.policy.dedup_algo)
        self._stagger()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tierstore-ckpt-{self.rank}")
        self._future: Future | None = None
        self._last_step: int | None = None
        self.keep_last = keep_last
        self._retained_below = 0
        if preallocate and self._diff is None and self._dedup is None and hasattr(store, "host"):
            self._preallocate()

    def _stagger(self) -> None:
        """Give each layer a slot so forced saves and bases spread over steps (LayerCheck's smoothed I/O)."""

        layers = sorted(self.map.layers)
        sizes = [_nbytes(self.map.layer_tensors(ln)) for ln in layers]
        if self._lw is not None and self._lw.max_staleness >= 1:
            self._lw.slots = dict(zip(layers, balanced_slots(sizes, self._lw.max_staleness)))
        if self._diff is not None and self._diff.base_every >= 1:
            slots = balanced_slots(sizes, self._diff.base_every)
            self._diff.slots = {ln: shifted(s, self.rank, self._diff.base_every, self.world_size)
                                for ln, s in zip(layers, slots)}

    def _preallocate(self) -> None:
        sizes = [codec.plan(self.map.layer_tensors(ln), {**self.map.layer_meta(ln), "_ts": {}}).nbytes
                 for ln in sorted(self.map.layers)]
        try:
            self.store.host.preallocate(sizes * 2)
        except TierStoreError as e:  # a small host budget: saves will fault pages in as they go
            log.info("host tier pre-allocation skipped: %s", e)

    def _retain(self) -> None:
        """Delete this rank's objects that the last ``keep_last`` committed steps no longer reach."""
        if self.keep_last is None:
            return
        steps = self.store.steps.steps(self.model)
        committed = [s for s, st in steps if st in ("committed", "durable")]
        if len(committed) < self.keep_last:
            return
        # a layer-wise resume at step R reads layers saved as far back as R - max_staleness
        oldest = committed[-self.keep_last] - (self.policy.max_staleness or 0)
        kept = [s for s in committed if s >= oldest]
        aborted = {s for s, st in steps if st == "aborted" and s < kept[-1]}
        horizon = kept[0]
        if horizon <= self._retained_below and not aborted:
            return
        keep = reachable(self.store.steps, self.model, kept)
        for key in self.store.list(self.model):
            if key.rank != self.rank or key in keep:
                continue
            if key.step < horizon or key.step in aborted:
                self.store.delete(key)
        self._retained_below = horizon

    # ---- saving ----------------------------------------------------------------

    def _select(self, step: int) -> list[str]:
        layers = sorted(self.map.layers)
        if self._lw is None:
            return layers
        want = torch.tensor(
            [int(self._lw.want(step, ln, self.map.param_tensors(ln))) for ln in layers], dtype=torch.int32
        )
        if self.group is not None:
            dist.all_reduce(want, op=dist.ReduceOp.MAX, group=self.group)
        return [ln for ln, w in zip(layers, want.tolist()) if w]

    def save(self, step: int, extra: dict | None = None) -> None:
        """Snapshot the state after ``step`` and return; the rest runs in the background.

        Raises:
            TierStoreError: the previous save failed in the background (its
                error, typed), or the snapshot itself failed.
        """
        self._drain()
        selected = self._select(step)
        direct = self._diff is None and self._dedup is None
        pendings = []
        staged: dict[str, dict[str, torch.Tensor]] = {}
        metas: dict[str, dict] = {}
        try:
            for ln in selected:
                live = self.map.layer_tensors(ln)
                metas[ln] = self.map.layer_meta(ln)
                if direct:
                    key = ShardKey(self.model, ln, step, self.rank)
                    pendings.append((ln, self.store.snapshot(key, live, metas[ln], epoch=self.epoch)))
                    if self._lw is not None:
                        staged[ln] = {n: t.clone() for n, t in live.items() if n.startswith(PARAM)}
                else:
                    staged[ln] = {n: t.clone() for n, t in live.items()}
                self.stats.logical_bytes += _nbytes(live)
        except BaseException:
            for _, p in pendings:
                p.abort()
            raise
        opt_meta = self.map.optimizer_meta()
        vote_extra = {"user": extra, "optimizer": opt_meta, "policy": self.policy.name}
        self._last_step = step
        self.stats.saves += 1
        self._future = self._pool.submit(self._finish, step, selected, pendings, staged, metas, vote_extra)

    def _drain(self) -> str | None:
        fut, self._future = self._future, None
        if fut is None:
            return None
        try:
            state = fut.result()
        except BaseException:
            self._reset_trackers()
            raise
        if state == "aborted":  # this rank's vote decided it: the next save starts from full objects
            self._reset_trackers()
        return state

    def _reset_trackers(self) -> None:
        if self._lw is not None:
            self._lw.reset()
        if self._diff is not None:
            self._diff.forget()

    def _finish(
        self,
        step: int,
        selected: list[str],
        pendings: list,
        staged: dict[str, dict[str, torch.Tensor]],
        metas: dict[str, dict],
        vote_extra: dict,
    ) -> str:
        infos = []
        try:
            self._retain()
            self.store.begin_step(
                self.model, step, self.world_size, layout={"layers": sorted(self.map.layers)}, epoch=self.epoch
            )
            for ln, p in pendings:
                infos.append(p.finish())
            pendings = []
            owners = self._dedup.plan(staged) if self._dedup is not None else {}
            if self._diff is not None or self._dedup is not None:
                for ln in selected:
                    infos.append(self._write_layer(ln, step, staged[ln], metas[ln], owners.get(ln)))
        except BaseException as e:
            for _, p in pendings:
                p.abort()
            try:
                self.store.vote(self.model, step, self.rank, infos, extra=vote_extra, ok=False, epoch=self.epoch)
            except Exception as ve:  # noqa: BLE001 - the original error is what matters
                log.debug("negative vote for step %s failed: %r", step, ve)
            if isinstance(e, TierStoreError):
                raise
            raise CommitError(f"save of step {step} failed on rank {self.rank}: {e!r}", step=step, rank=self.rank) from e
        for info in infos:
            self.stats.bytes += info.size
            self.stats.objects[info.kind] = self.stats.objects.get(info.kind, 0) + 1
            self.stats.per_step[step] = self.stats.per_step.get(step, 0) + info.size
        self.stats.layers_saved += len(selected)
        state = self.store.vote(self.model, step, self.rank, infos, extra=vote_extra, epoch=self.epoch)
        if self._lw is not None:
            for ln in selected:
                self._lw.saved(ln, step, {n: t for n, t in staged[ln].items() if n.startswith(PARAM)})
        return state

    def _write_layer(
        self, ln: str, step: int, tensors: dict[str, torch.Tensor], meta: dict, owners: dict[str, int] | None
    ) -> Any:
        key = ShardKey(self.model, ln, step, self.rank)
        refs = {p: o for p, o in (owners or {}).items() if o != self.rank}
        present = {part_of(n) for n in tensors}
        refs = {p: o for p, o in refs.items() if p in present}
        if refs and set(refs) == present and len(set(refs.values())) == 1:
            if self._diff is not None:
                self._diff.forget(ln)
            target = ShardKey(self.model, ln, step, next(iter(refs.values())))
            return self.store.put(key, {}, None, kind="ref", target=target, epoch=self.epoch)
        mine = {n: t for n, t in tensors.items() if part_of(n) not in refs}
        meta = dict(meta)
        if refs:
            meta["_refs"] = refs
        if self._diff is None:
            return self.store.put(key, mine, meta, epoch=self.epoch)
        kind, base_step = self._diff.kind(ln, step, mine)
        if kind == "delta" and base_step is not None:
            base = self._diff.base_tensors(ln)
            deltas = {n: xor_delta(t, base[n]) for n, t in mine.items() if not _bits_equal(t, base[n])}
            meta["_delta"] = {
                n: {"dtype": str(mine[n].dtype).removeprefix("torch."), "shape": list(mine[n].shape)} for n in deltas
            }
            base_key = ShardKey(self.model, ln, base_step, self.rank)
            info = self.store.put(key, deltas, meta, kind="delta", base=base_key, epoch=self.epoch)
        else:
            info = self.store.put(key, mine, meta, epoch=self.epoch)
        self._diff.saved(ln, step, mine, kind)
        return info

    def wait(self, timeout: float | None = None) -> str | None:
        """Wait for the last save: ``"committed"`` or ``"aborted"`` (``None`` if none).

        Raises:
            TierStoreError: the background part of the save failed (typed).
        """
        step = self._last_step
        self._drain()
        if step is None:
            return None
        state = self.store.wait_step(self.model, step, timeout=self.timeout if timeout is None else timeout)
        if state == "aborted":
            self._reset_trackers()
        return "committed" if state in ("committed", "durable") else state

    # ---- restoring ---------------------------------------------------------------

    def _new_epoch(self) -> int | None:
        if self.group is None:
            return self.store.open_epoch(self.model) if self.world_size == 1 else None

        t = torch.zeros(1, dtype=torch.int64)
        if self.rank == 0:
            t[0] = self.store.open_epoch(self.model)
        dist.broadcast(t, src=dist.get_global_rank(self.group, 0) if self.group else 0, group=self.group)
        return int(t[0])

    def restore(self) -> tuple[int | None, dict | None]:
        """Load the newest consistent state in place; ``(step, user extra)``.

        Bumps the job's epoch first (every rank agrees on it), so writes of a
        previous incarnation are fenced. Returns ``(None, None)`` when no
        step of this model is committed.

        Raises:
            RestoreMismatchError: the stored state does not fit the module or
                optimizer (missing layer/tensor, shape, dtype); nothing changed.
            NoValidCopyError: a needed object has no valid copy in any tier.
        """
        self._drain()
        self.epoch = self._new_epoch()
        try:
            res = self.store.resolve(self.model, max_staleness=self.policy.max_staleness)
        except NoValidCopyError as e:
            if "reason" not in e.fields:  # nothing committed yet: a fresh job
                return None, None
            raise
        if res is None:
            return None, None
        src_rank = self.rank if self.rank < res.world_size else self.rank % res.world_size
        tensors: dict[str, dict[str, torch.Tensor]] = {}
        metas: dict[str, dict] = {}
        for ln in sorted(self.map.layers):
            info = res.objects.get((ln, src_rank))
            if info is None:
                continue  # load() names the missing layer
            shard = self.store.get(info.key)
            if shard is None:
                raise RestoreMismatchError(f"layer {ln!r}: object {info.key} is gone", layer=ln, tensor=None)
            ts = dict(shard.tensors)
            meta = dict(shard.metadata)
            for part, owner in (meta.pop("_refs", None) or {}).items():
                other = self.store.get(ShardKey(self.model, ln, info.key.step, int(owner)))
                if other is None:
                    raise RestoreMismatchError(
                        f"layer {ln!r}: {part} of rank {src_rank} refers to rank {owner}, whose object is gone",
                        layer=ln,
                        tensor=part,
                    )
                ts.update({n: t for n, t in other.tensors.items() if part_of(n) == part})
            tensors[ln] = ts
            metas[ln] = meta
        for ln in res.layers:
            if ln not in self.map.layers:
                raise RestoreMismatchError(f"stored layer {ln!r} has no counterpart in the module", layer=ln, tensor=None)
        extra = res.extra.get(src_rank) or res.extra.get(str(src_rank)) or {}
        self.map.load(tensors, metas, extra.get("optimizer"))
        self._reset_trackers()
        return res.step, extra.get("user")

    def close(self) -> None:
        """Wait for the background work, then stop its thread (the store stays open)."""
        try:
            self._drain()
        finally:
            self._pool.shutdown(wait=True)

