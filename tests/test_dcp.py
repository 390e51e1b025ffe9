"""torch.distributed.checkpoint on tierstore: 2 real gloo ranks, real store; resharding to 1; async_save."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from tierstore.train.dcp import (
    TierStoreReader,
    TierStoreWriter,
    metadata_from_json,
    metadata_to_json,
)
from tierstore.errors import ManifestError

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


from tests.redis_server import free_port as _free_port  # noqa: E402


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dcp")
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen([sys.executable, "-m", "tests.test_dcp", str(r), "2", str(port), str(tmp / "home"), str(tmp / "out")],
                         cwd=ROOT, env=env)
        for r in range(2)
    ]
    codes = [p.wait(timeout=240) for p in procs]
    assert codes == [0, 0]
    return tmp


def test_two_ranks_round_trip_bitwise(saved):
    for r in range(2):
        res = json.loads((saved / f"out.{r}.json").read_text())
        assert res == {"ok": True, "ok_async": True}


def test_load_into_world_size_one(saved):
    import tierstore

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
            )
        },
        planner_data={"a": ("a",), "n.x": ("n", 0)},
        storage_data={MetadataIndex("a", [0, 0]): {"key": "m/dcp/1/0", "name": "a@0,0"}},
        version="1.0.0",
    )
    doc = json.loads(json.dumps(metadata_to_json(md)))
    back = metadata_from_json(doc)
    assert back.state_dict_metadata == md.state_dict_metadata
    assert back.planner_data == md.planner_data and back.storage_data == md.storage_data
    with pytest.raises(ManifestError):
        metadata_from_json({"schema": 99})
    with pytest.raises(ManifestError):
        metadata_from_json({"schema": 1, "state_dict_metadata": {"a": {"type": "tensor"}}})


def test_non_tensor_values_refused(store):
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException, match="non-tensor values are not supported"):
        dcp.save({"x": torch.ones(2), "meta": {"a": 1}}, storage_writer=TierStoreWriter(store, "nt", 0), no_dist=True)


def test_checkpoint_id():
    assert TierStoreWriter.validate_checkpoint_id("tierstore://m/3")
    assert not TierStoreReader.validate_checkpoint_id("/tmp/x")


if __name__ == "__main__":
    a = sys.argv[1:]
    worker(int(a[0]), int(a[1]), int(a[2]), a[3], a[4])
