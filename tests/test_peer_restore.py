"""Failure-class-aware restore: a node is lost, its shards come back from the peers' replicas."""

from __future__ import annotations

import shutil

import pytest
import torch

import tierstore
from tests._agents import AgentCluster, require_ucxx
from tierstore import ShardKey

pytestmark = pytest.mark.ucx


@pytest.fixture
def cluster(redis_url):
    require_ucxx()
    c = AgentCluster(3, extra=["--redis", redis_url])
    yield c
    c.close()


def _open(cluster, redis_url, tmp_path, node: str, root):
    return tierstore.open(tmp_path / node, redis=redis_url, durable="none", host_root=str(root), node_id=node,
                          peer_replicas=2, peer_secret_file=str(cluster.secret_file))


def test_restore_on_a_new_node_from_peer_replicas(cluster, redis_url, tmp_path):
    g = torch.Generator().manual_seed(3)
    state = {f"block{i}": {"w": torch.randn(128, 64, generator=g), "m": torch.randn(64, generator=g)} for i in range(3)}
    s0 = _open(cluster, redis_url, tmp_path, "node0", cluster.base / "node0")
    try:
        infos = [s0.put(ShardKey("gpt", layer, 5, 0), ts) for layer, ts in state.items()]
        s0.begin_step("gpt", 5, 1, layout={"layers": sorted(state)})
        assert s0.vote("gpt", 5, 0, infos) == "committed"
        s0.flush()  # replication to the peers finished
        for info in infos:
            assert {"host", "peer"} <= set(s0.info(info.key).tiers)
    finally:
        s0.close()
    # node0 is lost with its host tier; so is one of the two other nodes
    cluster.agents[0].kill()
    shutil.rmtree(cluster.base / "node0")
    cluster.agents[1].kill()
    s3 = _open(cluster, redis_url, tmp_path, "node3", tmp_path / "node3-shm")
    try:
        s3.open_epoch("gpt")
        res = s3.resolve("gpt")
        assert res.step == 5 and res.layers == {layer: 5 for layer in state}
        for layer, ts in state.items():
            out = {n: torch.empty_like(t) for n, t in ts.items()}
            s3.get(res.objects[(layer, 0)].key, out=out)
            assert all(torch.equal(out[n], ts[n]) for n in ts)
    finally:
        s3.close()
        shutil.rmtree(tmp_path / "node3-shm", ignore_errors=True)


def test_a_ranged_read_on_a_new_node_moves_the_slice_from_a_peer(cluster, redis_url, tmp_path, monkeypatch):
    """A node that lost its host tier reads a slice of a shard (what a resharded restore asks) from a peer's
    replica: verified, and the bytes that cross the network are the header, tables and the chunks of the
    slice, not the copy."""
    from backends.peer_conn import PeerConn

    moved: list[int] = []
    real = PeerConn.exchange

    async def counted(self, *a, **kw):
        reply, data = await real(self, *a, **kw)
        moved.append(0 if data is None else data.nbytes)
        return reply, data

    g = torch.Generator().manual_seed(4)
    w = torch.randn(4096, 1024, generator=g)  # 16 MiB
    key = ShardKey("gpt", "block0", 7, 0)
    s0 = _open(cluster, redis_url, tmp_path, "node0", cluster.base / "node0")
    try:
        info = s0.put(key, {"w": w})
        s0.begin_step("gpt", 7, 1, layout={"layers": ["block0"]})
        assert s0.vote("gpt", 7, 0, [info]) == "committed"
        s0.flush()
        assert "peer" in s0.info(key).tiers
    finally:
        s0.close()
    cluster.agents[0].kill()
    shutil.rmtree(cluster.base / "node0")
    s3 = _open(cluster, redis_url, tmp_path, "node3", tmp_path / "node3-shm")
    monkeypatch.setattr(PeerConn, "exchange", counted)
    try:
        shard = s3.open_ranged(key)
        got = shard.read_box("w", offsets=(1024, 0), sizes=(16, 1024))
        assert torch.equal(got, w[1024:1040])
        assert 0 < sum(moved) < info.size // 4, (moved, info.size)
    finally:
        s3.close()
        shutil.rmtree(tmp_path / "node3-shm", ignore_errors=True)


def test_replication_failure_is_not_recorded_as_peer_copy(cluster, redis_url, tmp_path):
    s0 = _open(cluster, redis_url, tmp_path, "node0", cluster.base / "node0")
    try:
        for a in cluster.agents[1:]:
            a.kill()  # no peer can take a replica
        info = s0.put(ShardKey("gpt", "block0", 1, 0), {"w": torch.ones(1000)})
        with pytest.raises(tierstore.TierUnavailableError):
            s0.flush()
        assert "peer" not in s0.info(info.key).tiers
    finally:
        try:
            s0.close()
        except tierstore.TierUnavailableError:
            pass
