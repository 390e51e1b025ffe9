"""Real ranks against a real Redis Cluster (3 primaries + 3 replicas, replica-acknowledged commits).

1. The crash/restore scenario of ``test_consistency_kill`` with the index on a
   cluster: a rank is SIGKILLed at a point of the commit protocol and restore
   returns the newest committed step, bitwise, never a partial one.
2. The primary serving the model's slot is SIGKILLed mid-commit (three of
   four votes of step 3 are in; the fourth is sent after the kill). The
   cluster promotes its replica, the operator restarts the dead node (it
   rejoins as the new replica), and the ranks carry on: a rank retries what
   failed (a vote is idempotent). Every step any rank was told is committed
   is committed afterwards, and restore returns the newest, bitwise.

Ranks are ``torch.distributed`` gloo processes forked from a fork server, as
in ``test_consistency_kill``.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from tests import test_consistency_kill as tk
from tests.redis_cluster import LocalCluster, make_cluster
from tests.redis_server import free_port
from tests.s3_server import FAKE_ENV

M = tk.M
WORLD = tk.WORLD
LAYERS = tk.LAYERS
LAST = 4  # the failover happens in step 3; step 4 runs on the promoted primary
FAILOVER_STEP = 3
HELD = WORLD - 1  # this rank votes only after the harness killed the primary


# -- 1. the crash/restore scenario on a cluster -----------------------------------------------------
@pytest.mark.timeout(170)
@pytest.mark.parametrize("kill", ["mid_prepare", "vote_sent", "mid_migration"])
def test_restore_after_a_rank_is_killed_on_a_cluster(kill, tmp_path, cluster_url, shm_root, s3_bucket):
    import tierstore

    endpoint, bucket = s3_bucket
    durable = f"s3://{bucket}/ckpt"
    numel = 1 << 20 if kill == "mid_migration" else 4096
    host_root = str(shm_root / "node0")
    outs = tk._run_ranks(tmp_path, cluster_url, durable, endpoint, host_root, kill, numel)
    assert outs[tk.VICTIM][-1] == f"AT {kill}"
    assert all("STEP 2 committed" in o or "STEP 2 durable" in o for o in outs)
    store = tierstore.open(tmp_path / "restore", redis=cluster_url, durable=durable, s3_endpoint_url=endpoint,
                           host_root=host_root, node_id="node0")
    try:
        assert store.index.is_cluster and store.index.replicas == 1
        if kill == "vote_sent":
            assert store.wait_step(M, 3, timeout=30) == "committed"
        if tk.EXPECT[kill] == 2:
            assert store.steps.state(M, 3) == "preparing" and store.steps.manifest(M, 3) is None
        assert store.wait_step(M, 2, timeout=30) == "durable"
        tk._check_restore(store, tk.EXPECT[kill])
        if kill == "mid_migration":
            durable_steps = [s for s, st in store.steps.steps(M) if st == "durable"]
            assert 2 in durable_steps
            store.index._r.flushall()  # lose the index on every primary
            report = store.rebuild_index(M)
            assert report.restored[M] == durable_steps
            tk._check_restore(store, max(durable_steps))
    finally:
        store.close()


# -- 2. the primary dies mid-commit ---------------------------------------------------------------
_OUT = None


def _say(msg: str) -> None:
    _OUT.send(msg)


def _retry(what: str, fn, deadline_s: float = 60.0):
    """Call ``fn`` until it succeeds; an unreachable or unacknowledging index is retried (a trainer's loop)."""
    from tierstore.errors import ReplicaAckError, TierUnavailableError

    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return fn()
        except (TierUnavailableError, ReplicaAckError) as e:
            if time.monotonic() > deadline:
                raise
            _say(f"RETRY {what}: {type(e).__name__}")
            time.sleep(0.1)


def failover_rank_main(argv: list[str], out, release, env: dict[str, str]) -> None:
    global _OUT
    _OUT = out
    os.environ.update(env)
    try:
        _failover_rank(argv, release)
    except BaseException as e:  # noqa: BLE001 - reported to the harness
        import traceback

        _say("FAIL " + "".join(traceback.format_exception(e))[-3000:])
    os._exit(0)


def _failover_rank(argv: list[str], release) -> None:
    import torch.distributed as dist

    import tierstore
    from tierstore import ShardKey
    from tierstore.errors import MigrationError

    rank, port, url, durable, host_root, home = argv
    rank = int(rank)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    store = tierstore.open(home, redis=url, durable=durable, host_root=host_root, node_id="node0",
                           index_ack_timeout_s=1.0)
    ep = torch.tensor([store.open_epoch(M) if rank == 0 else 0])
    dist.broadcast(ep, 0)
    epoch = int(ep.item())
    for step in range(1, LAST + 1):
        dist.barrier()
        _retry("begin", lambda: store.begin_step(M, step, WORLD, layout={"layers": list(LAYERS), "dp": WORLD},
                                                 epoch=epoch))
        infos = [_retry("put", lambda layer=layer: store.put(ShardKey(M, layer, step, rank),
                                                            tk.tensors(layer, step, rank, 4096), epoch=epoch))
                 for layer in LAYERS]
        if step == FAILOVER_STEP and rank == HELD:
            _say("HELD")
            release.wait(60)
        state = _retry("vote", lambda: store.vote(M, step, rank, infos, extra={"rank": rank}, epoch=epoch))
        if state == "preparing":
            state = _retry("wait", lambda: store.wait_step(M, step, timeout=30))
        _say(f"STEP {step} {state}")
        try:
            store.flush()
        except MigrationError as e:  # the index was down while objects migrated: they stay memory-only
            _say(f"FLUSH {type(e).__name__}")
    _say("DONE")


_CTX = tk._CTX
_CTX.set_forkserver_preload(["torch", "torch.distributed", "tierstore.store", "tests.test_consistency_kill",
                             "tests.test_cluster_kill"])


@pytest.fixture
def private_cluster(tmp_path):
    yield from make_cluster(tmp_path / "cluster")


@pytest.mark.timeout(170)
def test_primary_killed_mid_commit_fails_over_and_loses_no_committed_step(private_cluster, tmp_path, shm_root):
    import tierstore

    cl: LocalCluster = private_cluster
    durable = f"file://{tmp_path / 'durable'}"
    host_root = str(shm_root / "node0")
    primary = cl.primary_of(f"ts:{{{M}}}:x")
    replica = cl.replica_of(primary)
    votes_key = f"ts:{{{M}}}:votes:{FAILOVER_STEP}"
    port = free_port()
    env = {**FAKE_ENV, "OMP_NUM_THREADS": "1"}
    release = _CTX.Event()
    procs, conns = [], []
    for r in range(WORLD):
        mine, theirs = _CTX.Pipe(duplex=False)
        p = _CTX.Process(target=failover_rank_main, args=(
            [str(r), str(port), cl.url, durable, host_root, str(tmp_path / f"home{r}")], theirs, release, env))
        p.start()
        theirs.close()
        procs.append(p)
        conns.append(mine)
    outs: list[list[str]] = [[] for _ in range(WORLD)]
    try:
        outs[HELD] = tk._read_until(conns[HELD], "HELD", 120)
        pc = primary.client()
        deadline = time.monotonic() + 60
        while pc.hlen(votes_key) < WORLD - 1:  # the other ranks' votes of step 3 are in
            assert time.monotonic() < deadline, "the other ranks never voted"
            time.sleep(0.005)
        cl.kill(primary)  # mid-commit: three votes in, the deciding one not yet
        release.set()  # the last rank votes into the failover
        deadline = time.monotonic() + 30
        while replica.client(1).info("replication")["role"] != "master":
            assert time.monotonic() < deadline, "the replica was not promoted"
            time.sleep(0.05)
        time.sleep(1.5)  # the ranks meet a promoted primary without a replica: nothing is acknowledged
        cl.restart(primary)  # the operator restarts the dead node: it rejoins as the new replica
        for r in range(WORLD):
            outs[r] += tk._read_until(conns[r], "DONE", 120)
            procs[r].join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    told = {(r, int(line.split()[1])): line.split()[2] for r, o in enumerate(outs) for line in o
            if line.startswith("STEP ")}
    assert all(told[(r, s)] in ("committed", "durable") for r in range(WORLD) for s in range(1, LAST + 1)), outs
    assert any(line.startswith("RETRY") for o in outs for line in o), "no rank met the failover"
    # the promoted primary had no replica until the node came back: it acknowledged nothing meanwhile
    assert any(line.endswith("ReplicaAckError") for o in outs for line in o), outs
    cl.wait_ok()
    assert cl.primary_of(f"ts:{{{M}}}:x") is replica
    store = tierstore.open(tmp_path / "restore", redis=cl.url, durable=durable, host_root=host_root,
                           node_id="node0")
    try:
        states = dict(store.steps.steps(M))
        for (_r, s), st in told.items():  # every step a rank was told is committed survived the failover
            assert states[s] in ("committed", "durable"), (s, states)
        tk._check_restore(store, LAST)
    finally:
        store.close()

