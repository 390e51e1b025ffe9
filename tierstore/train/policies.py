"""Checkpoint policies: what each save writes, as composable, pure decisions.

A :class:`Policy` is a frozen dataclass; the constructors below make one each
and :func:`compose` merges them (later arguments win on a field they set)::

    policy = compose(layerwise(tau=0.01, max_staleness=10), differential(base_every=20), dedup())

* :func:`exact`: every layer at every save, full objects.
* :func:`layerwise` (LayerCheck): a layer is saved when its relative change
  ``||W - W_saved|| / ||W_saved||`` since its last saved version exceeds
  ``tau``, and in any case once ``max_staleness`` steps have passed; its
  optimizer state always goes with it. Restore composes each layer's newest
  version within the bound (``store.resolve(max_staleness=S)``).
* :func:`differential` (TierCheck): a full base every ``base_every`` steps of
  a layer; in between, lossless XOR deltas against the layer's previous saved
  version, at most ``max_chain`` in a row, and only where they pay: per layer,
  the measured compression and encode CPU decide delta or full object, and
  the decision is revisited (:mod:`tierstore.train.payoff`).
* :func:`dedup` (AdaCheck): shards bitwise identical across the ranks of the
  data-parallel group are written once (see :mod:`tierstore.train.dedup`).
* :func:`replay` (AdaCheck's online checkpoints): a full base every
  ``base_every`` steps and, in between, only the gradients the optimizer
  consumed; restore replays them (see :mod:`tierstore.train.replay`). It
  stands alone: it does not compose with the others.

The trackers here hold the per-layer state these decisions need; the
:class:`~tierstore.train.checkpointer.Checkpointer` drives them. They are pure
logic (no store, no collectives) and unit-tested as such.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from tierstore.errors import ConfigError
from tierstore.train.payoff import Payoff, PayoffRule
from tierstore.train.stagger import forced_save, is_base_step

__all__ = [
    "DiffTracker",
    "LayerwiseTracker",
    "PayoffRule",
    "Policy",
    "compose",
    "dedup",
    "differential",
    "exact",
    "layerwise",
    "relative_change",
    "replay",
]


@dataclass(frozen=True)
class Policy:
    """What a save writes.

    Attributes:
        tau: LayerCheck threshold on the relative change of a layer's
            parameters; ``None`` saves every layer at every save.
        max_staleness: the most steps a layer's saved version may lag the
            resume step (0 = exact).
        base_every: TierCheck: steps between full bases of a layer; ``None``
            writes full objects only.
        max_chain: the most deltas in a row (default ``base_every - 1``).
        payoff: differential: when a layer's deltas pay (``None``: a delta
            whenever the chain allows one, paying or not).
        dedup: write shards identical across the group once (AdaCheck).
        dedup_algo: digest algorithm for dedup (``xxh3`` or ``blake2s``).
        dedup_group: the data-parallel process group (``None``: the whole world).
        replay_every: gradient-log replay: the most steps between full bases
            (``None``: no replay).
        replay_offset: bases fall on steps ``s`` with ``(s - replay_offset) % replay_every == 0``.
        names: the parts composed, for reports.
    """

    tau: float | None = None
    max_staleness: int = 0
    base_every: int | None = None
    max_chain: int | None = None
    payoff: PayoffRule | None = None
    dedup: bool = False
    dedup_algo: str = "xxh3"
    dedup_group: Any = field(default=None, compare=False, repr=False)
    replay_every: int | None = None
    replay_offset: int = 0
    names: tuple[str, ...] = ("exact",)

    def __post_init__(self) -> None:
        if self.tau is not None and self.tau < 0:
            raise ConfigError(f"tau must be >= 0, got {self.tau}", field="tau")
        if self.max_staleness < 0:
            raise ConfigError(f"max_staleness must be >= 0, got {self.max_staleness}", field="max_staleness")
        if self.tau is not None and self.max_staleness < 1:
            raise ConfigError("layerwise needs max_staleness >= 1", field="max_staleness")
        if self.base_every is not None and self.base_every < 1:
            raise ConfigError(f"base_every must be >= 1, got {self.base_every}", field="base_every")
        if self.max_chain is not None and self.max_chain < 0:
            raise ConfigError(f"max_chain must be >= 0, got {self.max_chain}", field="max_chain")
        if self.dedup_algo not in ("xxh3", "blake2s"):
            raise ConfigError(f"unknown digest {self.dedup_algo!r}", field="dedup_algo")
        if self.replay_every is not None:
            if isinstance(self.replay_every, bool) or not isinstance(self.replay_every, int) or self.replay_every < 1:
                raise ConfigError(f"base_every must be an int >= 1, got {self.replay_every!r}", field="base_every")
            if self.tau is not None or self.base_every is not None or self.dedup:
                raise ConfigError("replay does not compose with layerwise, differential or dedup", field="replay")

    @property
    def name(self) -> str:
        return "+".join(self.names)

    @property
    def chain_limit(self) -> int:
        """The most deltas in a row (0 when not differential)."""
        if self.base_every is None:
            return 0
        return self.base_every - 1 if self.max_chain is None else self.max_chain


def exact() -> Policy:
    """Every layer at every save, full objects."""
    return Policy()


def layerwise(tau: float = 0.01, max_staleness: int = 10) -> Policy:
    """LayerCheck: save layers whose relative change exceeds ``tau``; force after ``max_staleness``."""
    return Policy(tau=tau, max_staleness=max_staleness, names=("layerwise",))


def differential(base_every: int = 10, max_chain: int | None = None,
                 payoff: PayoffRule | None = PayoffRule()) -> Policy:
    """TierCheck: a full base every ``base_every`` steps of a layer, XOR deltas between where they pay.

    ``payoff`` decides per layer from measured compression and CPU whether
    its deltas are worth writing (:mod:`tierstore.train.payoff`); ``None``
    writes a delta whenever the chain allows one.
    """
    return Policy(base_every=base_every, max_chain=max_chain, payoff=payoff, names=("differential",))


def dedup(group: Any = None, algo: str = "xxh3") -> Policy:
    """AdaCheck: shards identical across ``group`` (default: the world) are written once."""
    return Policy(dedup=True, dedup_algo=algo, dedup_group=group, names=("dedup",))


def replay(base_every: int = 20, base_offset: int = 0) -> Policy:
    """AdaCheck: a full base every ``base_every`` steps, the optimizer's gradients between; restore replays."""
    return Policy(replay_every=base_every, replay_offset=base_offset, names=("replay",))


