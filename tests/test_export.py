"""Export (a committed step -> safetensors / torch.save) and import (weights -> step 0), single process.

Multi-rank round trips (DDP replicas, FSDP2 shards reassembled) are in tests/test_export_dist.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tests._trainer import CFG, make, train_step
from tierstore.cli import main as cli_main
from tierstore.errors import KeyExistsError, MissingDependencyError, NoValidCopyError, RestoreMismatchError
from tierstore.interop.export import export_model
from tierstore.interop.importing import ImportMismatchError, import_model
from tierstore.interop.weights_files import INDEX_FILE
from tierstore.keys import ShardKey
from tierstore.testing.gpt import GPT
from tierstore.train.checkpointer import Checkpointer
from tierstore.train.policies import differential, layerwise
from tierstore.train.state import RNGState


def demo_gpt() -> nn.Module:
    """The factory ``tierstore import --module tests.test_export:demo_gpt`` calls."""
    return GPT(CFG)


def load_export(out: Path) -> dict[str, torch.Tensor]:
    """What a transformers-style reader sees: the index's files loaded with safetensors, one by one."""
    index = out / INDEX_FILE
    if not index.exists():
        return load_file(out / "model.safetensors")
    wm = json.loads(index.read_text())["weight_map"]
    got: dict[str, torch.Tensor] = {}
    for f in sorted(set(wm.values())):
        part = load_file(out / f)
        assert {n for n, g in wm.items() if g == f} == set(part), f
        got.update(part)
    assert set(got) == set(wm)
    return got


def bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def optim_by_name(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {f"optim/{names[id(p)]}/{k}": v for p, st in opt.state.items() for k, v in st.items()
            if isinstance(v, torch.Tensor)}


def pretrained(tmp_path: Path, sharded: bool) -> tuple[Path, dict[str, torch.Tensor]]:
    """A 'pretrained' GPT in safetensors: one file, or two shards and an index written by hand."""
    torch.manual_seed(123)
    sd = {n: t.clone() for n, t in GPT(CFG).state_dict().items()}
    src = tmp_path / "pretrained"
    src.mkdir()
    if not sharded:
        save_file(sd, src / "model.safetensors")
        return src, sd
    names = sorted(sd)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for f, ns in halves.items():
        save_file({n: sd[n] for n in ns}, src / f)
    (src / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": {n: f for f, ns in halves.items()
                                                                             for n in ns}}))
    return src, sd


@pytest.mark.parametrize("sharded", [False, True])
def test_import_train_export_round_trip_bitwise(store, tmp_path, sharded):
    src, sd = pretrained(tmp_path, sharded)
    model, opt, sched, loader = make()
    rep = import_model(store, src, "ft", module=GPT(CFG))
    assert rep.step == 0 and rep.tensors == len(sd) and rep.source == "safetensors"
    ck = Checkpointer(store, "ft", state={"model": model, "optim": opt, "sched": sched, "data": loader,
                                          "rng": RNGState()}, policy=differential(base_every=5))
    assert ck.restore().step == 0
    assert all(bits(model.state_dict()[n], t) for n, t in sd.items())
    assert not opt.state  # the optimizer, scheduler, loader start fresh
    for step in range(1, 4):
        train_step(model, opt, sched, loader)
        ck.save(step)
    assert ck.wait() == "committed"
    ck.close()
    rep = export_model(store, "ft", tmp_path / "out", max_shard_size="40KB")
    assert rep.step == 3 and len(rep.files) > 2 and rep.files[-1] == INDEX_FILE
    got = load_export(tmp_path / "out")
    live = {**model.state_dict(), **optim_by_name(model, opt)}
    assert set(got) == set(live)
    for n, t in live.items():
        assert bits(got[n], t), n
    assert rep.skipped == ["data", "rng", "sched"]


def _sgd(model: nn.Module, seed: int, frozen: tuple[str, ...] = ()) -> None:
    torch.manual_seed(seed)
    x = torch.randint(0, CFG.vocab, (2, CFG.block))
    model(x, x).backward()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.grad is not None and not n.startswith(frozen):
                p -= 0.01 * p.grad
            p.grad = None


