"""Lazy snapshots (``Checkpointer(..., lazy=True)``) against the real store: the snapshot of every policy
holds the state as it was at ``save()`` even when everything is changed the moment the optimizer's pre-hook
returns; training resumes bitwise; a step another rank aborted is never a base. Two real gloo ranks:
dedup and differential, lazily, with the same adversarial mutation, resuming bitwise.

The copy is made to start only once the trainer reached ``optimizer.step()`` (a global pre-hook runs before
the Checkpointer's; the background copy waits for it), so without the gate the mutation would land first.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tierstore.ports import free_port
from tierstore.testing.gpt import GPTConfig, char_dataset, get_batch, make_model, train
from tierstore.train.checkpointer import Checkpointer
from tierstore.train.gradlog import GRAD, LOG_LAYER
from tierstore.train.policies import compose, differential, exact, layerwise, replay

from tests import _warm

ROOT = Path(__file__).resolve().parents[1]
CFG = GPTConfig(d_model=32, n_layer=2, n_head=2, block=32)
POLICIES = {
    "exact": exact(),
    "layerwise": layerwise(tau=0.02, max_staleness=3),
    "differential": differential(base_every=3),
    "layerwise-differential": compose(layerwise(tau=0.02, max_staleness=3), differential(base_every=3)),
    "replay": replay(base_every=3),
}


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_u8(a.cpu()), _u8(b.cpu()))


def _hostile(opt: torch.optim.Optimizer):
    """A step pre-hook that changes every parameter and optimizer-state tensor in place."""

    def hook(o, args, kwargs):
        with torch.no_grad():
            for g in o.param_groups:
                for p in g["params"]:
                    p.add_(0.5)
                    for v in o.state.get(p, {}).values():
                        if isinstance(v, torch.Tensor):
                            v.add_(0.25)

    return opt.register_step_pre_hook(hook)


class _CopyAfterStepStarts:
    """The background copy of each save starts only when the trainer has reached ``optimizer.step()``."""

    def __init__(self, ck: Checkpointer, monkeypatch) -> None:
        self.reached = threading.Event()
        self._h = register_optimizer_step_pre_hook(lambda o, a, k: self.reached.set())  # global: runs first
        orig = ck._snapshot

        def slow(*args, **kwargs):
            self.reached.wait(timeout=10)
            return orig(*args, **kwargs)

        monkeypatch.setattr(ck, "_snapshot", slow)

    def remove(self) -> None:
        self._h.remove()


def _reference(ck: Checkpointer) -> dict[str, dict[str, torch.Tensor]]:
    """The state as ``save()`` sees it now, by layer; and the gradients a replay log entry holds."""
    ref = {ln: {n: t.detach().clone() for n, t in ts.items()} for ln, ts in ck.view.collect().layers.items()}
    model = ck.state["model"]
    ref[LOG_LAYER] = {GRAD + n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return ref


def _check_objects(store, name: str, refs: dict[int, dict], rank: int = 0) -> int:
    """Every object of ``rank`` at each step holds the reference bits; return the tensors compared."""
    compared = 0
    for step, ref in refs.items():
        keys = [k for k in store.list(name, step=step) if k.rank == rank]
        assert keys, f"nothing saved at step {step}"
        for key in keys:
            got = store.get(key)
            assert got is not None, key
            want = ref[key.layer]
            for n, t in got.tensors.items():
                assert _bits(t, want[n]), f"step {step} {key.layer} {n}: the snapshot is not the state at save()"
                compared += 1
    return compared


CASES = [(p, "cpu") for p in POLICIES] + [
    pytest.param("exact", "cuda", marks=[pytest.mark.cuda,
                                         pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]),
]


@pytest.mark.parametrize(("pname", "device"), CASES)
def test_snapshot_holds_the_state_of_save_when_the_update_mutates_everything(store, monkeypatch, pname, device):
    torch.manual_seed(0)
    model, opt = make_model(CFG, seed=0)
    model.blocks[0].register_buffer("seen", torch.zeros(3))  # a buffer the forward pass changes (as BatchNorm's)
    model.to(device)  # the same Parameter objects: the optimizer still holds them
    ck = Checkpointer(store, f"lz-{pname}-{device}", model, opt, POLICIES[pname], lazy=True, keep_last=None)
    gate = _CopyAfterStepStarts(ck, monkeypatch)
    hostile = _hostile(opt)  # registered after the Checkpointer's hook: runs the moment it returns
    data = char_dataset()
    refs = {}
    try:
        for s in range(7):
            x, y = (t.to(device) for t in get_batch(data, s, 0, 4, CFG.block, 0))
            opt.zero_grad(set_to_none=True)
            model(x, y).backward()
            opt.step()
            refs[s] = _reference(ck)
            gate.reached.clear()  # armed: this save's copy starts at the next optimizer.step()
            ck.save(s)
            model.blocks[0].seen.add_(1.0)  # right after save() returns, before the next forward
        x, y = (t.to(device) for t in get_batch(data, 7, 0, 4, CFG.block, 0))
        model(x, y).backward()
        opt.step()  # the last save's copy runs behind this step's pre-hook
        assert ck.wait() == "committed"
    finally:
        gate.remove()
        hostile.remove()
        ck.close()
    assert _check_objects(store, f"lz-{pname}-{device}", refs) > 0
    assert ck.stats.waits >= 1  # the gate held the update back at least once (the copy starts late)


def test_save_returns_before_the_copy_and_before_update_guards_a_custom_loop(store, monkeypatch):
    model, _opt = make_model(CFG, seed=1)
    ck = Checkpointer(store, "lz-custom", state={"model": model}, lazy=True, keep_last=None)
    go = threading.Event()
    orig = ck._snapshot

    def held(*args, **kwargs):
        go.wait(timeout=10)
        return orig(*args, **kwargs)

    monkeypatch.setattr(ck, "_snapshot", held)
    refs = {}
    try:
        for s in range(3):
            refs[s] = _reference(ck)
            ck.save(s)
            assert not store.list("lz-custom", step=s)  # save() returned; nothing is copied yet
            go.set()
            ck.before_update()  # a custom loop: no optimizer step, the update is done by hand
            go.clear()
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5).add_(1.0)
        assert ck.wait() == "committed"
    finally:
        go.set()
        ck.close()
    assert _check_objects(store, "lz-custom", refs) > 0


def _state(model, opt):
    return copy.deepcopy((model.state_dict(), opt.state_dict()))


def _same(a, b) -> bool:
    (ma, oa), (mb, ob) = a, b
    if ma.keys() != mb.keys() or any(not _bits(ma[k], mb[k]) for k in ma):
        return False
    if oa["param_groups"] != ob["param_groups"]:
        return False
    for i in oa["state"]:
        for k, v in oa["state"][i].items():
            w = ob["state"][i][k]
            if not (_bits(v, w) if isinstance(v, torch.Tensor) else v == w):
                return False
    return True


@pytest.mark.parametrize("pname", ["exact", "differential", "replay", "layerwise-differential"])
def test_lazy_training_resumes_bitwise(store, pname):
    policy = POLICIES[pname]
    model, opt = make_model(CFG, seed=0)
    ck = Checkpointer(store, f"lzr-{pname}", model, opt, policy, lazy=True)
    assert ck.restore() == (None, None)
    train(model, opt, 0, 7, batch_size=4, on_step=lambda s, _l: ck.save(s, extra={"pos": s + 1}))
    assert ck.wait() == "committed"
    ck.close()
    m2, o2 = make_model(CFG, seed=9)
    ck2 = Checkpointer(store, f"lzr-{pname}", m2, o2, policy, lazy=True)
    assert ck2.restore() == (6, {"pos": 7})
    if policy.tau is None:  # layerwise restores layers from versions within the bound, not the newest state
        assert _same(_state(m2, o2), _state(model, opt))
    la = train(model, opt, 7, 10, batch_size=4)
    lb = train(m2, o2, 7, 10, batch_size=4, on_step=lambda s, _l: ck2.save(s))
    if policy.tau is None:
        assert la == lb
    assert ck2.wait() == "committed"
    ck2.close()


def _two_ranks(store, name, policy):
    """Two Checkpointers of one job in one process (ranks 0 and 1, no collectives): the step protocol only."""
    m0, o0 = make_model(CFG, seed=0)
    m1, o1 = make_model(CFG, seed=0)
    c0 = Checkpointer(store, name, m0, o0, policy, rank=0, world_size=2)
    c1 = Checkpointer(store, name, m1, o1, policy, rank=1, world_size=2)
    return c0, c1


def _voted_preparing(ck: Checkpointer) -> None:
    """Wait until the background part of ``ck``'s last save voted (its vote did not decide the step)."""
    ck._future.result(timeout=30)  # orders this rank's vote before the other's


