"""Savings that pay (tierstore.train.payoff): the per-layer decision, pure, then on a real store.

The real run trains a module of two layers with an optimizer that moves one
layer slowly (a tiny step on the weights, a state that barely changes) and
one like AdamW on random gradients (every bit of its state changes each step):
the fast layer must switch to full objects (written directly, like exact's),
the slow one must keep deltas, and a restore must be bitwise.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tierstore.errors import ConfigError
from tierstore.train.checkpointer import Checkpointer
from tierstore.train.payoff import Payoff, PayoffRule
from tierstore.train.policies import DiffTracker, compose, differential, layerwise

MB = 1 << 20


# ---- the rule and the state machine, pure ------------------------------------------------


def test_rule_pays_on_ratio_and_cpu():
    r = PayoffRule(max_ratio=0.7, max_cpu_ms_per_mb=20.0)
    assert r.pays(0.5, 0.003, 4 * MB)  # halves 4 MB for 3 ms: 1.5 ms per MB saved
    assert not r.pays(0.9, 0.0, 4 * MB)  # saves too little, however cheap
    assert not r.pays(0.5, 0.050, 4 * MB)  # 25 ms per MB saved: too dear
    assert not r.pays(0.0, 0.0, 0)  # nothing to save
    assert r.pays(0.7, 0.0, MB)  # the bound itself pays


def test_cpu_counted_is_the_delta_s_extra_over_a_full_write():
    r = PayoffRule(max_cpu_ms_per_mb=20.0)
    assert not r.pays(0.5, 0.030, 2 * MB)  # 30 ms for 1 MB saved
    assert r.pays(0.5, 0.030, 2 * MB, full_cpu_s=0.015)  # 15 ms more than a full write: pays
    pay = Payoff(r)
    pay.record("a", "full", 2 * MB, 2 * MB, 0.015)
    pay.record("a", "delta", 2 * MB, MB, 0.030)
    assert pay.mode("a") == "delta"
    pay2 = Payoff(r)
    pay2.record("a", "delta", 2 * MB, MB, 0.030)  # no full write measured yet: the whole cost counts
    assert pay2.mode("a") == "full"


@pytest.mark.parametrize("kw", [dict(max_ratio=0.0), dict(max_ratio=1.5), dict(max_cpu_ms_per_mb=0),
                                dict(revisit=0), dict(revisit=8, max_revisit=4), dict(alpha=0.0)])
def test_rule_rejects_bad_config(kw):
    with pytest.raises(ConfigError):
        PayoffRule(**kw)


def test_layer_switches_to_full_and_back_through_probes():
    pay = Payoff(PayoffRule(revisit=3, max_revisit=12))
    assert pay.mode("a") == "probe" and not pay.direct("a")
    pay.record("a", "full", MB, MB, 0.0)  # a base: no decision
    assert pay.mode("a") == "probe"
    pay.record("a", "delta", MB, MB, 0.004)  # incompressible
    assert pay.mode("a") == "full"
    # revisit=3: two direct saves, then one staged save (the probe's base), then the probe
    assert [pay.direct("a") for _ in range(3)] == [True, True, False]
    assert pay.mode("a") == "probe"
    pay.record("a", "full", MB, MB, 0.0)
    pay.record("a", "delta", MB, MB // 4, 0.003)  # now it pays
    assert pay.mode("a") == "delta" and not pay.direct("a")
    assert pay.report()["a"]["direct_fulls"] == 2


def test_failed_revisits_back_off_and_a_paying_one_resets():
    pay = Payoff(PayoffRule(revisit=2, max_revisit=8))
    pay.record("a", "delta", MB, MB, 0.001)  # first probe fails: revisit stays 2
    waits = []
    for _ in range(3):
        n = 0
        while pay.direct("a"):
            n += 1
        waits.append(n)
        pay.record("a", "delta", MB, MB, 0.001)  # each revisit fails: the wait doubles, up to the cap
    assert waits == [1, 3, 7]
    assert pay.report()["a"]["revisit"] == 8
    while pay.direct("a"):
        pass
    pay.record("a", "delta", MB, MB // 10, 0.001)
    assert pay.mode("a") == "delta" and pay.report()["a"]["revisit"] == 2


def test_average_absorbs_one_odd_delta_but_follows_a_change():
    pay = Payoff(PayoffRule(max_ratio=0.7, alpha=0.5))
    pay.record("a", "delta", MB, int(0.3 * MB), 0.001)
    assert pay.mode("a") == "delta"
    pay.record("a", "delta", MB, MB, 0.001)  # average 0.65: still pays
    assert pay.mode("a") == "delta"
    pay.record("a", "delta", MB, MB, 0.001)  # average 0.825: the layer started moving fast
    assert pay.mode("a") == "full"


def test_layers_decide_independently():
    pay = Payoff(PayoffRule())
    pay.record("slow", "delta", MB, MB // 3, 0.002)
    pay.record("fast", "delta", MB, int(0.95 * MB), 0.002)
    assert (pay.mode("slow"), pay.mode("fast")) == ("delta", "full")
    pay.forget("fast")
    assert pay.mode("fast") == "probe"


def test_tracker_direct_forgets_the_base_and_kind_follows_the_payoff():
    tr = DiffTracker(base_every=100, max_chain=99, payoff=PayoffRule(revisit=2))
    t = {"w": torch.zeros(4)}
    assert tr.kind("a", 0, t) == ("full", None)
    tr.saved("a", 0, t, "full")
    assert tr.kind("a", 1, t) == ("delta", 0)
    tr.record("a", "delta", 16, 16, 0.0)  # did not pay
    assert tr.direct("a")  # one direct full save; the base is dropped
    assert tr.kind("a", 3, t) == ("full", None)  # the probe's base is staged and full
    tr.saved("a", 3, t, "full")
    assert tr.kind("a", 4, t) == ("delta", 3)  # the probe
    assert DiffTracker(10, 9).direct("a") is False  # without a payoff rule: never direct


def test_policy_carries_the_rule_through_compose():
    assert differential().payoff == PayoffRule()
    assert differential(payoff=None).payoff is None
    p = compose(layerwise(), differential(payoff=PayoffRule(revisit=4)))
    assert p.payoff == PayoffRule(revisit=4) and p.tau is not None


# ---- a real run ----------------------------------------------------------------------------


class _TwoLayers(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.slow = nn.Linear(n, n, bias=False)
        self.fast = nn.Linear(n, n, bias=False)


class _Mover(torch.optim.Optimizer):
    """``slow``: a tiny step and a nearly constant state; ``fast``: AdamW-like moments of random gradients."""

    def __init__(self, model: _TwoLayers) -> None:
        super().__init__([{"params": [model.slow.weight], "kind": "slow"},
                          {"params": [model.fast.weight], "kind": "fast"}], {})
        self.gen = torch.Generator().manual_seed(1)

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            p = g["params"][0]
            st = self.state[p]
            if not st:
                st["m"] = torch.zeros_like(p)
                st["v"] = torch.ones_like(p)
            if g["kind"] == "slow":
                p.add_(torch.sign(p), alpha=1e-6)  # a relative change ~1e-5: the low mantissa bits
                st["v"].mul_(1.0 + 1e-6)
            else:
                grad = torch.randn(p.shape, generator=self.gen)
                st["m"].mul_(0.9).add_(grad, alpha=0.1)
                st["v"].mul_(0.999).addcmul_(grad, grad, value=0.001)
                p.add_(st["m"] / st["v"].sqrt().add(1e-8), alpha=-1e-3)


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"m.{k}": v.clone() for k, v in model.state_dict().items()}
    for i, p in enumerate(opt.param_groups):
        for k, v in opt.state[p["params"][0]].items():
            out[f"o.{i}.{k}"] = v.clone()
    return out


def test_incompressible_layer_goes_full_slow_layer_keeps_deltas_restore_bitwise(store):
    torch.manual_seed(0)
    model = _TwoLayers(256)  # 256 KiB of weights per layer, 768 KiB with the state
    opt = _Mover(model)
    rule = PayoffRule(revisit=4, max_revisit=4)
    ck = Checkpointer(store, "payoff", model, opt, differential(base_every=50, payoff=rule), keep_last=None)
    kinds: dict[int, dict[str, str]] = {}
    for step in range(16):
        opt.step()
        ck.save(step)
        assert ck.wait() == "committed"
        kinds[step] = {ln: store.info(key).kind
                       for key in store.list("payoff") if key.step == step for ln in [key.layer]}
    want = _state(model, opt)
    report = ck.plan.payoff_report()
    ck.close()
    assert report["slow"]["mode"] == "delta" and report["slow"]["ratio"] < 0.7
    assert report["fast"]["mode"] != "delta" and report["fast"]["direct_fulls"] >= 9
    assert report["fast"]["ratio"] > 0.7
    # the slow layer: its bases (the first save, its staggered base slot), deltas between; the fast one:
    # full objects but for its probes (revisit 4: a probe every 5 saves)
    slow = [kinds[s]["slow"] for s in range(16)]
    assert slow[0] == "full" and slow.count("delta") >= 14, slow
    fast = [kinds[s]["fast"] for s in range(16)]
    assert fast.count("delta") == 3 and report["fast"]["deltas"] == 3, fast

    model2 = _TwoLayers(256)
    opt2 = _Mover(model2)
    opt2.step()  # the optimizer state exists, with other values
    ck2 = Checkpointer(store, "payoff", model2, opt2, differential(base_every=50, payoff=rule))
    assert ck2.restore().step == 15
    ck2.close()
    got = _state(model2, opt2)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)), k


def test_without_payoff_every_save_between_bases_is_a_delta(store):
    torch.manual_seed(0)
    model = _TwoLayers(64)
    opt = _Mover(model)
    ck = Checkpointer(store, "nopay", model, opt, differential(base_every=50, payoff=None), keep_last=None)
    for step in range(4):
        opt.step()
        ck.save(step)
    assert ck.wait() == "committed"
    ck.close()
    kinds = [store.info(k).kind for k in store.list("nopay") if k.layer == "fast"]
    assert kinds.count("delta") == 3
