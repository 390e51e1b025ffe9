"""The device tier: conformance of the bytes interface, and the reused double-buffered snapshots."""

from __future__ import annotations

import threading

import pytest
import torch

from backends.device import DeviceBackend
from tests.conformance import BackendConformance
from tierstore.errors import InvalidValueError, TierFullError


def _state(scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(int(scale * 1000))
    return {
        "w": torch.randn(64, 33, generator=g) * scale,
        "b": torch.randn(33, generator=g).to(torch.bfloat16),
        "step": torch.tensor(7, dtype=torch.int64),
        "mask": torch.rand(17, generator=g) > 0.5,
        "t": torch.randn(8, 9, generator=g).t(),  # non-contiguous source
        "empty": torch.empty(0, 3),
    }


def _assert_equal(snap_tensors, src):
    assert snap_tensors.keys() == src.keys()
    for k, v in src.items():
        got = snap_tensors[k]
        assert got.dtype == v.dtype and got.shape == v.shape, k
        assert torch.equal(got, v), k


class TestDeviceConformanceCPU(BackendConformance):
    @pytest.fixture
    def backend(self):
        b = DeviceBackend("cpu")
        yield b
        b.close()


def test_snapshot_copies_and_isolates_from_source():
    b = DeviceBackend()
    src = _state()
    snap = b.snapshot("m/rank0", src)
    expected = {k: v.clone() for k, v in src.items()}
    for v in src.values():
        if v.numel() and v.dtype != torch.bool:
            v.add_(1)  # the next optimizer step
    snap.wait()
    assert snap.done
    _assert_equal(snap.tensors, expected)


def test_double_buffering_reuses_buffers():
    b = DeviceBackend()
    s1 = b.snapshot("m", _state(1))
    s2 = b.snapshot("m", _state(2))  # s1 not yet released: goes to the second set
    ptr1, ptr2 = s1.tensors["w"].data_ptr(), s2.tensors["w"].data_ptr()
    assert ptr1 != ptr2
    _assert_equal(s1.tensors, _state(1))  # untouched by s2
    s1.release()
    s3 = b.snapshot("m", _state(3))
    assert s3.tensors["w"].data_ptr() == ptr1  # reused, not reallocated
    assert b.latest("m") is s3
    used = b.used_bytes()
    s2.release()
    s3.release()
    for i in range(4, 8):
        b.snapshot("m", _state(i)).release()
    assert b.used_bytes() == used  # steady state: no new allocations
    _assert_equal(b.latest("m").tensors, _state(7))


def test_latest_is_never_overwritten():
    b = DeviceBackend()
    s1 = b.snapshot("m", _state(1))
    s1.release()  # released, but it is the newest: a rollback may still need it
    s2 = b.snapshot("m", _state(2))
    assert s2.tensors["w"].data_ptr() != s1.tensors["w"].data_ptr()
    _assert_equal(s1.tensors, _state(1))
    assert b.latest("m") is s2


def test_snapshot_waits_for_a_release():
    b = DeviceBackend(wait_timeout_s=30)
    s1 = b.snapshot("m", _state(1))
    b.snapshot("m", _state(2))
    done = threading.Event()
    result = []

    def third():
        result.append(b.snapshot("m", _state(3)))
        done.set()

    t = threading.Thread(target=third)
    t.start()
    assert not done.wait(0.2)  # both sets busy: the third save waits
    s1.release()
    t.join(30)
    _assert_equal(result[0].tensors, _state(3))


def test_snapshot_times_out_when_never_released():
    b = DeviceBackend(wait_timeout_s=0.05, buffers_per_name=1)
    b.snapshot("m", _state(1))
    with pytest.raises(TierFullError):
        b.snapshot("m", _state(2))


def test_buffers_grow_with_the_state():
    b = DeviceBackend()
    b.snapshot("m", {"w": torch.ones(10)}).release()
    b.snapshot("m", {"w": torch.ones(10)}).release()
    big = {"w": torch.arange(1000.0), "v": torch.ones(3, dtype=torch.float64)}
    s = b.snapshot("m", big)
    _assert_equal(s.tensors, big)


def test_capacity_bound():
    b = DeviceBackend(capacity_bytes=10_000)
    b.snapshot("m", {"w": torch.ones(1000)})  # 4000 bytes
    with pytest.raises(TierFullError):
        b.snapshot("m", {"w": torch.ones(2000)})  # a second set of 8000 bytes
    with pytest.raises(TierFullError):
        b.put("obj", b"x" * 7000)
    b.drop("m")
    b.put("obj", b"x" * 7000)


def test_non_tensor_rejected():
    with pytest.raises(InvalidValueError):
        DeviceBackend().snapshot("m", {"w": [1, 2, 3]})


# -- CUDA --------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.cuda
def test_cuda_snapshot_on_side_stream():
    b = DeviceBackend("cuda")
    src = {k: v.cuda() for k, v in _state().items()}
    expected = {k: v.clone() for k, v in src.items()}
    snap = b.snapshot("m", src)
    snap.fence()  # the next optimizer step is ordered after the copies
    for v in src.values():
        if v.numel() and v.dtype != torch.bool:
            v.add_(1)
    snap.wait()
    assert snap.done
    for k, v in expected.items():
        assert snap.tensors[k].is_cuda and torch.equal(snap.tensors[k], v), k
    s2 = b.snapshot("m", src)
    snap.release()
    s3 = b.snapshot("m", src)
    assert s3.tensors["w"].data_ptr() == snap.tensors["w"].data_ptr()
    s2.wait(), s3.wait()


@cuda
@pytest.mark.cuda
def test_cuda_bytes_roundtrip():
    b = DeviceBackend("cuda")
    b.put("x", [b"abc", b"def"])
    assert bytes(b.get("x")) == b"abcdef"


@cuda
@pytest.mark.cuda
class TestDeviceConformanceCUDA(BackendConformance):
    @pytest.fixture
    def backend(self):
        b = DeviceBackend("cuda")
        yield b
        b.close()