def test_a_step_another_rank_aborted_is_not_a_delta_base(store):
    c0, c1 = _two_ranks(store, "abort-diff", differential(base_every=10))
    try:
        c0.save(1)
        c1.save(1)
        assert c0.wait() == "committed"
        c0.save(2)  # a delta on step 1; this rank's vote leaves the step preparing
        _voted_preparing(c0)
        store.begin_step("abort-diff", 2, 2)
        store.vote("abort-diff", 2, 1, [], ok=False)  # rank 1 fails step 2
        assert store.steps.state("abort-diff", 2) == "aborted"
        c0.save(3)
        c1.save(3)
        assert c0.wait() == "committed"
        kinds = {k.layer: store.info(k).kind for k in store.list("abort-diff", step=3) if k.rank == 0}
        assert kinds and set(kinds.values()) == {"full"}, kinds  # never a delta on the aborted step 2
        m, o = make_model(CFG, seed=5)
        ck = Checkpointer(store, "abort-diff", m, o, differential(base_every=10), rank=0, world_size=2)
        assert ck.restore(read_only=True).step == 3
        assert _same(_state(m, o), _state(c0.state["model"], c0.state["optim"]))
        ck.close()
    finally:
        c0.close()
        c1.close()


def test_a_step_another_rank_aborted_is_not_a_layerwise_version(store):
    pol = layerwise(tau=1e9, max_staleness=10)  # after the first save, no layer is due for a long time
    c0, c1 = _two_ranks(store, "abort-lw", pol)
    try:
        c0.save(1)  # every layer of rank 0, but the step aborts
        _voted_preparing(c0)
        store.begin_step("abort-lw", 1, 2)
        store.vote("abort-lw", 1, 1, [], ok=False)
        c0.save(2)
        c1.save(2)
        assert c0.wait() == "committed"
        saved = {k.layer for k in store.list("abort-lw", step=2) if k.rank == 0}
        assert saved == set(c0.layers)  # every layer again: step 1 never became a version of them
    finally:
        c0.close()
        c1.close()


