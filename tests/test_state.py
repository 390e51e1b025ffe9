"""Unit tests of tierstore.train.state (safe encoding of trainer state, RNG, wrappers) and the layer function."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch
from torch import nn

from tierstore.errors import CorruptObjectError, InvalidValueError
from tierstore.train.layers import default_layer_fn
from tierstore.train.state import RNGState, decode, encode, normalise_fqn, unwrap


def _round_trip(v):
    tensors: dict[str, torch.Tensor] = {}
    doc = json.loads(json.dumps(encode(v, tensors, "p/", "v"), allow_nan=False))  # plain JSON, no NaN tokens
    return decode(doc, tensors), tensors


def test_json_values_bytes_tuples_and_odd_keys_round_trip():
    v = {
        "lr": 3e-4, "steps": 10**30, "name": "cosine", "flag": True, "none": None,
        "blob": b"\x00\xffpickle-free", "betas": (0.9, 0.95), "nested": [{"a": (1, [2, (3,)])}],
        "nan": math.nan, "inf": -math.inf, 3: "int key", (1, 2): "tuple key", "__tuple__": "a tag as a key",
    }
    got, tensors = _round_trip(v)
    assert not tensors
    assert math.isnan(got.pop("nan")) and math.isnan(v.pop("nan"))
    assert got == v
    assert isinstance(got["betas"], tuple) and isinstance(got["blob"], bytes)


def test_tensors_leave_the_json_and_come_back():
    v = {"best_val_loss": torch.tensor(1.25), "gen": torch.Generator().manual_seed(3).get_state(),
         "arr": np.arange(5, dtype=np.int32), "np_scalar": np.float32(0.5)}
    got, tensors = _round_trip(v)
    assert sorted(tensors) == ["p/0", "p/1", "p/2"]
    assert got["best_val_loss"].dim() == 0 and got["best_val_loss"].item() == 1.25
    assert torch.equal(got["gen"], v["gen"])
    assert isinstance(got["arr"], np.ndarray) and got["arr"].dtype == np.int32 and (got["arr"] == v["arr"]).all()
    assert type(got["np_scalar"]) is np.float32 and got["np_scalar"] == np.float32(0.5)


@pytest.mark.parametrize("bad, where, fix", [
    ({"fn": lambda x: x}, "sched.fn", "code is not state"),
    ({"xs": [1, {2: (i for i in ())}]}, "sched.xs[1][2]", "state_dict()"),
    ({"obj": object()}, "sched.obj", "state_dict()"),
    ({"nt": torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])}, "sched.nt", "dense"),
    ({"loss_fn": nn.MSELoss()}, "sched.loss_fn", "save_hyperparameters(ignore=['loss_fn'])"),
    ({"cls": nn.Linear}, "sched.cls", "its name"),
    ({"loader": torch.utils.data.DataLoader(range(4))}, "sched.loader", "StatefulDataLoader"),
])
def test_unstorable_value_is_a_typed_error_naming_it_and_the_fix(bad, where, fix):
    with pytest.raises(InvalidValueError) as ei:
        encode(bad, {}, "p/", "sched")
    assert ei.value.key == where and where in str(ei.value) and fix in str(ei.value)


def test_cycle_is_refused():
    a: list = []
    a.append(a)
    with pytest.raises(InvalidValueError):
        encode(a, {}, "p/", "x")


def test_malformed_document_is_corrupt_not_a_crash():
    with pytest.raises(CorruptObjectError):
        decode({"__tensor__": "missing"}, {})
    with pytest.raises(CorruptObjectError):
        decode({"__bytes__": "not base64!"}, {})


def test_rng_state_round_trips_every_generator():
    rng = RNGState()
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    tensors: dict[str, torch.Tensor] = {}
    doc = json.loads(json.dumps(encode(rng.state_dict(), tensors, "r/", "rng")))
    want = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(9)
    random.seed(9)
    np.random.seed(9)
    rng.load_state_dict(decode(doc, {n: t.clone() for n, t in tensors.items()}))
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], want[0]) and got[1:] == want[1:]


def test_unwrap_and_normalise():
    m = nn.Sequential(nn.Linear(2, 2))
    assert unwrap(torch.compile(m)) is m
    assert unwrap(nn.DataParallel(m)) is m
    assert normalise_fqn("blocks.0._orig_mod.qkv.weight") == "blocks.0.qkv.weight"
    assert normalise_fqn("_fsdp_wrapped_module.layers.0._checkpoint_wrapped_module.w") == "layers.0.w"
    assert normalise_fqn("module.weight") == "module.weight"  # a submodule named "module" is kept


@pytest.mark.parametrize("name, layer", [
    ("transformer.h.3.attn.c_attn.weight", "transformer.h.3"),
    ("model.layers.12.mlp.up_proj.weight", "model.layers.12"),
    ("blocks.3.attn.qkv.weight", "blocks.3"),
    ("encoder.layer.0.attention.self.query.bias", "encoder.layer.0"),
    ("transformer.wte.weight", "transformer"),
    ("0.weight", "0"),
    ("0.1.weight", "0.1"),
    ("params.0", "params"),
    ("pos", "pos"),
])
def test_default_layer_fn_groups_blocks(name, layer):
    assert default_layer_fn(name) == layer
