"""The Checkpointer over Stateful trainer state, one process, against a real store.

Model + AdamW (two param groups) + cosine LR + a dataloader-like Stateful + RNG state + a 0-d tensor in
``extra``; named-step and weights-only read-only restores; typed errors raised at ``save()`` before anything
is written; wrapper prefixes; epochs of writers and readers (a reader in a second process never fences).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from tests import _warm
from tests import _trainer as T
from tierstore.errors import (
    ConfigError,
    FencedError,
    InvalidValueError,
    NoValidCopyError,
    RestoreMismatchError,
)
from tierstore.testing.gpt import setup_determinism
from tierstore.train.checkpointer import Checkpointer, load
from tierstore.train.policies import differential, layerwise, replay
from tierstore.train.state import RNGState

ROOT = Path(__file__).resolve().parents[1]


def _state(rank=0, seed=0, optim="adamw"):
    model, opt, sched, loader = T.make(rank, seed, optim)
    return {"model": model, "optim": opt, "sched": sched, "data": loader, "rng": RNGState()}


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _same_params(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def _train(st, start, stop, ck=None):
    losses = {}
    for s in range(start, stop):
        losses[s] = T.train_step(st["model"], st["optim"], st["sched"], st["data"])
        if ck is not None:
            ck.save(s, extra={"best_val_loss": torch.tensor(losses[s]), "next": s + 1})
    return losses


@pytest.mark.parametrize("policy", [None, differential(base_every=3), replay(base_every=3)],
                         ids=["exact", "differential", "replay"])
def test_stateful_resume_is_bitwise(store, policy):
    setup_determinism(0)
    ref = _state()
    ref_losses = _train(ref, 0, 12)
    setup_determinism(0)
    st = _state()
    ck = Checkpointer(store, "st", state=st, policy=policy, rank=0, world_size=1)
    assert ck.restore() == (None, None)
    _train(st, 0, 7, ck)
    assert ck.wait() == "committed"
    ck.close()
    torch.manual_seed(123)  # a restart: other seeds, other RNG state
    st2 = _state(seed=5)
    ck2 = Checkpointer(store, "st", state=st2, policy=policy, rank=0, world_size=1)
    step, extra = ck2.restore()
    assert step == 6 and extra["next"] == 7
    assert extra["best_val_loss"].dim() == 0 and extra["best_val_loss"].dtype == torch.float32
    assert st2["sched"].last_epoch == 7 and st2["data"].pos == 7 * 4
    assert st2["optim"].param_groups[1]["weight_decay"] == 0.0
    assert isinstance(st2["optim"].param_groups[0]["betas"], tuple)
    losses = _train(st2, 7, 12, ck2)
    assert losses == {s: ref_losses[s] for s in range(7, 12)}
    assert _same_params(_params(st2["model"]), _params(ref["model"]))
    assert ck2.wait() == "committed"
    ck2.close()


def test_layerwise_stays_within_its_bound(store):
    setup_determinism(0)
    st = _state()
    ck = Checkpointer(store, "st-lw", state=st, policy=layerwise(tau=0.02, max_staleness=3), rank=0, world_size=1)
    _train(st, 0, 8, ck)
    assert ck.wait() == "committed"
    ck.close()
    assert ck.stats.layers_saved < 8 * len(ck.layers)
    st2 = _state(seed=3)
    ck2 = Checkpointer(store, "st-lw", state=st2, policy=layerwise(tau=0.02, max_staleness=3), rank=0, world_size=1)
    assert ck2.restore()[0] == 7
    assert ck2.report.step == 7
    # the non-tensor state is exact (it rides with the step); the layers are within the bound
    assert st2["sched"].last_epoch == 8 and st2["data"].pos == 32
    for (n, a), b in zip(st["model"].named_parameters(), st2["model"].parameters()):
        assert torch.allclose(a, b, rtol=0.2, atol=0.05), n
    ck2.close()


def test_named_step_and_weights_only_read_only_restore(store):
    st = _state()
    ck = Checkpointer(store, "named", state=st, rank=0, world_size=1)
    saved = {}
    for s in range(4):
        T.train_step(st["model"], st["optim"], st["sched"], st["data"])
        ck.save(s)
        saved[s] = _params(st["model"])
    assert ck.wait() == "committed"
    epoch = store.index.epoch("named")
    model, _, _, _ = T.make(seed=9)
    got = load(store, "named", {"model": model}, step=2)  # weights only: no optimizer, no scheduler
    assert got.step == 2 and _same_params(_params(model), saved[2])
    got = load(store, "named", {"model": model})
    assert got.step == 3 and _same_params(_params(model), saved[3])
    # the positional form without an optimizer reads the weights of a checkpoint that has one
    m2, _, _, _ = T.make(seed=8)
    ro = Checkpointer(store, "named", m2)
    assert ro.restore(step=1, read_only=True).step == 1 and _same_params(_params(m2), saved[1])
    assert store.index.epoch("named") == epoch  # no reader took an epoch ...
    ck.save(4)
    assert ck.wait() == "committed"  # ... so the writer goes on
    with pytest.raises(NoValidCopyError, match="not committed"):
        ro.restore(step=17, read_only=True)
    ro.close()
    ck.close()


def test_unstorable_value_fails_save_before_anything_is_written(store):
    st = _state()
    st["data"].state_dict = lambda: {"pos": 1, "handle": open(os.devnull)}  # a file handle is not state
    with pytest.raises(InvalidValueError) as ei:  # the constructor reads the state once: refused already
        Checkpointer(store, "bad", state=st, rank=0, world_size=1)
    assert ei.value.key == "data.handle"
    st = _state()
    ck = Checkpointer(store, "bad", state=st, rank=0, world_size=1)
    ck.save(0)
    assert ck.wait() == "committed"
    with pytest.raises(InvalidValueError) as ei:
        ck.save(1, extra={"callback": print})
    assert ei.value.key == "extra.callback" and "extra.callback" in str(ei.value)
    assert store.list("bad", step=1) == [] and store.steps.state("bad", 1) is None  # never begun
    st["sched"].state_dict = lambda: {"lr_lambdas": [lambda e: 1.0]}
    with pytest.raises(InvalidValueError, match=r"sched\.lr_lambdas"):
        ck.save(1)
    assert store.steps.state("bad", 1) is None
    del st["sched"]
    ck.save(1)  # the state is fixed: the same step saves and commits
    assert ck.wait() == "committed"
    ck.close()


def test_missing_entry_and_bad_arguments(store):
    st = _state()
    ck = Checkpointer(store, "entries", state={"model": st["model"]}, rank=0, world_size=1)
    ck.save(0)
    ck.wait()
    ck.close()
    ck2 = Checkpointer(store, "entries", state=_state(seed=2), rank=0, world_size=1)
    with pytest.raises(RestoreMismatchError, match="'optim' is not in the checkpoint"):
        ck2.restore(read_only=True)
    assert ck2.restore(read_only=True, only=["model"]).step == 0
    ck2.close()
    with pytest.raises(ConfigError):
        Checkpointer(store, "x", st["model"], state={"model": st["model"]})
    with pytest.raises(InvalidValueError):
        Checkpointer(store, "x", state={"a/b": st["model"]})


def test_compiled_and_wrapped_prefixes_are_normalised(store):
    st = _state()
    T.train_step(st["model"], st["optim"], st["sched"], st["data"])
    compiled = torch.compile(st["model"])  # names gain "_orig_mod."
    ck = Checkpointer(store, "wrap", state={**st, "model": compiled}, rank=0, world_size=1)
    assert "blocks.0" in ck.layers and not any("orig" in ln for ln in ck.layers)
    ck.save(0)
    assert ck.wait() == "committed"
    ck.close()
    st2 = _state(seed=4)
    dp = torch.nn.DataParallel(st2["model"])  # names gain "module."
    ck2 = Checkpointer(store, "wrap", state={**st2, "model": dp}, rank=0, world_size=1)
    assert ck2.restore()[0] == 0
    assert _same_params(_params(st2["model"]), _params(st["model"]))
    ck2.close()


def test_epochs_writer_without_restore_is_fenced_reader_never_fences(store, redis_url, tmp_path):
    st = _state()
    w1 = Checkpointer(store, "ep", state=st, rank=0, world_size=1)
    w1.save(0)  # never restored: its first save takes the epoch
    assert w1.wait() == "committed"
    e1 = store.index.epoch("ep")
    assert e1 >= 1 and w1.epoch == e1
    # a reader in a second process: read-only restore, the writer is not fenced
    code = (
        "import sys, tierstore, torch\n"
        "from tests import _trainer as T\n"
        "from tierstore.train.checkpointer import Checkpointer\n"
        f"s = tierstore.open({str(tmp_path / 'reader')!r}, redis={redis_url!r}, durable='none', "
        f"host_root={str(store.host.root)!r})\n"
        "m = T.make(seed=7)[0]\n"
        "got = Checkpointer(s, 'ep', m).restore(read_only=True)\n"
        "print(got.step, s.index.epoch('ep'))\n"
        "s.close()\n"
    )
    out = _warm.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", str(e1)]
    T.train_step(st["model"], st["optim"], st["sched"], st["data"])
    w1.save(1)
    assert w1.wait() == "committed"
    # a second writer restores: the first one (a zombie now) is fenced at its next save, before it writes
    w2 = Checkpointer(store, "ep", state=_state(seed=3), rank=0, world_size=1)
    assert w2.restore()[0] == 1 and w2.epoch == e1 + 1
    with pytest.raises(FencedError):
        w1.save(2)
    assert store.list("ep", step=2) == []
    w2.save(2)
    assert w2.wait() == "committed"
    w1.close()
    w2.close()


def test_two_modules_get_their_own_layers(store):
    st = _state()
    ema = T.make(seed=1)[0]
    ck = Checkpointer(store, "two", state={**st, "ema": ema}, rank=0, world_size=1)
    assert "model.blocks.0" in ck.layers and "ema.blocks.0" in ck.layers
    T.train_step(st["model"], st["optim"], st["sched"], st["data"])
    ck.save(0)
    assert ck.wait() == "committed"
    ck.close()
    st2, ema2 = _state(seed=2), T.make(seed=3)[0]
    ck2 = Checkpointer(store, "two", state={**st2, "ema": ema2}, rank=0, world_size=1)
    assert ck2.restore().step == 0
    assert _same_params(_params(st2["model"]), _params(st["model"])) and _same_params(_params(ema2), _params(ema))
    ck2.close()


def test_replay_takes_rank_from_the_launcher_without_a_process_group(store, monkeypatch):
    """Issue 12: replay fell back to rank 0 under torchrun without a process group; now one discovery for all."""
    from tierstore.train.replay import ReplayCheckpointer

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    model, opt, _, _ = T.make()
    rc = ReplayCheckpointer(store, "envrank", model, opt, base_every=4)
    assert (rc.rank, rc.world_size) == (1, 2)
    assert rc.ranks.token == "job-7:3"  # every rank of this restart joins the same epoch
    rc.close()


class _WithExtra(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.meta = {"scale": torch.tensor([2.0, 3.0]), "calls": 0, "tag": b"fp8-v1"}

    def get_extra_state(self):
        return self.meta

    def set_extra_state(self, state):
        self.meta = state


def test_module_extra_state_with_tensors_round_trips(store):
    m = _WithExtra()
    m.meta = {"scale": torch.tensor([5.0, 7.0]), "calls": 4, "tag": b"fp8-v1"}
    ck = Checkpointer(store, "xs", m, rank=0, world_size=1)
    ck.save(0)
    assert ck.wait() == "committed"
    ck.close()
    m2 = _WithExtra()
    assert Checkpointer(store, "xs", m2, rank=0, world_size=1).restore(read_only=True).step == 0
    assert torch.equal(m2.meta["scale"], torch.tensor([5.0, 7.0])) and m2.meta["calls"] == 4
    assert m2.meta["tag"] == b"fp8-v1"
    assert torch.equal(m2.lin.weight, m.lin.weight)
