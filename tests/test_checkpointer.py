"""Checkpointer against a real store (Redis on loopback, shm host tier, local durable dir), one process."""

from __future__ import annotations

import copy

import pytest
import torch

from tierstore.train.checkpointer import Checkpointer, rank_from_env
from tierstore.errors import FencedError, RestoreMismatchError, TierStoreError
from tierstore.testing.gpt import GPTConfig, make_model, train
from tierstore.train.policies import compose, differential, exact, layerwise

torch.set_num_threads(1)
CFG = GPTConfig(d_model=32, n_layer=2, n_head=2, block=32)


def _state(model, opt):
    return copy.deepcopy((model.state_dict(), opt.state_dict()))


def _same(a, b) -> bool:
    (ma, oa), (mb, ob) = a, b
    if ma.keys() != mb.keys() or any(not torch.equal(ma[k], mb[k]) for k in ma):
        return False
    if oa["param_groups"] != ob["param_groups"] or oa["state"].keys() != ob["state"].keys():
        return False
    for i in oa["state"]:
        for k, v in oa["state"][i].items():
            w = ob["state"][i][k]
            if not (torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w):
                return False
    return True


def _run(store, name, policy, steps, seed=0):
    model, opt = make_model(CFG, seed=seed)
    ck = Checkpointer(store, name, model, opt, policy)
    assert ck.restore() == (None, None)
    train(model, opt, 0, steps, batch_size=4, on_step=lambda s, _l: ck.save(s, extra={"pos": s + 1}))
    assert ck.wait() == "committed"
    ck.close()
    return model, opt, ck


@pytest.mark.parametrize("policy", [exact(), differential(base_every=3), compose(differential(4, max_chain=2))])
def test_exact_round_trip(store, policy):
    model, opt, ck = _run(store, "m1", policy, 7)
    m2, o2 = make_model(CFG, seed=9)
    o2.param_groups[0]["lr"] = 1.0
    ck2 = Checkpointer(store, "m1", m2, o2, policy)
    assert ck2.restore() == (6, {"pos": 7})
    assert _same(_state(m2, o2), _state(model, opt))
    # both continue identically
    la = train(model, opt, 7, 9, batch_size=4)
    lb = train(m2, o2, 7, 9, batch_size=4, on_step=lambda s, _l: ck2.save(s))
    assert la == lb
    assert ck2.wait() == "committed"
    ck2.close()
    if policy.base_every:
        assert ck.stats.objects["delta"] > 0


def test_layerwise_saves_fewer_layers(store):
    model, opt, ck = _run(store, "lw", layerwise(tau=0.05, max_staleness=3), 8)
    assert ck.stats.layers_saved < 8 * len(ck.layers)
    m2, o2 = make_model(CFG, seed=9)
    ck2 = Checkpointer(store, "lw", m2, o2, layerwise(tau=0.05, max_staleness=3))
    step, extra = ck2.restore()
    assert step == 7 and extra == {"pos": 8}
    # every layer came back from some version within the bound: close to the live model
    for (n, a), b in zip(model.named_parameters(), m2.parameters()):
        assert torch.allclose(a, b, rtol=0.2, atol=0.05), n
    ck2.close()


def test_restore_into_lazy_optimizer(store):
    model, opt, _ = _run(store, "lazy", exact(), 3)
    m2, o2 = make_model(CFG, seed=1)
    assert not o2.state
    ck2 = Checkpointer(store, "lazy", m2, o2)
    assert ck2.restore()[0] == 2
    assert _same(_state(m2, o2), _state(model, opt))
    ck2.close()


def test_save_before_first_step_then_restore(store):
    model, opt = make_model(CFG, seed=0)
    ck = Checkpointer(store, "fresh", model, opt)
    ck.restore()
    ck.save(0)
    assert ck.wait() == "committed"
    train(model, opt, 0, 1, batch_size=4)  # optimizer state now exists
    ck2 = Checkpointer(store, "fresh", model, opt)
    assert ck2.restore()[0] == 0
    assert not opt.state  # back to the state before the first step
    ck.close()
    ck2.close()


@pytest.mark.parametrize(
    "other, layer, tensor",
    [
        (GPTConfig(d_model=32, n_layer=2, n_head=2, block=16), "pos", "param/pos.weight"),
        (GPTConfig(d_model=32, n_layer=3, n_head=2, block=32), "blocks.2", None),
        (GPTConfig(d_model=32, n_layer=1, n_head=2, block=32), "blocks.1", None),
    ],
)
def test_mismatch_raises_and_leaves_target_unchanged(store, other, layer, tensor):
    _run(store, "mm", exact(), 2)
    m2, o2 = make_model(other, seed=5)
    train(m2, o2, 0, 1, batch_size=4)
    before = _state(m2, o2)
    ck2 = Checkpointer(store, "mm", m2, o2)
    with pytest.raises(RestoreMismatchError) as ei:
        ck2.restore()
    assert ei.value.layer == layer and ei.value.tensor == tensor
    assert layer in str(ei.value)
    assert _same(_state(m2, o2), before)
    ck2.close()


def test_dtype_mismatch(store):
    _run(store, "dt", exact(), 2)
    m2, o2 = make_model(CFG, seed=5)
    m2.head.double()
    before = _state(m2, o2)
    with pytest.raises(RestoreMismatchError) as ei:
        Checkpointer(store, "dt", m2, o2).restore()
    assert ei.value.layer == "head" and ei.value.tensor == "param/head.weight"
    assert _same(_state(m2, o2), before)


