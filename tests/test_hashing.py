"""Tests of tierstore.train.hashing: digests identify bitwise-identical tensors of equal dtype and shape."""

from __future__ import annotations

import pytest
import torch

from tierstore import codec
from tierstore.errors import InvalidValueError
from tierstore.train.hashing import ALGORITHMS, digest_many, tensor_digest


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_equal_tensors_equal_digests(algo):
    a = torch.randn(64, 33)
    b = a.clone()
    assert tensor_digest(a, algo) == tensor_digest(b, algo)
    assert tensor_digest(a.t().contiguous().t(), algo) == tensor_digest(a, algo)  # same values, other strides
    assert len(tensor_digest(a, algo)) == 32
    p = torch.nn.Parameter(a.clone())
    assert tensor_digest(p, algo) == tensor_digest(a, algo)


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_one_bit_change_differs(algo):
    a = torch.randn(1000)
    seen = {tensor_digest(a, algo)}
    for i in (0, 1, 500, 999):
        for bit in (0, 17, 31):
            b = a.clone()
            b.view(torch.int32)[i] ^= 1 << bit
            seen.add(tensor_digest(b, algo))
    assert len(seen) == 1 + 4 * 3


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_dtype_and_shape_are_part_of_digest(algo):
    a = torch.arange(12, dtype=torch.int32)
    ds = {
        tensor_digest(a, algo),
        tensor_digest(a.view(3, 4), algo),
        tensor_digest(a.view(4, 3), algo),
        tensor_digest(a.view(torch.float32), algo),
        tensor_digest(a.view(torch.uint8), algo),
        tensor_digest(torch.empty(0), algo),
        tensor_digest(torch.empty(0, 3), algo),
        tensor_digest(torch.tensor(0.0), algo),
        tensor_digest(torch.tensor([0.0]), algo),
    }
    assert len(ds) == 9


def test_all_dtypes_and_odd_layouts():
    for name, dtype in codec.DTYPES.items():
        t = torch.zeros(5, dtype=dtype)
        assert tensor_digest(t) == tensor_digest(t.clone()), name
    base = torch.randn(10, 4)
    sliced = base[::2]  # non-contiguous
    assert tensor_digest(sliced) == tensor_digest(sliced.contiguous())
    one = base[:1, ::2][:, :1]  # size-1 with odd strides
    assert tensor_digest(one) == tensor_digest(one.clone())
    assert tensor_digest(-base) == tensor_digest(torch.neg(base).clone())


def test_digest_many_and_errors():
    ts = {"a": torch.ones(3), "b": torch.ones(3), "c": torch.zeros(3)}
    d = digest_many(ts)
    assert list(d) == ["a", "b", "c"] and d["a"] == d["b"] != d["c"]
    assert digest_many(ts, "blake2s")["a"] != d["a"]
    with pytest.raises(InvalidValueError):
        tensor_digest(torch.ones(3), "md5")
    with pytest.raises(InvalidValueError):
        tensor_digest([1, 2, 3])
