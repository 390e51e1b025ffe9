"""Tests of tierstore.delta: bitwise-exact XOR deltas and their compressibility."""

from __future__ import annotations

import lz4.frame
import numpy as np
import pytest
import torch

from tierstore import codec
from tierstore.delta import _CHUNK, apply_xor_delta, delta_nbytes, xor_delta
from tierstore.errors import CorruptObjectError, RestoreMismatchError


def bits(t: torch.Tensor) -> bytes:
    fresh = torch.empty(t.shape, dtype=t.dtype).copy_(t)
    return fresh.reshape(-1).view(torch.uint8).numpy().tobytes()


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    n = int(np.prod(shape)) if shape else 1
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    raw = np.random.default_rng(seed).integers(0, 256, size=n * dtype.itemsize, dtype=np.uint8)
    if dtype == torch.bool:
        raw &= 1
    return torch.from_numpy(raw).view(dtype).reshape(shape)


SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 0, 3), (_CHUNK + 3,)]


@pytest.mark.parametrize("dtype_name", sorted(codec.DTYPES))
@pytest.mark.parametrize("shape", SHAPES)
def test_roundtrip_every_dtype_bitwise(dtype_name, shape):
    dtype = codec.DTYPES[dtype_name]
    base, new = random_tensor(dtype, shape, 1), random_tensor(dtype, shape, 2)
    d = xor_delta(new, base)
    assert d.dtype == torch.uint8 and d.shape == (delta_nbytes(new),)
    assert bits(apply_xor_delta(base, d)) == bits(new)
    out = torch.empty(shape, dtype=dtype)
    assert apply_xor_delta(base, d, out=out) is out and bits(out) == bits(new)
    assert not bits(xor_delta(new, new)).strip(b"\0")


def test_shuffle_layout():
    base = torch.zeros(3, dtype=torch.int32)
    new = torch.tensor([0x04030201, 0x14131211, 0x24232221], dtype=torch.int32)
    assert xor_delta(new, base).tolist() == [1, 0x11, 0x21, 2, 0x12, 0x22, 3, 0x13, 0x23, 4, 0x14, 0x24]


def test_non_contiguous_inputs_and_out():
    base = torch.randn(6, 8)
    new = base + torch.randn(6, 8)
    d = xor_delta(new.t(), base.t())
    assert torch.equal(apply_xor_delta(base.t(), d), new.t())
    strided = torch.empty(6, 8).t()
    assert apply_xor_delta(base.t(), d, out=strided) is strided and torch.equal(strided, new.t())
    nan = torch.tensor([float("nan"), -0.0, float("inf")])
    weird = torch.tensor([1.0, 0.0, -float("inf")])
    assert bits(apply_xor_delta(weird, xor_delta(nan, weird))) == bits(nan)


def test_apply_in_place_on_base():
    base = torch.randn(1000)
    new = base * 1.01
    d = xor_delta(new, base)
    assert apply_xor_delta(base, d, out=base) is base and torch.equal(base, new)


def test_mismatches_rejected():
    with pytest.raises(RestoreMismatchError):
        xor_delta(torch.zeros(3), torch.zeros(4))
    with pytest.raises(RestoreMismatchError):
        xor_delta(torch.zeros(3), torch.zeros(3, dtype=torch.float64))
    with pytest.raises(CorruptObjectError):
        apply_xor_delta(torch.zeros(3), torch.zeros(11, dtype=torch.uint8))
    with pytest.raises(CorruptObjectError):
        apply_xor_delta(torch.zeros(3), torch.zeros(3, dtype=torch.int32))
    with pytest.raises(RestoreMismatchError):
        apply_xor_delta(torch.zeros(3), torch.zeros(12, dtype=torch.uint8), out=torch.zeros(2))


def _adamw_steps(steps: int = 3) -> list[torch.Tensor]:
    torch.manual_seed(0)
    layer = torch.nn.Linear(256, 256)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-4)
    x, y = torch.randn(64, 256), torch.randn(64, 256)
    snaps = [layer.weight.detach().clone()]
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(layer(x), y).backward()
        opt.step()
        snaps.append(layer.weight.detach().clone())
    return snaps


def test_shuffled_delta_of_real_updates_compresses():
    snaps = _adamw_steps()
    w0, w1 = snaps[-2], snaps[-1]
    assert not torch.equal(w0, w1)
    d = xor_delta(w1, w0)
    raw = w1.numpy().tobytes()
    dense_ratio = len(lz4.frame.compress(raw)) / len(raw)
    delta_ratio = len(lz4.frame.compress(d.numpy().tobytes())) / d.numel()
    plain_xor = torch.bitwise_xor(w1.view(torch.int32), w0.view(torch.int32)).numpy().tobytes()
    unshuffled_ratio = len(lz4.frame.compress(plain_xor)) / len(plain_xor)
    assert dense_ratio > 0.9  # fp32 weights do not compress
    assert delta_ratio < 0.8, delta_ratio  # the shuffled delta does (below the codec's "pays" threshold)
    assert delta_ratio < unshuffled_ratio - 0.1, (delta_ratio, unshuffled_ratio)
    blob = codec.encode({"w": d})
    assert codec.inspect(blob).compressed
    assert torch.equal(apply_xor_delta(w0, codec.decode(blob).tensors["w"]), w1)