def test_zombie_is_fenced_after_restore(store):
    model, opt = make_model(CFG, seed=0)
    old = Checkpointer(store, "z", model, opt)
    old.restore()
    old.save(0)
    assert old.wait() == "committed"
    new = Checkpointer(store, "z", *make_model(CFG, seed=0))
    assert new.restore()[0] == 0
    with pytest.raises(FencedError):
        old.save(1)  # the zombie's save is refused at once (begin_step is synchronous), typed
    assert store.list("z", step=1) == []
    new.save(1)
    assert new.wait() == "committed"
    old.close()
    new.close()


def test_custom_layer_fn_and_wait_without_save(store):
    model, opt = make_model(CFG, seed=0)
    ck = Checkpointer(store, "one", model, opt, layer_fn=lambda n: "all/of it")
    assert ck.wait() is None
    assert ck.layers == ["all_of_it"]
    ck.save(3)
    assert ck.wait() == "committed"
    assert [k.layer for k in store.list("one")] == ["all_of_it"]
    ck.close()


def test_rank_from_env():
    assert rank_from_env({}) == (0, 1)
    assert rank_from_env({"RANK": "3", "WORLD_SIZE": "4"}) == (3, 4)
    assert issubclass(FencedError, TierStoreError)


def test_retention_recycles_old_versions_and_keeps_restorable(tmp_path, redis_url, shm_root):
    import tierstore
    from tierstore.train.checkpointer import Checkpointer

    store = tierstore.open(tmp_path / "ret", redis=redis_url, durable="none", host_root=str(shm_root / "n"))
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        ck = Checkpointer(store, "ret", model, opt, keep_last=2, rank=0, world_size=1)
        for step in range(6):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            ck.save(step)
            assert ck.wait() == "committed"
        ck.save(6)
        ck.wait()
        steps = {k.step for k in store.list("ret")}
        assert steps == {4, 5, 6}, steps  # keep_last committed + the newest; older ones deleted (segments reused)
        want = {n: p.detach().clone() for n, p in model.named_parameters()}
        for p in model.parameters():
            p.data.zero_()
        assert ck.restore()[0] == 6
        assert all(torch.equal(p, want[n]) for n, p in model.named_parameters())
        ck.close()
    finally:
        store.close()


def test_layerwise_retention_keeps_stale_layers(tmp_path, redis_url, shm_root):
    import tierstore
    from tierstore.train.checkpointer import Checkpointer
    from tierstore.train.policies import layerwise

    store = tierstore.open(tmp_path / "lw", redis=redis_url, durable="none", host_root=str(shm_root / "n"))
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        ck = Checkpointer(store, "lw", model, None, policy=layerwise(tau=1e9, max_staleness=4), keep_last=1,
                          rank=0, world_size=1)
        for step in range(10):
            with torch.no_grad():
                model[1].weight.add_(0.01)
            ck.save(step)
            assert ck.wait() == "committed"
        res = store.resolve("lw", max_staleness=4)
        assert res.step == 9 and set(res.layers) == {"0", "1"}
        ck.close()
    finally:
        store.close()


@pytest.mark.parametrize("verify", ["before_update", "in_pass"])
def test_the_report_says_where_a_restore_spent_its_time(store, verify):
    import time

    _run(store, "phases", exact(), 3)
    m2, o2 = make_model(CFG, seed=9)
    ck = Checkpointer(store, "phases", m2, o2)
    t = time.perf_counter()
    assert ck.restore(verify=verify)[0] == 2
    total = time.perf_counter() - t
    phases = ck.report.phases
    want = {"agree", "resolve", "read", "load"} if verify == "before_update" else {"agree", "resolve", "read+load"}
    assert set(phases) == want, phases
    assert all(v >= 0 for v in phases.values()) and sum(phases.values()) <= total
    ck.close()


# decisions that do not depend on measured numbers: layers saved only when forced, deltas wherever the chain allows
@pytest.mark.parametrize("name, policy", [("cl-lw", layerwise(tau=1e9, max_staleness=3)),
                                          ("cl-diff", differential(base_every=3, payoff=None))])
def test_every_committed_complete_set_is_closed_under_the_index_links(store, name, policy):
    """A Checkpointer's manifests (layers inherited from older steps, delta chains) record complete sets that the
    index's links do not reach beyond: what retention keeps without reading a record is what it kept reading
    them (the equality is what makes skipping the reads safe)."""
    from consistency.closure import closure, is_closed, reachable, read_keys, required_steps

    _run(store, name, policy, 8)
    committed = [s for s, st in store.steps.steps(name) if st in ("committed", "durable")]
    assert len(committed) >= 3
    for step in committed:
        assert is_closed(store.steps.manifest(name, step))
        roots = set()
        for s in required_steps(store.steps, name, [step]):
            roots |= read_keys(store.steps.manifest(name, s))
        assert reachable(store.steps, name, [step]) == closure(store.index, roots), step
    kinds = {store.info(k).kind for s in committed for k in read_keys(store.steps.manifest(name, s))}
    steps_read = {k.step for s in committed for k in read_keys(store.steps.manifest(name, s)) if k.step != s}
    assert steps_read, "no step reads an older one: the test would not exercise the links"
    assert name != "cl-diff" or "delta" in kinds
