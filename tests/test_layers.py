"""Unit tests of tierstore.train.layers: layer mapping and validated in-place restore."""

from __future__ import annotations

import copy

import pytest
import torch

from tierstore.errors import InvalidValueError, RestoreMismatchError
from tierstore.testing.gpt import GPTConfig, make_model
from tierstore.train.layers import StateMap, default_layer_fn, sanitize_layer_name

torch.set_num_threads(1)
CFG = GPTConfig(d_model=32, n_layer=2, n_head=2, block=16)


def _stepped(seed=0, steps=2, optim="adamw"):
    model, opt = make_model(CFG, seed=seed, optim=optim)
    for i in range(steps):
        x = torch.randint(0, CFG.vocab, (2, CFG.block), generator=torch.Generator().manual_seed(i))
        opt.zero_grad()
        model(x, x).backward()
        opt.step()
    return model, opt


def _snapshot(sm: StateMap):
    return (
        {ln: {n: t.clone() for n, t in sm.layer_tensors(ln).items()} for ln in sm.layers},
        {ln: sm.layer_meta(ln) for ln in sm.layers},
        copy.deepcopy(sm.optimizer_meta()),
    )


def _state(model, opt):
    return copy.deepcopy((model.state_dict(), opt.state_dict()))


def _assert_same(a, b):
    (ma, oa), (mb, ob) = a, b
    assert ma.keys() == mb.keys()
    for k in ma:
        assert torch.equal(ma[k], mb[k]), k
    assert oa["param_groups"] == ob["param_groups"]
    assert oa["state"].keys() == ob["state"].keys()
    for i in oa["state"]:
        for k, v in oa["state"][i].items():
            w = ob["state"][i][k]
            assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w


def test_default_layer_fn_and_sanitize():
    assert default_layer_fn("blocks.3.attn.qkv.weight") == "blocks.3"
    assert default_layer_fn("embed.weight") == "embed"
    assert default_layer_fn("pos") == "pos"
    assert sanitize_layer_name("a b/c") == "a_b_c"
    assert sanitize_layer_name("x..y") == "x._y"


def test_layers_of_gpt():
    model, opt = _stepped()
    sm = StateMap(model, opt)
    assert sorted(sm.layers) == sorted(["embed", "pos", "blocks.0", "blocks.1", "ln_f", "head"])
    t = sm.layer_tensors("blocks.0")
    assert "param/blocks.0.qkv.weight" in t and "buffer/blocks.0.mask" in t
    assert "optim/blocks.0.qkv.weight/exp_avg_sq" in t and "optim/blocks.0.qkv.weight/step" in t
    custom = StateMap(model, opt, layer_fn=lambda n: "all layers!")
    assert list(custom.layers) == ["all_layers_"]


def test_round_trip_restores_module_and_optimizer_bitwise():
    src_m, src_o = _stepped(seed=0, steps=3)
    snap = _snapshot(StateMap(src_m, src_o))
    dst_m, dst_o = _stepped(seed=1, steps=1)
    for g in dst_o.param_groups:
        g["lr"] = 0.5
        g["betas"] = (0.1, 0.2)
    StateMap(dst_m, dst_o).load(*snap)
    _assert_same(_state(dst_m, dst_o), _state(src_m, src_o))
    assert isinstance(dst_o.param_groups[0]["betas"], tuple)


def test_restore_into_lazy_optimizer_creates_state():
    src_m, src_o = _stepped(seed=0, steps=2)
    snap = _snapshot(StateMap(src_m, src_o))
    dst_m, dst_o = make_model(CFG, seed=5)
    assert len(dst_o.state) == 0
    StateMap(dst_m, dst_o).load(*snap)
    _assert_same(_state(dst_m, dst_o), _state(src_m, src_o))
    # training continues identically
    x = torch.randint(0, CFG.vocab, (2, CFG.block), generator=torch.Generator().manual_seed(9))
    for m, o in ((src_m, src_o), (dst_m, dst_o)):
        o.zero_grad()
        m(x, x).backward()
        o.step()
    _assert_same(_state(dst_m, dst_o), _state(src_m, src_o))


def test_sgd_momentum_round_trip():
    src_m, src_o = _stepped(seed=0, steps=2, optim="sgd")
    snap = _snapshot(StateMap(src_m, src_o))
    assert any("momentum_buffer" in n for ts in snap[0].values() for n in ts)
    dst_m, dst_o = make_model(CFG, seed=3, optim="sgd")
    StateMap(dst_m, dst_o).load(*snap)
    _assert_same(_state(dst_m, dst_o), _state(src_m, src_o))


@pytest.mark.parametrize(
    "mutate, layer, tensor",
    [
        (lambda s: s[0]["blocks.1"].__setitem__("param/blocks.1.fc.weight", torch.zeros(3, 3)), "blocks.1", "param/blocks.1.fc.weight"),
        (lambda s: s[0]["head"].__setitem__("param/head.weight", s[0]["head"]["param/head.weight"].double()), "head", "param/head.weight"),
        (lambda s: s[0].pop("ln_f"), "ln_f", None),
        (lambda s: s[0]["embed"].pop("param/embed.weight"), "embed", "param/embed.weight"),
        (lambda s: s[0]["pos"].__setitem__("param/pos.extra", torch.zeros(1)), "pos", "param/pos.extra"),
        (lambda s: s[0]["blocks.0"].__setitem__("optim/blocks.0.fc.weight/exp_avg", torch.zeros(2)), "blocks.0", "optim/blocks.0.fc.weight/exp_avg"),
        (lambda s: s[0].__setitem__("ghost", {}), "ghost", None),
    ],
)
def test_mismatch_raises_and_changes_nothing(mutate, layer, tensor):
    src_m, src_o = _stepped(seed=0, steps=2)
    snap = _snapshot(StateMap(src_m, src_o))
    mutate(snap)
    dst_m, dst_o = _stepped(seed=1, steps=1)
    before = _state(dst_m, dst_o)
    with pytest.raises(RestoreMismatchError) as ei:
        StateMap(dst_m, dst_o).load(*snap)
    assert ei.value.layer == layer and ei.value.tensor == tensor
    assert layer in str(ei.value)
    _assert_same(_state(dst_m, dst_o), before)


def test_param_group_mismatch_raises():
    src_m, src_o = _stepped(seed=0, steps=1)
    snap = _snapshot(StateMap(src_m, src_o))
    dst_m, _ = make_model(CFG, seed=1)
    params = list(dst_m.parameters())
    dst_o = torch.optim.AdamW([{"params": params[:3]}, {"params": params[3:]}])
    with pytest.raises(RestoreMismatchError):
        StateMap(dst_m, dst_o).load(*snap)


def test_optimizer_with_foreign_param_rejected():
    model, _ = make_model(CFG)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(InvalidValueError):
        StateMap(model, opt)


def test_signature_changes_with_layout():
    m1, o1 = make_model(CFG)
    m2, o2 = make_model(GPTConfig(d_model=16, n_layer=2, n_head=2, block=16))
    assert StateMap(m1, o1).signature() != StateMap(m2, o2).signature()
    assert StateMap(m1, o1).signature() == StateMap(*make_model(CFG, seed=4)).signature()
