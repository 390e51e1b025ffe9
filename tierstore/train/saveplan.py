"""The save policies as objects: what the Checkpointer asks of a policy, in one small interface.

The :class:`~tierstore.train.checkpointer.Checkpointer` names no policy. It
builds one :class:`SavePlan` from its :class:`~tierstore.train.policies.Policy`
and calls it at fixed points of a save and a restore; the plan holds the
policy's parts (:class:`Part`: layer-wise, differential, dedup, replay), each
with its own tracker, and asks each in turn. A part answers three questions
and keeps what it needs for the next save:

* **what this step writes**: :meth:`SavePlan.layout` (a replay log or a
  base), :meth:`SavePlan.select` (the layers due: layer-wise), and per layer
  :meth:`SavePlan.direct` (a full object copied straight into the host tier)
  or staged and written by :meth:`SavePlan.write` (a delta, a ref to another
  rank's identical shard, or a full object);
* **what it reads from earlier steps**: :meth:`SavePlan.floor`, the step a
  restore of a step starts from, so retention keeps it (the closure itself is
  computed from the manifests by :mod:`consistency.closure`, and the vote
  refuses a step whose closure the index does not hold);
* **what to remember for the next**: :meth:`SavePlan.remember` after a
  positive vote, :meth:`SavePlan.forget` after a failed or aborted save or a
  restore (every layer full and due again), :meth:`SavePlan.seed` from an
  imported base.

Order of the calls in one save (see :mod:`tierstore.train.checkpointer`):
``layout`` -> (begin) -> ``at_save`` -> ``select`` -> ``direct``/``keep`` per
layer, ``snapshotted`` (or ``snapshot_log``) -> ``floor`` (retention) ->
``write`` -> (vote) -> ``remember``. The parts are pure logic over their
trackers, except the two that need the job: dedup's collective
(:mod:`tierstore.train.dedup`) and replay's optimizer hook
(:mod:`tierstore.train.gradlog`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from tierstore.train.dedup import DedupPlanner
from tierstore.train.gradlog import ReplayLog
from tierstore.train.layers import PARAM
from tierstore.train.policies import DiffTracker, LayerwiseTracker, Policy
from tierstore.train.stagger import balanced_slots, shifted
from tierstore.train.writing import Snapshot, nbytes, write_layer

__all__ = ["Part", "SavePlan"]


class Part:
    """One policy's part of a save; every hook defaults to "no opinion"."""

    #: the layers it writes are staged (copied aside) for :meth:`SavePlan.write`, not copied into the host tier
    stages_all = False
    #: :meth:`SavePlan.write` runs a collective (every rank must have begun the step)
    collective = False
    #: :meth:`SavePlan.select` runs a collective (every rank must have begun the step first)
    selects_together = False

    def arrange(self, layers: list[str], sizes: list[int], rank: int, world: int) -> None:
        """The layers and their sizes are known: spread forced saves and bases over steps."""

    def due(self, step: int, ln: str, col: Any) -> bool | None:
        """Whether ``ln`` is due at ``step`` (``None``: this part does not select)."""
        return None

    def stages(self, ln: str) -> bool:
        """Whether this save of ``ln`` is staged (for a delta or a ref) rather than copied directly."""
        return self.stages_all

    def keep(self, snap: Snapshot, ln: str, live: Mapping[str, torch.Tensor]) -> None:
        """At the snapshot: copy what :meth:`remember` needs of ``ln``."""

    def remember(self, snap: Snapshot) -> None:
        """The step's vote was positive: remember what the next save compares against."""

    def forget(self) -> None:
        """The next save starts from nothing (full objects, every layer due)."""

    def seed(self, ln: str, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """An imported base: ``ln``'s saved version ``version`` is ``tensors`` (the part may keep them)."""


class _Layerwise(Part):
    """LayerCheck: a layer is written when it changed more than ``tau`` or reached its staleness bound."""

    selects_together = True

    def __init__(self, policy: Policy) -> None:
        assert policy.tau is not None
        self.tracker = LayerwiseTracker(policy.tau, policy.max_staleness)

    def arrange(self, layers: list[str], sizes: list[int], rank: int, world: int) -> None:
        if self.tracker.max_staleness >= 1:
            self.tracker.slots = dict(zip(layers, balanced_slots(sizes, self.tracker.max_staleness)))

    def due(self, step: int, ln: str, col: Any) -> bool | None:
        return self.tracker.want(step, ln, col.param_tensors(ln))

    def keep(self, snap: Snapshot, ln: str, live: Mapping[str, torch.Tensor]) -> None:
        src = snap.staged.get(ln, live)
        snap.lw_params[ln] = {n: (t if ln in snap.staged else t.clone()) for n, t in src.items()
                              if n.startswith(PARAM)}

    def remember(self, snap: Snapshot) -> None:
        for ln, params in snap.lw_params.items():
            self.tracker.saved(ln, snap.step, params)

    def forget(self) -> None:
        self.tracker.reset()

    def seed(self, ln: str, version: int, tensors: dict[str, torch.Tensor]) -> None:
        self.tracker.saved(ln, version, {n: t for n, t in tensors.items() if n.startswith(PARAM)})


class _Differential(Part):
    """TierCheck: XOR deltas against the layer's previous version, full bases on the layer's slot."""

    def __init__(self, policy: Policy) -> None:
        assert policy.base_every is not None
        self.tracker = DiffTracker(policy.base_every, policy.chain_limit, policy.payoff)

    def arrange(self, layers: list[str], sizes: list[int], rank: int, world: int) -> None:
        every = self.tracker.base_every
        if every >= 1:
            self.tracker.slots = {ln: shifted(s, rank, every, world)
                                  for ln, s in zip(layers, balanced_slots(sizes, every))}

    def stages(self, ln: str) -> bool:
        return not self.tracker.direct(ln)  # payoff: a layer whose deltas do not pay is written like exact's

    def forget(self) -> None:
        self.tracker.forget()

    def seed(self, ln: str, version: int, tensors: dict[str, torch.Tensor]) -> None:
        self.tracker.saved(ln, version, tensors, "full")


class _Dedup(Part):
    """AdaCheck: shards identical across the data-parallel group are written once (a ref elsewhere)."""

    stages_all = True
    collective = True

    def __init__(self, policy: Policy, group: Any) -> None:
        self.planner = DedupPlanner(policy.dedup_group or group, policy.dedup_algo)


class SavePlan:
    """What one Checkpointer's saves write, read and remember, under its policy; see the module docstring.

    Args:
        policy: the Checkpointer's policy.
        ckpt: the Checkpointer (replay hooks its optimizer and writes through its store).
        group: the Checkpointer's gloo group (``None``: one process, no dedup collective).
    """

    def __init__(self, policy: Policy, ckpt: Any, group: Any) -> None:
        self.policy = policy
        self.layerwise = _Layerwise(policy) if policy.tau is not None else None
        self.differential = _Differential(policy) if policy.base_every else None
        self.dedup = _Dedup(policy, group) if policy.dedup and group is not None else None
        self.parts: list[Part] = [p for p in (self.layerwise, self.differential, self.dedup) if p is not None]
        # replay stands alone (Policy refuses it composed): its log replaces every layer between bases
        self.replay = ReplayLog(ckpt, policy.replay_every, policy.replay_offset) if policy.replay_every else None

    # ---- what a save writes --------------------------------------------------------------------

    @property
    def direct_only(self) -> bool:
        """Every save writes full objects of every layer straight into the host tier (preallocation pays)."""
        return self.differential is None and self.dedup is None

    @property
    def selects_together(self) -> bool:
        return any(p.selects_together for p in self.parts)

    @property
    def collective(self) -> bool:
        return any(p.collective for p in self.parts)

    @property
    def needs_pointers(self) -> bool:
        """:meth:`at_save` needs the data pointers a forward pass changes in place."""
        return self.replay is not None

    def arrange(self, col: Any, rank: int, world: int) -> None:
        layers = sorted(col.layers)
        sizes = [nbytes(col.layers[ln]) for ln in layers]
        for p in self.parts:
            p.arrange(layers, sizes, rank, world)

    def layout(self, step: int, col: Any) -> tuple[bool, dict[str, Any]]:
        """``(base, layout)``: whether ``step`` writes the state's layers (else a replay log), and the layout
        the step is begun with."""
        if self.replay is None:
            return True, {"layers": sorted(col.layers)}
        base = self.replay.due_base(step)
        return base, self.replay.layout(col, base)

    def at_save(self, pointers: set[int]) -> None:
        """On the trainer's thread, once the step is begun."""
        if self.replay is not None:
            self.replay.at_save(pointers)

    def select(self, step: int, col: Any, agree: Callable[[torch.Tensor], Any]) -> list[str]:
        """The layers ``step`` writes; ``agree`` takes the max across ranks in place (every rank writes a
        layer any rank found due, so the step's layers are the same everywhere)."""
        layers = sorted(col.layers)
        if not any(p.selects_together for p in self.parts):
            return layers
        want = []
        for ln in layers:
            votes = [p.due(step, ln, col) for p in self.parts]
            want.append(1 if ln in col.always or any(v for v in votes if v is not None) else 0)
        t = torch.tensor(want, dtype=torch.int32)
        agree(t)
        return [ln for ln, w in zip(layers, t.tolist()) if w]

    def direct(self, ln: str) -> bool:
        """Whether this save of ``ln`` is copied straight into the host tier (not staged)."""
        return not any(p.stages(ln) for p in self.parts)

    def keep(self, snap: Snapshot, ln: str, live: Mapping[str, torch.Tensor]) -> None:
        for p in self.parts:
            p.keep(snap, ln, live)

    def snapshotted(self, step: int, snap: Snapshot) -> None:
        """The state's layers of ``step`` are copied (a base, for replay)."""
        if self.replay is not None:
            self.replay.saved_base(step, snap)

    def snapshot_log(self, step: int, col: Any) -> Snapshot:
        """Copy a step that writes no base (``layout`` said so): replay's gradient log."""
        assert self.replay is not None
        return self.replay.snapshot(step, col)

    def write(self, store: Any, model: str, rank: int, epoch: int | None, snap: Snapshot,
              ranks_begun: Callable[[], None]) -> list[Any]:
        """Write the staged layers (deltas, refs, full objects), in the order selected; ``ranks_begun``
        returns once every rank began the step (before a collective)."""
        owners: dict[str, dict[str, int]] = {}
        if self.dedup is not None:
            ranks_begun()
            owners = self.dedup.planner.plan(snap.staged)
        diff = self.differential.tracker if self.differential is not None else None
        return [write_layer(store, model, rank, ln, snap.step, snap.staged[ln], snap.metas[ln], owners.get(ln),
                            diff, epoch) for ln in snap.staged]

    # ---- what a step reads from earlier steps --------------------------------------------------

    @property
    def floor(self) -> Callable[[int], int] | None:
        """``floor(step)``: the oldest step a restore of ``step`` starts from (retention keeps it), where
        that is not in the step's manifest alone (a replay chain's base); ``None``: the manifests say it."""
        return self.replay.base_of if self.replay is not None else None

    # ---- what to remember for the next ---------------------------------------------------------

    def remember(self, snap: Snapshot) -> None:
        for p in self.parts:
            p.remember(snap)

    def forget(self) -> None:
        for p in self.parts:
            p.forget()
        if self.replay is not None:
            self.replay.forget()

    def seed(self, seeds: Mapping[str, tuple[int, dict[str, torch.Tensor]]]) -> None:
        """Start from an imported base (:func:`tierstore.train.imported.import_seeds`): the first saves are
        deltas (or layer-wise comparisons) against it."""
        for ln, (version, tensors) in seeds.items():
            for p in self.parts:
                p.seed(ln, version, tensors)

    @property
    def imports_bases(self) -> bool:
        """Whether a restored imported base can seed the trackers (a dedup plan decides per step instead)."""
        return self.dedup is None

    # ---- the restore side ----------------------------------------------------------------------

    @property
    def restores_itself(self) -> bool:
        """The plan rebuilds the state itself (replay: a base, then the logs), in one verified pass."""
        return self.replay is not None

    def restore(self, step: int | None, *, read_only: bool, only: Iterable[str] | None) -> tuple[int | None, Any]:
        assert self.replay is not None
        return self.replay.restore(step, read_only=read_only, only=only)

    def continue_from(self, step: int | None, base: int | None) -> None:
        """A writer restored ``step`` (its chain starts at ``base``): the next save may continue it."""
        if self.replay is not None and step is not None:
            self.replay.continue_from(step, base)

    def proven_lost(self, step: int) -> str | None:
        """Why the last restore proved ``step`` unrestorable (a replay diverged or lost an entry), if it did."""
        return self.replay.proven.get(step) if self.replay is not None else None

    def payoff_report(self) -> dict[str, Any] | None:
        """Differential's per-layer payoff measurements and decisions (:meth:`tierstore.train.payoff.Payoff.report`);
        ``None`` without them."""
        payoff = self.differential.tracker.payoff if self.differential is not None else None
        return payoff.report() if payoff is not None else None

    def close(self) -> None:
        if self.replay is not None:
            self.replay.close()
