"""Gradient-log checkpoints with optimizer replay (AdaCheck's online checkpoints).

A :class:`ReplayCheckpointer` writes a full *base* (module + optimizer state,
the same layer shards as the :class:`~tierstore.train.checkpointer.Checkpointer`,
extracted and restored with :class:`~tierstore.train.layers.StateMap`) every
``base_every`` steps, and in between, per step, only a *log entry*: the
gradients the optimizer consumed at that step, in their own dtype, plus the
scalars of its param groups (lr, betas, weight decay, momentum, ...).

Capture: ``optimizer.register_step_pre_hook`` copies every ``p.grad`` into
reused staging tensors just before ``optimizer.step()`` runs, i.e. after the
data-parallel reduction and after any gradient clipping (so a clip factor is
already applied to what is logged), and records the param groups' scalars
(a learning-rate scheduler's value included). The training loop does not
change beyond constructing the object and calling :meth:`save`.

Protocol (every rank, same order, like the Checkpointer)::

    rc = ReplayCheckpointer(store, "gpt", model, opt, base_every=20)
    step, extra, report = rc.restore()   # (None, None, report) on a fresh job
    for step in ...:
        train_step()                      # ends with opt.step(): the hook captures
        rc.save(step, extra={...})        # returns after the snapshot
    rc.wait(); rc.close()

Each save is one two-phase-commit step of ``model``: a base step holds every
layer's shard (``layout.replay == "base"``); a log step holds one object per
rank, ``ShardKey(model, "grads", step, rank)`` (``layout.replay == "log"``),
and its vote's ``extra.replay`` carries the xxh3 digest of the parameters
after the step (``post``), the previous step and the base step. A log step is
committed only when every rank's entry is. A save writes a log entry only
when exactly one optimizer step ran since the previous save of this object,
and that save was made; otherwise it writes a base.

Restore: the newest committed base, then the committed log steps that follow
it contiguously are replayed through the same code path (set ``p.grad``, set
the group scalars, ``optimizer.step()``) and each is verified against its
recorded post-step digest. A log entry that is missing, fails its checksum in
every tier, or replays to another digest stops the replay: all ranks agree on
the newest step every rank verified (``all_reduce(MIN)``), reload the base and
replay up to it, and the :class:`ReplayReport` (plus a
:class:`ReplayFallbackWarning`) says so. Wrong weights are never returned.
Committed steps newer than the restored one are retired (objects and step
records deleted) so the resumed run can write them again.

Supported optimizers: ``SGD`` (with or without momentum), ``Adam``, ``AdamW``
(exact classes; each updates every parameter elementwise from its own grad
and state). Others raise :class:`~tierstore.errors.ConfigError`.

Where bitwise replay is NOT guaranteed: fused kernels or reductions that are
non-deterministic (``fused=True`` on an accelerator, ``foreach`` kernels
whose results depend on tensor grouping on some devices), replay on another
device type or another torch build than the one that trained, and
optimizers whose step reads anything not in the grads, the param groups or
the per-parameter state (closures). The digest check detects all of these:
the restore then falls back instead of returning diverged weights.
Garbage collection must keep each base step while its log steps are kept
(``Retention.keep_last > base_every``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import xxhash

from tierstore.errors import (
    CommitError,
    ConfigError,
    NoValidCopyError,
    RestoreMismatchError,
    TierStoreError,
)
from tierstore.keys import ShardKey, validate_name
from tierstore.train.checkpointer import SaveStats
from tierstore.train.hashing import tensor_digest
from tierstore.train.layers import StateMap

__all__ = [
    "LOG_LAYER",
    "SUPPORTED_OPTIMIZERS",
    "ReplayCheckpointer",
    "ReplayFallbackWarning",
    "ReplayReport",
    "params_digest",
]

log = logging.getLogger(__name__)

SUPPORTED_OPTIMIZERS: dict[str, type] = {"SGD": torch.optim.SGD, "Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}
LOG_LAYER = "grads"
GRAD = "grad/"


class ReplayFallbackWarning(UserWarning):
    """A restore stopped short of the newest committed step (a bad or missing log entry)."""


@dataclass
class ReplayReport:
    """What :meth:`ReplayCheckpointer.restore` did.

    Attributes:
        step: the step restored (``None``: nothing committed).
        base_step: the base it started from.
        replayed: the log steps replayed (and verified), in order.
        newest: the newest committed step of the model.
        fell_back: ``step`` is older than ``newest``.
        reason: why (the first bad entry, or an unloadable base).
        base_s, replay_s: seconds spent loading the base and replaying.
    """

    step: int | None = None
    base_step: int | None = None
    replayed: list[int] = field(default_factory=list)
    newest: int | None = None
    fell_back: bool = False
    reason: str | None = None
    base_s: float = 0.0
    replay_s: float = 0.0


def params_digest(params: list[torch.Tensor]) -> str:
    """xxh3-128 over the per-tensor digests of ``params`` (order matters)."""
    h = xxhash.xxh3_128()
    for p in params:
        h.update(tensor_digest(p).encode())
    return h.hexdigest()


def _scalar(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, tuple):
        return list(v)
    return v


def _group_scalars(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    out = []
    for g in opt.param_groups:
        d = {}
        for k, v in g.items():
            if k == "params":
                continue
            v = _scalar(v)
            try:
                json.dumps(v)
            except (TypeError, ValueError):
                continue
            d[k] = v
        out.append(d)
    return out


def _set_group_scalars(opt: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> None:
    if len(groups) != len(opt.param_groups):
        raise RestoreMismatchError(f"log has {len(groups)} param groups, optimizer {len(opt.param_groups)}",
                                   layer=LOG_LAYER, tensor=None)
    for g, sg in zip(opt.param_groups, groups):
        for k, v in sg.items():
            cur = g.get(k)
            if isinstance(cur, torch.Tensor):
                cur.fill_(v)
            elif isinstance(cur, tuple) and isinstance(v, list):
                g[k] = tuple(v)
            else:
                g[k] = v


class ReplayCheckpointer:
    """Bases every ``base_every`` steps, gradient logs between; see the module docstring.

    Args:
        store: an open :class:`~tierstore.store.TierStore`.
        model_name: the key namespace (use it for nothing else).
        module, optimizer: what is saved; ``optimizer`` must be SGD, Adam or AdamW.
        base_every: the most steps between bases.
        rank, world_size: default from ``torch.distributed``, else 0 and 1.
        layer_fn: ``param_name -> layer name`` for the bases.
        group: the gloo group for the restore's collectives (default: a new one).
        timeout: seconds :meth:`wait` waits for a commit decision.
        base_offset: a base falls on steps ``s`` with ``(s - base_offset) % base_every == 0``
            (see :mod:`tierstore.train.stagger`), besides whenever one is needed.

    Raises:
        ConfigError: an unsupported optimizer or a bad ``base_every``.
    """

    def __init__(self, store: Any, model_name: str, module: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 base_every: int = 20, rank: int | None = None, world_size: int | None = None,
                 layer_fn: Callable[[str], str] | None = None, group: Any = None, timeout: float = 120.0,
                 base_offset: int = 0) -> None:

        name = type(optimizer).__name__
        if SUPPORTED_OPTIMIZERS.get(name) is not type(optimizer):
            raise ConfigError(f"replay supports {sorted(SUPPORTED_OPTIMIZERS)} only, not {name}",
                              field="optimizer", optimizer=name)
        if isinstance(base_every, bool) or not isinstance(base_every, int) or base_every < 1:
            raise ConfigError(f"base_every must be an int >= 1, got {base_every!r}", field="base_every")
        self.store = store
        self.model = validate_name(model_name, "model")
        self.module, self.optimizer = module, optimizer
        self.map = StateMap(module, optimizer, layer_fn)
        self.base_every, self.base_offset = base_every, base_offset
        self.opt_name = name
        dist_on = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (dist.get_rank() if dist_on else 0)
        self.world_size = world_size if world_size is not None else (dist.get_world_size() if dist_on else 1)
        self.group = None
        if dist_on and dist.get_world_size() > 1:
            self.group = group if group is not None else dist.new_group(backend="gloo")
        self.timeout = timeout
        self.epoch: int | None = None
        self.stats = SaveStats()
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        self._names = [self.map._name_of[id(p)] for p in self._params]
        self._staging: dict[int, torch.Tensor] = {}
        self._captured: dict[int, torch.Tensor] | None = None
        self._scalars: list[dict[str, Any]] | None = None
        self._steps_since_save = 0
        self._replaying = False
        self._last_saved: int | None = None
        self._last_base: int | None = None
        self._params_free = threading.Event()
        self._params_free.set()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tierstore-replay-{self.rank}")
        self._future: Future | None = None
        self._last_step: int | None = None
        self._hook = optimizer.register_step_pre_hook(self._pre_step)

    # ---- capture ---------------------------------------------------------------

    def _pre_step(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if self._replaying:
            return
        self._params_free.wait()  # the previous save's digest reads the parameters
        captured = {}
        for i, p in enumerate(self._params):
            g = p.grad
            if g is None:
                continue
            if g.layout != torch.strided:
                raise ConfigError(f"replay cannot log the sparse gradient of {self._names[i]!r}", field="grad")
            buf = self._staging.get(i)
            if buf is None or buf.shape != g.shape or buf.dtype != g.dtype or buf.device != g.device:
                buf = self._staging[i] = torch.empty_like(g, memory_format=torch.contiguous_format)
            buf.copy_(g)
            captured[i] = buf
        self._captured = captured
        self._scalars = _group_scalars(opt)
        self._steps_since_save += 1

    # ---- saving ----------------------------------------------------------------

    def _due_base(self, step: int) -> bool:
        return (self._last_base is None or self._last_saved is None or self._last_saved != step - 1
                or self._steps_since_save != 1 or self._captured is None
                or step - self._last_base >= self.base_every
                or (step - self.base_offset) % self.base_every == 0)

    def save(self, step: int, extra: dict | None = None) -> None:
        """Snapshot after ``step`` (a base or a log entry) and return; the rest runs in the background.

        Raises:
            TierStoreError: the previous save failed in the background, or the snapshot failed.
        """
        self._drain()
        base = self._due_base(step)
        pendings = []
        try:
            if base:
                for ln in sorted(self.map.layers):
                    live = self.map.layer_tensors(ln)
                    key = ShardKey(self.model, ln, step, self.rank)
                    pendings.append(self.store.snapshot(key, live, self.map.layer_meta(ln), epoch=self.epoch))
                    self.stats.logical_bytes += sum(t.numel() * t.element_size() for t in live.values())
            else:
                captured = self._captured or {}  # _due_base() made a base when nothing was captured
                grads = {GRAD + self._names[i]: t for i, t in captured.items()}
                meta = {"scalars": self._scalars, "optimizer": self.opt_name}
                key = ShardKey(self.model, LOG_LAYER, step, self.rank)
                pendings.append(self.store.snapshot(key, grads, meta, epoch=self.epoch))
                self.stats.logical_bytes += sum(t.numel() * t.element_size() for t in grads.values())
        except BaseException:
            for p in pendings:
                p.abort()
            self._forget()
            raise
        rep = {"kind": "base" if base else "log", "optimizer": self.opt_name,
               "base": step if base else self._last_base, "prev": self._last_saved}
        vote_extra = {"user": extra, "optimizer": self.map.optimizer_meta(), "replay": rep}
        self._params_free.clear()
        self._last_step = step
        self._last_saved = step
        if base:
            self._last_base = step
        self._steps_since_save = 0
        self._captured = None
        self.stats.saves += 1
        self._future = self._pool.submit(self._finish, step, base, pendings, vote_extra)

    def _finish(self, step: int, base: bool, pendings: list, vote_extra: dict) -> str:
        infos = []
        try:
            try:
                vote_extra["replay"]["post"] = params_digest(self._params)
            finally:
                self._params_free.set()
            layers = sorted(self.map.layers)
            self.store.begin_step(self.model, step, self.world_size,
                                  layout={"layers": layers if base else [LOG_LAYER], "replay": vote_extra["replay"]["kind"]},
                                  epoch=self.epoch)
            while pendings:
                infos.append(pendings.pop(0).finish())
        except BaseException as e:
            for p in pendings:
                p.abort()
            try:
                self.store.vote(self.model, step, self.rank, infos, extra=vote_extra, ok=False, epoch=self.epoch)
            except TierStoreError as ve:
                log.warning("negative vote for step %d failed: %s", step, ve)
            if isinstance(e, TierStoreError):
                raise
            raise CommitError(f"replay save of step {step} failed on rank {self.rank}: {e!r}",
                              step=step, rank=self.rank) from e
        for info in infos:
            self.stats.bytes += info.size
            self.stats.objects[info.kind] = self.stats.objects.get(info.kind, 0) + 1
            self.stats.per_step[step] = self.stats.per_step.get(step, 0) + info.size
        return self.store.vote(self.model, step, self.rank, infos, extra=vote_extra, epoch=self.epoch)

    def _forget(self) -> None:
        self._last_base = None
        self._last_saved = None

    def _drain(self) -> str | None:
        fut, self._future = self._future, None
        if fut is None:
            return None
        try:
            return fut.result()
        except BaseException:
            self._forget()
            raise

    def wait(self, timeout: float | None = None) -> str | None:
        """Wait for the last save: ``"committed"`` or ``"aborted"`` (``None`` if none)."""
        step = self._last_step
        self._drain()
        if step is None:
            return None
        state = self.store.wait_step(self.model, step, timeout=self.timeout if timeout is None else timeout)
        if state == "aborted":
            self._forget()
        return "committed" if state in ("committed", "durable") else state

    # ---- restoring ---------------------------------------------------------------

    def _all_min(self, value: int) -> int:
        if self.group is None:
            return value

        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t[0])

    def _new_epoch(self) -> int | None:
        if self.group is None:
            return self.store.open_epoch(self.model) if self.world_size == 1 else None

        t = torch.zeros(1, dtype=torch.int64)
        if self.rank == 0:
            t[0] = self.store.open_epoch(self.model)
        dist.broadcast(t, src=dist.get_global_rank(self.group, 0), group=self.group)
        return int(t[0])

    def _plan(self) -> tuple[list[tuple[int, list[int]]], dict[int, dict], int | None]:
        """Bases newest first, each with its contiguous committed log steps; the manifests; the newest step."""
        steps = [s for s, st in self.store.steps.steps(self.model) if st in ("committed", "durable")]
        mans: dict[int, dict] = {}
        for s in steps:
            m = self.store.steps.manifest(self.model, s)
            if m is not None and (m.get("layout") or {}).get("replay") in ("base", "log"):
                mans[s] = m
        plans = []
        for b in sorted((s for s, m in mans.items() if m["layout"]["replay"] == "base"), reverse=True):
            chain, s = [], b + 1
            while s in mans and mans[s]["layout"]["replay"] == "log":
                rep = (mans[s]["ranks"].get("0", {}).get("extra") or {}).get("replay") or {}
                if rep.get("base") != b or rep.get("prev") != s - 1:
                    break
                chain.append(s)
                s += 1
            plans.append((b, chain))
        return plans, mans, (max(steps) if steps else None)

    def _src(self, m: dict) -> int:
        return self.rank if self.rank < m["world"] else self.rank % m["world"]

    def _load_base(self, m: dict) -> None:
        b, src = m["step"], self._src(m)
        tensors, metas = {}, {}
        for o in m["ranks"][str(src)]["objects"]:
            key = ShardKey.parse(o["key"])
            shard = self.store.get(key)
            if shard is None:
                raise NoValidCopyError(f"base object {key} is gone", key=str(key))
            tensors[key.layer], metas[key.layer] = dict(shard.tensors), dict(shard.metadata)
        opt_meta = (m["ranks"][str(src)].get("extra") or {}).get("optimizer") or {}
        if opt_meta.get("type") not in (None, self.opt_name):
            raise RestoreMismatchError(f"base of step {b} was written by {opt_meta.get('type')}, "
                                       f"the optimizer is {self.opt_name}", layer=None, tensor=None)
        self.map.load(tensors, metas, opt_meta or None)

    def _replay_one(self, m: dict) -> None:
        """Apply one log step; raise on a bad entry (before changing anything) or a digest mismatch."""
        s, src = m["step"], self._src(m)
        key = ShardKey(self.model, LOG_LAYER, s, src)
        shard = self.store.get(key)
        if shard is None:
            raise NoValidCopyError(f"log entry {key} is gone", key=str(key))
        want = (m["ranks"][str(src)].get("extra") or {}).get("replay", {}).get("post")
        by_name = dict(zip(self._names, self._params))
        for n, g in shard.tensors.items():
            p = by_name.get(n[len(GRAD):]) if n.startswith(GRAD) else None
            if p is None or g.shape != p.shape:
                raise RestoreMismatchError(f"log entry {key}: gradient {n!r} does not fit the model",
                                           layer=LOG_LAYER, tensor=n)
        if shard.metadata.get("optimizer") != self.opt_name:
            raise RestoreMismatchError(f"log entry {key} was written by {shard.metadata.get('optimizer')}",
                                       layer=LOG_LAYER, tensor=None)
        _set_group_scalars(self.optimizer, shard.metadata["scalars"])
        for n, p in by_name.items():
            g = shard.tensors.get(GRAD + n)
            p.grad = None if g is None else g.to(p.device)
        self._replaying = True
        try:
            self.optimizer.step()
        finally:
            self._replaying = False
            for p in self._params:
                p.grad = None
        got = params_digest(self._params)
        if got != want:
            raise _Mismatch(f"replay of step {s} gives parameters {got}, the run recorded {want}")

    def _replay(self, mans: dict[int, dict], base: int, chain: list[int]) -> tuple[int, bool, str | None]:
        """Replay ``chain``; (last good step, state is dirty, reason of the stop)."""
        reached = base
        for s in chain:
            try:
                self._replay_one(mans[s])
            except _Mismatch as e:
                return reached, True, str(e)
            except TierStoreError as e:
                return reached, False, f"log step {s}: {e}"
            reached = s
        return reached, False, None

    def restore(self) -> tuple[int | None, dict | None, ReplayReport]:
        """Load the newest verifiable state in place: ``(step, user extra, report)``.

        Collective over the group. Bumps the job's epoch first.

        Raises:
            NoValidCopyError: steps are committed but no base can be loaded.
            RestoreMismatchError: the stored state does not fit the module or optimizer.
        """
        self._drain()
        self.epoch = self._new_epoch()
        self._forget()
        plans, mans, newest = self._plan()
        report = ReplayReport(newest=newest)
        if not plans:
            if newest is not None:
                raise NoValidCopyError(f"model {self.model!r} has committed steps but no replay base",
                                       model=self.model)
            return None, None, report
        reasons: list[str] = []
        first_error: TierStoreError | None = None
        for b, chain in plans:
            t0 = time.perf_counter()
            ok, failed = 1, f"base {b}: unreadable on another rank"
            try:
                self._load_base(mans[b])
            except TierStoreError as e:
                ok, failed = 0, f"base {b}: {e}"
                first_error = first_error or e
            if self._all_min(ok) == 0:
                reasons.append(failed)
                continue
            report.base_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            reached, dirty, why = self._replay(mans, b, chain)
            agreed = self._all_min(reached)
            if why:
                reasons.append(why)
            elif agreed < reached:
                reasons.append(f"another rank stopped at step {agreed}")
            if dirty or agreed != reached:
                self._load_base(mans[b])
                got, _, again = self._replay(mans, b, [s for s in chain if s <= agreed])
                if got != agreed:
                    raise NoValidCopyError(f"replay to step {agreed} failed twice: {again}", model=self.model)
            report.replay_s = time.perf_counter() - t0
            report.step, report.base_step = agreed, b
            report.replayed = [s for s in chain if s <= agreed]
            break
        else:
            if isinstance(first_error, RestoreMismatchError):
                raise first_error
            raise NoValidCopyError(f"no replay base of {self.model!r} can be loaded: {reasons[0]}",
                                   model=self.model, reason=reasons[0])
        report.fell_back = report.step != newest
        report.reason = "; ".join(reasons) or None
        if report.fell_back:
            msg = f"{self.model}: restored step {report.step}, not the newest committed {newest}: {report.reason}"
            log.warning(msg)
            warnings.warn(msg, ReplayFallbackWarning, stacklevel=2)
            if self.rank == 0:
                _retire_after(self.store, self.model, report.step)
            self._all_min(0)  # every rank waits for the retirement
        # the next save may continue this chain: its state is verified and its steps stay committed
        self._last_saved, self._last_base, self._steps_since_save = report.step, report.base_step, 0
        extra = (mans[report.step]["ranks"][str(self._src(mans[report.step]))].get("extra") or {}).get("user")
        return report.step, extra, report

    def close(self) -> None:
        """Wait for background work, remove the hook, stop the thread (the store stays open)."""
        try:
            self._drain()
        finally:
            self._hook.remove()
            self._pool.shutdown(wait=True)


class _Mismatch(Exception):
    pass


def _retire_after(store: Any, model: str, step: int) -> None:
    """Delete every recorded step of ``model`` newer than ``step``: objects, durable manifests, records."""
    later = [s for s, _ in store.steps.steps(model) if s > step]
    store.steps.delete_durable_manifests(model, later)
    for key in store.list(model):
        if key.step > step:
            store.delete(key)
    store.steps.drop_steps(model, later, keep_aborted_state=False)
