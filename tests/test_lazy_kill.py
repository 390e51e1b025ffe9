"""A lazy save whose process is SIGKILLed in the middle of its background copy (some layers copied into the
host tier, the others not) never becomes a step: a restore returns the previous committed step bitwise, and
the new incarnation saves the killed step's number again."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch

from tierstore.testing.gpt import GPTConfig, char_dataset, get_batch, make_model, train_step
from tierstore.train.checkpointer import Checkpointer
from tierstore.train.policies import exact

from tests import _warm

ROOT = Path(__file__).resolve().parents[1]
CFG = GPTConfig(d_model=32, n_layer=2, n_head=2, block=32)
M = "lazykill"


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"optim.{i}.{k}"] = v.detach().clone()
    return out


def worker(home: str, ref: str) -> None:
    import tierstore

    store = tierstore.open(home)
    data = char_dataset()
    model, opt = make_model(CFG, seed=0)
    ck = Checkpointer(store, M, model, opt, exact(), lazy=True, keep_last=None)
    ck.restore()
    for s in range(2):
        train_step(model, opt, *get_batch(data, s, 0, 4, CFG.block, 0))
        ck.save(s)
    assert ck.wait() in ("committed", "durable")
    torch.save(_state(model, opt), ref)  # the state of step 1 (a test file, written and read by the test)
    calls = {"n": 0}
    real = store.snapshot

    def killed_mid_copy(*args, **kwargs):  # the third layer of step 2's background copy: the process dies
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)

    store.snapshot = killed_mid_copy  # type: ignore[method-assign]
    train_step(model, opt, *get_batch(data, 2, 0, 4, CFG.block, 0))
    ck.save(2)  # returns; the copy runs in the background and dies on its third layer
    train_step(model, opt, *get_batch(data, 3, 0, 4, CFG.block, 0))  # blocks in the optimizer's pre-hook
    raise SystemExit("the process should have been killed during the copy")


def test_a_process_killed_during_its_lazy_copy_restores_the_previous_step(tmp_path):
    import tierstore

    home, ref = tmp_path / "home", tmp_path / "ref.pt"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    p = _warm.run([sys.executable, "-m", "tests.test_lazy_kill", str(home), str(ref)], cwd=ROOT, env=env, timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    store = tierstore.open(home)
    try:
        assert dict(store.steps.steps(M)).get(2) == "preparing"  # begun, never voted
        model, opt = make_model(CFG, seed=7)
        ck = Checkpointer(store, M, model, opt, exact(), lazy=True, keep_last=None)
        step, _ = ck.restore()
        assert step == 1
        want = torch.load(ref, weights_only=True)
        got = _state(model, opt)
        assert want.keys() == got.keys()
        for k, v in want.items():
            assert torch.equal(got[k], v), k
        data = char_dataset()
        train_step(model, opt, *get_batch(data, 2, 0, 4, CFG.block, 0))
        ck.save(2)  # the new incarnation begins the killed step again, as a new attempt
        assert ck.wait() in ("committed", "durable")
        (rec,) = store.steps.records(M, [2])
        assert rec.attempt == 2
        ck.close()
    finally:
        store.close()


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])
