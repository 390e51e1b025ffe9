"""Lazy snapshots that cannot lie: a parameter a module changes in place during forward (``nn.Embedding``
with ``max_norm`` renormalises the rows it looks up) is never committed with the changed values.

Each case makes the background copy start only once the trainer reached ``optimizer.step()``
(:class:`tests.test_lazy_snapshot._CopyAfterStepStarts`), so the next forward pass has run (and changed the
embedding in place) before the copy reads it: on a Checkpointer that trusts that only the optimizer changes
parameters, every step holds renormalised rows the model never had at ``save()``.

* the real ``nn.Embedding(max_norm=...)`` under every policy (dedup over a one-rank gloo group): every
  committed object holds the state of ``save()`` bit for bit, a replay log step's digest is that of the
  parameters at ``save()``, and a restore gives the state of the last ``save()``;
* a custom module that changes its own parameter in forward: the step is voted down with a typed
  :class:`~tierstore.errors.SnapshotChangedError` naming the tensor, never committed; the tensor is copied at
  ``save()`` from then on, so the next save (and every later one) commits the right values.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.test_lazy_snapshot import _bits, _CopyAfterStepStarts, _reference
from tierstore.errors import SnapshotChangedError
from tierstore.train.checkpointer import Checkpointer
from tierstore.train.gradlog import params_digest
from tierstore.train.policies import compose, dedup, differential, exact, layerwise, replay

VOCAB, DIM = 48, 8
POLICIES = {
    "exact": exact,
    "layerwise": lambda: layerwise(tau=0.0, max_staleness=2),
    "differential": lambda: differential(base_every=3),
    "layerwise-differential": lambda: compose(layerwise(tau=0.0, max_staleness=2), differential(base_every=3)),
    "dedup": dedup,
    "replay": lambda: replay(base_every=3),
}


class EmbNet(nn.Module):
    """A token embedding with ``max_norm`` (renormalised in place by every forward) and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM, max_norm=1.0)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.emb(x)).reshape(-1, VOCAB), y.reshape(-1))


class SelfDecay(nn.Module):
    """A parameter the module itself changes in place during forward (not the optimizer)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(VOCAB, DIM))
        self.gain = nn.Parameter(torch.ones(DIM))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.gain.mul_(0.9)  # a custom in-place change in forward
        h = F.embedding(x, self.w) * self.gain
        return F.mse_loss(h.sum(-1), y.float())


def _batch(s: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(s)
    x = torch.randint(0, VOCAB, (4, 6), generator=g)
    return x, torch.randint(0, VOCAB, (4, 6), generator=g) % DIM


@pytest.fixture
def one_rank_group(tmp_path):
    """A one-rank gloo group (dedup's hashing runs in a group); torch.distributed torn down after."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _train(ck: Checkpointer, model: nn.Module, opt: torch.optim.Optimizer, gate: _CopyAfterStepStarts,
           steps: int) -> dict[int, dict]:
    """Train ``steps`` steps saving each lazily; return the state at each ``save()`` (and the grads)."""
    return _train_from(ck, model, opt, gate, 0, steps)


def _train_from(ck: Checkpointer, model: nn.Module, opt: torch.optim.Optimizer, gate: _CopyAfterStepStarts,
                first: int, steps: int) -> dict[int, dict]:
    refs = {}
    for s in range(first, first + steps):
        opt.zero_grad(set_to_none=True)
        model(*_batch(s)).backward()
        opt.step()
        refs[s] = _reference(ck)
        refs[s]["digest"] = params_digest([p for g in opt.param_groups for p in g["params"]])
        gate.reached.clear()  # armed: this save's copy starts at the next optimizer.step()
        ck.save(s)
    model(*_batch(first + steps)).backward()
    opt.step()  # the last save's copy runs behind this step's pre-hook
    return refs


def _check_step(store, name: str, step: int, ref: dict) -> int:
    compared = 0
    for key in store.list(name, step=step):
        got = store.get(key)
        for n, t in got.tensors.items():
            assert _bits(t, ref[key.layer][n]), f"step {step} {key.layer} {n}: not the state at save()"
            compared += 1
    return compared


