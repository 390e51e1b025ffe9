"""SIGTERM during ``tierstore import`` or ``export`` ends it through its cleanup, as Ctrl-C does.

The command runs as a real subprocess against the suite's Redis server and a local durable directory.
The test waits for its first progress line on stderr, pauses it there (SIGSTOP), sends SIGTERM and lets
it go on (SIGCONT), so the signal arrives while layers are still being written. Without the handler
SIGTERM ended the process on the spot: an import left its step 0 preparing (a step nobody decided) and an
export left a half-written file in ``--out``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from tierstore.interop.importing import import_model

ROOT = Path(__file__).resolve().parent.parent
LAYERS = 400


def _run_until_progress(args: list[str]) -> tuple[int, str]:
    proc = subprocess.Popen([sys.executable, "-m", "tierstore.cli", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stderr is not None
    try:
        first = proc.stderr.readline()
        assert "layers" in first, first + proc.stderr.read()
        assert not first.split("] ")[1].startswith(f"{LAYERS}/"), first  # still writing
        os.kill(proc.pid, signal.SIGSTOP)
        os.kill(proc.pid, signal.SIGTERM)
        os.kill(proc.pid, signal.SIGCONT)
        _out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, first + err


def test_sigterm_during_import_votes_its_step_down(store, tmp_path):
    src = tmp_path / "weights.pt"
    torch.save({f"l{i}.w": torch.full((256,), float(i)) for i in range(LAYERS)}, src)
    conn = ["--redis", store.config.redis_url, "--host-root", store.config.host_root,
            "--durable", store.config.durable_url]
    rc, err = _run_until_progress(["import", str(src), "--model", "big", *conn])
    assert rc == 128 + signal.SIGTERM, err[-3000:]
    assert "interrupted by SIGTERM" in err
    assert dict(store.steps.steps("big")) == {0: "aborted"}  # decided, not left preparing


def test_sigterm_during_export_leaves_no_partial_file(store, tmp_path):
    src = tmp_path / "weights.pt"
    torch.save({f"l{i}.w": torch.full((256,), float(i)) for i in range(LAYERS)}, src)
    assert import_model(store, src, "wide").step == 0
    out = tmp_path / "out"
    conn = ["--redis", store.config.redis_url, "--host-root", store.config.host_root,
            "--durable", store.config.durable_url]
    rc, err = _run_until_progress(["export", "wide", "0", "--format", "torch", "--out", str(out), *conn])
    assert rc == 128 + signal.SIGTERM, err[-3000:]
    assert "interrupted by SIGTERM" in err
    assert not out.exists() or list(out.iterdir()) == []