def test_first_differential_save_is_a_delta_against_the_import(store, tmp_path):
    src, _ = pretrained(tmp_path, False)
    import_model(store, src, "ft", module=GPT(CFG))
    model = GPT(CFG)
    ck = Checkpointer(store, "ft", state={"model": model}, policy=differential(base_every=50))
    assert ck.restore().step == 0
    _sgd(model, 1)
    ck.save(1)
    assert ck.wait() == "committed"
    ck.close()
    deltas = [k for k in store.list("ft", step=1) if store.info(k).kind == "delta"]
    assert deltas and len(deltas) >= len(ck.layers) - 1, ck.stats.objects  # a layer's slot may force a base
    assert all(store.info(k).base == ShardKey("ft", k.layer, 0, 0) for k in deltas)
    again = GPT(CFG)
    assert Checkpointer(store, "ft", state={"model": again}).restore(read_only=True).step == 1
    assert all(bits(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))


def test_first_layerwise_save_skips_layers_unchanged_since_the_import(store, tmp_path):
    src, _ = pretrained(tmp_path, False)
    import_model(store, src, "ft", module=GPT(CFG))
    model = GPT(CFG)
    opt = torch.optim.SGD([p for n, p in model.named_parameters() if n.startswith("blocks.1.")], lr=0.05)
    pol = layerwise(tau=0.0, max_staleness=10)
    ck = Checkpointer(store, "ft", state={"model": model, "optim": opt}, policy=pol)
    assert ck.restore().step == 0
    torch.manual_seed(1)
    x = torch.randint(0, CFG.vocab, (2, CFG.block))
    model(x, x).backward()
    opt.step()
    ck.save(1)
    assert ck.wait() == "committed"
    ck.close()
    assert {k.layer for k in store.list("ft", step=1)} == {"blocks.1"}  # the one block that moved
    rep = export_model(store, "ft", tmp_path / "out", max_staleness=10, model_only=True)
    got = load_export(tmp_path / "out")
    assert rep.step == 1 and all(bits(got[n], t) for n, t in model.state_dict().items())


def test_named_step_and_refused_steps(store, tmp_path):
    model = GPT(CFG)
    ck = Checkpointer(store, "m", state={"model": model})
    snaps = {}
    for step in range(3):
        _sgd(model, step)
        snaps[step] = {n: t.clone() for n, t in model.state_dict().items()}
        ck.save(step)
        assert ck.wait() == "committed"
    ck.close()
    rep = export_model(store, "m", tmp_path / "one", step=1, format="torch")
    got = torch.load(tmp_path / "one" / "pytorch_model.bin", weights_only=True)
    assert rep.step == 1 and all(bits(got[n], t) for n, t in snaps[1].items())
    store.begin_step("m", 5, 1, layout={"layers": ck.layers})  # begun, never voted: preparing
    for step in (5, 7):
        with pytest.raises(NoValidCopyError, match="not committed"):
            export_model(store, "m", tmp_path / f"no{step}", step=step)
        assert not (tmp_path / f"no{step}").exists() or not any((tmp_path / f"no{step}").iterdir())
    assert export_model(store, "m", tmp_path / "newest").step == 2  # the preparing step is not the newest
    with pytest.raises(KeyExistsError):
        export_model(store, "m", tmp_path / "newest")
    assert export_model(store, "m", tmp_path / "newest", step=0, overwrite=True).step == 0
    assert all(bits(load_export(tmp_path / "newest")[n], t) for n, t in snaps[0].items())


