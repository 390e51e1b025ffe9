"""torch.distributed.checkpoint on tierstore: 2 real gloo ranks, resharding to 1, async_save; non-tensor values;
early typed refusals; picklable writer/reader; named-step loads only of committed steps.

PyTorch's e2e DCP cases (DDP, FSDP2 resharding, async thread/process, partial load) are in test_dcp_dist.py."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from tierstore.errors import (
    CheckpointFailedError,
    CommitError,
    InvalidValueError,
    KeyExistsError,
    ManifestError,
    StepAbortedError,
    StepBusyError,
    UnknownError,
)
from tierstore.interop import dcp as tsdcp
from tierstore.interop.dcp import (
    TierStoreReader,
    TierStoreWriter,
    metadata_from_json,
    metadata_to_json,
)

ROOT = Path(__file__).resolve().parents[1]


def _state(rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    # distinct names per rank (DCP writes identical plain tensors once across ranks)
    return {
        f"w{rank}": torch.randn(17, 5, generator=g),
        f"b{rank}": torch.randn(3, generator=g).to(torch.bfloat16),
        f"i{rank}": torch.arange(6, dtype=torch.int64).reshape(2, 3) + rank,
        "shared": torch.ones(4),  # identical on every rank: DCP dedups it
    }


def worker(rank: int, world: int, port: int, home: str, out: str) -> None:
    import torch.distributed as dist

    import tierstore

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    store = tierstore.open(home=home)
    sd = _state(rank)
    dcp.save(sd, storage_writer=TierStoreWriter(store, "dcpm", step=1))
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(target, storage_reader=TierStoreReader(store, "dcpm", step=1))
    ok = all(torch.equal(target[k], sd[k]) for k in sd)
    # async_save of a later step, then load the newest
    sd2 = {k: v + 1 for k, v in sd.items()}
    fut = dcp.async_save(sd2, storage_writer=TierStoreWriter(store, "dcpm", step=2))
    fut.result()
    target2 = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(target2, storage_reader=TierStoreReader(store, "dcpm"))
    ok2 = all(torch.equal(target2[k], sd2[k]) for k in sd)
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump({"ok": ok, "ok_async": ok2}, f)
    dist.barrier()
    store.close()
    dist.destroy_process_group()


from tests import _warm  # noqa: E402
from tests._leaks import purge_homes  # noqa: E402
from tests.redis_server import free_port as _free_port  # noqa: E402


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dcp")
    port = _free_port()
    # the ranks' host tier, named: a test of this module opens the same one (each test gets a private
    # TIERSTORE_SHM_DIR of its own, tests/conftest.py, where a step not yet durable would not be found)
    (tmp / "shm").mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TIERSTORE_SHM_DIR=str(tmp / "shm"))
    procs = [
        _warm.popen([sys.executable, "-m", "tests.test_dcp", str(r), "2", str(port), str(tmp / "home"), str(tmp / "out")],
                         cwd=ROOT, env=env)
        for r in range(2)
    ]
    codes = [p.wait(timeout=240) for p in procs]
    assert codes == [0, 0]
    yield tmp
    purge_homes(tmp / "home")


def test_two_ranks_round_trip_bitwise(saved):
    for r in range(2):
        res = json.loads((saved / f"out.{r}.json").read_text())
        assert res == {"ok": True, "ok_async": True}


def test_load_into_world_size_one(saved, monkeypatch):
    import tierstore

    monkeypatch.setenv("TIERSTORE_SHM_DIR", str(saved / "shm"))  # the ranks' host tier: step 1 may be in memory only
    store = tierstore.open(home=saved / "home")
    try:
        want = {**_state(0), **_state(1)}
        target = {k: torch.zeros_like(v) for k, v in want.items()}
        dcp.load(target, storage_reader=TierStoreReader(store, "dcpm", step=1), no_dist=True)
        for k in want:
            assert torch.equal(target[k], want[k]), k
        # a key the checkpoint lacks fails the load (DCP's CheckpointException derives from BaseException)
        from torch.distributed.checkpoint.api import CheckpointException

        with pytest.raises(CheckpointException):
            dcp.load({"nope": torch.zeros(1)}, storage_reader=TierStoreReader(store, "dcpm", step=1), no_dist=True)
    finally:
        store.close()


def test_metadata_json_round_trip():
    md = Metadata(
        state_dict_metadata={
            "a": TensorStorageMetadata(
                TensorProperties(dtype=torch.float16), torch.Size([4, 2]),
                [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 2])),
                 ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 2]))],
            ),
            "opt.param_groups": BytesStorageMetadata(),
        },
        planner_data={"a": ("a",), "n.x": ("n", 0)},
        storage_data={MetadataIndex("a", [0, 0]): {"key": "m/dcp/1/0", "name": "a@0,0", "type": "tensor"},
                      MetadataIndex("opt.param_groups"): {"key": "m/dcp/1/1", "name": "g@bytes", "type": "bytes"}},
        version="1.0.0",
    )
    doc = json.loads(json.dumps(metadata_to_json(md)))
    back = metadata_from_json(doc)
    assert back.state_dict_metadata == md.state_dict_metadata
    assert back.planner_data == md.planner_data and back.storage_data == md.storage_data
    # a schema-1 document (tensors only, no "type") still reads
    v1 = dict(doc, schema=1, storage_data=[{k: v for k, v in e.items() if k != "type"} for e in doc["storage_data"]])
    assert metadata_from_json(v1).storage_data[MetadataIndex("a", [0, 0])]["type"] == "tensor"
    with pytest.raises(ManifestError):
        metadata_from_json({"schema": 99})
    with pytest.raises(ManifestError):
        metadata_from_json({"schema": 2, "state_dict_metadata": {"a": {"type": "tensor"}}})
    with pytest.raises(ManifestError):
        metadata_from_json(dict(doc, storage_data=[dict(doc["storage_data"][0], type="pickle")]))


def test_checkpoint_id():
    assert TierStoreWriter.validate_checkpoint_id("tierstore://m/3")
    assert not TierStoreReader.validate_checkpoint_id("/tmp/x")


# ------------------------------------------------------------------------------ non-tensor values


def _model_and_optim(lr: float):
    from tests import dcp_cases as cases

    model = cases.Net()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    return model, opt


def test_init_state_dict_optimizer_param_groups_round_trip(store):
    """DCP's test_init_state_dict: a non-tensor (the learning rate) comes back through set_state_dict."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_state_dict,
    )

    model, opt = _model_and_optim(0.1)
    model(torch.rand(2, 8)).sum().backward()
    opt.step()
    model.extra.version = 7
    sd = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)}
    dcp.save(sd, storage_writer=TierStoreWriter(store, "init", 0), no_dist=True)

    model2, opt2 = _model_and_optim(0.2)
    msd, osd = get_model_state_dict(model2), get_optimizer_state_dict(model2, opt2)
    target = {"model": msd, "optimizer": osd}
    dcp.load(target, storage_reader=TierStoreReader(store, "init", 0), no_dist=True)
    assert target["model"] is msd and target["optimizer"] is osd  # in place, as DCP promises
    set_state_dict(model2, opt2, model_state_dict=msd, optim_state_dict=osd)
    assert opt2.param_groups[0]["lr"] == 0.1 and opt2.param_groups[0]["betas"] == (0.9, 0.999)
    assert model2.extra.version == 7  # the module's _extra_state
    for k, v in opt.state_dict()["state"][0].items():
        assert torch.equal(opt2.state_dict()["state"][0][k], v), k


