"""A restore validates before it touches: another optimizer type or state structure is refused, naming what
differs, before any module or optimizer changes; ``weights_only=True`` loads the modules alone.

One process against the real store of the fixtures (its Redis-protocol index, shared-memory host tier).
"""

from __future__ import annotations

import pytest
import torch

from tierstore.errors import RestoreMismatchError
from tierstore.train.checkpointer import Checkpointer


def _net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _step(net: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    net(torch.ones(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _snapshot(net: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    sd = opt.state_dict()
    return {"params": {n: p.detach().clone() for n, p in net.named_parameters()},
            "state": {i: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
                      for i, st in sd["state"].items()},
            "groups": [{k: v for k, v in g.items()} for g in sd["param_groups"]]}


def _same(a: dict, b: dict) -> bool:
    if a["params"].keys() != b["params"].keys() or a["state"].keys() != b["state"].keys():
        return False
    if not all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"]):
        return False
    for i in a["state"]:
        if a["state"][i].keys() != b["state"][i].keys():
            return False
        for k, v in a["state"][i].items():
            w = b["state"][i][k]
            if not (torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w):
                return False
    return a["groups"] == b["groups"]


@pytest.fixture
def saved(store):
    """An AdamW(weight_decay=0.1) checkpoint at step 1 of model ``v``; its weights."""
    net = _net(0)
    opt = torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.1)
    ck = Checkpointer(store, "v", net, opt)
    for s in range(2):
        _step(net, opt)
        ck.save(s)
    assert ck.wait() in ("committed", "durable")
    ck.close()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


@pytest.mark.parametrize("other", ["sgd", "adam"])
@pytest.mark.parametrize("verify", ["before_return", "in_pass"])
def test_another_optimizer_type_is_refused_before_anything_changes(store, saved, other, verify):
    net = _net(1)
    opt = (torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9) if other == "sgd"
           else torch.optim.Adam(net.parameters(), lr=0.5))
    _step(net, opt)  # the target holds state of its own
    before = _snapshot(net, opt)
    ck = Checkpointer(store, "v", net, opt)
    want = "SGD" if other == "sgd" else "Adam,"
    with pytest.raises(RestoreMismatchError, match=f"is a {want.rstrip(',')}, the checkpoint's a AdamW") as e:
        ck.restore(verify=verify)
    assert e.value.stored == "AdamW" and e.value.target == ("SGD" if other == "sgd" else "Adam")
    assert _same(before, _snapshot(net, opt))  # nothing changed: weights, state, lr
    assert opt.param_groups[0]["lr"] == 0.5
    # the weights alone, on request: the optimizer is left as it is
    got = ck.restore(verify=verify, weights_only=True)
    assert got.step == 1
    assert all(torch.equal(p, saved[n]) for n, p in net.named_parameters())
    after = _snapshot(net, opt)
    assert after["state"].keys() == before["state"].keys() and after["groups"] == before["groups"]
    assert all(torch.equal(v, after["state"][i][k]) for i, st in before["state"].items()
               for k, v in st.items() if isinstance(v, torch.Tensor))
    ck.close()


def test_other_optimizer_state_keys_are_refused(store, saved):
    """The same type, configured otherwise (``amsgrad``: one more state tensor per parameter), once stepped."""
    net = _net(1)
    opt = torch.optim.AdamW(net.parameters(), lr=0.5, weight_decay=0.1, amsgrad=True)
    _step(net, opt)
    before = _snapshot(net, opt)
    ck = Checkpointer(store, "v", net, opt)
    with pytest.raises(RestoreMismatchError, match=r"the checkpoint holds \['exp_avg', 'exp_avg_sq', 'step'\], "
                                                   r"the target \['exp_avg', 'exp_avg_sq', 'max_exp_avg_sq', 'step'\]"):
        ck.restore(verify="in_pass")
    assert _same(before, _snapshot(net, opt))
    ck.close()


class _Plain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)


class _Tagged(_Plain):
    """The same tensors, with non-tensor state of its own (``_extra_state``)."""

    def get_extra_state(self) -> dict:
        return {"tag": 7}

    def set_extra_state(self, state: dict) -> None:
        pass


def test_a_module_with_unexpected_keys_is_refused(store):
    ck = Checkpointer(store, "x", _Tagged())
    ck.save(0)
    assert ck.wait() in ("committed", "durable")
    ck.close()
    target = _Plain()
    before = {n: t.clone() for n, t in target.state_dict().items()}
    ck = Checkpointer(store, "x", target)
    with pytest.raises(RestoreMismatchError, match=r"unexpected keys \['_extra_state'\]"):
        ck.restore(verify="in_pass")
    assert all(torch.equal(before[n], t) for n, t in target.state_dict().items())
    ck.close()


def test_a_checkpoint_without_the_stored_class_stays_readable_and_checked(store):
    """An entry saved before the optimizer's class was stored (no ``"class"``): its ``meta["type"]`` decides."""
    net = _net(0)
    opt = torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.1)
    _step(net, opt)
    ck = Checkpointer(store, "old", net, opt)
    collect = ck.view.collect

    def old_collect(extra=None):
        c = collect(extra)
        for e in c.doc["entries"].values():
            e.pop("class", None)
        return c

    ck.view.collect = old_collect  # as an older version wrote it
    ck.save(0)
    assert ck.wait() in ("committed", "durable")
    ck.close()
    ref = _snapshot(net, opt)
    net2 = _net(1)
    opt2 = torch.optim.AdamW(net2.parameters(), lr=0.5, weight_decay=0.0)
    ck = Checkpointer(store, "old", net2, opt2)
    assert ck.restore(verify="in_pass").step == 0
    assert _same(ref, _snapshot(net2, opt2))
    net3 = _net(1)
    opt3 = torch.optim.SGD(net3.parameters(), lr=0.5)
    ck2 = Checkpointer(store, "old", net3, opt3)
    with pytest.raises(RestoreMismatchError, match="the checkpoint's a AdamW"):
        ck2.restore(verify="in_pass")
    ck.close()
    ck2.close()