@pytest.mark.parametrize("pname", list(POLICIES))
def test_embedding_max_norm_is_committed_as_it_was_at_save(store, monkeypatch, one_rank_group, pname):
    torch.manual_seed(0)
    model = EmbNet()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    name = f"emb-{pname}"
    ck = Checkpointer(store, name, model, opt, POLICIES[pname](), lazy=True, keep_last=None,
                      group=one_rank_group)
    gate = _CopyAfterStepStarts(ck, monkeypatch)
    v0 = model.emb.weight._version
    try:
        refs = _train(ck, model, opt, gate, 6)
        assert ck.wait() == "committed"
    finally:
        gate.remove()
        ck.close()
    assert model.emb.weight._version - v0 > 6 * 2  # the forward passes did renormalise in place
    compared = 0
    states = dict(store.steps.steps(name))
    for s, ref in refs.items():
        assert states.get(s) in ("committed", "durable"), (s, states.get(s))
        compared += _check_step(store, name, s, ref)
        m = store.steps.manifest(name, s)
        post = ((m["ranks"]["0"].get("extra") or {}).get("replay") or {}).get("post")
        if post is not None:  # a replay log step: its digest is that of the parameters at save()
            assert post == ref["digest"], f"step {s}: the log's digest is not that of the state at save()"
    assert compared > 0
    # the user's view: a restore gives the state of the last save() (layerwise: the layers' saved versions)
    m2 = EmbNet()
    o2 = torch.optim.AdamW(m2.parameters(), lr=0.05)
    ck2 = Checkpointer(store, name, m2, o2, POLICIES[pname](), group=one_rank_group)
    try:
        assert ck2.restore(read_only=True).step == 5
    finally:
        ck2.close()
    if pname not in ("layerwise", "layerwise-differential"):
        want = refs[5]
        for ln, ts in ck2.view.collect().layers.items():
            for n, t in ts.items():
                if n.startswith("param/"):
                    assert _bits(t, want[ln][n]), f"restored {ln} {n} is not the state at the last save()"


def test_a_custom_in_place_change_in_forward_votes_the_step_down(store, monkeypatch):
    torch.manual_seed(1)
    model = SelfDecay()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ck = Checkpointer(store, "decay", model, opt, lazy=True, keep_last=None)
    gate = _CopyAfterStepStarts(ck, monkeypatch)
    try:
        opt.zero_grad()
        model(*_batch(0)).backward()
        opt.step()
        gate.reached.clear()
        ck.save(0)
        model(*_batch(1)).backward()  # changes `gain` in place before the copy starts
        opt.step()
        with pytest.raises(SnapshotChangedError) as err:
            ck.wait()
        assert "param/gain" in str(err.value) and err.value.fields["tensors"] == ["param/gain"]
        assert err.value.fields["step"] == 0
        assert store.steps.state("decay", 0) == "aborted"  # never committed with the changed values
        assert ck.stats.changed_in_forward == 1
        # `gain` is copied at save() now: the next save (and every later one) commits the state of its save()
        ref = _reference(ck)
        gate.reached.clear()
        ck.save(1)
        model(*_batch(2)).backward()
        opt.step()
        assert ck.wait() == "committed"
        assert _check_step(store, "decay", 1, ref) == 2  # w and gain (plain SGD keeps no state)
        opt.zero_grad()
        refs = _train_from(ck, model, opt, gate, 2, 3)
        assert ck.wait() == "committed"
    finally:
        gate.remove()
        ck.close()
    for s, r in refs.items():
        assert _check_step(store, "decay", s, r) == 2
    assert ck.stats.changed_in_forward == 1


def test_eager_saves_need_no_version_check_and_lazy_ones_without_in_place_changes_pass(store):
    """The check never fires when forward leaves the parameters alone (the optimizer's update is gated)."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(DIM, DIM), nn.Linear(DIM, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ck = Checkpointer(store, "plain", model, opt, lazy=True, keep_last=None)
    try:
        for s in range(4):
            opt.zero_grad()
            model(torch.randn(3, DIM)).sum().backward()
            opt.step()
            ck.save(s)
        assert ck.wait() == "committed"
        assert ck.stats.changed_in_forward == 0
    finally:
        ck.close()