def test_scheduler_dataloader_bytes_and_bytesio_round_trip(store):
    import io
    import pickle

    from tests import dcp_cases as cases

    model, opt = _model_and_optim(0.1)
    sched = cases.scheduler(opt)
    loader, ts = cases.Loader(0, 1), cases.TrainState()
    cases.train(model, opt, sched, loader, ts, steps=3)
    raw = {"blob": pickle.dumps({"any": [1, 2]}), "empty": b"", "io": io.BytesIO(b"\x00\x01"), "none": None,
           "nested": {"s": "text", "f": 1.5, "i": -3, "t": (1, "a"), "set": {1, 2}}}
    sd = {"sched": sched, "data": loader, "train": ts, "raw": raw}
    dcp.save(sd, storage_writer=TierStoreWriter(store, "misc", 1), no_dist=True)

    sched2 = cases.scheduler(_model_and_optim(0.1)[1])
    loader2, ts2 = cases.Loader(0, 1), cases.TrainState()
    raw2 = {"blob": b"", "empty": b"x", "io": io.BytesIO(), "none": 0,
            "nested": {"s": "", "f": 0.0, "i": 0, "t": (), "set": set()}}
    dcp.load({"sched": sched2, "data": loader2, "train": ts2, "raw": raw2},
             storage_reader=TierStoreReader(store, "misc"), no_dist=True)
    assert sched2.state_dict() == sched.state_dict() and sched2.last_epoch == 3
    assert (loader2.position, loader2.epoch) == (loader.position, loader.epoch) and ts2 == ts
    # a non-stateful entry is replaced by what was loaded (DCP's semantics)
    got = dcp_load_plain(store, "misc", 1, raw2)
    assert got["blob"] == raw["blob"] and got["empty"] == b"" and got["io"].getvalue() == b"\x00\x01"
    assert got["none"] is None and got["nested"] == raw["nested"]