# ---- two real gloo ranks ------------------------------------------------------------------------------------


def worker(rank: int, port: int, home: str, out: str) -> None:
    import torch.distributed as dist

    import tierstore
    from tierstore.testing.gpt import setup_determinism, train_step
    from tierstore.train.policies import dedup

    setup_determinism(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    store = tierstore.open(home=home)
    pol = compose(differential(base_every=3), dedup())
    data = char_dataset()
    result: dict = {}

    # 1. the adversarial mutation, both ranks, every save
    model, opt = make_model(CFG, seed=0)
    ck = Checkpointer(store, "lz2", model, opt, pol, lazy=True, keep_last=None)
    reached = threading.Event()
    glob = register_optimizer_step_pre_hook(lambda o, a, k: reached.set())
    orig = ck._snapshot

    def slow(*args, **kwargs):
        reached.wait(timeout=10)
        return orig(*args, **kwargs)

    ck._snapshot = slow  # type: ignore[method-assign]
    hostile = _hostile(opt)
    refs = {}
    for s in range(5):
        x, y = get_batch(data, s, rank, 4, CFG.block, 0)
        train_step(model, opt, x, y, world_size=2)
        refs[s] = _reference(ck)
        reached.clear()
        ck.save(s)
    x, y = get_batch(data, 5, rank, 4, CFG.block, 0)
    train_step(model, opt, x, y, world_size=2)
    result["outcome"] = ck.wait()
    result["objects"] = ck.stats.objects
    glob.remove()
    hostile.remove()
    ck.close()
    dist.barrier()
    result["compared"] = _check_objects(store, "lz2", refs, rank)

    # 2. a real run, saved lazily, resumed bitwise in a fresh model
    model, opt = make_model(CFG, seed=0)
    ck = Checkpointer(store, "lz2r", model, opt, pol, lazy=True)
    ck.restore()
    train(model, opt, 0, 5, rank=rank, world_size=2, batch_size=4, on_step=lambda s, _l: ck.save(s))
    result["run_outcome"] = ck.wait()
    ck.close()
    m2, o2 = make_model(CFG, seed=3)
    ck2 = Checkpointer(store, "lz2r", m2, o2, pol, lazy=True)
    result["restored"] = ck2.restore()[0]
    result["equal"] = _same(_state(m2, o2), _state(model, opt))
    la = train(model, opt, 5, 8, rank=rank, world_size=2, batch_size=4)
    lb = train(m2, o2, 5, 8, rank=rank, world_size=2, batch_size=4, on_step=lambda s, _l: ck2.save(s))
    result["continues"] = la == lb
    result["run2_outcome"] = ck2.wait()
    ck2.close()
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(result, f)
    dist.barrier()
    store.close()
    dist.destroy_process_group()


def test_two_gloo_ranks_lazy_dedup_differential(tmp_path):
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    procs = [
        _warm.popen([sys.executable, "-m", "tests.test_lazy_snapshot", str(r), str(port),
                          str(tmp_path / "home"), str(tmp_path / "out")], cwd=ROOT, env=env)
        for r in range(2)
    ]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    res = [json.loads((tmp_path / f"out.{r}.json").read_text()) for r in range(2)]
    for r in res:
        assert r["outcome"] == "committed" and r["compared"] > 0
        assert r["run_outcome"] == "committed" and r["restored"] == 4 and r["equal"] and r["continues"]
        assert r["run2_outcome"] == "committed"
    assert sum(r["objects"]["ref"] for r in res) > 0  # dedup ran (on copies), lazily
    assert sum(r["objects"]["delta"] for r in res) > 0


if __name__ == "__main__":
    a = sys.argv[1:]
    worker(int(a[0]), int(a[1]), a[2], a[3])
