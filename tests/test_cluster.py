"""The index on a real Redis Cluster (3 primaries + 3 replicas of the bundled server, on loopback).

What is tried, the way an operator or a user would:

- a seed URL of *any* node (a primary not serving the model, a replica) is
  detected as a cluster; ``redis+cluster://`` forces it; a cluster URL that
  cannot be one fails typed;
- models whose slots sit on each of the three primaries save, commit, become
  durable, restore bitwise, are collected and rebuilt; every script's keys
  hash to the model's slot, and no node ever answered CROSSSLOT or MOVED to a
  script;
- the node registry and the models list, which live outside model slots;
  step events (pub/sub) from a model on another node;
- ``tierstore admin`` against the cluster;
- replica acknowledgement: with the replica of the model's primary frozen
  (SIGSTOP, its replication link closed), the deciding vote fails with ReplicaAckError instead of
  reporting a commit, and so do ``wait`` and a new epoch; after the primary is
  SIGKILLed and the frozen replica promoted, exactly that unacknowledged
  commit is gone and restore returns the newest acknowledged step; garbage
  collection meanwhile refuses to drop the older step for it;
- on a single server: acks off by default, a replica attached turns them on,
  asking for a replica that is not there fails typed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import torch
from redis.cluster import key_slot

import tierstore
from consistency.gc import Retention
from consistency.index import Index
from consistency.nodes import NodeRegistry
from tests.redis_cluster import LocalCluster, make_cluster
from tests.redis_server import RedisProcess
from tests.test_admin import parse_json_out
from tierstore import ShardKey
from tierstore.cli import admin
from tierstore.config import StoreConfig
from tierstore.errors import ConfigError, ReplicaAckError, TierUnavailableError

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("emb", "head")


def models_on_each_primary(cl: LocalCluster) -> list[str]:
    """One model name whose slot each primary serves."""
    out: dict[int, str] = {}
    for i in range(1000):
        name = f"gpt{i}"
        port = cl.primary_of(f"ts:{{{name}}}:x").port
        out.setdefault(port, name)
        if len(out) == cl.primaries:
            return sorted(out.values())
    raise AssertionError("no model names spread over the primaries")


def tensors(layer: str, step: int, rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 7919 + rank * 131 + LAYERS.index(layer))
    return {"param": torch.randn(257, generator=g), "exp_avg": torch.randn(257, generator=g).half()}


def open_store(tmp_path: Path, url: str, node: str = "node0", **kw) -> tierstore.TierStore:
    return tierstore.open(tmp_path / f"home-{node}", redis=url, durable=f"file://{tmp_path / 'durable'}",
                          host_root=str(tmp_path / "shm" / node), node_id=node, **kw)


def save_step(store, model: str, step: int, world: int = 2, epoch: int | None = None) -> list[str]:
    """Begin ``step``, put every rank's shards, vote for every rank; the states the votes returned."""
    store.begin_step(model, step, world, layout={"layers": list(LAYERS)}, epoch=epoch)
    states = []
    for rank in range(world):
        infos = [store.put(ShardKey(model, layer, step, rank), tensors(layer, step, rank), epoch=epoch)
                 for layer in LAYERS]
        states.append(store.vote(model, step, rank, infos, extra={"rank": rank}, epoch=epoch))
    return states


def check_restore(store, model: str, step: int, world: int = 2) -> None:
    res = store.resolve(model)
    assert res.step == step and res.layers == {layer: step for layer in LAYERS}
    for (layer, rank), info in res.objects.items():
        got = store.get(info.key).tensors
        for name, t in tensors(layer, step, rank).items():
            assert torch.equal(got[name], t), (info.key, name)
    assert sorted(res.objects) == sorted((layer, r) for layer in LAYERS for r in range(world))


def errorstats(cl: LocalCluster) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in cl.nodes:
        if n.alive():
            for k, v in n.client().info("errorstats").items():
                out[k] = out.get(k, 0) + int(v["count"] if isinstance(v, dict) else v)
    return out


