"""Issue 13 item 7: the Checkpointer re-reads the module's and optimizer's state at every save.

A buffer reassigned each step, a replaced ``nn.Parameter`` and BatchNorm statistics after
``.double()`` must be saved as they are at the save, and restored into the live objects.
"""

from __future__ import annotations

import torch
from torch import nn

from tierstore.train.checkpointer import Checkpointer

torch.set_num_threads(1)


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count = self.count + 1  # a new tensor each step: the old one is no longer the module's
        return self.lin(x)


def test_reassigned_buffer_is_saved_current(store):
    m = Counter()
    ck = Checkpointer(store, "stale-buf", m, None, rank=0, world_size=1)
    for step in range(3):
        m(torch.randn(2, 4))
        ck.save(step)
        assert ck.wait() == "committed"
    ck.close()
    assert int(m.count) == 3
    m2 = Counter()
    ck2 = Checkpointer(store, "stale-buf", m2, None, rank=0, world_size=1)
    assert ck2.restore()[0] == 2
    assert int(m2.count) == 3
    assert torch.equal(m2.lin.weight, m.lin.weight)
    ck2.close()


def test_replaced_parameter_is_saved_and_restored(store):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    ck = Checkpointer(store, "stale-param", m, opt, rank=0, world_size=1)
    m(torch.randn(3, 4)).sum().backward()
    opt.step()
    # replace a parameter (e.g. a re-initialised head), in the module and in the optimizer
    new = nn.Parameter(torch.full((2, 4), 7.0))
    old = m[1].weight
    m[1].weight = new
    g = opt.param_groups[0]
    g["params"] = [new if p is old else p for p in g["params"]]
    opt.state.pop(old, None)
    ck.save(0)
    assert ck.wait() == "committed"
    ck.close()
    torch.manual_seed(1)
    m2 = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt2 = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9)
    ck2 = Checkpointer(store, "stale-param", m2, opt2, rank=0, world_size=1)
    assert ck2.restore()[0] == 0
    assert torch.equal(m2[1].weight, torch.full((2, 4), 7.0))
    assert torch.equal(m2[0].weight, m[0].weight)
    assert "momentum_buffer" not in opt2.state.get(m2[1].weight, {})
    assert torch.equal(opt2.state[m2[0].weight]["momentum_buffer"], opt.state[m[0].weight]["momentum_buffer"])
    ck2.close()


def test_batchnorm_stats_after_double_are_current(store):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    ck = Checkpointer(store, "stale-bn", m, None, rank=0, world_size=1)
    m.double()  # replaces the buffers (running_mean, running_var) with new float64 tensors
    m.train()
    for _ in range(3):
        m(torch.randn(8, 4, dtype=torch.float64))
    ck.save(0)
    assert ck.wait() == "committed"
    ck.close()
    torch.manual_seed(1)
    m2 = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).double()
    ck2 = Checkpointer(store, "stale-bn", m2, None, rank=0, world_size=1)
    assert ck2.restore()[0] == 0
    for (n, a), b in zip(m.state_dict().items(), m2.state_dict().values()):
        assert a.dtype == b.dtype and torch.equal(a, b), n
    assert int(m2[1].num_batches_tracked) == 3
    ck2.close()