_DEFAULTS = Policy()


def compose(*policies: Policy) -> Policy:
    """Merge policies: each field takes the value of the last policy that set it."""
    if not policies:
        return exact()
    values: dict[str, Any] = {}
    names: list[str] = []
    for p in policies:
        for f in dataclasses.fields(Policy):
            if f.name == "names":
                continue
            v = getattr(p, f.name)
            if v != getattr(_DEFAULTS, f.name) or (f.name == "dedup_group" and v is not None):
                values[f.name] = v
        names.extend(n for n in p.names if n != "exact" and n not in names)
    return Policy(**values, names=tuple(names) or ("exact",))


def _sum_squares(norms: list[torch.Tensor]) -> float:
    """Sum of the squares of 0-d float64 norms, with one device-to-host read where they share a device."""
    if not norms:
        return 0.0
    if len({t.device for t in norms}) == 1:
        return float(torch.stack(norms).square().sum())
    return sum(float(t) ** 2 for t in norms)


def saved_norm2(saved: Mapping[str, torch.Tensor]) -> float:
    """``||W_saved||**2`` over the floating-point tensors of a layer (float64 sums): the denominator of
    :func:`relative_change`, computed once per saved version."""
    return _sum_squares([torch.linalg.vector_norm(t, dtype=torch.float64)
                         for t in saved.values() if t.is_floating_point()])


def relative_change(live: Mapping[str, torch.Tensor], saved: Mapping[str, torch.Tensor], *,
                    den: float | None = None) -> float:
    """``||W - W_saved|| / ||W_saved||`` over all tensors of a layer (float64 sums; ``den``: the saved
    version's :func:`saved_norm2`, if known). A non-floating tensor that differs is an infinite change.

    One float32 temporary per tensor (the difference), float64 only inside the reductions, and one read of
    the result per layer (no synchronisation per tensor on a GPU)."""
    nums: list[torch.Tensor] = []
    for n, s in saved.items():
        w = live[n]
        if not (w.is_floating_point() and s.is_floating_point()):
            if not torch.equal(w, s):
                return float("inf")
            continue
        nums.append(torch.linalg.vector_norm(w - s, dtype=torch.float64))
    num = _sum_squares(nums)
    if den is None:
        den = saved_norm2(saved)
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return (num / den) ** 0.5


