"""The benchmark's workload in layers of many tensors (``tierstore bench --tensors-per-layer``)."""

from __future__ import annotations

import pytest
import torch

from tierstore.bench.run import main
from tierstore.bench.workload import make_workload


def test_layers_of_many_parameters_hold_every_tensor_once():
    work = make_workload(0, 4 << 20, n_tensors=400, per_layer=40)
    assert len(work.layers) == 10
    for group in work.layers.values():
        assert len(group) == 40
        assert {n for n in group if n.startswith("param")} == {"param"} | {f"param{j}" for j in range(1, 10)}
    assert len(work.flat) == 400
    assert sum(t.numel() * t.element_size() for t in work.flat.values()) == work.nbytes
    assert 3.5 * 2**20 < work.nbytes <= 4 * 2**20 + 400 * 4


def test_perturb_changes_every_parameter_and_step():
    work = make_workload(0, 1 << 20, n_tensors=80, per_layer=8)
    before = {n: t.clone() for n, t in work.flat.items()}
    work.perturb()
    for name, t in work.flat.items():
        changed = not torch.equal(before[name], t)
        assert changed == (".param" in name or ".step" in name), name


def test_the_default_is_one_parameter_per_layer():
    work = make_workload(0, 1 << 20, n_tensors=40)
    assert len(work.layers) == 10
    assert all(sorted(g) == ["exp_avg", "exp_avg_sq", "param", "step"] for g in work.layers.values())


@pytest.mark.parametrize("per_layer", [0, 6])
def test_a_per_layer_count_that_is_not_whole_parameters_is_refused(per_layer, capsys):
    with pytest.raises(ValueError, match="multiple of 4"):
        make_workload(0, 1 << 20, n_tensors=40, per_layer=per_layer)
    assert main(["--tensors-per-layer", str(per_layer)]) == 2
    assert "multiple of 4" in capsys.readouterr().err


def test_the_lazy_systems_module_sees_every_parameter_and_its_state():
    from tierstore.bench.tierstore_systems import _as_module

    work = make_workload(0, 1 << 20, n_tensors=24, per_layer=12)
    module, opt = _as_module(work.layers)
    params = dict(module.named_parameters())
    assert len(params) == 6 and len(opt.state) == 6
    for layer, group in work.layers.items():
        sub = layer.split(".", 1)[-1]
        for tag in ("", "1", "2"):
            p = params[f"{sub}.param{tag}"]
            assert p.data_ptr() == group[f"param{tag}"].data_ptr()
            assert opt.state[p]["exp_avg_sq"] is group[f"exp_avg_sq{tag}"]
