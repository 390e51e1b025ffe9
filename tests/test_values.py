"""The values real trainer state contains (tierstore.train.values), and what the Checkpointer refuses up front.

Unit tests of the tagged JSON (pure logic): paths, Namespaces, enums, dataclasses, sets, dtypes, devices,
tuples and non-str keys round-trip; enums and dataclasses decode to their class only from the target's
template or an allow-list, never by importing what the data names; malformed tags are typed errors.
Then the Checkpointer against a real store: such values and a torchdata ``StatefulDataLoader`` resume
exactly; a plain ``DataLoader``, a ``None`` entry, an Accelerate-prepared DataLoader whose state_dict()
raises are typed errors naming the entry; ``world_size=1`` under torch.distributed needs no collective
(rank 0 saves alone while rank 1 never calls the Checkpointer).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import pathlib
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tierstore.errors import CorruptObjectError, InvalidValueError, RestoreMismatchError
from tierstore.train import values as V
from tierstore.train.checkpointer import Checkpointer

from tests import _warm

ROOT = Path(__file__).resolve().parents[1]


class Mode(enum.Enum):
    FAST = "fast"
    SLOW = "slow"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Perm(enum.Flag):
    R = 1
    W = 2


@dataclasses.dataclass
class Opt:
    lr: float
    mode: Mode = Mode.SLOW
    tags: frozenset = frozenset()
    seen: int = dataclasses.field(default=0, init=False)


@dataclasses.dataclass(frozen=True)
class Run:
    name: str
    opt: Opt
    shape: tuple = (1, 2)


def _value():
    opt = Opt(3e-4, Mode.FAST, frozenset({"a", "b"}))
    opt.seen = 7
    return {
        "root": pathlib.Path("/data/run"), "pure": pathlib.PurePosixPath("a/b"), "win": pathlib.PureWindowsPath("C:/x"),
        "args": argparse.Namespace(lr=0.1, mode=Mode.SLOW, **{"odd-name": (1, 2)}),
        "mode": Mode.FAST, "level": Level.HIGH, "perm": Perm.R | Perm.W, "run": Run("r1", opt),
        "set": {3, 1, (2, 3)}, "fset": frozenset({1.5}), "dtype": torch.bfloat16, "device": torch.device("cuda", 1),
        "tuple": (1, [2, (3,)], ()), 7: {8: "int keys"}, (1, "a"): "tuple key", "nested": [{Mode.FAST: "enum key"}],
    }


def _round_trip(v, **kw):
    tensors: dict[str, torch.Tensor] = {}
    doc = json.loads(json.dumps(encode := V.encode(v, tensors, "p/", "v"), allow_nan=False))
    assert doc == encode
    return V.decode(doc, tensors, **kw)


def test_real_state_values_round_trip_with_their_types():
    v = _value()
    got = _round_trip(v, like=_value())
    assert got == v
    for k in v:
        assert type(got[k]) is type(v[k]), k
    assert got["run"].opt.seen == 7 and type(got["run"].opt) is Opt and got["run"].opt.mode is Mode.FAST
    assert type(got["tuple"][1][1]) is tuple and got["args"].mode is Mode.SLOW
    assert list(got["nested"][0]) == [Mode.FAST]  # an enum key: from the template's keys


def test_without_a_template_enums_and_dataclasses_keep_their_type_name_and_nothing_is_imported():
    got = _round_trip(_value())
    name = f"{Mode.__module__}.Mode"
    assert got["mode"] == f"{name}.FAST" and got["args"].mode == f"{name}.SLOW"
    assert got["run"]["__type__"] == f"{Run.__module__}.Run" and got["run"]["opt"]["lr"] == 3e-4
    assert got["root"] == pathlib.Path("/data/run") and got["dtype"] is torch.bfloat16  # these need no template
    evil = {"__enum__": {"type": "tierstore_no_such_module.Evil", "name": "X", "value": 1}}
    evil_dc = {"__dataclass__": {"type": "os.system", "fields": {"command": "true"}}}
    assert V.decode(evil, {}) == "tierstore_no_such_module.Evil.X"
    assert V.decode(evil_dc, {}) == {"__type__": "os.system", "command": "true"}
    assert "tierstore_no_such_module" not in sys.modules
    # the template must hold the very class the data names: a different class is not used
    assert V.decode(V.encode(Mode.FAST, {}, "", "x"), {}, like=Level.LOW) == f"{name}.FAST"


def test_allowed_types_decode_without_a_template(monkeypatch):
    monkeypatch.setattr(V, "_ALLOWED", {})
    V.allow_value_types(Mode, Opt, Run)
    got = _round_trip(_value())
    assert got["mode"] is Mode.FAST and type(got["run"]) is Run and got["run"].opt.mode is Mode.FAST
    with pytest.raises(InvalidValueError):
        V.allow_value_types(dict)


def test_a_class_that_changed_is_a_mismatch_and_malformed_tags_are_corrupt():
    @dataclasses.dataclass
    class Opt2:  # Opt, after its fields changed
        lr: float

    Opt2.__qualname__ = Opt.__qualname__
    Opt2.__module__ = Opt.__module__
    with pytest.raises(RestoreMismatchError, match="fields"):
        _round_trip(Opt(1.0), like=Opt2(0.0))
    for bad in ({"__dtype__": "no_such_dtype"}, {"__path__": ["Evil", "x"]}, {"__device__": "warp:9"},
                {"__enum__": {}}, {"__set__": [[1, {"a": 1}]]}, {"__namespace__": [1]},
                {"__dataclass__": {"type": 3, "fields": {}}}):
        with pytest.raises(CorruptObjectError):
            V.decode(bad, {})


def _stateful_loader(seed=0):
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(torch.arange(40.0).reshape(20, 2), batch_size=3, shuffle=True,
                              generator=torch.Generator().manual_seed(seed))


def test_the_checkpointer_restores_such_values_and_a_stateful_dataloader_exactly(store):
    pytest.importorskip("torchdata.stateful_dataloader", reason="needs torchdata (the test extra)")
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    loader = _stateful_loader()
    it = iter(loader)
    for _ in range(4):  # mid-epoch: 4 of 7 batches drawn
        model(next(it)).sum().backward()
        opt.step()
    hp = _value()
    ck = Checkpointer(store, "values", state={"model": model, "optim": opt, "hp": hp, "data": loader},
                      rank=0, world_size=1)
    ck.save(0)
    assert ck.wait() == "committed"
    ck.close()
    want = [b.clone() for b in it]  # what the uninterrupted run draws next

    model2, loader2 = torch.nn.Linear(2, 1), _stateful_loader(seed=99)
    state = {"model": model2, "optim": torch.optim.AdamW(model2.parameters(), lr=0.01),
             "hp": {**_value(), "mode": Mode.SLOW}, "data": loader2}
    ck2 = Checkpointer(store, "values", state=state, rank=0, world_size=1)
    assert ck2.restore(read_only=True).step == 0
    ck2.close()
    assert state["hp"] == hp and state["hp"]["mode"] is Mode.FAST and type(state["hp"]["run"]) is Run
    got = list(loader2)
    assert len(got) == len(want) == 3 and all(torch.equal(a, b) for a, b in zip(got, want))


def test_entries_that_cannot_be_checkpointed_are_refused_naming_them(store):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(InvalidValueError, match="StatefulDataLoader") as ei:
        Checkpointer(store, "refused", state={"model": model, "data": torch.utils.data.DataLoader(range(4))},
                     rank=0, world_size=1)
    assert ei.value.key == "data"
    with pytest.raises(InvalidValueError, match="'optim' is None") as ei:
        Checkpointer(store, "refused", state={"model": model, "optim": None}, rank=0, world_size=1)
    assert ei.value.key == "optim"
    state = {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}
    ck = Checkpointer(store, "refused", state=state, rank=0, world_size=1)
    state["optim"] = None  # gone by the save: refused before anything is written
    with pytest.raises(InvalidValueError, match="'optim' is None"):
        ck.save(0)
    assert store.steps.state("refused", 0) is None
    ck.close()

    class LooksStateful:
        def state_dict(self):
            return self.missing  # an AttributeError inside state_dict()

        def load_state_dict(self, sd):
            pass

    with pytest.raises(InvalidValueError, match=r"'odd': .*state_dict\(\) raised AttributeError") as ei:
        Checkpointer(store, "refused", state={"model": model, "odd": LooksStateful()}, rank=0, world_size=1)
    assert ei.value.key == "odd" and isinstance(ei.value.__cause__, AttributeError)


def test_an_accelerate_prepared_dataloader_is_a_typed_error_naming_it(store):
    accelerate = pytest.importorskip("accelerate", reason="needs accelerate (the test extra)")
    loader = accelerate.Accelerator(cpu=True).prepare(torch.utils.data.DataLoader(range(8), batch_size=2))
    with pytest.raises(InvalidValueError, match="use_stateful_dataloader=True") as ei:
        Checkpointer(store, "accel", state={"model": torch.nn.Linear(2, 2), "data": loader}, rank=0, world_size=1)
    assert ei.value.key == "data"


_RANK_LOCAL = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    rank, port, home = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    if rank == 0:  # Lightning's rank-0-only save_checkpoint: rank 1 never constructs a Checkpointer
        import tierstore
        from tierstore.train.checkpointer import Checkpointer, load
        store = tierstore.open(home)
        m = torch.nn.Linear(4, 4)
        ck = Checkpointer(store, "rank0", m, rank=0, world_size=1, timeout=30)
        ck.save(3)
        assert ck.wait() == "committed"
        ck.close()
        m2 = torch.nn.Linear(4, 4)
        assert load(store, "rank0", {"model": m2}, rank=0, world_size=1).step == 3
        assert torch.equal(m.weight, m2.weight)
        store.close()
    dist.barrier()
    dist.destroy_process_group()
""")


def test_world_size_one_under_torch_distributed_needs_no_collective(tmp_path):
    from tests.redis_server import free_port

    port, script = free_port(), tmp_path / "rank_local.py"
    script.write_text(_RANK_LOCAL)
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    procs = [_warm.popen([sys.executable, str(script), str(r), str(port), str(tmp_path / "home")], cwd=ROOT,
                              env={**__import__("os").environ, **env}) for r in range(2)]
    try:
        codes = [p.wait(timeout=90) for p in procs]  # on main, rank 0 hangs in dist.new_group
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0, 0]