class LayerwiseTracker:
    """Per layer: the parameters as last saved, and the step they were saved at.

    Protocol: ``want(step, layer, live)`` says whether the layer is due;
    after the step's objects are written, ``saved(layer, step, params)``
    records the copy (owned by the tracker). ``reset()`` forgets everything
    (after a restore or a failed save), so every layer is due at the next save.
    """

    def __init__(self, tau: float, max_staleness: int) -> None:
        self.tau = tau
        self.max_staleness = max_staleness
        self._saved: dict[str, dict[str, torch.Tensor]] = {}
        self._den: dict[str, float] = {}  # saved_norm2 of each saved version
        self._step: dict[str, int] = {}
        self.slots: dict[str, int] = {}

    def want(self, step: int, layer: str, live: Mapping[str, torch.Tensor]) -> bool:
        if layer not in self._saved or set(live) != set(self._saved[layer]):
            return True
        if step - self._step[layer] >= self.max_staleness:
            return True
        if (layer in self.slots and step - self._step[layer] >= max(1, self.max_staleness // 2)
                and forced_save(step, self._step[layer], self.slots[layer], self.max_staleness)):
            return True  # smoothed I/O: past half the bound, a layer's forced save falls on its own slot
        return relative_change(live, self._saved[layer], den=self._den[layer]) > self.tau

    def saved(self, layer: str, step: int, params: Mapping[str, torch.Tensor]) -> None:
        self._saved[layer] = {n: t.detach().clone() for n, t in params.items()}
        self._den[layer] = saved_norm2(self._saved[layer])
        self._step[layer] = step

    def last_step(self, layer: str) -> int | None:
        return self._step.get(layer)

    def reset(self) -> None:
        self._saved.clear()
        self._den.clear()
        self._step.clear()


@dataclass
class _DiffState:
    step: int
    chain: int
    tensors: dict[str, torch.Tensor]


class DiffTracker:
    """Per layer: the full tensors of the last saved version (the next delta's base).

    Protocol: at the snapshot, ``direct(layer)`` says whether this save of
    the layer is a full object written straight into the host tier (its
    deltas do not pay: no staging copy, no base kept); otherwise the layer is
    staged and, on the writer's thread, ``kind(layer, tensors)`` ->
    ``("full", None)`` or ``("delta", base_step)``; after the object is
    written, ``saved(layer, step, tensors, kind)`` keeps ``tensors`` (the
    tracker then owns them: pass a copy) and ``record(layer, kind, raw,
    stored, cpu_s)`` feeds the payoff measurements. ``forget(layer)`` forces
    the next one full.
    """

    def __init__(self, base_every: int, max_chain: int, payoff: PayoffRule | None = None) -> None:
        self.base_every = base_every
        self.max_chain = max_chain
        self.payoff = Payoff(payoff) if payoff is not None else None
        self._state: dict[str, _DiffState] = {}
        self._base_step: dict[str, int] = {}
        self.slots: dict[str, int] = {}

    def kind(self, layer: str, step: int, tensors: Mapping[str, torch.Tensor]) -> tuple[str, int | None]:
        if self.payoff is not None and self.payoff.mode(layer) == "full":
            self.payoff.direct(layer)  # staged anyway (dedup plans it): counts as one of the full saves
            return "full", None
        st = self._state.get(layer)
        if st is None or self.max_chain == 0:
            return "full", None
        if st.chain >= self.max_chain or step - self._base_step[layer] >= self.base_every:
            return "full", None
        if layer in self.slots and is_base_step(step, self.slots[layer], self.base_every):
            return "full", None  # smoothed I/O: bases fall on the layer's own slot
        if set(tensors) != set(st.tensors) or any(
            tensors[n].shape != st.tensors[n].shape or tensors[n].dtype != st.tensors[n].dtype for n in tensors
        ):
            return "full", None
        return "delta", st.step

    def direct(self, layer: str) -> bool:
        """At the snapshot: True when this save of ``layer`` is a full object that needs no base kept."""
        if self.payoff is None or not self.payoff.direct(layer):
            return False
        self.forget(layer)
        return True

    def record(self, layer: str, kind: str, raw_bytes: int, stored_bytes: int, cpu_s: float) -> None:
        """What a staged write of ``layer`` stored and cost (see :meth:`Payoff.record`)."""
        if self.payoff is not None:
            self.payoff.record(layer, kind, raw_bytes, stored_bytes, cpu_s)

    def base_tensors(self, layer: str) -> dict[str, torch.Tensor]:
        return self._state[layer].tensors

    def saved(self, layer: str, step: int, tensors: dict[str, torch.Tensor], kind: str) -> None:
        prev = self._state.get(layer)
        chain = prev.chain + 1 if (kind == "delta" and prev is not None) else 0
        if kind != "delta":
            self._base_step[layer] = step
        self._state[layer] = _DiffState(step, chain, tensors)

    def forget(self, layer: str | None = None) -> None:
        if layer is None:
            self._state.clear()
            self._base_step.clear()
        else:
            self._state.pop(layer, None)
            self._base_step.pop(layer, None)