def dcp_load_plain(store, model: str, step: int, like: dict) -> dict:
    target = {"raw": like}
    dcp.load(target, storage_reader=TierStoreReader(store, model, step), no_dist=True)
    return target["raw"]


def test_stateful_and_non_stateful_loads(store):
    """DCP's test_stateful_and_non_stateful_loads: Stateful values load in place, plain ones are replaced."""
    from torch.distributed.checkpoint.stateful import Stateful

    class StateDict(dict):
        def __init__(self):
            self.set_sd_item_called = False

        def __setitem__(self, item, value):
            self.set_sd_item_called = True
            super().__setitem__(item, value)

    class Foo(Stateful):
        def __init__(self):
            self.load_state_dict_called = False

        def state_dict(self):
            return {}

        def load_state_dict(self, state_dict):
            self.load_state_dict_called = True

    foo = Foo()
    sd = StateDict()
    sd["foo"] = foo
    sd.set_sd_item_called = False
    dcp.save(sd, storage_writer=TierStoreWriter(store, "stateful", 0), no_dist=True)
    dcp.load(sd, storage_reader=TierStoreReader(store, "stateful", 0), no_dist=True)
    assert foo.load_state_dict_called and not sd.set_sd_item_called

    sd = StateDict()
    sd["foo"] = {"replicated": torch.rand(10, 10), "bytes": [1, 2, 3, 4]}
    sd.set_sd_item_called = False
    dcp.save(sd, storage_writer=TierStoreWriter(store, "stateful", 1), no_dist=True)
    dcp.load(sd, storage_reader=TierStoreReader(store, "stateful", 1), no_dist=True)
    assert sd.set_sd_item_called and sd["foo"]["bytes"] == [1, 2, 3, 4]


# ------------------------------------------------------------------------------ early, typed refusals


class _Evil:
    """Pickles to a call that would create a marker file: proof of arbitrary code execution."""

    marker = ""

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_unsafe_value_refused_before_anything_is_written(store, tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException

    evil = _Evil()
    evil.marker = str(tmp_path / "pwned")
    sd = {"w": torch.ones(2), "obj": evil}
    # the typed front door checks the whole state dict first: nothing is planned, no step exists
    with pytest.raises(InvalidValueError, match=r"obj: .*weights_only=True") as ei:
        tsdcp.save(sd, TierStoreWriter(store, "unsafe", 1), no_dist=True)
    assert ei.value.tensor == "obj" and any(g.startswith("pathlib.") for g in ei.value.unsafe_globals)
    assert store.steps.state("unsafe", 1) is None and store.list("unsafe") == []
    # plain dcp.save: DCP wraps the typed error in its CheckpointException; the step is aborted at once
    with pytest.raises(CheckpointException) as ci:
        dcp.save(sd, storage_writer=TierStoreWriter(store, "unsafe", 2), no_dist=True)
    (exc, _tb), = ci.value.failures.values()
    assert isinstance(exc, InvalidValueError) and exc.tensor == "obj"
    assert store.steps.state("unsafe", 2) == "aborted" and store.list("unsafe", step=2) == []
    assert not (tmp_path / "pwned").exists()


def test_unsupported_dtype_refused_at_planning(store):
    from torch.distributed.checkpoint.api import CheckpointException

    sd = {"ok": torch.ones(2), "z": torch.ones(2, dtype=torch.complex128)}
    with pytest.raises(CheckpointException) as ci:
        dcp.save(sd, storage_writer=TierStoreWriter(store, "dtype", 1), no_dist=True)
    (exc, _tb), = ci.value.failures.values()
    assert isinstance(exc, InvalidValueError) and exc.tensor == "z" and "complex128" in str(exc)
    assert store.steps.state("dtype", 1) is None and store.list("dtype") == []  # nothing written, no step
    with pytest.raises(InvalidValueError, match="complex128"):
        tsdcp.save(sd, TierStoreWriter(store, "dtype", 1), no_dist=True)


def test_saving_a_committed_step_again_is_refused_and_leaves_it_intact(store):
    dcp.save({"w": torch.ones(3)}, storage_writer=TierStoreWriter(store, "twice", 5), no_dist=True)
    with pytest.raises(KeyExistsError, match="already saved"):
        tsdcp.save({"w": torch.zeros(3)}, TierStoreWriter(store, "twice", 5), no_dist=True)
    fut = tsdcp.async_save({"w": torch.zeros(3)}, TierStoreWriter(store, "twice", 5), no_dist=True)
    with pytest.raises(KeyExistsError):  # through the future, typed too
        fut.result(timeout=120)
    target = {"w": torch.full((3,), 9.0)}
    tsdcp.load(target, TierStoreReader(store, "twice", 5), no_dist=True)
    assert torch.equal(target["w"], torch.ones(3))


def test_aborted_step_refused_for_load_and_saved_again_as_a_new_attempt(store, tmp_path, caplog):
    evil = _Evil()
    evil.marker = str(tmp_path / "pwned")
    with pytest.raises(InvalidValueError):
        tsdcp.save({"w": torch.ones(1), "x": evil}, TierStoreWriter(store, "ab", 3), no_dist=True)  # up front
    assert store.steps.state("ab", 3) is None
    dcp_save_quiet({"w": torch.ones(1), "x": evil}, TierStoreWriter(store, "ab", 3))
    assert store.steps.state("ab", 3) == "aborted"
    with pytest.raises(StepAbortedError):
        tsdcp.load({"w": torch.zeros(1)}, TierStoreReader(store, "ab", 3), no_dist=True)
    with pytest.raises(UnknownError):
        tsdcp.load({"w": torch.zeros(1)}, TierStoreReader(store, "ab", 4), no_dist=True)
    # as FileSystemWriter would: the step number is saved again, as attempt 2, naming why attempt 1 ended
    w = TierStoreWriter(store, "ab", 3)
    with caplog.at_level("WARNING", logger="tierstore.interop.dcp_storage"):
        tsdcp.save({"w": torch.full((1,), 2.0)}, w, no_dist=True)
    assert w.attempt == 2 and "negative vote of rank 0" in (w.previous_attempt or "")
    assert "attempt 1 did not commit (negative vote of rank 0" in caplog.text
    (rec,) = store.steps.records("ab", [3])
    assert rec.state == "committed" and rec.attempt == 2
    target = {"w": torch.zeros(1)}
    tsdcp.load(target, TierStoreReader(store, "ab", 3), no_dist=True)
    assert torch.equal(target["w"], torch.full((1,), 2.0))


def dcp_save_quiet(sd: dict, writer: TierStoreWriter) -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException):
        dcp.save(sd, storage_writer=writer, no_dist=True)


