"""Lightning's FSDP2 strategy with sharded tierstore saves (``TierStoreModelParallelStrategy(
save_distributed_checkpoint=True)``), with real processes: 2 gloo ranks on CPU, then 1.

The ranks (``tests/_lightning_fsdp2_job.py``): an uninterrupted 2-rank run A saves every 4 steps; B resumes its
step-4 checkpoint on 2 ranks, C resumes ``ckpt_path="last"``, D resumes the step-4 checkpoint on one rank. Checked
here: each rank's stored objects of a step are exactly that rank's shards (nothing gathered, nothing held twice),
the pointer Lightning sees is written once the step is committed, B ends bitwise where A ended (parameters, AdamW
state, losses), C restores A's last step, D (resharded, 2 -> 1) restores the full state of step 4 bitwise and saves
on its own, E (resharded, 2 -> 4) does too on four ranks, a one-process reader of a sharded pointer gets full tensors, and a state dict a hook rewrote is
refused before anything is written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning.pytorch", reason="needs PyTorch Lightning (the lightning extra)")

import tierstore
from tests import _reshard as R
from tests import _warm
from tests._ranks import run_ranks
from tierstore.interop.lightning import read_checkpoint
from tierstore.interop.pointer import model_name, read_pointer
from tierstore.train.view import STATE_LAYER


def _load(path: str) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def _nbytes(ts: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts.values())


def test_sharded_saves_resume_bitwise_and_restore_on_one_and_four_ranks(tmp_path):
    home, ck, out = tmp_path / "home", tmp_path / "ck", str(tmp_path / "out")
    job = run_ranks("tests._lightning_fsdp2_job", ["two", str(home), str(ck), out], preload=_warm.LIGHTNING)
    assert job.codes == [0, 0], job.tail()
    mid, last = read_pointer(ck / "epoch=0-step=4.ckpt"), read_pointer(ck / "last.ckpt")
    assert mid.info["layout"] == last.info["layout"] == "sharded" and mid.info["world_size"] == 2
    assert (mid.info["global_step"], last.info["global_step"]) == (4, 8) and mid.model == last.model

    full4 = _load(f"{out}.a4.full.pt")
    store = tierstore.open(str(home))
    try:
        assert store.steps.state(mid.model, mid.step) in ("committed", "durable")
        assert store.steps.pins(mid.model)[str(ck / "epoch=0-step=4.ckpt")] == mid.step
        keys = store.list(mid.model, step=mid.step)
        assert {k.rank for k in keys} == {0, 1}
        held: dict[str, int] = {}
        for rank in (0, 1):  # each rank's objects hold its own shards, bit for bit, and nothing else
            stored: dict[str, torch.Tensor] = {}
            for k in keys:
                if k.rank == rank and k.layer != STATE_LAYER:
                    assert store.info(k).kind == "full"
                    stored.update(dict(store.get(k).items()))
            local = _load(f"{out}.a4.local.{rank}.pt")
            assert R.differences(stored, local) == [], rank
            assert _nbytes(stored) < _nbytes(full4), rank
            for n, t in stored.items():
                held[n] = held.get(n, 0) + t.numel()
        # the two ranks' shards add up to each tensor once (an AdamW step count is a scalar on each rank)
        assert all(held[n] == (2 if t.dim() == 0 else t.numel()) for n, t in full4.items()), held
        assert any(_load(f"{out}.a4.local.0.pt")[n].shape[0] < t.shape[0] for n, t in full4.items() if t.dim() == 2)
        # a one-process reader of the sharded pointer gets the full tensors, as a gathered checkpoint holds them
        sd = read_checkpoint(ck / "epoch=0-step=4.ckpt", store)["state_dict"]
        assert R.differences({f"param/{n}": t for n, t in sd.items()},
                             {n: t for n, t in full4.items() if n.startswith("param/")}) == []
    finally:
        store.close()

    for rank in (0, 1):
        losses = json.loads(Path(f"{out}.two.{rank}.json").read_text())
        a, b, c = losses["a"], losses["b"], losses["c"]
        assert sorted(map(int, b)) == [4, 5, 6, 7] and all(b[s] == a[s] for s in b), rank  # resumed mid-epoch
        assert R.differences(_load(f"{out}.b.local.{rank}.pt"), _load(f"{out}.a.local.{rank}.pt")) == [], rank
        assert sorted(map(int, c)) == [8, 9], rank  # ckpt_path="last": A's step 8, restored bitwise
        assert R.differences(_load(f"{out}.c.local.{rank}.pt"), _load(f"{out}.a.local.{rank}.pt")) == [], rank

    # resharded: the 2-rank step-4 checkpoint on one FSDP2 rank
    job = run_ranks("tests._lightning_fsdp2_job", ["one", str(home), str(ck), out], world=1,
                    preload=_warm.LIGHTNING)
    assert job.codes == [0], job.tail()
    assert R.differences(_load(f"{out}.d.full.pt"), full4) == []
    d = json.loads(Path(f"{out}.one.0.json").read_text())["d"]
    assert sorted(map(int, d)) == [4, 5] and all(v == v for v in d.values())
    saved = read_pointer(Path(f"{ck}-one") / "epoch=1-step=6.ckpt")
    assert saved.info["layout"] == "sharded" and saved.info["world_size"] == 1
    refused = json.loads(Path(f"{out}.one.0.json").read_text())["refused"]  # a hook rewrote the state dict
    assert refused is not None and "save_distributed_checkpoint=False" in refused, refused
    assert not list(Path(f"{ck}-bad").glob("*.ckpt"))
    store = tierstore.open(str(home))
    try:
        assert store.steps.steps(model_name("lightning", f"{ck}-bad")) == []  # nothing begun, nothing written
    finally:
        store.close()


    # resharded up (2 -> 4 ranks): each of the four restores its own shards of the 2-rank step, so the full state
    # they hold at the start is step 4's bit for bit (the 16-row weights split 4 ways, the head's one row on one
    # rank and empty shards on the others); they train on and save on four ranks
    job = run_ranks("tests._lightning_fsdp2_job", ["four", str(home), str(ck), out], world=4,
                    preload=_warm.LIGHTNING, timeout_s=400)
    assert job.codes == [0, 0, 0, 0], job.tail()
    assert R.differences(_load(f"{out}.e.full.pt"), full4) == []
    for rank in range(4):
        e = json.loads(Path(f"{out}.four.{rank}.json").read_text())["e"]
        assert sorted(map(int, e)) == [4, 5] and all(v == v for v in e.values()), rank
    saved = read_pointer(Path(f"{ck}-four") / "epoch=1-step=6.ckpt")
    assert saved.info["layout"] == "sharded" and saved.info["world_size"] == 4


def test_a_reboot_after_sharded_saves_resumes_last_from_the_newest_durable_step(tmp_path):
    """Sharded saves at 2 and 4 made durable, a resume saving 6 and 8 in host memory only, then a node reboot (the
    index server stopped, shared memory wiped): ``ckpt_path="last"`` names step 8, which is gone, so every rank
    resumes from step 4 (rank 0's choice, broadcast) and ends bitwise where an uninterrupted run ends."""
    from tests.test_lightning_reboot import _reboot

    home, ck, out = tmp_path / "home", tmp_path / "ck", str(tmp_path / "out")
    for phase in ("reboot-a", "reboot-b"):
        job = run_ranks("tests._lightning_fsdp2_job", [phase, str(home), str(ck), out], preload=_warm.LIGHTNING)
        assert job.codes == [0, 0], (phase, job.tail())
    assert read_pointer(ck / "last.ckpt").info["global_step"] == 8
    _reboot(home)
    job = run_ranks("tests._lightning_fsdp2_job", ["reboot-c", str(home), str(ck), out], preload=_warm.LIGHTNING)
    assert job.codes == [0, 0], job.tail()
    for rank in (0, 1):
        got = json.loads(Path(f"{out}.reboot-c.{rank}.json").read_text())
        f, ref = got["f"], got["ref"]
        assert sorted(map(int, f)) == [4, 5, 6, 7], rank  # resumed at global step 4, the newest durable one
        assert all(f[s] == ref[s] for s in f), rank
        assert R.differences(_load(f"{out}.f.local.{rank}.pt"), _load(f"{out}.ref.local.{rank}.pt")) == [], rank

