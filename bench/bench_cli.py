"""Start-up time of the command line: how long ``tierstore --help``, ``tierstore admin models``,
``tierstore admin steps M``, ``tierstore admin verify M`` and ``tierstore server status`` take, end to end.

Each command runs as a fresh process (what a person or a script pays), ``--repeats`` times,
alternating; reported: the median and min-max wall time, and whether the process imported torch
(it should not for these commands; aim: ``tierstore admin models`` under 0.5 s on a quiet machine).
The store is an embedded home in a temporary directory with one model of 4 steps x 2 ranks x 2
layers, its server started before timing (a running server is the normal case), stopped and
removed at the end.

Two ways of starting a command are timed: ``python -m tierstore.cli`` (the interpreter and the
package) and the ``tierstore`` console script on PATH, when there is one (a version manager's shim,
such as pyenv's, adds its own start-up there).

Run: ``python -m bench.bench_cli [--repeats 7]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["main"]

_PROBE = ("import sys, runpy; sys.argv = ['tierstore'] + sys.argv[1:]\n"
          "try:\n    runpy.run_module('tierstore.cli', run_name='__main__')\n"
          "finally:\n    sys.stderr.write('TORCH=%d' % ('torch' in sys.modules))\n")


def _populate(home: Path) -> None:
    import torch

    import tierstore

    store = tierstore.open(home)
    try:
        for step in range(1, 5):
            store.begin_step("bench", step, 2, layout={"layers": ["a", "b"]})
            for rank in (0, 1):
                objs = [store.put(tierstore.ShardKey("bench", layer, step, rank), {"w": torch.randn(256)})
                        for layer in ("a", "b")]
                store.vote("bench", step, rank, objs)
        store.flush()
    finally:
        store.close()


def _time(cmd: list[str], env: dict[str, str]) -> tuple[float, bool]:
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - t
    if p.returncode not in (0, 1):
        raise RuntimeError(f"{cmd} failed ({p.returncode}): {p.stderr[-2000:]}")
    return wall, "TORCH=1" in p.stderr


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_cli", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7, help="runs of each command (default: 7)")
    a = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-cli-"))
    home = work / "home"
    env = dict(os.environ, TIERSTORE_HOME=str(home), TIERSTORE_SHM_DIR=str(work))
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    os.environ["TIERSTORE_SHM_DIR"] = str(work)
    commands = {
        "tierstore --help": ["--help"],
        "tierstore admin models": ["admin", "models"],
        "tierstore admin steps bench": ["admin", "steps", "bench"],
        "tierstore admin verify bench": ["admin", "verify", "bench"],
        "tierstore server status": ["server", "status"],
    }
    script = shutil.which("tierstore")
    try:
        _populate(home)
        rows = []
        for name, args in commands.items():
            ways = {"python -m tierstore.cli": [sys.executable, "-c", _PROBE, *args]}
            if script:
                ways["tierstore (console script)"] = [script, *args]
            for way, cmd in ways.items():
                walls, torch_seen = [], False
                for _ in range(a.repeats):
                    wall, seen = _time(cmd, env)
                    walls.append(wall)
                    torch_seen |= seen
                rows.append((name, way, statistics.median(walls), min(walls), max(walls),
                             "yes" if torch_seen else ("no" if way.startswith("python") else "?")))
        print(f"{a.repeats} runs each, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
        print("| command | started as | median s | min-max s | imports torch |")
        print("| --- | --- | --- | --- | --- |")
        for name, way, med, lo, hi, torch_seen in rows:
            print(f"| `{name}` | {way} | {med:.3f} | {lo:.3f}-{hi:.3f} | {torch_seen} |")
    finally:
        subprocess.run([sys.executable, "-m", "tierstore.cli", "server", "stop", "--purge", "--yes"], env=env,
                       capture_output=True, check=False)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