# -- detection ------------------------------------------------------------------------------------
def test_a_seed_of_any_node_is_detected_as_a_cluster(redis_cluster, cluster_url, redis_url):
    cl = redis_cluster
    primary = cl.primary_of("ts:{gpt}:x")
    others = [n for n in cl.nodes if n is not primary]
    for seed in (primary, others[0], cl.replica_of(primary)):
        # the replica count is what the nodes say now: under load a node's health can flap past the node timeout
        # between one seed and the next (seen in a fresh-clone run beside a testbed: replicas 0)
        cl.wait_ok()
        idx = Index(f"redis://127.0.0.1:{seed.port}/0")
        try:
            assert idx.is_cluster and idx.replicas == 1
            idx.raise_epoch("gpt", 7)  # a script in gpt's slot, whichever node the seed was
            assert idx.epoch("gpt") == 7
        finally:
            idx.close()
    forced = Index(f"redis+cluster://127.0.0.1:{others[1].port}")
    assert forced.is_cluster and forced.epoch("gpt") == 7
    forced.close()
    single = Index(redis_url)
    assert not single.is_cluster and single.replicas == 0  # a single server: acks off
    single.close()
    with pytest.raises(TierUnavailableError):  # forcing a cluster client onto a server that is not one
        Index(redis_url.replace("redis://", "redis+cluster://")).ping()
    with pytest.raises(ConfigError):
        Index("redis+cluster:///tmp/x.sock").ping()
    with pytest.raises(ConfigError):
        Index(f"redis://127.0.0.1:{primary.port}/3").ping()  # a cluster has database 0 only


def test_index_settings_come_from_config_and_environment():
    env = {"TIERSTORE_INDEX_REPLICAS": "auto", "TIERSTORE_ACK_TIMEOUT": "0.25"}
    cfg = StoreConfig.from_env(env)
    assert cfg.index_replicas is None and cfg.index_ack_timeout_s == 0.25
    assert StoreConfig.from_env({"TIERSTORE_INDEX_REPLICAS": "2"}).index_replicas == 2
    assert StoreConfig.from_env(env, index_replicas=0).index_replicas == 0  # explicit wins
    for bad in ({"TIERSTORE_INDEX_REPLICAS": "one"}, {"TIERSTORE_ACK_TIMEOUT": "soon"},
                {"TIERSTORE_ACK_TIMEOUT": "0"}, {"TIERSTORE_INDEX_REPLICAS": "-1"}):
        with pytest.raises(ConfigError):
            StoreConfig.from_env(bad)


# -- the whole life of steps, on models spread over the primaries -----------------------------------
def test_models_on_every_primary_commit_restore_collect_and_rebuild(redis_cluster, cluster_url, tmp_path,
                                                                    monkeypatch):
    cl = redis_cluster
    models = models_on_each_primary(cl)
    slots_seen: dict[str, set[int]] = {m: set() for m in models}
    run_script = Index.run_script

    def spy(self, script, keys, args, **kw):
        slots = {key_slot(k.encode()) for k in keys}
        model = keys[0].split("{", 1)[1].split("}", 1)[0]
        assert slots == {key_slot(f"{{{model}}}".encode())}, (keys, slots)
        slots_seen.setdefault(model, set()).update(slots)
        return run_script(self, script, keys, args, **kw)

    monkeypatch.setattr(Index, "run_script", spy)
    before = errorstats(cl)
    # the seed is a node that serves none of the models' slots only by chance: use each node in turn
    stores = [open_store(tmp_path, f"redis://127.0.0.1:{n.port}/0", node=f"n{i}")
              for i, n in enumerate(cl.nodes[:3])]
    try:
        for i, model in enumerate(models):
            store = stores[i]
            epoch = store.open_epoch(model)
            for step in (1, 2, 3):
                assert save_step(store, model, step, epoch=epoch) == ["preparing", "committed"]
                assert store.wait_step(model, step, timeout=10) in ("committed", "durable")
                store.flush()  # each durable before the next (a lagging migration skips the steps between)
            assert store.wait_step(model, 3, timeout=10) == "durable"
            check_restore(store, model, 3)
            report = store.gc(model, dry_run=False)
            assert report.dropped_steps == [1] and all(k.split("/")[2] == "1" for k in report.deleted)
            assert [s for s, _ in store.steps.steps(model)] == [2, 3]
            for r in range(2):  # retention's rank listing, kept by the record and delete scripts in the slot
                assert store.index.list_rank_objects(model, r) == ([k for k in store.list(model) if k.rank == r], True)
        assert set(stores[0].models()) == set(models)  # ts:models lives outside every model slot
        # lose the index (every primary), rebuild it from the durable manifests
        stores[0].index._r.flushall()
        for model, store in zip(models, stores):
            report = store.rebuild_index(model)
            assert report.restored[model] == [2, 3]
            store.open_epoch(model)
            check_restore(store, model, 3)
            # rebuilt in step order: no delta recorded before its base, so the model stays unmarked; a delta's
            # base record (a key its script reads undeclared, in the model's slot) is read on the cluster
            store.index.record_object(ShardKey(model, "emb", 4, 1), kind="delta", base=ShardKey(model, "emb", 3, 1),
                                      size=1, checksum="c", tiers=["host"])
            for r in range(2):
                assert store.index.list_rank_objects(model, r) == ([k for k in store.list(model) if k.rank == r], True)
        assert all(slots_seen[m] == {key_slot(f"{{{m}}}".encode())} for m in models)
        after = errorstats(cl)
        for kind in ("errorstat_CROSSSLOT", "errorstat_MOVED", "errorstat_ASK"):
            assert after.get(kind, 0) == before.get(kind, 0), (kind, after)
    finally:
        for s in stores:
            s.close()


