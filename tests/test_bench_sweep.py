"""``tierstore bench --sweep`` (the growth with the number of tensors, and at one rank) and the torchsnapshot peers.

The sweep's points and its table are pure logic (unit tests on made-up summaries); one small run end to end
checks the sub-runs, their progress lines, ``sweep.json`` and the table appended to ``results.md``, and that
torchsnapshot is measured where it is installed and skipped with the reason where it is not.
No speed assertions.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tierstore.bench.report import growth_rows, render_growth
from tierstore.bench.run import SWEEP_TENSORS, build_parser, sweep_points, sweeps

ROOT = Path(__file__).resolve().parent.parent


def test_sweep_points_cover_every_count_at_both_rank_counts_once() -> None:
    assert SWEEP_TENSORS == (200, 1000, 4000)
    assert sweep_points(2, 200, [200, 1000, 4000]) == [
        (2, 200), (2, 1000), (2, 4000), (1, 200), (1, 1000), (1, 4000)]
    assert sweep_points(1, 200, [200, 1000]) == [(1, 200), (1, 1000)]
    assert sweep_points(2, 64, [200]) == [(2, 64), (2, 200), (1, 200)]  # the main run's point is one of them


def test_sweep_is_in_a_full_cpu_run_by_default_and_a_flag_otherwise() -> None:
    def on(*argv: str) -> bool:
        return sweeps(build_parser().parse_args(list(argv)))

    args = build_parser().parse_args([])
    assert args.sweep_tensors == "200,1000,4000"
    assert "tierstore_host" in args.sweep_systems.split(",") and "copy" in args.sweep_systems.split(",")
    assert on() is True  # the full report shows the growth with the number of tensors
    assert on("--quick") is False and on("--device", "cuda") is False and on("--no-sweep") is False
    assert on("--quick", "--sweep") is True


def _fig(kind: str, stall: float, restore: float | None, committed: float | None = None,
         verified: float | None = None) -> dict[str, Any]:
    def st(v: float | None) -> dict[str, float] | None:
        return None if v is None else {"median": v, "min": v, "max": v, "n": 1}

    return {"kind": kind, "stall_s": st(stall), "committed_s": st(committed), "restore_s": st(restore),
            "verified_s": st(verified)}


def test_growth_rows_are_ratios_to_the_bound_of_the_same_run() -> None:
    small = {"summary": {"copy": _fig("bound", 0.1, 0.2), "tierstore_host": _fig("tierstore", 0.15, 0.3, 0.25, 0.4)}}
    big = {"summary": {"copy": _fig("bound", 0.2, 0.1), "tierstore_host": _fig("tierstore", 1.0, 0.5, 2.0, None),
                       "peer": _fig("peer", 0.4, None)}}
    rows = growth_rows([(2, 200, small), (1, 4000, big)])
    assert [(r["ranks"], r["tensors"], r["system"]) for r in rows] == [
        (2, 200, "tierstore_host"), (1, 4000, "tierstore_host"), (1, 4000, "peer")]
    a, b, c = rows
    assert a["stall"] == pytest.approx(1.5) and a["committed"] == pytest.approx(2.5)
    assert a["restore"] == pytest.approx(1.5) and a["verified"] == pytest.approx(2.0)
    assert b["stall"] == pytest.approx(5.0) and b["committed"] == pytest.approx(10.0)
    assert b["restore"] == pytest.approx(5.0) and b["verified"] is None
    assert c["restore"] is None and c["committed"] is None and c["copy_stall_s"] == pytest.approx(0.2)
    md = render_growth(rows, 0.25)
    assert "| 1 | 4000 | `tierstore_host` | 200 | 5.00 | 10.00 | 5.00 | — |" in md
    assert "0.25 GiB per rank" in md


def test_growth_rows_without_a_bound_have_no_ratios() -> None:
    rows = growth_rows([(1, 200, {"summary": {"x": _fig("peer", 0.1, 0.1)}})])
    assert rows == [{"ranks": 1, "tensors": 200, "system": "x", "copy_stall_s": None, "stall": None,
                     "committed": None, "restore": None, "verified": None}]


def test_a_small_sweep_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "tierstore.bench.run", "--quick", "--size-gib", "0.004", "--repeats", "1",
         "--ranks", "1", "--systems", "copy,torchsnapshot,torchsnapshot_async", "--sweep", "--sweep-tensors",
         "8,40", "--sweep-systems", "copy,tierstore_host", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=400,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, f"bench failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    rows = json.loads((out / "sweep.json").read_text(encoding="utf-8"))
    points = {(r["ranks"], r["tensors"]) for r in rows}
    # the main run's point (200 tensors) has rows only for the systems it measured besides the bound: the
    # torchsnapshot peers, when torchsnapshot is installed (an optional extra, not in CI's test extras)
    main = {(1, 200)} if importlib.util.find_spec("torchsnapshot") is not None else set()
    assert points == main | {(1, 8), (1, 40)}, rows
    for n in (8, 40):
        sub = json.loads((out / "sweep" / f"r1-t{n}" / "results.json").read_text(encoding="utf-8"))
        assert sub["config"]["tensors"] == n and sub["config"]["slowdown"] is False
        assert set(sub["summary"]) == {"copy", "tierstore_host"}, sub["skipped"]
        assert all(r["stall"] is not None and r["restore"] is not None for r in rows if r["tensors"] == n)
    md = (out / "results.md").read_text(encoding="utf-8")
    assert "## Growth with the number of tensors" in md and "| 1 | 40 | `tierstore_host` |" in md
    # a line per system and round of every sub-run (setup, then round 1/1), no slowdown pass in a sub-run
    err = proc.stderr
    assert len(re.findall(r"round 1/1 tierstore_host: save stall", err)) == 2, err[-3000:]
    assert "in 40 tensors" in err and "in 8 tensors" in err
    res = json.loads((out / "results.json").read_text(encoding="utf-8"))
    for name in ("torchsnapshot", "torchsnapshot_async"):
        if importlib.util.find_spec("torchsnapshot") is None:
            assert "torchsnapshot is not importable" in res["skipped"][name]
        else:
            assert name in res["summary"], res["skipped"]
            fig = res["summary"][name]
            assert fig["stall_s"]["median"] > 0 and fig["restore_s"]["median"] > 0
            assert fig["committed_s"]["median"] >= fig["stall_s"]["median"] * 0.999