def test_step_another_writer_is_saving_is_refused_before_anything_is_written(store):
    store.begin_step("busy", 7, 4)  # another writer's save of 3 ranks (+ the metadata voter) is in flight
    with pytest.raises(StepBusyError, match=r"another writer \(attempt 1, 4 voters, .*times out in") as ei:
        tsdcp.save({"w": torch.ones(1)}, TierStoreWriter(store, "busy", 7), no_dist=True)
    assert isinstance(ei.value, CommitError) and ei.value.attempt == 1 and ei.value.expires_in_s > 500
    assert store.steps.state("busy", 7) == "preparing" and store.list("busy") == []


def test_typed_front_door_never_raises_a_base_exception(store):
    dcp.save({"w": torch.ones(2)}, storage_writer=TierStoreWriter(store, "front", 0), no_dist=True)
    with pytest.raises(CheckpointFailedError, match="nope") as ei:  # a key the checkpoint lacks: DCP's own error
        tsdcp.load({"nope": torch.zeros(1)}, TierStoreReader(store, "front", 0), no_dist=True)
    assert isinstance(ei.value, Exception) and 0 in ei.value.failures


# ------------------------------------------------------------------------------ picklable writer and reader


def test_writer_and_reader_pickle_as_configuration(store):
    import pickle

    from tierstore.config import StoreConfig

    w = TierStoreWriter(store, "pk", 1)
    blob = pickle.dumps(w)
    assert b"TierStore\x94" not in blob and b"RLock" not in blob
    w2 = pickle.loads(blob)
    assert w2._store.live is None and w2._store.spec == store.config
    dcp.save({"w": torch.arange(4)}, storage_writer=w2, no_dist=True)  # reopens the store from its config
    r = pickle.loads(pickle.dumps(TierStoreReader(store, "pk")))
    target = {"w": torch.zeros(4, dtype=torch.int64)}
    dcp.load(target, storage_reader=r, no_dist=True)
    assert torch.equal(target["w"], torch.arange(4)) and r.store is not store
    cfg = dict(home=store.config.home, redis=store.config.redis_url, durable=store.config.durable_url,
               host_root=store.config.host_root, node_id=store.config.node_id)
    for spec in (cfg, StoreConfig(**{f: getattr(store.config, f) for f in store.config.__dataclass_fields__})):
        target = {"w": torch.zeros(4, dtype=torch.int64)}
        dcp.load(target, storage_reader=pickle.loads(pickle.dumps(TierStoreReader(spec, "pk", 1))), no_dist=True)
        assert torch.equal(target["w"], torch.arange(4))
    with pytest.raises(InvalidValueError):
        TierStoreWriter(object(), "pk", 2)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ named-step loads


