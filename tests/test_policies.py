"""Unit tests of tierstore.train.policies: composition and the per-layer trackers."""

from __future__ import annotations

import pytest
import torch

from tierstore.errors import ConfigError
from tierstore.train.policies import (
    DiffTracker,
    LayerwiseTracker,
    Policy,
    compose,
    dedup,
    differential,
    exact,
    layerwise,
    relative_change,
)


def test_constructors_and_compose():
    assert exact() == Policy()
    p = compose(layerwise(0.02, 5), differential(8), dedup(algo="blake2s"))
    assert (p.tau, p.max_staleness, p.base_every, p.dedup, p.dedup_algo) == (0.02, 5, 8, True, "blake2s")
    assert p.name == "layerwise+differential+dedup"
    assert p.chain_limit == 7
    assert compose().name == "exact"
    assert compose(differential(4, max_chain=2)).chain_limit == 2
    assert exact().chain_limit == 0


@pytest.mark.parametrize(
    "kwargs", [dict(tau=-1.0, max_staleness=2), dict(tau=0.1, max_staleness=0), dict(base_every=0), dict(dedup_algo="md5")]
)
def test_bad_config(kwargs):
    with pytest.raises(ConfigError):
        Policy(**kwargs)


def test_relative_change():
    a = {"w": torch.ones(4)}
    assert relative_change(a, a) == 0.0
    assert relative_change({"w": torch.full((4,), 1.1)}, a) == pytest.approx(0.1)
    assert relative_change({"w": torch.ones(4)}, {"w": torch.zeros(4)}) == float("inf")
    assert relative_change({"m": torch.tensor([True])}, {"m": torch.tensor([False])}) == float("inf")


def test_layerwise_tracker_threshold_and_staleness():
    tr = LayerwiseTracker(tau=0.05, max_staleness=3)
    w = {"w": torch.ones(10)}
    assert tr.want(0, "a", w)  # never saved
    tr.saved("a", 0, w)
    w["w"].add_(0.01)  # the tracker holds a copy: live changes do not leak in
    assert not tr.want(1, "a", w)
    assert not tr.want(2, "a", w)
    assert tr.want(3, "a", w)  # forced by staleness
    assert tr.want(1, "a", {"w": torch.full((10,), 1.2)})  # above tau
    assert tr.want(1, "a", {"v": torch.ones(10)})  # layout changed
    assert tr.last_step("a") == 0
    tr.reset()
    assert tr.want(1, "a", w)


def test_diff_tracker_bases_and_chains():
    tr = DiffTracker(base_every=4, max_chain=2)
    t = {"w": torch.zeros(3)}
    assert tr.kind("a", 0, t) == ("full", None)
    tr.saved("a", 0, dict(t), "full")
    assert tr.kind("a", 1, t) == ("delta", 0)
    tr.saved("a", 1, dict(t), "delta")
    assert tr.kind("a", 2, t) == ("delta", 1)
    tr.saved("a", 2, dict(t), "delta")
    assert tr.kind("a", 3, t) == ("full", None)  # chain limit
    tr.saved("a", 3, dict(t), "full")
    tr.saved("a", 4, dict(t), "delta")
    assert tr.kind("a", 7, t) == ("full", None)  # base_every since the base at 3
    assert tr.kind("a", 5, {"w": torch.zeros(4)}) == ("full", None)  # shape changed
    assert tr.kind("a", 5, {"w": torch.zeros(3), "v": torch.zeros(1)}) == ("full", None)
    tr.forget("a")
    assert tr.kind("a", 5, t) == ("full", None)
    assert DiffTracker(1, 0).kind("a", 0, t) == ("full", None)
