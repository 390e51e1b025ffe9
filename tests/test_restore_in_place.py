"""A restore loads optimizer state into the tensors the optimizer already holds, as ``dcp.load`` does.

Where the optimizer has a state tensor of the stored one's shape, dtype and device, the restore copies the
verified bytes into it (no new memory to fault in); where it has none, or one that another parameter's
state shares, a new tensor. Every verify mode, against the real index server and host tier.
"""

from __future__ import annotations

import pytest
import torch

from tests import _reshard as R
from tierstore.train.checkpointer import Checkpointer


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    model(*R.batch(step, 0)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _memory(opt: torch.optim.Optimizer) -> dict[tuple[int, str], tuple[int, int]]:
    return {(id(p), k): (id(v), v.data_ptr()) for p, st in opt.state.items() for k, v in st.items()
            if isinstance(v, torch.Tensor)}


def _saved(store, name: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, Checkpointer, dict]:
    model = R.make(seed=1)
    opt = R.adamw(model)
    _train(model, opt, 0)
    ck = Checkpointer(store, name, model, opt)
    ck.save(0)
    assert ck.wait() == "committed"
    return model, opt, ck, R.full_state(model, opt)


@pytest.mark.parametrize("verify", ["in_pass", "before_return", "before_update"])
def test_optimizer_state_is_restored_into_the_optimizers_own_tensors(store, verify):
    model, opt, ck, want = _saved(store, f"ip-{verify}")
    _train(model, opt, 1)  # the state moves on
    before = _memory(opt)
    assert R.differences(R.full_state(model, opt), want) != []
    assert ck.restore(verify=verify, read_only=verify != "before_update").step == 0
    if verify == "before_update":
        ck.before_update()  # the verification's verdict: every copy matched
    assert R.differences(R.full_state(model, opt), want) == []
    assert _memory(opt) == before
    _train(model, opt, 1)  # the restored state trains on; the stored copy is another memory
    ck.close()
    fresh = R.make(seed=3)
    fopt = R.adamw(fresh)
    reader = Checkpointer(store, f"ip-{verify}", fresh, fopt)
    assert reader.restore(read_only=True).step == 0
    assert R.differences(R.full_state(fresh, fopt), want) == []
    reader.close()


def test_an_optimizer_without_state_gets_new_tensors(store):
    _model, _opt, ck, want = _saved(store, "ip-fresh")
    ck.close()
    model = R.make(seed=2)
    opt = R.adamw(model)
    ck = Checkpointer(store, "ip-fresh", model, opt)
    assert not opt.state
    assert ck.restore().step == 0
    ck.before_update()
    assert R.differences(R.full_state(model, opt), want) == []
    ck.close()


def test_state_tensors_shared_between_parameters_are_not_written_through_each_other(store):
    """Two parameters of one shape whose ``exp_avg`` is one tensor before the restore: copying both in place
    would leave the first with the second's values; each gets its own."""
    model, opt, ck, want = _saved(store, "ip-shared")
    a, b = model.blocks[0].fc.weight, model.blocks[1].fc.weight
    assert a.shape == b.shape
    opt.state[b]["exp_avg"] = opt.state[a]["exp_avg"]
    assert ck.restore(verify="in_pass", read_only=True).step == 0
    assert R.differences(R.full_state(model, opt), want) == []
    assert opt.state[a]["exp_avg"].data_ptr() != opt.state[b]["exp_avg"].data_ptr()
    ck.close()
