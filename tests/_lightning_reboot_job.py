"""One rank of the 2-rank Lightning runs of tests/test_lightning_reboot.py (``python -m tests._lightning_reboot_job
PHASE HOME CKPT_DIR OUT``, launched with the launcher's environment; Lightning starts no processes itself).

``a``: saves every 2 steps to step 4, then everything is made durable. ``b``: resumes with ``ckpt_path="last"`` on
a store whose migration is off (saves 6 and 8 commit in host memory only) and is SIGKILLed right after the save
of step 8. ``c`` (after the test's reboot): ``ckpt_path="last"`` again to step 8, then an uninterrupted reference
run; writes both runs' losses and parameters to ``OUT.<rank>.json``.
"""

from __future__ import annotations

import json
import os
import sys

from tests import _lightning_job as J


def _cb(store: object, ckpt_dir: str) -> object:
    from tierstore.interop.lightning import TierStoreCheckpoint

    return TierStoreCheckpoint(store=store, dirpath=ckpt_dir, every_n_train_steps=2, save_last=True, save_top_k=-1)


def main(argv: list[str]) -> int:
    import tierstore

    phase, home, ckpt_dir, out = argv
    rank = int(os.environ["RANK"])
    store = tierstore.open(home, migrate=phase != "b")
    if phase == "a":
        J.trainer([_cb(store, ckpt_dir)], 4, devices=2, strategy="ddp").fit(J.Net(), J.data(rank, 2))
        store.flush()
    elif phase == "b":
        J.trainer([_cb(store, ckpt_dir), J.KillAt(8)], 10, devices=2, strategy="ddp").fit(
            J.Net(), J.data(rank, 2), ckpt_path="last")
        raise AssertionError("not killed")
    else:
        net = J.Net()
        J.trainer([_cb(store, ckpt_dir)], 8, devices=2, strategy="ddp").fit(net, J.data(rank, 2), ckpt_path="last")
        ref = J.Net()
        J.trainer([], 8, devices=2, strategy="ddp", enable_checkpointing=False).fit(ref, J.data(rank, 2))
        res = {tag: {"losses": m.losses, "params": {n: p.tolist() for n, p in J.params(m).items()}}
               for tag, m in (("resumed", net), ("ref", ref))}
        with open(f"{out}.{rank}.json", "w") as f:
            json.dump(res, f)
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
