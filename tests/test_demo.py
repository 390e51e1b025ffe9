"""``tierstore demo`` end to end in a subprocess: exit status, summary, a valid PNG."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="matplotlib is not installed (tierstore[plot])")


def test_demo_short_run(tmp_path, shm_root):
    home, out = tmp_path / "home", tmp_path / "out"
    cmd = [sys.executable, "-m", "tierstore.cli", "demo", "--home", str(home), "--out", str(out),
           "--host-root", str(shm_root / "node0"), "--steps", "6", "--kill-at", "3", "--ranks", "2",
           "--model-name", "demo-test"]
    try:
        p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=240,
                           cwd=str(Path(__file__).parent.parent))
    finally:
        subprocess.run([sys.executable, "-m", "tierstore.cli", "server", "stop", "--home", str(home)],
                       check=False, capture_output=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "tierstore demo summary" in p.stdout
    assert "rank 1 killed at step 3" in p.stdout
    assert "written vs full checkpoints (steps 0-5, 2 ranks)" in p.stdout  # every rank's bytes, every step drawn
    assert f"remove them with: tierstore server stop --purge --home {home}" in p.stdout  # --host-root: not the host tier
    # the last store to close the host tier freed the segments it kept for reuse: only objects stay
    assert list((shm_root / "node0" / ".pool").iterdir()) == []
    for figure in ("stall per save", "commit latency", "bytes in host/", "bytes in durable/", "restore",
                   "loss before failure"):
        assert figure in p.stdout, figure
    summary = json.loads((out / "summary.json").read_text())
    assert summary["kill_at"] == 3 and summary["world"] == 2
    # the victim died before saving step 3: the restore comes from an earlier committed step, in memory
    assert summary["restore"]["step"] is not None and 1 <= summary["restore"]["step"] <= 2
    assert set(summary["restore"]["tiers"]) == {"host"} and summary["restore"]["seconds"] > 0
    assert summary["steps_committed"] >= 5  # every step but the lost one (gc keeps the last 2 records)
    assert summary["replay_bitwise"] is True  # exact restore: the replayed steps reproduce the lost run
    n = len(summary["replayed_steps"])
    assert f"yes ({n} step)" in p.stdout if n == 1 else f"yes ({n} steps)" in p.stdout
    assert summary["ranks_reporting"] == 2 and summary["killed_rank"] == 1
    assert set(summary["restore"]["steps_by_rank"].values()) == {summary["restore"]["step"]}
    assert [s for s, _ in summary["loss_curve"]["phase1"]] == list(range(summary["restore"]["step"] + 1, 6))
    # the plot's baseline: a full checkpoint of the same state for every step drawn, which the policy undercuts
    full, written = summary["full_bytes_per_step"], summary["bytes_per_step"]
    assert set(full) == set(written) and len(set(full.values())) == 1 and min(full.values()) > 0, full
    assert sum(sum(k.values()) for k in written.values()) < sum(full.values())  # dedup: rank 1 writes refs
    png = out / "demo.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    with Image.open(png) as im:
        im.verify()
    with Image.open(png) as im:
        assert im.size[0] > 300 and im.size[1] > 300


    # the picture's numbers are the summary's: one record (summary.json's figures), printed and drawn
    from tierstore.cli.demo_plot import figures, numbers

    shown = numbers(png)
    assert shown == summary["figures"] == figures(summary), (shown, summary["figures"])

    def row(label: str) -> str:
        (line,) = [ln for ln in p.stdout.splitlines() if f"│ {label}" in ln]
        return line

    assert f"│ {shown['stall_median']}, {shown['stall_max']} " in row("stall per save (median, max)")
    assert f"│ {shown['torch_save_median']}, {shown['torch_save_max']} (5 per rank" in row("torch.save of the same")
    assert f" in {shown['restore']}: " in row("restore (2 ranks)")
    assert f"│ {shown['torch_load']} " in row("torch.load + load_state_dict")
    assert f"│ {shown['written']} vs {shown['full']} ({shown['smaller']} smaller; refs {shown['refs']})" in row(
        "written vs full checkpoints")
    # torch.save and torch.load of the same state were measured in the demo: 5 times on each of the 2 ranks
    ts = summary["torch_save"]
    assert ts["repeats"] == 5 and ts["save_s"]["n"] == 10 and ts["load_s"]["n"] == 2, ts
    assert ts["save_s"]["median"] > 0 and ts["load_s"]["seconds"] > 0 and ts["bytes"] > 0
    assert "-" not in (shown["torch_save_median"], shown["torch_load"], shown["restore"], shown["stall_median"])
    assert not list(Path(ts["where"]).glob("tierstore-demo-torch-save-*"))  # its files were removed
