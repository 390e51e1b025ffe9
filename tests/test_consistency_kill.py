"""Fault injection with real ranks: a rank is SIGKILLed at each point of the commit protocol.

Four rank processes (``torch.distributed`` over gloo) save steps 1..3 of a
model against the real Redis-protocol server and moto's S3 server (durable =
``s3://bucket/prefix``). At step 3 the harness SIGKILLs rank 1 at the point
named by the ``kill`` parameter (the rank announces it reached the point and
waits; the kill comes from this harness, never from the library). Then a
fresh process-equivalent restores: a new epoch, ``resolve``, and every shard
read back must be bitwise equal to what was saved at the step restore
chose, which must be the newest committed step (never a partial one).

The ranks are forked from a fork server that imported torch once (see :func:`rank_main`).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest
import torch

M = "gpt"
WORLD = 4
VICTIM = 1
LAYERS = ("emb", "block0", "block1", "head")
STEPS = 3
ROOT = Path(__file__).resolve().parents[1]


def tensors(layer: str, step: int, rank: int, numel: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1_000_003 + rank * 1009 + LAYERS.index(layer))
    return {"param": torch.randn(numel, generator=g), "exp_avg": torch.randn(numel, generator=g).half(),
            "step": torch.tensor(step)}


_OUT = None  # the rank's pipe to the harness


def _say(msg: str) -> None:
    _OUT.send(msg)


def _announce_and_hang(point: str) -> None:
    _say(f"AT {point}")
    time.sleep(600)


def _send_raw_vote(store, infos, step: int, rank: int, epoch: int, *, whole: bool) -> None:
    """Write the vote's EVALSHA on the wire, all of it or half of it, without reading the reply."""
    script, keys, args = store.steps.vote_call(M, step, rank, infos, epoch=epoch, extra={"rank": rank})
    store.index._r.script_load(script.script)
    conn = store.index._r.connection_pool.get_connection()
    data = b"".join(conn.pack_command("EVALSHA", script.sha, len(keys), *keys, *args, -1))
    conn._sock.sendall(data if whole else data[: len(data) // 2])


def rank_main(argv: list[str], out, env: dict[str, str]) -> None:
    """One rank: save steps 1..STEPS; rank VICTIM stops at ``kill`` in the last step and waits for SIGKILL."""
    global _OUT
    _OUT = out
    os.environ.update(env)
    try:
        _rank(argv)
    except BaseException as e:  # noqa: BLE001 - reported to the harness
        import traceback

        _say("FAIL " + "".join(traceback.format_exception(e))[-3000:])
    os._exit(0)


def _rank(argv: list[str]) -> None:
    import torch.distributed as dist

    import tierstore
    from tierstore import ShardKey
    from tierstore.errors import CommitError

    rank, port, redis_url, durable, endpoint, host_root, home, kill, numel = argv
    rank, numel = int(rank), int(numel)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    store = tierstore.open(home, redis=redis_url, durable=durable, s3_endpoint_url=endpoint, host_root=host_root,
                           node_id="node0")
    ep = torch.tensor([store.open_epoch(M) if rank == 0 else 0])
    dist.broadcast(ep, 0)
    epoch = int(ep.item())
    victim = rank == VICTIM
    for step in range(1, STEPS + 1):
        dist.barrier()  # the previous step is committed and flushed on every rank
        last = step == STEPS
        store.begin_step(M, step, WORLD, layout={"layers": list(LAYERS), "dp": WORLD}, epoch=epoch)
        if last and victim and kill == "before_prepare":
            _announce_and_hang(kill)
        infos = []
        for i, layer in enumerate(LAYERS):
            infos.append(store.put(ShardKey(M, layer, step, rank), tensors(layer, step, rank, numel if last else 4096),
                                   epoch=epoch))
            if last and victim and kill == "mid_prepare" and i == 1:
                _announce_and_hang(kill)
        if last and victim and kill in ("vote_partial", "vote_sent"):
            votes = store.index._k(M, "votes", step)
            while store.index._r.hlen(votes) < WORLD - 1:  # be the last voter
                time.sleep(0.005)
            _send_raw_vote(store, infos, step, rank, epoch, whole=kill == "vote_sent")
            _announce_and_hang(kill)
        store.vote(M, step, rank, infos, extra={"rank": rank}, epoch=epoch)
        if last and victim and kill == "after_vote":
            _announce_and_hang(kill)
        if last and victim and kill == "mid_migration":
            while True:
                tiers = [store.info(i.key).tiers for i in infos]
                n = sum("durable" in t for t in tiers)
                if n:
                    _say(f"MIGRATED {n}/{len(infos)}")
                    _announce_and_hang(kill)
                time.sleep(0.001)
        try:
            state = store.wait_step(M, step, timeout=30 if not last else 3)
        except CommitError:
            state = "undecided"
        if not last:
            assert state in ("committed", "durable"), state
            store.flush()
        _say(f"STEP {step} {state}")
    try:
        store.flush()
    except Exception as e:  # noqa: BLE001 - reported, not fatal for the harness
        _say(f"FLUSH {e}")
    _say("DONE")


# ----------------------------------------------------------------------------- harness
from tests.redis_server import free_port
from tests.s3_server import FAKE_ENV, s3_bucket, s3_env, s3_server  # noqa: F401 - fixtures

EXPECT = {  # kill point -> the step restore must return
    "before_prepare": 2,
    "mid_prepare": 2,
    "after_vote": 3,
    "vote_partial": 2,
    "vote_sent": 3,
    "mid_migration": 3,
}


# Ranks fork from a server that imported torch and tierstore once: no import per rank (seconds each on 2 cores).
_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "torch.distributed", "boto3", "tierstore.store", "backends.s3",
                             "tests.test_consistency_kill"])