def test_named_step_load_refuses_a_step_whose_coordinator_died_before_its_vote(store, tmp_path):
    """The coordinator writes the metadata object and dies before its vote: the step must not load."""
    import dataclasses

    dcp.save({"w": torch.ones(3)}, storage_writer=TierStoreWriter(store, "crash", 1), no_dist=True)
    cfg = json.dumps(dataclasses.asdict(store.config))
    code = textwrap.dedent(f"""
        import json, os, torch, torch.distributed.checkpoint as dcp
        import tierstore
        from tierstore.config import StoreConfig
        from tierstore.store import TierStore
        from tierstore.interop.dcp import META_LAYER, TierStoreWriter
        put = TierStore.put
        def dying_put(self, key, *a, **k):
            rec = put(self, key, *a, **k)
            if key.layer == META_LAYER:
                os._exit(7)  # after the metadata is written, before its vote
            return rec
        TierStore.put = dying_put
        store = tierstore.open(config=StoreConfig(**json.loads({cfg!r})))
        w = TierStoreWriter(store, "crash", 2, epoch=store.open_epoch("crash"), lease=0)  # no lease: held till timeout
        dcp.save({{"w": torch.full((3,), 2.0)}}, storage_writer=w, no_dist=True)
    """)
    p = _warm.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert p.returncode == 7, p.stderr[-2000:]
    assert store.steps.state("crash", 2) == "preparing" and store.list("crash", "dcp-metadata", 2)
    with pytest.raises(CommitError, match="not committed"):
        tsdcp.load({"w": torch.zeros(3)}, TierStoreReader(store, "crash", 2), no_dist=True)
    target = {"w": torch.zeros(3)}
    tsdcp.load(target, TierStoreReader(store, "crash"), no_dist=True)  # newest committed: step 1
    assert torch.equal(target["w"], torch.ones(3))
    # without a lease another writer cannot tell a dead attempt from a live one before its timeout: refused,
    # nothing written (with one, the claim lapses: tests/test_dcp_lease.py)
    with pytest.raises(StepBusyError):
        tsdcp.save({"w": torch.full((3,), 3.0)}, TierStoreWriter(store, "crash", 2), no_dist=True)
    # the job restarting takes a new epoch: the attempt of the old incarnation is taken over at once
    w = TierStoreWriter(store, "crash", 2, epoch=store.open_epoch("crash"))
    tsdcp.save({"w": torch.full((3,), 3.0)}, w, no_dist=True)
    assert w.attempt == 2 and w.previous_attempt.startswith("fenced: it is of epoch 1")
    tsdcp.load(target, TierStoreReader(store, "crash", 2), no_dist=True)
    assert torch.equal(target["w"], torch.full((3,), 3.0))
    tsdcp.load(target, TierStoreReader(store, "crash", 1), no_dist=True)
    assert torch.equal(target["w"], torch.ones(3))  # the committed step is untouched


def test_tampered_value_never_reaches_a_general_unpickler(store, tmp_path, monkeypatch):
    """A stored non-tensor value that is a malicious pickle (valid checksum, committed): the load refuses it, typed.

    A committed object cannot be replaced through the store (committed steps are
    immutable), so the forged bytes go in the way an attacker with a patched
    writer would put them: the writer's own refusal is switched off for the save.
    """
    from tierstore.interop import dcp_storage

    evil = _Evil()
    evil.marker = str(tmp_path / "pwned")
    monkeypatch.setattr(dcp_storage, "check_restricted", lambda *a, **k: None)
    dcp.save({"w": torch.ones(2), "obj": {"a": evil}}, storage_writer=TierStoreWriter(store, "tamper", 1),
             no_dist=True)
    monkeypatch.undo()
    assert store.wait_step("tamper", 1) in ("committed", "durable")
    assert not (tmp_path / "pwned").exists()  # saving pickles it; nothing has unpickled it
    with pytest.raises(InvalidValueError, match="weights_only"):
        tsdcp.load({"w": torch.zeros(2), "obj": {"a": 0}}, TierStoreReader(store, "tamper", 1), no_dist=True)
    assert not (tmp_path / "pwned").exists()


if __name__ == "__main__":
    a = sys.argv[1:]
    worker(int(a[0]), int(a[1]), int(a[2]), a[3], a[4])