def test_dtype_cast_floats_only(store, tmp_path):
    model = GPT(CFG)
    model.register_buffer("seen", torch.tensor([7, 9], dtype=torch.int64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ck = Checkpointer(store, "m", model, opt)
    x = torch.randint(0, CFG.vocab, (2, CFG.block))
    model(x, x).backward()
    opt.step()
    ck.save(0)
    assert ck.wait() == "committed"
    ck.close()
    export_model(store, "m", tmp_path / "bf16", dtype="bf16")
    got = load_export(tmp_path / "bf16")
    for n, t in model.state_dict().items():
        want = t.to(torch.bfloat16) if t.is_floating_point() else t
        assert bits(got[n], want), n
    assert got["seen"].dtype == torch.int64
    for n, t in optim_by_name(model, opt).items():  # optimizer state (its step counts) keeps its dtype
        assert bits(got[n], t), n


def test_names_that_do_not_match_are_reported_and_nothing_is_written(store, tmp_path):
    _, sd = pretrained(tmp_path, False)
    bad = dict(sd)
    bad["blocks.0.extra.weight"] = torch.zeros(3)
    del bad["head.weight"]
    bad["pos.weight"] = torch.zeros(5, 5)
    save_file(bad, tmp_path / "bad.safetensors")
    with pytest.raises(ImportMismatchError) as ei:
        import_model(store, tmp_path / "bad.safetensors", "ft", module=GPT(CFG))
    e = ei.value
    assert isinstance(e, RestoreMismatchError)
    assert e.fields["unexpected"] == ["blocks.0.extra.weight"] and e.fields["missing"] == ["head.weight"]
    assert e.fields["shapes"] == [["pos.weight", [5, 5], list(sd["pos.weight"].shape)]]
    assert "nothing was written" in str(e)
    assert store.steps.steps("ft") == [] and store.list("ft") == []
    assert cli_main(["import", str(tmp_path / "bad.safetensors"), "--model", "ft", "--redis", store.config.redis_url,
                     "--host-root", store.config.host_root, "--module", "tests.test_export:demo_gpt"]) == 1
    assert store.steps.steps("ft") == []


def test_torch_file_with_wrapper_prefixes_and_a_pickled_object(store, tmp_path):
    _, sd = pretrained(tmp_path, False)
    torch.save({"state_dict": {f"module._orig_mod.{n}": t for n, t in sd.items()}, "epoch": 3}, tmp_path / "w.pt")
    rep = import_model(store, tmp_path / "w.pt", "ft", module=GPT(CFG))
    assert rep.source == "torch" and rep.renamed["module._orig_mod.head.weight"] == "head.weight"
    model = GPT(CFG)
    Checkpointer(store, "ft", state={"model": model}).restore(read_only=True)
    assert all(bits(model.state_dict()[n], t) for n, t in sd.items())
    torch.save({"w": torch.zeros(2), "evil": _Evil()}, tmp_path / "evil.pt")
    with pytest.raises(Exception) as ei:  # weights_only refuses the object: nothing is unpickled
        import_model(store, tmp_path / "evil.pt", "other")
    assert "weights_only" in str(ei.value) and store.steps.steps("other") == []
    with pytest.raises(KeyExistsError):
        import_model(store, tmp_path / "w.pt", "ft", module=GPT(CFG))


class _Evil:
    def __reduce__(self):
        return (print, ("unpickled!",))


def test_memory_bound_on_a_state_larger_than_the_bound(store, tmp_path):
    layers = 16
    model = nn.Sequential(*[nn.Linear(128, 128) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 128)).sum().backward()
    opt.step()
    ck = Checkpointer(store, "big", model, opt)
    ck.save(0)
    assert ck.wait() == "committed"
    ck.close()
    per_layer = [sum(t.numel() * t.element_size() for t in [*m.parameters(),
                     *[v for p in m.parameters() for v in opt.state[p].values()]]) for m in model]
    largest_tensor = 128 * 128 * 4
    rep = export_model(store, "big", tmp_path / "out", dtype="bf16", max_shard_size="100KB")
    total = sum(per_layer)
    assert rep.peak_bytes <= 2 * max(per_layer) + largest_tensor, (rep.peak_bytes, max(per_layer))
    assert total > 5 * (2 * max(per_layer) + largest_tensor)  # the state is well beyond the bound
    assert rep.largest_layer_bytes == max(per_layer)
    got = load_export(tmp_path / "out")
    assert bits(got["15.weight"], model[15].weight.detach().to(torch.bfloat16))


def test_corrupt_shard_falls_back_or_fails_naming_it(store, tmp_path):
    model = GPT(CFG)
    ck = Checkpointer(store, "m", state={"model": model})
    for step in range(2):
        _sgd(model, step)
        ck.save(step)
        assert ck.wait() == "committed"
    ck.close()
    store.flush()
    key = ShardKey("m", "blocks.0", 1, 0)
    name = getattr(store.info(key), "name", str(key))  # the physical name of the live copy (tagged or the key)
    host = Path(store.host.root) / name
    data = bytearray(host.read_bytes())
    data[len(data) // 2] ^= 0x40
    host.write_bytes(bytes(data))
    rep = export_model(store, "m", tmp_path / "fallback")  # the durable copy verifies
    got = load_export(tmp_path / "fallback")
    assert rep.step == 1 and all(bits(got[n], t) for n, t in model.state_dict().items())
    durable = Path(store.durable.root) / name
    durable.write_bytes(durable.read_bytes()[:-5])
    try:
        rep = export_model(store, "m", tmp_path / "bad")
    except NoValidCopyError as e:
        assert str(key) in str(e)
        assert not any(p.name.endswith(".safetensors") for p in (tmp_path / "bad").iterdir())
    else:  # a read path that verifies while resolving falls back to the older step
        assert rep.step == 0


def test_cli_export_import_and_install_hint(store, tmp_path, capsys, monkeypatch):
    model = GPT(CFG)
    ck = Checkpointer(store, "m", state={"model": model})
    ck.save(0)
    assert ck.wait() == "committed"
    ck.close()
    conn = ["--redis", store.config.redis_url, "--host-root", store.config.host_root,
            "--durable", store.config.durable_url]
    out = tmp_path / "cli"
    assert cli_main(["export", "m", "0", "--out", str(out), "--model-only", "--max-shard-size", "30KB", *conn]) == 0
    cap = capsys.readouterr()
    assert "layers" in cap.err and "exported m step 0" in cap.out
    assert all(bits(load_export(out)[n], t) for n, t in model.state_dict().items())
    assert cli_main(["import", str(out), "--model", "copy", "--module", "tests.test_export:demo_gpt", *conn]) == 0
    assert "imported" in capsys.readouterr().out and store.resolve("copy").step == 0
    monkeypatch.setitem(sys.modules, "safetensors", None)  # as if the extra were not installed
    with pytest.raises(MissingDependencyError):
        import_model(store, out, "third")
    assert cli_main(["import", str(out), "--model", "third", *conn]) == 1
    assert "pip install 'tierstore[safetensors]'" in capsys.readouterr().err


def test_cli_import_finds_a_module_in_the_current_directory(store, tmp_path):
    """``tierstore import --module mymodels:build_mlp`` with ``mymodels.py`` in the current directory, run as the
    console script runs (``python -P``: no current directory on ``sys.path``, no ``PYTHONPATH=.``)."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "mymodels.py").write_text("import torch\n\n\ndef build_mlp():\n"
                                      "    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))\n")
    mlp = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    save_file(mlp.state_dict(), work / "mlp.safetensors")
    conn = ["--redis", store.config.redis_url, "--host-root", store.config.host_root,
            "--durable", store.config.durable_url]
    script = "import sys\nfrom tierstore.cli import main\nsys.exit(main())\n"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    p = subprocess.run([sys.executable, "-P", "-c", script, "import", "mlp.safetensors", "--model", "mlp",
                        "--module", "mymodels:build_mlp", "--quiet", *conn],
                       cwd=work, env=env, capture_output=True, text=True, timeout=180, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "imported mlp.safetensors as step 0 of mlp" in p.stdout
    assert store.resolve("mlp").step == 0
    p = subprocess.run([sys.executable, "-P", "-c", script, "import", "mlp.safetensors", "--model", "mlp2",
                        "--module", "nosuchmodule:build", *conn],
                       cwd=work, env=env, capture_output=True, text=True, timeout=180, check=False)
    assert p.returncode == 1 and "No module named 'nosuchmodule'" in p.stderr, p.stderr
