"""MemoryBackend: the conformance suite plus its capacity bound."""

from __future__ import annotations

import pytest

from backends.memory import MemoryBackend
from tests.conformance import BackendConformance
from tierstore.errors import TierFullError


class TestMemoryConformance(BackendConformance):
    @pytest.fixture
    def backend(self):
        b = MemoryBackend()
        yield b
        b.close()


def test_capacity_bound():
    b = MemoryBackend(capacity_bytes=100)
    b.put("a", b"x" * 60)
    with pytest.raises(TierFullError) as ei:
        b.put("b", b"y" * 50)
    assert ei.value.key == "b" and ei.value.capacity == 100
    b.put("a", b"z" * 90)  # replacing frees the old bytes first
    assert b.used_bytes() == 90
    with pytest.raises(TierFullError):
        b.reserve("r", 20)
    b.delete("a")
    r = b.reserve("r", 100)
    with pytest.raises(TierFullError):
        b.put("c", b"1")
    r.commit()
    assert b.used_bytes() == 100


def test_get_is_zero_copy():
    b = MemoryBackend()
    b.put("k", b"abc")
    assert b.get("k") is b.get("k")