def _read_until(conn, marker: str, timeout: float) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not conn.poll(max(0.0, deadline - time.monotonic())):
            continue
        try:
            line = conn.recv()
        except EOFError:
            break
        lines.append(line)
        if line.startswith((marker, "FAIL")):
            break
    assert lines and lines[-1].startswith(marker), f"rank never said {marker!r}: {lines}"
    return lines


def _run_ranks(tmp_path, redis_url, durable, endpoint, host_root, kill, numel) -> list[list[str]]:
    port = free_port()
    env = {**FAKE_ENV, "OMP_NUM_THREADS": "1"}
    procs, conns = [], []
    for r in range(WORLD):
        mine, theirs = _CTX.Pipe(duplex=False)
        p = _CTX.Process(target=rank_main, args=([str(r), str(port), redis_url, durable, endpoint, host_root,
                                                   str(tmp_path / f"home{r}"), kill, str(numel)], theirs, env))
        p.start()
        theirs.close()
        procs.append(p)
        conns.append(mine)
    try:
        outs = [[] for _ in range(WORLD)]
        outs[VICTIM] = _read_until(conns[VICTIM], "AT ", 120)
        os.kill(procs[VICTIM].pid, signal.SIGKILL)
        procs[VICTIM].join(10)
        for r, p in enumerate(procs):
            if r != VICTIM:
                outs[r] = _read_until(conns[r], "DONE", 120)
                p.join(30)
        return outs
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()


def _check_restore(store, expect_step: int) -> None:
    from tierstore import ShardKey

    steps = dict(store.steps.steps(M))
    committed = [s for s, st in steps.items() if st in ("committed", "durable")]
    assert max(committed) == expect_step, steps
    epoch_before = store.index.epoch(M)
    assert store.open_epoch(M) == epoch_before + 1
    res = store.resolve(M)
    assert res.step == expect_step and res.world_size == WORLD
    assert res.layers == {layer: expect_step for layer in LAYERS}  # exact: never a mix, never partial
    assert sorted(res.objects) == sorted((layer, r) for layer in LAYERS for r in range(WORLD))
    for (layer, rank), info in res.objects.items():
        assert info.key == ShardKey(M, layer, expect_step, rank)
        got = store.get(info.key)
        want = tensors(layer, expect_step, rank, info.size and _numel(got))
        for name, t in want.items():
            assert got.tensors[name].dtype == t.dtype and torch.equal(got.tensors[name], t), (info.key, name)
    assert {r: e["rank"] for r, e in res.extra.items()} == {r: r for r in range(WORLD)}


def _numel(shard) -> int:
    return shard.tensors["param"].numel()


@pytest.mark.timeout(170)
@pytest.mark.parametrize("kill", list(EXPECT))
def test_restore_after_a_rank_is_killed(kill, tmp_path, redis_url, shm_root, s3_bucket):  # noqa: F811
    import tierstore

    endpoint, bucket = s3_bucket
    durable = f"s3://{bucket}/ckpt"
    numel = 1 << 20 if kill == "mid_migration" else 4096  # last step: 4 MiB params, migration takes a while
    host_root = str(shm_root / "node0")
    outs = _run_ranks(tmp_path, redis_url, durable, endpoint, host_root, kill, numel)
    assert outs[VICTIM][-1] == f"AT {kill}"
    assert all("STEP 2 committed" in o or "STEP 2 durable" in o for o in outs)
    store = tierstore.open(tmp_path / "restore", redis=redis_url, durable=durable, s3_endpoint_url=endpoint,
                           host_root=host_root, node_id="node0")
    try:
        if kill == "vote_sent":
            assert store.wait_step(M, 3, timeout=30) == "committed"  # the server ran the vote it received
        if EXPECT[kill] == 2:
            assert store.steps.state(M, 3) == "preparing" and store.steps.manifest(M, 3) is None
        assert store.wait_step(M, 2, timeout=30) == "durable"
        _check_restore(store, EXPECT[kill])
        if kill == "mid_migration":
            print(outs[VICTIM][-2])  # MIGRATED n/4: how far the victim's migration got (shown with -s)
            durable_steps = [s for s, st in store.steps.steps(M) if st == "durable"]
            # the victim never reported its migration: step 3 cannot be durable unless it all landed first
            assert 2 in durable_steps
            # lose the index: only the durable steps come back, bitwise
            store.index._r.flushall()
            report = store.rebuild_index(M)
            assert report.restored[M] == durable_steps
            if 3 not in durable_steps:
                assert report.lost_steps[M] == [3]
            _check_restore(store, max(durable_steps))
    finally:
        store.close()


