"""Tied tensors (a language model's ``lm_head`` sharing the embedding's weight) are stored once (issue 29).

- a save writes the tied weight once: no object holds it under its second name, and a step's bytes are
  those of the untied tensors only;
- a restore into the same tied model gives the values bitwise and leaves the tie in place (one tensor);
- a weights-only restore into the same architecture untied fills both names from the one stored copy;
- a checkpoint an older tierstore wrote with both names stored restores into the tied model;
- a plain read (``tierstore export``'s source) gives both names, as ``state_dict()`` does.
"""

from __future__ import annotations

import torch
from torch import nn

from tierstore.train.checkpointer import Checkpointer
from tierstore.train.plain import read_plain

V, D = 64, 16


class TinyLM(nn.Module):
    def __init__(self, tie: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.block = nn.Linear(D, D)
        self.lm_head = nn.Linear(D, V, bias=False)
        if tie:
            self.lm_head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.tanh(self.block(self.embed(ids))))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 3) -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = torch.randint(0, V, (4, 8), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(ids).reshape(-1, V), ids.reshape(-1)).backward()
        opt.step()


def _saved(store, name: str, model: nn.Module, opt: torch.optim.Optimizer) -> int:
    ck = Checkpointer(store, name, model, opt)
    ck.restore()
    ck.save(0)
    assert ck.wait() == "committed"
    ck.close()
    return sum(store.info(k).size for k in store.list(name, step=0))


def test_a_tied_weight_is_stored_once_and_restores_tied(store):
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt)
    tied_bytes = _saved(store, "tied", model, opt)
    assert all(k.layer != "lm_head" for k in store.list("tied")), store.list("tied")  # nothing but the tied weight
    torch.manual_seed(0)
    untied = TinyLM(tie=False)
    uopt = torch.optim.AdamW(untied.parameters(), lr=1e-2)
    _train(untied, uopt)
    untied_bytes = _saved(store, "untied", untied, uopt)
    weight = V * D * 4 * 3  # the weight and AdamW's two moments
    assert untied_bytes - tied_bytes >= weight, (tied_bytes, untied_bytes)

    torch.manual_seed(1)
    back = TinyLM()
    bopt = torch.optim.AdamW(back.parameters(), lr=1e-2)
    ck = Checkpointer(store, "tied", back, bopt)
    assert ck.restore().step == 0
    ck.close()
    for (n, a), b in zip(model.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), n
    assert back.lm_head.weight is back.embed.weight  # still one tensor
    _train(model, opt, 1)
    _train(back, bopt, 1)  # the optimizer state came back too: the next step is the same
    assert torch.equal(model.embed.weight, back.embed.weight)


def test_a_tied_checkpoint_into_an_untied_model_and_an_old_one_into_a_tied_model(store):
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _train(model, opt)
    _saved(store, "tied2", model, opt)
    untied = TinyLM(tie=False)
    ck = Checkpointer(store, "tied2", untied)
    assert ck.restore(read_only=True).step == 0  # weights only: the one stored copy fills both names
    ck.close()
    assert torch.equal(untied.lm_head.weight, model.embed.weight)
    assert torch.equal(untied.embed.weight, model.embed.weight)

    # as an older tierstore stored a tied model: both names (an untied model holding the same values)
    old = TinyLM(tie=False)
    old.load_state_dict(model.state_dict())
    _saved(store, "old", old, torch.optim.SGD(old.parameters(), lr=0.1))
    assert any(k.layer == "lm_head" for k in store.list("old"))
    tied = TinyLM()
    ck = Checkpointer(store, "old", tied)
    assert ck.restore(read_only=True).step == 0
    ck.close()
    assert torch.equal(tied.embed.weight, model.embed.weight) and tied.lm_head.weight is tied.embed.weight


def test_a_plain_read_gives_both_names(store):
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _train(model, opt)
    _saved(store, "tied3", model, opt)
    plain = read_plain(store, "tied3")
    sd = plain.entries["model"]
    assert set(sd) == set(model.state_dict())
    assert torch.equal(sd["lm_head.weight"], model.embed.weight)
    fresh = TinyLM()
    fresh.load_state_dict(sd, strict=True)
