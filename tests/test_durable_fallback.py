"""The durable tier is the last line: after a node loss (the trainer SIGKILLed, its node's shared memory
gone) a restore returns a step no older than the newest step that was durable at the moment of the loss,
however far the durable tier lags behind the saves.

The trainer is the README's loop (exact policy, the default ``keep_last=3``, a save every step) on a
durable tier slower than the saves (every durable put sleeps): retention keeps the last committed steps in
memory, and must never take the newest durable step out of the durable tier while it is the only one.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from tierstore.testing.gpt import GPTConfig, char_dataset, get_batch, make_model, train_step
from tierstore.train.checkpointer import Checkpointer

from tests import _warm

ROOT = Path(__file__).resolve().parents[1]
CFG = GPTConfig(d_model=32, n_layer=2, n_head=2, block=32)
M = "ret"


def _open(redis_url: str, durable: str, host_root: str, slow_s: float = 0.0):
    import tierstore
    from tierstore.testing.faults import FaultPlan, FaultRule, install

    store = tierstore.open(Path(durable).parent / "home", redis=redis_url, durable=f"file://{durable}",
                           host_root=host_root, node_id="node0")
    if slow_s:
        install(store, FaultPlan([FaultRule("backend.put@durable", "slow", delay_s=slow_s)]))
    return store


def _trained(steps: int):
    """The model and optimizer after ``steps`` steps of the loop (bitwise as the worker's: one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        data = char_dataset()
        model, opt = make_model(CFG, seed=0)
        for s in range(steps):
            train_step(model, opt, *get_batch(data, s, 0, 4, CFG.block, 0))
    finally:
        torch.set_num_threads(threads)
    return model, opt


def worker(redis_url: str, durable: str, host_root: str, steps: int) -> None:
    """The README's training loop, a save every step, on a slow durable tier; prints each committed step."""
    store = _open(redis_url, durable, host_root, slow_s=0.03)
    data = char_dataset()
    model, opt = make_model(CFG, seed=0)
    ck = Checkpointer(store, M, model, opt)  # exact, keep_last=3
    ck.restore()
    for s in range(steps):
        train_step(model, opt, *get_batch(data, s, 0, 4, CFG.block, 0))
        ck.save(s + 1)
        assert ck.wait() == "committed"
        print(f"committed {s + 1}", flush=True)
        time.sleep(0.05)  # the test looks at the index between saves
    print("done", flush=True)
    time.sleep(600)  # killed by the test


def _newest_durable(store) -> int | None:
    durable = [s for s, st in store.steps.steps(M) if st == "durable"]
    return durable[-1] if durable else None


def test_node_loss_under_migration_lag_restores_the_newest_durable_step(tmp_path, redis_url, shm_root):
    durable, host_root = tmp_path / "durable", shm_root / "node0"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    p = _warm.popen([sys.executable, "-m", "tests.test_durable_fallback", redis_url, str(durable),
                          str(host_root), "40"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    observer = _open(redis_url, str(durable), str(tmp_path / "observer-host"))
    try:
        # the node is lost at the first moment when the memory window (3 steps) has moved past the newest
        # durable step: the old retention deleted that step's objects exactly then
        at_loss, states = None, {}
        assert p.stdout is not None
        for line in p.stdout:
            if not line.startswith("committed"):
                break
            newest = int(line.split()[1])
            at_loss = _newest_durable(observer)
            if at_loss is not None and newest - at_loss >= 4:
                states = dict(observer.steps.steps(M))
                break
        p.send_signal(signal.SIGKILL)  # the node is lost: the trainer, and its shared memory below
        p.wait(timeout=60)
        shutil.rmtree(host_root, ignore_errors=True)
        assert states, ("the durable tier never lagged 4 steps behind", at_loss,
                        p.stderr.read()[-3000:] if p.stderr else "")
        observer.close()

        store = _open(redis_url, str(durable), str(host_root))
        model, opt = make_model(CFG, seed=5)
        ck = Checkpointer(store, M, model, opt)
        step, _ = ck.restore()
        assert step is not None and step >= at_loss, (step, at_loss, states)
        want, want_opt = _trained(step)
        for (n, a), b in zip(model.state_dict().items(), want.state_dict().values()):
            assert torch.equal(a, b), n
        assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], want_opt.state_dict()["state"][0]["exp_avg"])
        # what the index reports durable is what the durable tier holds, object for object
        for rec in store.steps.records(M):
            if rec.state == "durable":
                assert store.list(M, step=rec.step), f"step {rec.step} is reported durable but holds no object"
        ck.close()
        store.close()
    finally:
        if p.poll() is None:
            p.kill()
        try:
            observer.close()
        except Exception:  # noqa: BLE001 - already closed above
            pass


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
