"""``tierstore admin`` against a real index server, populated through the store itself.

Every subcommand runs in both output modes; the JSON is checked against the
store's own state (index records, manifests, step states), and ``verify``
and ``where`` must catch a byte flipped in the host tier's file.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import threading
import time

import pytest
import redis
import torch

from tests.redis_server import free_port
from tierstore.cli import admin
from tierstore.keys import ShardKey

M = "gpt"


@pytest.fixture
def populated(store):
    """Steps 1, 2 committed (and durable after flush), 3 preparing (one vote of two), 4 aborted."""
    infos: dict[ShardKey, object] = {}

    def put(key, tensors, **kw):
        infos[key] = store.put(key, tensors, **kw)
        return infos[key]

    layout = {"layers": ["embed", "head"]}
    store.begin_step(M, 1, 2, layout=layout)
    for r in (0, 1):
        objs = [put(ShardKey(M, ln, 1, r), {"w": torch.full((64,), float(r + 1))}) for ln in ("embed", "head")]
        store.vote(M, 1, r, objs, extra={"data_pos": 1})
    store.flush()  # durable before step 2 commits (a lagging migration skips the steps between)
    store.begin_step(M, 2, 2, layout=layout)
    o0 = [put(ShardKey(M, "embed", 2, 0), {"w": torch.full((64,), 3.0)}),
          put(ShardKey(M, "head", 2, 0), {"w": torch.zeros(64, dtype=torch.int32)}, kind="delta",
              base=ShardKey(M, "head", 1, 0))]
    o1 = [put(ShardKey(M, "embed", 2, 1), {}, kind="ref", target=ShardKey(M, "embed", 2, 0))]
    store.vote(M, 2, 0, o0)
    store.vote(M, 2, 1, o1)
    store.begin_step(M, 3, 2, layout=layout)
    store.vote(M, 3, 0, [put(ShardKey(M, "embed", 3, 0), {"w": torch.ones(8)})])
    store.begin_step(M, 4, 2, layout=layout)
    store.vote(M, 4, 0, [put(ShardKey(M, "embed", 4, 0), {"w": torch.ones(8)})], ok=False)
    store.flush()
    assert store.wait_step(M, 2, timeout=10) == "durable"
    return store, infos


@pytest.fixture
def conn(tmp_path, redis_url, shm_root):
    return ["--redis", redis_url, "--home", str(tmp_path / "home"), "--durable", f"file://{tmp_path / 'durable'}",
            "--host-root", str(shm_root / "node0")]


LISTINGS = {"models", "steps", "layers", "nodes", "du"}


def parse_json_out(command: str, out: str):
    """``--json`` as a script reads it: a listing is JSON lines (one record a line), the rest one document."""
    lines = out.splitlines()
    assert all(line.strip() for line in lines), repr(out)  # no blank or pretty-printed lines
    docs = [json.loads(line) for line in lines]
    if command in LISTINGS:
        assert all(isinstance(d, dict) for d in docs), docs
        return docs
    (doc,) = docs
    return doc


def run(capsys, conn, *args, json_out=True):
    capsys.readouterr()
    rc = admin.main([*conn, *(["--json"] if json_out else []), *args])
    out, err = capsys.readouterr()
    return rc, (parse_json_out(args[0], out) if json_out and out.strip() else out), err


def test_models(populated, conn, capsys):
    store, infos = populated
    rc, data, _ = run(capsys, conn, "models")
    assert rc == 0
    (row,) = data
    assert row["model"] == M
    assert row["objects"] == len(store.list(M)) == len(infos)
    assert row["bytes"] == sum(i.size for i in infos.values())
    assert row["newest_committed"] == 2 and row["newest_durable"] == 2
    assert row["states"] == {"durable": 2, "preparing": 1, "aborted": 1}
    assert row["retention"] == "by rank"  # full copies only
    rc, text, _ = run(capsys, conn, "models", json_out=False)
    assert rc == 0 and M in text and "durable 2" in text
    # a delta on another rank's copy: a writer's retention pass reads every rank's objects from now on
    store.index.record_object(ShardKey(M, "x", 9, 1), kind="delta", base=ShardKey(M, "x", 8, 0), size=1,
                              checksum="c", tiers=["host"])
    assert run(capsys, conn, "models")[1][0]["retention"] == "every rank"


def test_steps(populated, conn, capsys):
    store, _infos = populated
    rc, rows, _ = run(capsys, conn, "steps", M)
    assert rc == 0
    assert [(r["step"], r["state"]) for r in rows] == store.steps.steps(M)
    by = {r["step"]: r for r in rows}
    assert by[2]["votes"] == 2 and by[3]["votes"] == 1 and by[3]["world"] == 2
    assert "negative vote" in by[4]["reason"]
    for step, row in by.items():
        recs = [store.index.get_object(k) for k in store.list(M, step=step)]
        assert row["bytes"] == sum(r.size for r in recs)
        for tier in ("host", "durable"):
            assert row["bytes_per_tier"].get(tier, 0) == sum(r.size for r in recs if tier in r.tiers)
        assert row["age_s"] >= 0
    assert by[1]["commit_latency_s"] is not None and by[3]["commit_latency_s"] is None
    rc, text, _ = run(capsys, conn, "steps", M, json_out=False)
    assert rc == 0 and "aborted" in text and "preparing" in text and "2/2" in text and "1/2" in text


def test_show(populated, conn, capsys):
    store, _infos = populated
    rc, d, _ = run(capsys, conn, "show", M, "2")
    assert rc == 0
    manifest = store.steps.manifest(M, 2)
    assert d["state"] == "durable" and d["world"] == manifest["world"] == 2
    assert d["layers"] == ["embed", "head"]
    for r, vote in manifest["ranks"].items():
        for o in vote["objects"]:
            cell = d["cells"][ShardKey.parse(o["key"]).layer][r]
            assert (cell["kind"], cell["size"], cell["checksum"]) == (o["kind"], o["size"], o["checksum"])
            assert cell["tiers"] == sorted(store.index.get_object(ShardKey.parse(o["key"])).tiers)
    assert d["cells"]["embed"]["1"]["target"] == f"{M}/embed/2/0"
    assert d["cells"]["head"]["0"]["base"] == f"{M}/head/1/0"
    assert "1" not in d["cells"]["head"]  # rank 1 did not save head at step 2
    rc, text, _ = run(capsys, conn, "show", M, "2", json_out=False)
    assert rc == 0 and "not saved" in text and "[durable,host]" in text and "ref" in text and "delta" in text
    rc, _, err = run(capsys, conn, "show", M, "99")
    assert rc == 1 and "no step 99" in err


def test_layers(populated, conn, capsys):
    _store, infos = populated
    rc, rows, _ = run(capsys, conn, "layers", M)
    assert rc == 0
    by = {r["layer"]: r for r in rows}
    assert by["embed"]["newest_version"] == 2 and by["embed"]["staleness"] == 0
    assert by["head"]["newest_version"] == 2 and by["head"]["versions"] == 2
    assert by["head"]["kinds"] == ["delta"]
    assert by["embed"]["bytes_newest"] == infos[ShardKey(M, "embed", 2, 0)].size + infos[ShardKey(M, "embed", 2, 1)].size
    rc, text, _ = run(capsys, conn, "layers", M, json_out=False)
    assert rc == 0 and "embed" in text and "head" in text


def test_where_reads_every_copy(populated, conn, capsys):
    _store, infos = populated
    key = ShardKey(M, "embed", 1, 1)
    rc, d, _ = run(capsys, conn, "where", str(key))
    assert rc == 0
    assert d["record"]["checksum"] == infos[key].checksum
    copies = {c["tier"]: c for c in d["copies"]}
    assert set(copies) == {"host", "durable"}
    for c in copies.values():
        assert c["present"] and c["ok"] and c["indexed"] and c["checksum"] == infos[key].checksum
        assert c["size"] == infos[key].size
    rc, text, _ = run(capsys, conn, "where", str(key), json_out=False)
    assert rc == 0 and infos[key].checksum in text
    rc, _, err = run(capsys, conn, "where", f"{M}/nolayer/1/0")
    assert rc == 1 and "no object" in err
    rc, _, err = run(capsys, conn, "where", "not-a-key")
    assert rc == 2 and "bad key" in err


def _flip_byte(store, key: ShardKey) -> None:
    path = store.host.root / store.info(key).name
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size // 2)
        b = f.read(1)
        f.seek(size // 2)
        f.write(bytes([b[0] ^ 0xFF]))


def test_verify_catches_a_corrupt_host_copy(populated, conn, capsys):
    store, infos = populated
    rc, d, _ = run(capsys, conn, "verify", M)
    assert rc == 0, d
    assert d["checked"] == len(infos) and d["bad"] == 0
    key = ShardKey(M, "embed", 1, 0)
    _flip_byte(store, key)
    rc, d, _ = run(capsys, conn, "verify", M, "1")
    assert rc == admin.EXIT_VERIFY
    assert d["checked"] == 4 and d["bad"] == 1
    (bad,) = [r for r in d["results"] if not r["ok"]]
    assert bad["key"] == str(key) and bad["tiers"] == {"host": "BAD", "durable": "ok"}
    assert any(p.startswith("host:") for p in bad["problems"])
    rc, text, _ = run(capsys, conn, "verify", M, json_out=False)
    assert rc == admin.EXIT_VERIFY and str(key) in text and "1 object(s) with bad" in text
    rc, d, _ = run(capsys, conn, "where", str(key))
    assert rc == admin.EXIT_VERIFY
    copies = {c["tier"]: c for c in d["copies"]}
    assert copies["host"]["ok"] is False and copies["durable"]["ok"] is True
    # the store itself falls back to the durable copy
    assert torch.equal(store.get(key).tensors["w"], torch.full((64,), 1.0))


def test_verify_reports_a_copy_missing_from_an_indexed_tier(populated, conn, capsys):
    store, _infos = populated
    key = ShardKey(M, "head", 1, 1)
    assert store.durable.delete(store.info(key).name)
    rc, d, _ = run(capsys, conn, "verify", M, "1")
    assert rc == admin.EXIT_VERIFY
    (bad,) = [r for r in d["results"] if not r["ok"]]
    assert bad["key"] == str(key) and "durable" in bad["problems"][0]


def test_nodes(populated, conn, capsys, redis_url):
    from consistency.index import Index
    from consistency.nodes import NodeRegistry
    from tierstore.agent import NodeRegistration

    client = redis.Redis.from_url(redis_url)
    reg = NodeRegistration(NodeRegistry(Index(redis_url)), "nodeA", {"node_id": "nodeA", "address": "127.0.0.1:4567", "capacity": 1 << 30,
                                             "pid": 1234, "started": f"{time.time():.3f}"}, ttl_s=30, used=lambda: 4096)
    reg.beat()
    client.sadd("ts:nodes", "ghost")  # registered, then its hash expired: a dead agent
    rc, rows, _ = run(capsys, conn, "nodes")
    assert rc == 0
    by = {r["node_id"]: r for r in rows}
    assert by["nodeA"]["alive"] and by["nodeA"]["address"] == "127.0.0.1:4567"
    assert by["nodeA"]["used"] == 4096 and by["nodeA"]["capacity"] == 1 << 30 and 0 < by["nodeA"]["ttl_left_s"] <= 30
    assert by["ghost"]["alive"] is False
    rc, text, _ = run(capsys, conn, "nodes", json_out=False)
    assert rc == 0 and "nodeA" in text and "expired" in text


def test_du(populated, conn, capsys):
    store, _infos = populated
    rc, rows, _ = run(capsys, conn, "du")
    assert rc == 0
    for tier in ("host", "durable"):
        for kind in ("full", "delta", "ref"):
            recs = [store.index.get_object(k) for k in store.list(M)]
            want = sum(r.size for r in recs if tier in r.tiers and r.kind == kind)
            got = sum(r["bytes"] for r in rows if r["tier"] == tier and r["kind"] == kind and r["model"] == M)
            assert got == want
    rc, rows2, _ = run(capsys, conn, "du", M)
    assert rows2 == rows
    rc, text, _ = run(capsys, conn, "du", json_out=False)
    assert rc == 0 and "delta" in text and "ref" in text


def test_watch_sees_commits(populated, conn, capsys):
    store, _ = populated
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(rc=admin.main([*conn, "--json", "watch", M, "--count", "2",
                                                                      "--timeout", "60"])))
    capsys.readouterr()
    t.start()
    channel = store.index._k(M, "events")
    deadline = time.monotonic() + 30
    while store.index._r.pubsub_numsub(channel)[0][1] < 1:
        assert time.monotonic() < deadline, "watch never subscribed"
        time.sleep(0.02)
    store.begin_step(M, 5, 1)
    store.vote(M, 5, 0, [store.put(ShardKey(M, "embed", 5, 0), {"w": torch.ones(4)})])
    t.join(60)
    assert not t.is_alive() and result["rc"] == 0
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert [(e["step"], e["state"]) for e in events][:1] == [(5, "committed")]
    assert events[0]["votes"] == 1 and events[0]["world"] == 1
    assert len(events) == 2 and events[1]["state"] in ("durable", "committed")


def test_watch_timeout_without_events(populated, conn, capsys):
    rc, text, _ = run(capsys, conn, "watch", M, "--timeout", "0.3", json_out=False)
    assert rc == 0 and "watching" in text and f"no step events of {M} in 0.3 s" in text
    rc, out, err = run(capsys, conn, "watch", M, "--timeout", "0.3")  # JSON lines on stdout, the note on stderr
    assert rc == 0 and out == "" and f"no step events of {M}" in err


def test_gc_dry_run_then_yes(populated, conn, capsys):
    store, _infos = populated
    from consistency.gc import Retention

    expected = store.gc(M, Retention(keep_last=1), dry_run=True)
    assert expected.deleted  # the fixture leaves garbage
    before = set(map(str, store.list(M)))
    rc, d, _ = run(capsys, conn, "gc", M, "--keep-last", "1")
    assert rc == 0 and d["dry_run"] is True and sorted(d["would_delete"]) == sorted(expected.deleted)
    assert d["would_free_bytes"] == expected.bytes_freed
    assert "deleted" not in d and "bytes_freed" not in d  # a dry run deletes nothing, and says so
    assert set(map(str, store.list(M))) == before
    rc, text, _ = run(capsys, conn, "gc", M, "--keep-last", "1", json_out=False)
    assert "dry run" in text and set(map(str, store.list(M))) == before
    rc, d, _ = run(capsys, conn, "gc", M, "--keep-last", "1", "--yes")
    assert rc == 0 and d["dry_run"] is False and sorted(d["deleted"]) == sorted(expected.deleted)
    assert "would_delete" not in d
    after = set(map(str, store.list(M)))
    assert after == before - set(expected.deleted)
    for k in expected.deleted:
        assert not store.host.exists(k) and not store.durable.exists(k)
    assert store.resolve(M).step == 2  # the kept step still restores


def test_rebuild_index_needs_yes(populated, conn, capsys):
    store, _ = populated
    rc, _, err = run(capsys, conn, "rebuild-index")
    assert rc == 2 and "--yes" in err
    if not hasattr(store, "rebuild_index"):
        rc, _, err = run(capsys, conn, "rebuild-index", "--yes")
        assert rc == 1 and "not available yet" in err
        return
    durable_steps = [s for s, st in store.steps.steps(M) if st == "durable"]
    store.index._r.flushall()  # the index is lost
    rc, d, _ = run(capsys, conn, "rebuild-index", "--yes")
    assert rc == 0, d
    rc, rows, _ = run(capsys, conn, "steps", M)
    assert rc == 0 and [r["step"] for r in rows if r["state"] == "durable"] == durable_steps
    rc, text, _ = run(capsys, conn, "rebuild-index", "--yes", json_out=False)
    assert rc == 0 and "index rebuilt" in text


def test_errors(conn, capsys, redis_url, tmp_path):
    rc, _, err = run(capsys, conn, "steps", "nosuchmodel")
    assert rc == 1 and "no model 'nosuchmodel'" in err
    down = ["--redis", f"redis://127.0.0.1:{free_port()}/0", "--home", str(tmp_path / "h"), "--durable", "none"]
    rc, _, err = run(capsys, down, "models")
    assert rc == 1 and "cannot be reached" in err
    rc, _, err = run(capsys, conn, "show", M)  # missing STEP
    assert rc == 2
    rc, _, err = run(capsys, conn, "frobnicate")
    assert rc == 2


def test_through_the_cli_dispatcher(populated, conn):
    p = subprocess.run([sys.executable, "-m", "tierstore.cli", "admin", *conn, "--json", "steps", M],
                       check=False, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert [r["step"] for r in parse_json_out("steps", p.stdout)] == [1, 2, 3, 4]
    # one record per line composes with shell tools: the first line is the first step, whole
    p = subprocess.run(f"{sys.executable} -m tierstore.cli admin {' '.join(map(shlex.quote, conn))} --json steps {M}"
                       " | head -1", shell=True, check=False, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert json.loads(p.stdout)["step"] == 1 and p.stdout.count("\n") == 1
