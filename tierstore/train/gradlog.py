"""The ``replay`` policy's machinery: gradient logs between full bases, replayed on restore (AdaCheck).

With ``policy=replay(base_every)`` the Checkpointer writes, per save, either
a *base* (every layer, full objects, exactly as ``exact()``) or a *log
entry*: the gradients the optimizer consumed at that step, in their own
dtype, as one object per rank ``ShardKey(model, "grads", step, rank)``
(tensors ``grad/<name>``, metadata: the param groups' scalars), plus the
``_state`` layer (RNG, data position, ... exact at every step). Each save is
one two-phase-commit step; ``layout.replay`` says ``base`` or ``log``, and
the vote's ``replay`` entry carries the xxh3 digest of the parameters after
the step (``post``), the previous step and the base step.

Capture: ``optimizer.register_step_pre_hook`` copies every ``p.grad`` into
reused staging tensors just before ``optimizer.step()``: after the
data-parallel reduction and any gradient clipping. A save writes a log entry
only when exactly one optimizer step ran since the previous save, and that
save was made, and no parameter changed in place between that save and this
update outside the optimizer (a module changing its parameters in forward,
``nn.Embedding(max_norm=...)``, or a write the version counter does not see:
``p.data.clamp_()``, a numpy view; a log cannot replay that. The version
counters recorded at ``save()`` tell, and so does a fingerprint of the
parameters taken at ``save()``, the lazy snapshots' rule of
:mod:`tierstore.train.lazy`, ``StoreConfig.lazy_check``: sampled elements or
a full digest, compared again before the next update); otherwise a base. The
hook waits until the previous save's digest of the parameters is taken; that
digest is of the parameters at ``save()`` (those a forward pass changes are
digested at ``save()``, and a counter that moved, or a fingerprint that
differs, after the digest fails the step: it is never committed with a digest
its log cannot reach).

Restore: the newest committed base, then the committed log steps that follow
it contiguously, replayed through the same code path (set ``p.grad``, set
the group scalars, ``optimizer.step()``) and each verified against its
recorded digest. A missing, unreadable or diverging entry stops the replay:
all ranks agree on the newest step every rank verified (``all_reduce(MIN)``),
reload the base and replay up to it; ``ckpt.report`` and a
:class:`ReplayFallbackWarning` say so. Wrong weights are never returned. The
committed steps newer than the one restored are not deleted: those the replay
proved unrestorable (a digest that differs, an entry gone from every tier) are
in :attr:`ReplayLog.proven`, and the Checkpointer supersedes them (keeping
their copies) when the resumed run saves their numbers again; the others are
judged again then. The other entries of the state
(scheduler, data, RNG) and the param groups' hyper-parameters come from the
restored step itself.

Supported optimizers: ``SGD``, ``Adam``, ``AdamW`` (exact classes). Bitwise
replay needs deterministic kernels on the same device type and torch build;
the digest check detects everything else and falls back instead.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import warnings
from collections.abc import Iterable
from typing import Any

import torch
import xxhash

from tierstore.errors import ConfigError, NoValidCopyError, RestoreMismatchError, TierStoreError
from tierstore.keys import ShardKey
from tierstore.train.hashing import tensor_digest
from tierstore.train.layers import PARAM
from tierstore.train.lazy import Fingerprint, changed_error
from tierstore.train.view import STATE_LAYER, Collected
from tierstore.train.writing import Snapshot, nbytes

__all__ = ["GRAD", "LOG_LAYER", "SUPPORTED_OPTIMIZERS", "ReplayFallbackWarning", "ReplayLog", "params_digest"]

log = logging.getLogger(__name__)

SUPPORTED_OPTIMIZERS: dict[str, type] = {"SGD": torch.optim.SGD, "Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}
LOG_LAYER = "grads"
GRAD = "grad/"


class ReplayFallbackWarning(UserWarning):
    """A restore stopped short of the newest committed step (a bad or missing log entry)."""


class _Mismatch(Exception):
    pass


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


class ReplayLog:
    """The replay policy of one Checkpointer (made by it; see the module docstring).

    Raises:
        ConfigError: the state holds no optimizer, several, or an unsupported one.
    """

    def __init__(self, ckpt: Any, base_every: int, base_offset: int = 0) -> None:
        opts = [(k, v) for k, v in ckpt.state.items() if isinstance(v, torch.optim.Optimizer)]
        if len(opts) != 1:
            raise ConfigError(f"replay needs exactly one optimizer in the state, found {len(opts)}", field="optimizer")
        self.opt_key, self.optimizer = opts[0]
        name = type(self.optimizer).__name__
        if SUPPORTED_OPTIMIZERS.get(name) is not type(self.optimizer):
            raise ConfigError(f"replay supports {sorted(SUPPORTED_OPTIMIZERS)} only, not {name}",
                              field="optimizer", optimizer=name)
        self.ckpt = ckpt
        self.opt_name = name
        self.base_every, self.base_offset = base_every, base_offset
        self._staging: dict[int, torch.Tensor] = {}
        self._captured: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._scalars: list[dict[str, Any]] | None = None
        self._steps_since_save = 0
        self._replaying = False
        self.proven: dict[int, str] = {}  # steps the last restore proved unrestorable, and why
        self._last_saved: int | None = None
        self._last_base: int | None = None
        self._bases: list[int] = []  # base steps of this run, oldest first (retention keeps a chain's base)
        self._params_free = threading.Event()
        self._params_free.set()
        self._at_save: list[tuple[torch.Tensor, int, str | None]] = []
        self._fp: Fingerprint | None = None  # of the parameters at save() (writes the counter does not see)
        self._fp_at_save: Any = None
        self._moved_in_forward = False  # since the last save, a parameter changed outside the optimizer's update
        self._warned = False
        self._hook = self.optimizer.register_step_pre_hook(self._pre_step)

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _pre_step(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if self._replaying:
            return
        self._params_free.wait()  # the previous save's digest reads the parameters
        if not self._moved_in_forward and (any(p._version != v for p, v, _d in self._at_save) or self._fp_moved()):
            self._moved_in_forward = True  # a parameter changed since save() and before this update: not a log
        captured = []
        for p in self._params():
            g = p.grad
            if g is None:
                continue
            if g.layout != torch.strided:
                raise ConfigError("replay cannot log a sparse gradient", field="grad")
            buf = self._staging.get(id(p))
            if buf is None or buf.shape != g.shape or buf.dtype != g.dtype or buf.device != g.device:
                buf = self._staging[id(p)] = torch.empty_like(g, memory_format=torch.contiguous_format)
            buf.copy_(g)
            captured.append((p, buf))
        self._captured = captured
        self._scalars = _group_scalars(opt)
        self._steps_since_save += 1

    # ---- saving ----------------------------------------------------------------------------

    def due_base(self, step: int) -> bool:
        if self._moved_in_forward:
            self._moved_in_forward = False
            if not self._warned:
                self._warned = True
                log.warning("%s: parameters changed in place between save() and the next update (in forward?): "
                            "a gradient log cannot replay that, so such steps are saved as bases", self.ckpt.model)
            return True
        return (self._last_base is None or self._last_saved is None or self._last_saved != step - 1
                or self._steps_since_save != 1 or self._captured is None
                or step - self._last_base >= self.base_every
                or (step - self.base_offset) % self.base_every == 0)

    def layout(self, col: Collected, base: bool) -> dict[str, Any]:
        if base:
            return {"layers": sorted(col.layers), "replay": "base"}
        return {"layers": sorted([LOG_LAYER, *col.always]), "replay": "log"}

    def _mark(self, step: int, base: bool, snap: Snapshot) -> None:
        snap.vote_extra["replay"] = {"kind": "base" if base else "log", "optimizer": self.opt_name,
                                     "base": step if base else self._last_base, "prev": self._last_saved}
        snap.before_vote = self._digest
        self._params_free.clear()
        self._last_saved = step
        if base:
            self._last_base = step
            self._bases.append(step)
        self._steps_since_save = 0
        self._captured = None

    def base_of(self, step: int) -> int:
        """The base a restore of ``step`` starts from (retention keeps it); ``0`` if unknown: keep all."""
        older = [b for b in self._bases if b <= step]
        return older[-1] if older else 0

    def saved_base(self, step: int, snap: Snapshot) -> None:
        """The Checkpointer snapshotted a base of ``step``."""
        self._mark(step, True, snap)

    def snapshot(self, step: int, col: Collected) -> Snapshot:
        """Copy a log entry of ``step`` (the gradients captured) and the layers saved at every step."""
        ck = self.ckpt
        names: dict[int, str] = {}
        for m in col.maps.values():
            for p in self._params():
                n = m.name_of(p)
                if n is not None:
                    names[id(p)] = n
        grads = {GRAD + names[id(p)]: buf for p, buf in (self._captured or []) if id(p) in names}
        snap = Snapshot(step, sorted([LOG_LAYER, *col.always]))
        try:
            key = ShardKey(ck.model, LOG_LAYER, step, ck.rank)
            meta = {"scalars": self._scalars, "optimizer": self.opt_name}
            snap.pendings.append((LOG_LAYER, ck.store.snapshot(key, grads, meta, epoch=ck.epoch)))
            for ln in sorted(col.always):
                key = ShardKey(ck.model, ln, step, ck.rank)
                snap.pendings.append((ln, ck.store.snapshot(key, col.layers[ln], col.metas[ln], epoch=ck.epoch)))
                ck.stats.logical_bytes += nbytes(col.layers[ln])
        except BaseException:
            snap.abort()
            raise
        ck.stats.logical_bytes += nbytes(grads)
        self._mark(step, False, snap)
        return snap

    def at_save(self, in_forward: set[int]) -> None:
        """On the trainer's thread, in ``save()``: what the step's digest must be of (the parameters now).

        Records each parameter's version counter, and digests now those a forward pass changes in place
        (data pointers in ``in_forward``): the digest of the others runs on the background thread, and a
        parameter whose counter moved by then fails the step (:class:`~tierstore.errors.SnapshotChangedError`),
        never a log whose digest is of values the model did not have at ``save()``.
        """
        self._at_save = [(p, p._version, tensor_digest(p) if p.numel() and p.data_ptr() in in_forward else None)
                         for p in self._params()]
        kind = getattr(getattr(self.ckpt.store, "config", None), "lazy_check", "sample")
        self._fp = Fingerprint([("", str(i), p, v) for i, (p, v, _d) in enumerate(self._at_save)], kind) \
            if kind != "off" and self._at_save else None
        self._fp_at_save = self._fp.take() if self._fp is not None else None

    def _fp_moved(self) -> list[torch.Tensor]:
        """The parameters whose fingerprint differs from the one taken at ``save()`` (a write through
        ``.data``, a numpy view, ``untyped_storage()``: the version counter did not move)."""
        fp, before = self._fp, self._fp_at_save
        if fp is None or before is None:
            return []
        return [fp.tensors[int(i)] for _ln, i in fp.differ(before, fp.take())]

    def _digest(self, vote_extra: dict) -> None:
        try:
            at = self._at_save or [(p, p._version, None) for p in self._params()]
            h = xxhash.xxh3_128()  # params_digest's, with the digests taken at save() where there are some
            for p, _v, d in at:
                h.update((d if d is not None else tensor_digest(p)).encode())
            moved = [p for p, v, d in at if d is None and p._version != v]
            if not moved:  # after the digest: a write the counter does not see, before or during it
                moved = [p for p in self._fp_moved() if not any(p is q and d is not None for q, _v, d in at)]
            if moved:  # checked before the update may run (it waits for _params_free)
                self._changed(moved)
            vote_extra["replay"]["post"] = h.hexdigest()
        finally:
            self._params_free.set()

    def _changed(self, moved: list[torch.Tensor]) -> None:
        ck = self.ckpt
        names: list[tuple[str, str]] = []
        for m in ck.view.maps([k for k, v in ck.state.items() if isinstance(v, torch.nn.Module)]).values():
            for p in moved:
                n = m.name_of(p)
                if n is not None and n in m.layer_of:
                    names.append((m.layer_of[n], PARAM + n))
        ck.stats.changed_in_forward += 1
        ck.in_forward.learn(names)
        raise changed_error(self._last_saved if self._last_saved is not None else -1, sorted(names), ck.rank)

    def forget(self) -> None:
        """The next save writes a base (after a failed save or a restore)."""
        self._last_base = None
        self._last_saved = None
        self._params_free.set()

    def continue_from(self, step: int, base: int | None) -> None:
        """After a writer's restore of ``step`` (verified, committed): the next save may continue its chain."""
        self._last_saved, self._last_base, self._steps_since_save = step, base, 0
        self._at_save = [(p, p._version, None) for p in self._params()]
        self._fp = self._fp_at_save = None
        self._moved_in_forward = False
        if base is not None and base not in self._bases:
            self._bases.append(base)

    def close(self) -> None:
        self._hook.remove()
        self._params_free.set()

    # ---- restoring ---------------------------------------------------------------------------

    def _plan(self, upto: int | None) -> tuple[list[tuple[int, list[int]]], dict[int, dict]]:
        """Bases newest first, each with its contiguous committed log steps; the manifests."""
        st = self.ckpt.store.steps
        steps = [s for s, state in st.steps(self.ckpt.model) if state in ("committed", "durable")
                 and (upto is None or s <= upto)]
        mans: dict[int, dict] = {}
        for s in steps:
            m = st.manifest(self.ckpt.model, s)
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
        return plans, mans

    def _src(self, m: dict) -> int:
        return self.ckpt.rank if self.ckpt.rank < m["world"] else self.ckpt.rank % m["world"]

    def _load_base(self, b: int, keys: list[str]) -> None:
        ck = self.ckpt
        res = ck.store.resolve(ck.model, 0, step=b)
        doc = ck.doc(res)
        meta = ((doc.get("entries") or {}).get(self.opt_key) or {}).get("meta") or {}
        if meta.get("type") not in (None, self.opt_name):
            raise RestoreMismatchError(f"base of step {b} was written by {meta.get('type')}, "
                                       f"the optimizer is {self.opt_name}", layer=None, tensor=None)
        plan = ck.view.prepare(ck.read(res), doc, keys, rest=False)
        ck.view.apply(plan)

    def _replay_one(self, m: dict) -> None:
        """Apply one log step; raise on a bad entry (before changing anything) or a digest mismatch."""
        ck = self.ckpt
        s, src = m["step"], self._src(m)
        key = ShardKey(ck.model, LOG_LAYER, s, src)
        shard = ck.store.get(key)
        if shard is None:
            raise NoValidCopyError(f"log entry {key} is gone", key=str(key), evidence="lost")
        want = (m["ranks"][str(src)].get("extra") or {}).get("replay", {}).get("post")
        params = self._params()
        smap = next(iter(ck.view.maps([k for k, v in ck.state.items() if isinstance(v, torch.nn.Module)]).values()))
        by_name = {smap.name_of(p): p for p in params}
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
            g = shard.tensors.get(GRAD + n) if n is not None else None
            p.grad = None if g is None else g.to(p.device, copy=True)
        self._replaying = True
        try:
            self.optimizer.step()
        finally:
            self._replaying = False
            for p in params:
                p.grad = None
        got = params_digest(params)
        if got != want:
            raise _Mismatch(f"replay of step {s} gives parameters {got}, the run recorded {want}")

    def _replay(self, mans: dict[int, dict], chain: list[int]) -> tuple[int | None, bool, str | None]:
        """Replay ``chain``; (last good step or None, state is dirty, reason of the stop).

        A stop on positive evidence (a digest that differs, an entry gone from every tier or that does not
        fit) proves the steps from there on unrestorable: they go to :attr:`proven`."""
        reached = None
        for s in chain:
            try:
                self._replay_one(mans[s])
            except _Mismatch as e:
                self._prove([c for c in chain if c >= s], str(e))
                return reached, True, str(e)
            except TierStoreError as e:
                if _definitive(e):
                    self._prove([c for c in chain if c >= s], f"log step {s}: {e}")
                return reached, False, f"log step {s}: {e}"
            reached = s
        return reached, False, None

    def _prove(self, steps: list[int], why: str) -> None:
        for s in steps:
            self.proven.setdefault(s, why[:500])

    def restore(self, step: int | None, *, read_only: bool, only: Iterable[str] | None) -> tuple[int | None, Any]:
        """Load the newest verifiable state (or ``step``) in place; ``(step, user extra)``. Collective."""
        ck = self.ckpt
        keys = list(ck.state) if only is None else list(only)
        if self.opt_key not in keys:
            raise ConfigError(f"a replay restore replays the optimizer: include {self.opt_key!r} in only=",
                              field="only")
        self.forget()
        self.proven = {}
        plans, mans = self._plan(step)
        rep = ck.report
        if step is not None and step not in mans:
            raise NoValidCopyError(f"step {step} of {ck.model!r} is not a committed replay step", model=ck.model,
                                   step=step, reason="not committed")
        if not plans:
            if rep.newest is not None:
                raise NoValidCopyError(f"model {ck.model!r} has committed steps but no replay base",
                                       model=ck.model)
            return None, None
        reasons: list[str] = []
        first_error: TierStoreError | None = None
        agreed = None
        for b, chain in plans:
            t0 = time.perf_counter()
            ok, failed = 1, f"base {b}: unreadable on another rank"
            try:
                self._load_base(b, keys)
            except TierStoreError as e:
                ok, failed = 0, f"base {b}: {e}"
                first_error = first_error or e
                if _definitive(e):
                    self._prove([b, *chain], failed)
            if ck.ranks.all_min(ok) == 0:
                reasons.append(failed)
                continue
            rep.base_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            reached, dirty, why = self._replay(mans, chain)
            agreed = ck.ranks.all_min(b if reached is None else reached)
            if why:
                reasons.append(why)
            elif agreed < (reached if reached is not None else b):
                reasons.append(f"another rank stopped at step {agreed}")
            if dirty or agreed != (b if reached is None else reached):
                self._load_base(b, keys)
                got, _, again = self._replay(mans, [s for s in chain if s <= agreed])
                if (b if got is None else got) != agreed:
                    raise NoValidCopyError(f"replay to step {agreed} failed twice: {again}", model=ck.model)
            rep.replay_s = time.perf_counter() - t0
            rep.base_step, rep.replayed = b, [s for s in chain if s <= agreed]
            break
        if agreed is None:
            if isinstance(first_error, RestoreMismatchError):
                raise first_error
            evidence = "lost" if all(b in self.proven for b, _ in plans) else "unknown"
            raise NoValidCopyError(f"no replay base of {ck.model!r} can be loaded: {reasons[0]}",
                                   model=ck.model, reason=reasons[0], evidence=evidence)
        newest = step if step is not None else rep.newest
        rep.reason = "; ".join(reasons) or None
        if agreed != newest:
            if step is not None:
                raise NoValidCopyError(f"step {step} of {ck.model!r} cannot be replayed: {rep.reason}",
                                       model=ck.model, step=step, reason=rep.reason)
            msg = f"{ck.model}: restored step {agreed}, not the newest committed {newest}: {rep.reason}"
            log.warning(msg)
            warnings.warn(msg, ReplayFallbackWarning, stacklevel=3)
        res = ck.store.resolve(ck.model, 0, step=agreed)
        doc = ck.doc(res)
        plan = ck.view.prepare(ck.read(res, [ln for ln in res.layers if ln == STATE_LAYER]), doc, keys,
                               modules=False)
        ck.view.apply(plan)
        return agreed, plan.get("user")


def _definitive(e: TierStoreError) -> bool:
    """Whether a read's failure is positive evidence (a copy gone or bad in every tier, a misfit), not a tier
    that did not answer."""
    if isinstance(e, RestoreMismatchError):
        return True
    return isinstance(e, NoValidCopyError) and e.evidence == "lost"
