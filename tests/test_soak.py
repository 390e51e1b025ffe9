"""The one-minute soak (in CI): save/commit/restore on 2 rank processes with a fault every few seconds.

Runs ``python -m bench.soak --duration 60`` (about 20 faults; the leak checks compare the descriptors and
memory after the warm-up with the end); the hour-long soak is the same command with the default
``--duration 3600``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(900)
def test_soak_one_minute(tmp_path):
    out = tmp_path / "soak.json"
    p = subprocess.run([sys.executable, "-m", "bench.soak", "--duration", "60", "--ranks", "2",
                        "--fault-every", "3", "--seed", "1", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=880)
    assert out.exists(), f"soak produced no report (rc={p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    r = json.loads(out.read_text())
    print(json.dumps({k: v for k, v in r.items() if k != "ranks"}))
    assert p.returncode == 0
    assert r["bytes_lost"] == 0 and r["lost"] == []
    assert r["checkpoints_committed"] > 10 and r["steps_verified"] >= r["checkpoints_committed"]
    assert r["faults_injected"] >= 10
    assert r["restores"] > 0
    for rank in r["ranks"]:
        assert rank["restore_failures"] == 0 or rank["restores"] > rank["restore_failures"]
        assert rank["fds_last"] - rank["fds_first"] <= 16, f"descriptors leak: {rank}"
        assert rank["rss_last"] - rank["rss_first"] < 64 << 20, f"memory grows: {rank}"
