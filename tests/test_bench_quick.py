"""The benchmark harness runs end to end on a tiny state and writes well-formed results.

No speed assertions: only that ``python -m tierstore.bench.run --quick`` exits 0, writes
``results.json`` with the expected keys and figures for every peer, and a
markdown table in ``results.md``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PEERS = ["copy", "torch_save_shm", "torch_save_disk", "dcp_save", "dcp_async", "dcp_async_staged"]


_DONE: list = []  # this session's run: made once even when the module's fixtures are set up again


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str, str, str]:
    """One quick bench run, made once per pytest session (each xdist worker is one)."""
    if _DONE:
        return _DONE[0]
    out = tmp_path_factory.mktemp("bench") / "tmp"
    proc = subprocess.run(
        [sys.executable, "-m", "tierstore.bench.run", "--quick", "--size-gib", "0.02", "--repeats", "1",
         "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, f"bench failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    with open(out / "results.json", encoding="utf-8") as f:
        res = json.load(f)
    md = (out / "results.md").read_text(encoding="utf-8")
    _DONE.append((res, md, proc.stdout, proc.stderr))
    return _DONE[0]


def test_json_has_the_expected_keys(results: tuple[dict, str, str, str]) -> None:
    res, _, _, _ = results
    for key in ("date", "machine", "config", "state_bytes_per_rank", "skipped", "summary", "ranks"):
        assert key in res, key
    assert res["machine"]["torch"]
    assert res["config"]["ranks"] == 2 and res["config"]["repeats"] == 1
    assert len(res["ranks"]) == 2
    assert {r["rank"] for r in res["ranks"]} == {0, 1}
    assert 0.015 * 2**30 < res["state_bytes_per_rank"] < 0.025 * 2**30


def test_every_peer_has_figures(results: tuple[dict, str, str, str]) -> None:
    res, _, _, _ = results
    summ = res["summary"]
    for name in PEERS:
        assert name in summ, f"{name} missing; skipped: {res['skipped']}"
        fig = summ[name]
        for key in ("stall_s", "complete_s", "restore_s", "extra_rss_bytes", "shm_bytes",
                    "stall_vs_copy", "stall_vs_best_peer", "slowdown"):
            assert key in fig, (name, key)
        assert fig["stall_s"]["n"] == 1 and fig["stall_s"]["median"] > 0
        assert fig["complete_s"]["median"] >= fig["stall_s"]["median"] * 0.999
        assert fig["restore_s"]["median"] > 0
    assert summ["copy"]["stall_vs_copy"] == pytest.approx(1.0)
    assert summ["dcp_async_staged"]["returns_s"] is not None
    assert summ["torch_save_disk"]["durable_s"] is not None
    assert summ["copy"]["extras"]["xxh3_128_gib_s"] > 0
    for rank in res["ranks"]:
        for name in PEERS:
            assert len(rank["systems"][name]["samples"]) == 1


def test_tierstore_is_measured_or_skipped_with_a_reason(results: tuple[dict, str, str, str]) -> None:
    res, _, _, _ = results
    assert "tierstore_host" in res["summary"] or res["skipped"].get("tierstore_host")


def test_markdown_table(results: tuple[dict, str, str, str]) -> None:
    _, md, stdout, _ = results
    lines = [line for line in md.splitlines() if line.startswith("|")]
    assert lines[0].startswith("| system | stall |")
    assert set(lines[1].replace("|", "").split()) == {"---"}
    width = lines[0].count("|")
    assert all(line.count("|") == width for line in lines)
    for name in PEERS:
        assert any(line.startswith(f"| `{name}` |") for line in lines), name
    assert "| system | stall |" in stdout


def test_progress_line_per_system_and_round(results: tuple[dict, str, str, str]) -> None:
    """On stderr (not a terminal): the plan at once, then a numbered line per system's setup, per system
    and round, per slowdown pass."""
    res, _, _, stderr = results
    lines = [line for line in stderr.splitlines() if line.startswith("bench: ")]
    assert lines and "rank(s)" in lines[0] and "scratch" in lines[0], stderr[-2000:]
    measured = list(res["summary"])
    total = 3 * len(measured)  # skipped systems leave the plan
    for name in measured:
        for what in (f"setup {name}:", f"round 1/1 {name}: save stall", f"slowdown {name}:"):
            assert sum(what in line for line in lines) == 1, (what, stderr[-3000:])
    numbered = [line for line in lines if re.match(r"bench: \[\d+/\d+\] ", line)]
    assert len(numbered) == 3 * len(measured)
    assert numbered[-1].startswith(f"bench: [{total}/{total}] ")