def test_node_registry_models_list_and_events_across_slots(redis_cluster, cluster_url, tmp_path):
    models = models_on_each_primary(redis_cluster)
    idx = Index(cluster_url)
    reg = NodeRegistry(idx)
    ids = [f"node{i}" for i in range(8)]  # ts:node:<id> keys spread over the slots
    assert len({redis_cluster.primary_of(f"ts:node:{n}").port for n in ids}) > 1
    for i, n in enumerate(ids):
        reg.beat(n, {"address": f"10.0.0.{i}:1234", "capacity": 1 << 20}, ttl_s=30 if i else 0.3)
    got = {n.node_id: n for n in reg.nodes()}
    assert sorted(got) == ids and got["node3"].address == "10.0.0.3:1234" and got["node3"].alive
    reg.remove("node5")
    time.sleep(0.5)
    got = {n.node_id: n for n in reg.nodes()}
    assert "node5" not in got and not got["node0"].alive and got["node1"].alive  # node0's TTL ran out
    store = open_store(tmp_path, cluster_url)
    try:
        subs = {m: store.steps.subscribe(m) for m in models}
        for m in models:
            save_step(store, m, 1)
        for m in models:  # each model's events, whichever node published them
            seen = set()
            deadline = time.monotonic() + 10
            while (1, "committed") not in seen and time.monotonic() < deadline:
                ev = subs[m].get(1.0)
                if ev is not None:
                    seen.add(ev)
            assert (1, "committed") in seen, (m, seen)
            subs[m].close()
        assert set(store.models()) == set(models)
    finally:
        store.close()
        idx.close()


def _admin_args(url: str, tmp_path: Path) -> list[str]:
    return ["--redis", url, "--home", str(tmp_path / "adm"), "--durable", f"file://{tmp_path / 'durable'}",
            "--host-root", str(tmp_path / "shm" / "node0"), "--json"]


