"""``tierstore testbed`` end to end: index, S3 server, two nodes of agent + ranks, a node lost, restore."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_testbed_node_loss_and_restore(tmp_path):
    from tierstore.cli.testbed import peer_supported

    peer, why = peer_supported()
    cmd = [sys.executable, "-m", "tierstore.cli", "testbed", "--ranks-per-node", "1", "--steps", "5",
           "--kill-at", "2", "--json", "--workdir", str(tmp_path / "tb"), "--timeout", "240"]
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=290, cwd=str(REPO))
    assert p.returncode == 0, p.stdout + p.stderr
    rep = json.loads(p.stdout)
    assert rep["killed"] == "node1" and rep["peer"] == peer, why
    assert 0 <= rep["restored_step"] <= 2
    node0, node1 = rep["ranks"]["0"], rep["ranks"]["1"]
    assert (node0["node"], node1["node"]) == ("node0", "node1")
    # the surviving node reads its own memory; the lost node's shards come from the peer or durable tier
    assert set(node0["tiers"]) == {"host"}
    assert node1["tiers"] and set(node1["tiers"]) <= ({"peer", "durable"} if peer else {"durable"})
    for r in (node0, node1):
        assert r["restored_step"] == rep["restored_step"] and r["last_step"] == 4 and r["final_state"] == "committed"


def test_compose_file_is_valid():
    import shutil

    import pytest

    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("the docker-compose binary is missing (apt-get install -y --no-install-recommends docker-compose)")
    compose = REPO / "docker" / "docker-compose.yml"
    p = subprocess.run([exe, "-f", str(compose), "config", "-q"], check=False, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    p = subprocess.run([exe, "-f", str(compose), "config", "--services"], check=False, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert set(p.stdout.split()) == {"redis", "minio", "bucket", "node0", "node1"}
    p = subprocess.run([exe, "-f", str(compose), "config"], check=False, capture_output=True, text=True, timeout=60)
    text = p.stdout
    assert "tierstore agent" in text and "torchrun" in text and "tierstore.cli.demo" in text
    assert (REPO / "docker" / "Dockerfile").read_text().count("torch==2.13.0") == 1
