"""PyTorch Lightning on tierstore (tierstore.interop.lightning), with the real Lightning, CPU, gloo.

One process: ``ckpt_path="last"`` resumes bitwise (mid-epoch and across epochs) with the policy applied to the
re-saves of ``last.ckpt``; top-k rotation leaves exactly one model per checkpoint file; re-saving a path is an
overwrite (a new step, the old one collected); a path never saved is a typed ``FileNotFoundError``, not a
fresh start; hyper-parameters Lightning users pass (paths, Namespaces, enums, dataclasses, sets, dtypes)
round-trip, an ``nn.Module`` among them is refused with the fix; the plain CheckpointIO under Lightning's own
ModelCheckpoint; a ``save_last="link"`` link and a file Lightning wrote itself.

Two ranks (one launch killed by SIGKILL at the start of step 7, one resumed with ``ckpt_path="last"``):
Lightning's rank-0-only saves under DDP never deadlock, and the resumed run equals an uninterrupted one bit
for bit on both ranks; in the second launch, FSDP2 (``TierStoreModelParallelStrategy``) saves the gathered
state on rank 0 and resumes it into the sharded module bitwise.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
from pathlib import Path

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch", reason="needs PyTorch Lightning (the lightning extra)")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from tests import _lightning_job as J  # noqa: E402
from tests._runs import check_run  # noqa: E402
from tierstore.errors import CheckpointNotFoundError, InvalidValueError  # noqa: E402
from tierstore.interop.lightning import TierStoreCheckpoint, TierStoreCheckpointIO  # noqa: E402
from tierstore.interop.pointer import read_pointer, retire_older  # noqa: E402
from tierstore.train.policies import differential  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _cb(store, d, **kw):
    kw.setdefault("every_n_train_steps", 2)
    return TierStoreCheckpoint(store=store, dirpath=str(d), **kw)


def _lightning_models(store, prefix="lightning."):
    return sorted(m for m in store.models() if m.startswith(prefix))


def _pointers(d):
    return sorted(p for p in os.listdir(d) if p.endswith(".ckpt"))


def test_resume_last_is_bitwise_and_the_policy_applies_to_resaves(store, tmp_path):
    ref = J.Net()
    J.trainer([], 12, enable_checkpointing=False).fit(ref, J.data())
    a = J.Net()
    J.trainer([_cb(store, tmp_path, save_last=True, save_top_k=2, monitor="train_loss",
                   policy=differential(base_every=3, payoff=None))], 6).fit(a, J.data())
    files = _pointers(tmp_path)
    assert "last.ckpt" in files and len(files) == 3  # last + top 2
    last = read_pointer(tmp_path / "last.ckpt")
    assert last.info == {"global_step": 6, "epoch": 1, "layout": "module", "pin": str(tmp_path / "last.ckpt")}
    assert last.step == max(s for s, _ in store.steps.steps(last.model))  # the run's newest step
    kinds = {r.kind for r in store.index.get_objects(store.list(last.model))}
    assert "delta" in kinds  # the run's saves went through the differential policy, building on the previous one
    b = J.Net()
    J.trainer([_cb(store, tmp_path, save_last=True, save_top_k=2, monitor="train_loss")], 12).fit(
        b, J.data(), ckpt_path="last")
    assert sorted(b.losses) == list(range(6, 12))  # resumed mid-epoch 1, crossed into epoch 2
    assert all(b.losses[s] == ref.losses[s] for s in b.losses)
    pr, pb = J.params(ref), J.params(b)
    assert all(torch.equal(pr[n], pb[n]) for n in pr)
    # top-k rotation leaves one model for the run, its pins exactly the checkpoint files' steps, nothing
    # uncollected, and no durable manifest outliving its step
    files = _pointers(tmp_path)
    model = check_run(store, {str(tmp_path / f): read_pointer(tmp_path / f) for f in files})
    assert _lightning_models(store) == [model]
    store.flush()
    assert set(store.steps.durable_steps(model)) <= {s for s, _ in store.steps.steps(model)}


def test_resaving_a_path_overwrites_it_and_a_path_never_saved_is_an_error(store, tmp_path):
    net = J.Net()
    t = J.trainer([_cb(store, tmp_path / "ck")], 2)
    t.fit(net, J.data())
    path = str(tmp_path / "manual.ckpt")
    t.save_checkpoint(path)
    with torch.no_grad():
        net.head.bias.add_(1.0)
    t.save_checkpoint(path)  # the same global step again: Lightning expects an overwrite
    ptr = read_pointer(path)
    assert ptr.step == 1 and store.steps.state(ptr.model, 1) in ("committed", "durable")
    store.flush()  # step 1 is durable now: the next re-save collects the older steps, manifests included
    t.save_checkpoint(path)
    ptr = read_pointer(path)
    assert ptr.step == 2 and [s for s, _ in store.steps.steps(ptr.model)] == [1, 2]  # 1: the newest durable
    store.flush()
    retire_older(store, ptr.model)  # what the next re-save does first, now that step 2 is durable
    assert [s for s, _ in store.steps.steps(ptr.model)] == [2]
    assert store.steps.durable_steps(ptr.model) == [2] and {k.step for k in store.list(ptr.model)} == {2}
    io = t.strategy.checkpoint_io
    got = io.load_checkpoint(path)
    assert torch.equal(got["state_dict"]["head.bias"], net.head.bias) and got["global_step"] == 2
    with pytest.raises(CheckpointNotFoundError) as ei:
        io.load_checkpoint(tmp_path / "never.ckpt")
    assert isinstance(ei.value, FileNotFoundError) and "never.ckpt" in str(ei.value)
    with pytest.raises(FileNotFoundError):  # a resume from it fails loudly instead of starting from scratch
        J.trainer([_cb(store, tmp_path / "ck2")], 4).fit(J.Net(), J.data(), ckpt_path=str(tmp_path / "never.ckpt"))
    store.delete_model(ptr.model, force=True)  # the pointer outlives its model: a typed error too
    with pytest.raises(CheckpointNotFoundError, match="does not hold"):
        io.load_checkpoint(path)
    io.remove_checkpoint(path)
    assert not os.path.exists(path)


def test_hyperparameters_round_trip_and_a_module_among_them_is_refused(store, tmp_path):
    hp = {"root": pathlib.Path("/data/set"), "args": argparse.Namespace(lr=0.1, layers=(2, 3)),
          "mode": J.Mode.SLOW, "sched": J.Sched(warmup=5), "tags": frozenset({"x"}), "dtype": torch.bfloat16,
          "ids": {3: "three", 4: "four"}, "classes": {1, 2}}
    net = J.Net(**hp)
    t = J.trainer([_cb(store, tmp_path)], 2)
    t.fit(net, J.data())
    path = tmp_path / "hp.ckpt"
    t.save_checkpoint(path)
    got = t.strategy.checkpoint_io.load_checkpoint(path)["hyper_parameters"]
    assert got == {**hp} and got["mode"] is J.Mode.SLOW and type(got["sched"]) is J.Sched
    assert type(got["args"].layers) is tuple and got["dtype"] is torch.bfloat16
    fresh = TierStoreCheckpointIO(store)  # no trainer to take templates from: the type names are kept
    plain = fresh.load_checkpoint(path)["hyper_parameters"]
    assert plain["mode"] == f"{J.Mode.__module__}.Mode.SLOW" and plain["sched"]["__type__"].endswith(".Sched")
    bad = J.Net(loss_fn=torch.nn.MSELoss())  # Lightning itself warns to leave modules out of the hyper-parameters
    with pytest.raises(InvalidValueError, match=r"save_hyperparameters\(ignore=\['loss_fn'\]\)") as ei:
        J.trainer([_cb(store, tmp_path / "bad")], 2).fit(bad, J.data())
    assert ei.value.key == "lightning.hyper_parameters.loss_fn" and not (tmp_path / "bad").exists()


def test_plain_checkpoint_io_under_lightnings_own_model_checkpoint(store, tmp_path):
    plugin = TierStoreCheckpointIO(store, name="plain")
    ref = J.Net()
    J.trainer([], 8, enable_checkpointing=False).fit(ref, J.data())
    a = J.Net()
    mc = ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=3, save_last="link", save_top_k=1)
    J.trainer([mc], 4, plugins=[plugin]).fit(a, J.data())
    assert os.path.islink(tmp_path / "last.ckpt")  # Lightning's link to the newest top-k pointer
    target = os.path.realpath(tmp_path / "last.ckpt")
    assert read_pointer(target).info["layout"] == "dict"  # no trainer bound: the dict as it is
    b = J.Net()
    J.trainer([ModelCheckpoint(dirpath=str(tmp_path / "b"))], 8, plugins=[TierStoreCheckpointIO(store, name="plain")]
              ).fit(b, J.data(), ckpt_path=str(tmp_path / "last.ckpt"))
    assert all(b.losses[s] == ref.losses[s] for s in b.losses) and sorted(b.losses) == list(range(3, 8))
    plugin.remove_checkpoint(tmp_path / "last.ckpt")  # a link: only the link goes
    assert os.path.exists(target) and read_pointer(target).model in store.models()
    own = tmp_path / "own.ckpt"  # a file Lightning wrote itself still loads through the plugin
    torch.save({"state_dict": {"w": torch.ones(2)}, "epoch": 3}, own)
    assert plugin.load_checkpoint(own, weights_only=True)["epoch"] == 3
    plugin.remove_checkpoint(own)
    assert not own.exists()


def _launch(mode: str, home: Path, ck: Path, out: Path, kill: int, steps: int) -> list[int]:
    from tests import _warm
    from tests._ranks import run_ranks

    job = run_ranks("tests._lightning_job", [mode, str(home), str(ck), str(out), str(kill), str(steps)],
                    preload=_warm.LIGHTNING)
    if mode != "first" and job.codes != [0, 0]:
        print(job.tail())
    return job.codes


def test_ddp_rank0_saves_sigkill_resume_bitwise_and_fsdp2(tmp_path):
    home, ck, out = tmp_path / "home", tmp_path / "ck", tmp_path / "out"
    assert _launch("first", home, ck, out, 7, 12) == [-signal.SIGKILL] * 2  # killed at the start of step 7
    assert read_pointer(ck / "last.ckpt").info["global_step"] == 6
    assert _launch("second", home, ck, out, -1, 12) == [0, 0]
    for rank in range(2):
        res = json.loads(Path(f"{out}.{rank}.json").read_text())
        got, ref = res["resumed"], res["ref"]
        assert sorted(map(int, got["losses"])) == list(range(6, 12))
        assert all(got["losses"][s] == ref["losses"][s] for s in got["losses"]), rank
        assert got["params"] == ref["params"], rank
        run = {str(ck / f): read_pointer(ck / f) for f in res["files"] if not os.path.islink(ck / f)}
        assert res["models"] == sorted({p.model for p in run.values()})  # the run is one model
        assert res["pins"] == {k: p.step for k, p in run.items()}  # rotation: the pins follow the files
        f = res["fsdp2"]
        assert f["sharded"] and f["layout"] == "dict" and f["equal"], (rank, f)
        assert sorted(map(int, f["losses_b"])) == [3, 4, 5]
        assert all(f["losses_a"][s] == f["losses_b"][s] for s in f["losses_b"])


def test_saves_during_fit_return_before_their_commit_and_every_pointer_names_a_committed_step(
        store, tmp_path, monkeypatch):
    """``async_save`` (the default): during ``fit`` a save returns after the snapshot while its commit is still
    pending (the training thread goes on to the next batch), the pointer appears only once the step is committed,
    the next save waits for the previous one, and at the end of ``fit`` every pointer names a committed step.
    A save whose commit fails raises, typed, at the next call that waits for it, and leaves no pointer."""
    import threading

    from tierstore.errors import CommitError
    from tierstore.train.checkpointer import Checkpointer

    gate = threading.Event()
    real_wait = Checkpointer.wait
    seen: list[tuple[int, bool]] = []  # (global step at a batch start, whether a save's commit was pending)

    def held_wait(self, *a, **kw):
        gate.wait(30)  # the commit's wait is held until the training thread reached the next batch
        return real_wait(self, *a, **kw)

    monkeypatch.setattr(Checkpointer, "wait", held_wait)
    cb = _cb(store, tmp_path / "ck", every_n_train_steps=1, save_top_k=-1)

    class Probe(pl.Callback):
        def on_train_batch_start(self, trainer, *args):
            pending = cb.io._saves.busy()
            seen.append((trainer.global_step, pending))
            gate.set()

    J.trainer([cb, Probe()], 3).fit(J.Net(), J.data())
    assert (1, True) in seen, seen  # the training thread ran on while the first save's commit was pending
    files = _pointers(tmp_path / "ck")
    assert len(files) == 3, files
    for f in files:
        ptr = read_pointer(tmp_path / "ck" / f)
        assert store.steps.state(ptr.model, ptr.step) in ("committed", "durable"), f

    monkeypatch.setattr(Checkpointer, "wait", lambda self, *a, **kw: "aborted")
    cb2 = _cb(store, tmp_path / "ck2", every_n_train_steps=1, save_top_k=-1)
    with pytest.raises(CommitError, match="was aborted"):
        J.trainer([cb2], 2).fit(J.Net(), J.data())
    assert not os.path.isdir(tmp_path / "ck2") or _pointers(tmp_path / "ck2") == []
