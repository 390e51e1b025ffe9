"""One rank of the 2-rank Trainer runs of tests/test_huggingface_reboot.py (``python -m tests._hf_reboot_job PHASE
HOME RUN_DIR OUT``, launched with the launcher's environment).

``a``: ``max_steps=8``, stops after its save at step 4, then everything is made durable. ``b``: resumes from
``checkpoint-4`` on a store whose migration is off (``checkpoint-8`` commits in host memory only) and is SIGKILLed
right after that save. ``c`` (after the test's reboot): ``resume_from_checkpoint=True``, then an uninterrupted
reference run; writes both runs' per-step logs and parameters to ``OUT.<rank>.json``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from typing import Any

from transformers import TrainerCallback

from tests import _hf_job as H


class _At(TrainerCallback):
    def __init__(self, step: int, kill: bool) -> None:
        self.step, self.kill = step, kill

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
        if not self.kill and state.global_step == self.step:
            control.should_training_stop = True
        return control

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
        if self.kill and state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)
        return control


def _trainer(store: Any, out: str, callbacks: list | None = None, **kw: Any) -> Any:
    from tierstore.interop.huggingface import TierStoreTrainer

    return TierStoreTrainer(model=H.model(), args=H.args(out, max_steps=8, **kw), train_dataset=H.Windows(),
                            store=store, callbacks=callbacks)


def main(argv: list[str]) -> int:
    import tierstore

    phase, home, run, out = argv
    rank = int(os.environ["RANK"])
    store = tierstore.open(home, migrate=phase != "b")
    if phase == "a":
        _trainer(store, run, [_At(4, kill=False)]).train()
        store.flush()
    elif phase == "b":
        _trainer(store, run, [_At(8, kill=True)]).train(resume_from_checkpoint=os.path.join(run, "checkpoint-4"))
        raise AssertionError("not killed")
    else:
        said: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda r: said.append(r.getMessage())  # type: ignore[method-assign]
        logging.getLogger("tierstore.interop.huggingface").addHandler(handler)
        t = _trainer(store, run)
        t.train(resume_from_checkpoint=True)
        ref = _trainer(store, run + "-ref", save_strategy="no")
        ref.train()
        res: dict[str, Any] = {tag: {"log": H.steps_logged(x), "params": H.params(x.model)}
                               for tag, x in (("resumed", t), ("ref", ref))}
        res["said"] = said
        with open(f"{out}.{rank}.json", "w") as f:
            json.dump(res, f)
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
