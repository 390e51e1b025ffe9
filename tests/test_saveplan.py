"""The save policies are objects behind one interface (:mod:`tierstore.train.saveplan`).

- the Checkpointer and its restore side name no policy: no tracker class, no policy field, no
  per-policy branch; they call the plan (checked on their source);
- the plan's answers, per policy, on a real (single-process) Checkpointer's state: what a step writes
  (selected layers, direct or staged), what it reads from earlier steps (replay's floor), what it
  remembers (layer-wise comparisons after a positive vote, nothing after ``forget``), and a seed from an
  imported base.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch
from torch import nn

from tierstore.train.checkpointer import Checkpointer
from tierstore.train.policies import compose, differential, exact, layerwise, replay
from tierstore.train.saveplan import SavePlan
from tierstore.train.stagger import is_base_step
from tierstore.train.writing import Snapshot

ROOT = Path(__file__).resolve().parents[1]
#: what only a policy's own part may name: its tracker classes and its Policy fields
POLICY_NAMES = {"LayerwiseTracker", "DiffTracker", "DedupPlanner", "ReplayLog", "tau", "base_every",
                "replay_every", "replay_offset", "dedup_algo", "dedup_group", "chain_limit", "payoff",
                "_lw", "_diff", "_dedup", "_replay"}


def _names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, ast.alias):
            out.add(node.asname or node.name.rsplit(".", 1)[-1])
    return out


def test_the_checkpointer_names_no_policy():
    for rel in ("tierstore/train/checkpointer.py", "tierstore/train/restore_side.py"):
        named = _names(ROOT / rel) & POLICY_NAMES
        assert not named, f"{rel} names policy internals {sorted(named)}: ask the SavePlan instead"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))


def _ck(store, policy, name: str) -> Checkpointer:
    m = _model()
    return Checkpointer(store, name, state={"model": m, "optim": torch.optim.SGD(m.parameters(), lr=0.1)},
                        policy=policy, preallocate=False)


def test_exact_writes_every_layer_directly(store):
    ck = _ck(store, exact(), "plan-exact")
    try:
        col = ck.view.collect()
        plan = ck.plan
        assert plan.direct_only and not plan.selects_together and not plan.collective
        assert plan.layout(3, col) == (True, {"layers": sorted(col.layers)})
        assert plan.select(3, col, lambda t: t) == sorted(col.layers)
        assert all(plan.direct(ln) for ln in col.layers)
        assert plan.floor is None and not plan.restores_itself
    finally:
        ck.close()


def test_layerwise_remembers_after_a_positive_vote_and_forgets_on_reset(store):
    ck = _ck(store, layerwise(tau=0.5, max_staleness=8), "plan-lw")
    try:
        plan = ck.plan
        col = ck.view.collect()
        layers = sorted(col.layers)
        assert plan.selects_together
        agreed: list[list[int]] = []
        assert plan.select(0, col, lambda t: agreed.append(t.tolist())) == layers  # nothing saved: all due
        assert agreed, "the selection is agreed across ranks (a max collective)"
        snap = Snapshot(0, layers)
        for ln in layers:
            plan.keep(snap, ln, col.layers[ln])
        plan.remember(snap)
        # unchanged since step 0, within the bound: only the layers saved at every step are due
        assert plan.select(1, col, lambda t: t) == sorted(col.always)
        # a layer the other rank found due is written here too (the max wins)
        def other_wants_all(t: torch.Tensor) -> None:
            t.fill_(1)
        assert plan.select(1, col, other_wants_all) == layers
        plan.forget()
        assert plan.select(1, col, lambda t: t) == layers
    finally:
        ck.close()


def test_differential_stages_and_is_seeded_by_an_imported_base(store):
    ck = _ck(store, differential(base_every=4, payoff=None), "plan-diff")
    try:
        plan = ck.plan
        col = ck.view.collect()
        ln = next(iter(sorted(set(col.layers) - set(col.always))))
        assert not plan.direct_only and not plan.direct(ln)
        tensors = {n: t.clone() for n, t in col.layers[ln].items()}
        plan.seed({ln: (7, tensors)})
        assert plan.differential is not None
        tracker = plan.differential.tracker
        nxt = next(s for s in (8, 9, 10) if not is_base_step(s, tracker.slots[ln], 4))  # off the layer's base slot
        assert tracker.kind(ln, nxt, tensors) == ("delta", 7)
        plan.forget()
        assert tracker.kind(ln, nxt, tensors) == ("full", None)
    finally:
        ck.close()


def test_replay_owns_its_layout_floor_and_restore(store):
    ck = _ck(store, replay(base_every=5), "plan-replay")
    try:
        plan = ck.plan
        col = ck.view.collect()
        assert plan.restores_itself and plan.needs_pointers and plan.floor is not None
        base, layout = plan.layout(0, col)
        assert base and layout["replay"] == "base"
        assert plan.floor(3) == 0  # no base saved yet: keep everything
    finally:
        ck.close()


def test_a_composed_policy_has_each_part_once():
    plan = SavePlan(compose(layerwise(), differential()), ckpt=None, group=None)
    assert plan.layerwise is not None and plan.differential is not None and plan.dedup is None
    assert len(plan.parts) == 2 and plan.replay is None
