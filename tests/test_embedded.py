"""The embedded default: one private server shared by several processes, surviving restarts."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import torch

import tierstore
from tierstore.embedded import ensure_server, stop_server

from tests import _warm

ROOT = str(Path(__file__).parents[1])

CHILD = """
import sys, torch, tierstore
s = tierstore.open(sys.argv[1], host_root=sys.argv[2])
r = int(sys.argv[3])
s.put(tierstore.ShardKey("m", "l", 1, r), {"w": torch.full((4,), float(r))})
s.close()
"""


def test_open_with_no_services(tmp_path, shm_root):
    home = tmp_path / "home"
    env = {**os.environ, "PYTHONPATH": ROOT}
    procs = [_warm.popen([sys.executable, "-c", textwrap.dedent(CHILD), str(home), str(shm_root), str(r)],
                              env=env) for r in range(3)]
    assert [p.wait(60) for p in procs] == [0, 0, 0]
    s = tierstore.open(home, host_root=str(shm_root))
    try:
        assert len(s.list("m")) == 3
        assert torch.equal(s.get("m/l/1/2").tensors["w"], torch.full((4,), 2.0))
        s.flush()
    finally:
        s.close()
    # the index survives a server restart (append-only file)
    assert stop_server(home)
    ensure_server(home)
    s = tierstore.open(home, host_root=str(shm_root))
    try:
        assert len(s.list("m")) == 3
    finally:
        s.close()
        stop_server(home)
    assert (home / "index" / "appendonlydir").exists()
