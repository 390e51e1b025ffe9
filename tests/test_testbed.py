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


def test_testbed_netns_nodes_cross_real_interfaces(tmp_path):
    """The same scenario with each node in its own network namespace: replicas and restore cross the veths."""
    import pytest

    from tierstore.cli.netns import netns_supported
    from tierstore.cli.testbed import peer_supported

    ok, why = netns_supported()
    if not ok:
        pytest.skip(f"network namespaces cannot be made here: {why}")
    peer, why_peer = peer_supported()
    if not peer:
        pytest.skip(f"the peer tier is off here: {why_peer}")
    cmd = [sys.executable, "-m", "tierstore.cli", "testbed", "--netns", "--ranks-per-node", "1", "--steps", "5",
           "--kill-at", "2", "--json", "--workdir", str(tmp_path / "tb"), "--timeout", "240"]
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=290, cwd=str(REPO))
    assert p.returncode == 0, p.stdout + p.stderr
    rep = json.loads(p.stdout)
    assert set(rep["netns"]) == {"node0", "node1"} and rep["netns"]["node0"] != rep["netns"]["node1"]
    node0, node1 = rep["ranks"]["0"], rep["ranks"]["1"]
    assert set(node0["tiers"]) == {"host"}
    assert node1["tiers"] and set(node1["tiers"]) <= {"peer", "durable"}
    assert node0["restored_step"] == node1["restored_step"] == rep["restored_step"]
    # every byte between the nodes, the index and S3 went over the links: replicas alone are megabytes
    for node in ("node0", "node1"):
        assert rep["links"][node]["sent"] > 1 << 20 and rep["links"][node]["received"] > 1 << 20, rep["links"]