def test_admin_cli_against_the_cluster(redis_cluster, cluster_url, tmp_path, capsys):
    models = models_on_each_primary(redis_cluster)
    store = open_store(tmp_path, cluster_url)
    try:
        for m in models:
            save_step(store, m, 1)
        store.begin_step(models[0], 2, 2)
        store.flush()
        assert store.wait_step(models[0], 1, timeout=10) == "durable"
        NodeRegistry(store.index).beat("nodeA", {"address": "127.0.0.1:4567"}, ttl_s=30)
    finally:
        store.close()
    seed = f"redis://127.0.0.1:{redis_cluster.nodes[-1].port}/0"  # a replica as the seed
    conn = _admin_args(seed, tmp_path)
    # the command itself, once, as an operator runs it
    p = subprocess.run([sys.executable, "-m", "tierstore.cli", "admin", *conn, "models"], capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert p.returncode == 0, p.stderr
    assert sorted(r["model"] for r in parse_json_out("models", p.stdout)) == models

    def run(*args: str):
        capsys.readouterr()
        rc = admin.main([*conn, *args])
        out = capsys.readouterr().out
        return rc, parse_json_out(args[0], out) if out.strip() else None

    rc, rows = run("steps", models[0])
    assert rc == 0 and [(r["step"], r["state"]) for r in rows] == [(1, "durable"), (2, "preparing")]
    rc, d = run("show", models[1], "1")
    assert rc == 0 and d["step"] == 1 and d["state"] in ("committed", "durable")
    rc, rows = run("nodes")
    assert rc == 0 and [r["node_id"] for r in rows] == ["nodeA"]
    rc, d = run("verify", models[2])
    assert rc == 0 and d["results"] and all(r["ok"] for r in d["results"])
    rc, d = run("gc", models[0])  # a dry run: the preparing step and the newest committed one are kept
    assert rc == 0 and d["would_delete"] == []


# -- replica acknowledgement -----------------------------------------------------------------------
@pytest.fixture
def private_cluster(tmp_path):
    """A cluster of this test's own: it is broken on purpose."""
    yield from make_cluster(tmp_path / "cluster")


def test_a_commit_no_replica_acknowledged_is_never_reported_and_only_it_is_lost_on_failover(private_cluster,
                                                                                           tmp_path):
    cl = private_cluster
    model = "gpt"
    store = open_store(tmp_path, cl.url, index_ack_timeout_s=0.5, migrate=False)  # host tier only: the index dies
    primary = cl.primary_of(f"ts:{{{model}}}:x")
    replica = cl.replica_of(primary)
    assert replica.proc is not None
    try:
        assert store.index.replicas == 1
        epoch = store.open_epoch(model)
        assert save_step(store, model, 1, epoch=epoch) == ["preparing", "committed"]
        store.begin_step(model, 2, 2, layout={"layers": list(LAYERS)}, epoch=epoch)
        infos = {r: [store.put(ShardKey(model, layer, 2, r), tensors(layer, 2, r), epoch=epoch) for layer in LAYERS]
                 for r in (0, 1)}
        assert store.vote(model, 2, 0, infos[0], extra={"rank": 0}, epoch=epoch) == "preparing"
        # the replica is cut off: frozen, and its replication link closed by the primary, so nothing written
        # from now on reaches it (a frozen replica alone would still read what sits in its socket buffer)
        os.kill(replica.proc.pid, signal.SIGSTOP)
        try:
            primary.client().client_kill_filter(_type="replica")
            assert primary.client().info("replication")["connected_slaves"] == 0
            with pytest.raises(ReplicaAckError) as e:
                store.vote(model, 2, 1, infos[1], extra={"rank": 1}, epoch=epoch)
            assert e.value.state == "committed" and e.value.acked == 0 and e.value.wanted == 1
            assert store.steps.state(model, 2) == "committed"  # the primary has it ...
            with pytest.raises(ReplicaAckError):  # ... but nobody is told so
                store.wait_step(model, 2, timeout=5)
            with pytest.raises(ReplicaAckError):
                store.open_epoch(model)
            # gc keeping only the newest step would drop step 1 for an unacknowledged step 2: it refuses
            with pytest.raises(ReplicaAckError):
                store.gc(model, Retention(keep_last=1), dry_run=False)
            assert store.gc(model, Retention(keep_last=1)).dropped_steps == [1]  # what it would have done
            cl.kill(primary)  # the primary dies before its replica ever had step 2
        finally:
            os.kill(replica.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while replica.client(1).info("replication")["role"] != "master":
            assert time.monotonic() < deadline, "the replica was not promoted"
            time.sleep(0.05)
        with pytest.raises((ReplicaAckError, TierUnavailableError)):  # no replica yet: nothing is acknowledged
            store.wait_step(model, 1, timeout=5)
        cl.restart(primary)  # the operator brings the old primary back: it rejoins as the replica
        cl.wait_ok()
        assert cl.primary_of(f"ts:{{{model}}}:x") is replica
        restore = open_store(tmp_path, cl.url)  # a new process on the same node: its host tier has the shards
        try:
            assert restore.wait_step(model, 1, timeout=10) in ("committed", "durable")
            assert restore.steps.state(model, 2) in (None, "preparing")  # the unacknowledged commit is gone
            assert restore.steps.manifest(model, 2) is None
            new_epoch = restore.open_epoch(model)
            assert new_epoch > epoch
            check_restore(restore, model, 1)
            # the job goes on from step 1 on the promoted primary
            assert save_step(restore, model, 2, epoch=new_epoch) == ["preparing", "committed"]
            check_restore(restore, model, 2)
        finally:
            restore.close()
    finally:
        store.close()


def test_single_server_acks_follow_its_replicas(tmp_path, redis_url):
    single = Index(redis_url, replicas=1, replica_timeout_s=0.2)  # asking for a replica that is not there
    with pytest.raises(ReplicaAckError) as e:
        single.bump_epoch("gpt")
    assert e.value.acked == 0 and e.value.timeout_s == 0.2
    single.close()
    primary = RedisProcess(tmp_path / "p", appendonly=False)
    replica = RedisProcess(tmp_path / "r", appendonly=False)
    (tmp_path / "p").mkdir()
    (tmp_path / "r").mkdir()
    primary.start()
    replica.start()
    try:
        redis.Redis(port=primary.port).config_set("repl-diskless-sync-delay", 0)
        redis.Redis(port=replica.port).replicaof("127.0.0.1", primary.port)
        deadline = time.monotonic() + 20
        while redis.Redis(port=replica.port).info("replication").get("master_link_status") != "up":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        store = open_store(tmp_path, primary.url)
        try:
            assert not store.index.is_cluster and store.index.replicas == 1
            assert save_step(store, "gpt", 1) == ["preparing", "committed"]
            # acknowledged: the replica has the manifest the moment the vote returned
            assert redis.Redis(port=replica.port).get("ts:{gpt}:manifest:1") is not None
            check_restore(store, "gpt", 1)
        finally:
            store.close()
    finally:
        replica.stop()
        primary.stop()
