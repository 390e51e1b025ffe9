"""Launch a job of rank processes, as a launcher does, and wait for it with a bound: the one loop the tests that
run real ``torch.distributed`` ranks share.

Each rank is ``python -m MODULE ARGS...`` in the checkout (forked from a warm interpreter, :mod:`tests._warm`), one thread for BLAS, its output to a file (a pipe
read only at the end blocks a rank that logs more than the pipe holds). ``torchrun=True`` sets what ``torchrun``
sets (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``NODE_RANK``); otherwise the
ranks get the port from their arguments. A rank that exits with ``dies_with`` takes the job down with it (the
others are SIGKILLed, as a launcher tears down a job whose rank failed). Past ``timeout_s`` every rank still
running is SIGKILLed, so a hung job ends the test with codes that say so, never a hang.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests import _warm
from tests.redis_server import free_port

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Job:
    codes: list[int]  # each rank's exit code (negative: the signal that ended it)
    logs: list[str]  # the end of each rank's output (stdout and stderr)

    def tail(self, chars: int = 3000) -> str:
        return "\n".join(f"-- rank {r} exited {c}:\n{log[-chars:]}" for r, (c, log) in enumerate(zip(self.codes,
                                                                                                    self.logs)))


def run_ranks(module: str, args: Sequence[str] | Callable[[int, int], Sequence[str]], *, world: int = 2,
              timeout_s: float = 240, torchrun: bool = True, dies_with: int | None = None,
              env: dict[str, str] | None = None, preload: Sequence[str] = _warm.TORCH) -> Job:
    """Run ``world`` ranks of ``python -m module`` and wait (at most ``timeout_s``). ``args``: every rank's
    arguments, or ``args(rank, port)``. Each rank is a child of the warm interpreter that imported
    ``preload`` (:mod:`tests._warm`): a process of its own, without the seconds of ``import torch``."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ranks-") as logdir:
        procs, files = [], []
        for r in range(world):
            e = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **(env or {}))
            if torchrun:
                e.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(r),
                         LOCAL_RANK=str(r), NODE_RANK="0")
            argv = list(args(r, port) if callable(args) else args)
            f = open(os.path.join(logdir, f"rank{r}.log"), "w+b")  # noqa: SIM115 - closed below
            files.append(f)
            procs.append(_warm.popen([sys.executable, "-m", module, *argv], preload=preload, cwd=ROOT, env=e,
                                     stdout=f, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout_s
        try:
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                if dies_with is not None and any(p.returncode == dies_with for p in procs):
                    for p in procs:
                        if p.poll() is None:
                            p.send_signal(signal.SIGKILL)
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            codes = [p.wait() for p in procs]
            logs = []
            for f in files:
                f.seek(0)
                logs.append(f.read()[-20000:].decode(errors="replace"))
                f.close()
    return Job(codes, logs)
