"""The fault matrix: every fault kind at every point it applies to, on real servers.

Each case commits two steps cleanly, then runs a faulty window (puts, votes,
flushes, gets of older steps, deletes of aborted steps) under a seeded plan,
then checks, with the plan paused:

* every step committed before the window is still there, bitwise;
* every step committed in the window reads back bitwise, or (only where the
  fault damaged the only copy before it was replicated) fails closed with a
  NoValidCopyError naming the key; nothing read is ever wrong bytes;
* resolve() returns a committed step; every object of it reads bitwise or
  fails closed, naming itself; aborted steps are never resolved;
* every error the caller saw is a TierStoreError naming its key or tier.

Then the special faults: the index server restarted with and without its
append-only file, S3 throttling / 500 / AccessDenied (botocore hooks in front
of moto), /dev/shm full, a full durable disk (tmpfs) and client clock skew.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from backends.host import HostBackend
from backends.localfs import LocalFSBackend
from consistency.index import Index
from consistency.manifest import durable_manifest_name, parse_manifest
from tierstore.config import StoreConfig
from tierstore.errors import (
    AccessDeniedError, IndexLostError, NoValidCopyError, StepAbortedError, TierFullError, TierStoreError, TierUnavailableError,
)
from tierstore.testing.faults import FaultPlan, FaultRule, install
from tierstore.keys import ShardKey
from tierstore.store import TierStore
from tests import _warm
from tests.redis_server import RedisProcess

MODEL = "m"
WORLD = 2
LAYERS = ("emb", "h0")
TRIED: Counter = Counter()


def make_store(tmp_path: Path, redis_url: str, shm_root: Path, *, durable=None, host_capacity=None) -> TierStore:
    cfg = StoreConfig(home=str(tmp_path / "home"), redis_url=redis_url, durable_url="file://unused",
                      host_root=str(shm_root / "node0"), node_id="node0", host_capacity_bytes=host_capacity).resolved()
    host = HostBackend(cfg.host_root, capacity_bytes=host_capacity, recycle_grace_s=0.0)
    dur = durable if durable is not None else LocalFSBackend(tmp_path / "durable", fsync=False)
    return TierStore(cfg, Index(redis_url), host, dur)


def tensors(step: int, rank: int, layer: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + rank * 10 + LAYERS.index(layer))
    return {"w": torch.randn(64, 33, generator=g), "m": torch.randint(0, 100, (17,), generator=g)}


def same(shard, want: dict[str, torch.Tensor]) -> bool:
    """Bitwise equality of every tensor (and no extra or missing names)."""
    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.detach().contiguous().reshape(-1).view(torch.uint8)

    return set(shard.tensors) == set(want) and all(
        shard.tensors[n].dtype == t.dtype and torch.equal(raw(shard.tensors[n]), raw(t)) for n, t in want.items())


def check_error(e: BaseException, errors: list) -> None:
    """An error the user sees: typed, and naming what failed (a key or a tier)."""
    assert isinstance(e, TierStoreError), f"untyped error {type(e).__name__}: {e}"
    text = str(e)
    named = any(w in text for w in ("host", "durable", "index", "peer", f"{MODEL}/", f"of {MODEL}")) or any(
        e.fields.get(f) for f in ("key", "tier", "url", "failures", "step"))
    assert named, f"error names neither key nor tier: {e!r}"
    errors.append(e)


def save_step(store: TierStore, step: int, errors: list) -> None:
    """Every rank begins, puts its shards and votes, as the Checkpointer does: a negative vote on failure."""
    for rank in range(WORLD):
        infos, ok = [], True
        try:
            store.begin_step(MODEL, step, WORLD, layout={"layers": list(LAYERS)})
            for layer in LAYERS:
                infos.append(store.put(ShardKey(MODEL, layer, step, rank), tensors(step, rank, layer)))
        except TierStoreError as e:
            check_error(e, errors)
            ok = False
        try:
            store.vote(MODEL, step, rank, infos if ok else [], ok=ok)
        except TierStoreError as e:
            check_error(e, errors)
            try:
                store.vote(MODEL, step, rank, [], ok=False)
            except TierStoreError as e2:
                check_error(e2, errors)


def commit_clean(store: TierStore, step: int) -> None:
    save_step(store, step, [])
    assert store.steps.state(MODEL, step) in ("committed", "durable")


def evict_all(store: TierStore, errors: list) -> None:
    """Drop every host copy the eviction policy may drop (durable, not the newest step)."""
    try:
        store.evict_host(1 << 50)
    except TierFullError:
        pass
    except TierStoreError as e:
        check_error(e, errors)


def read_step(store: TierStore, step: int, errors: list, *, damaged_ok: bool) -> bool:
    """Read every shard of a committed step: bitwise, or (damaged_ok) a typed NoValidCopyError naming it."""
    all_ok = True
    for rank in range(WORLD):
        for layer in LAYERS:
            key = ShardKey(MODEL, layer, step, rank)
            try:
                shard = store.get(key)
            except NoValidCopyError as e:
                assert damaged_ok, f"committed {key} lost: {e}"
                assert str(key) in str(e)
                errors.append(e)
                all_ok = False
                continue
            assert shard is not None, f"committed {key} is gone"
            assert same(shard, tensors(step, rank, layer)), f"committed {key} changed"
    return all_ok


# points and the kinds that apply there (in-process; kill runs in a subprocess below)
POINTS = ["backend.put@host", "backend.put@durable", "backend.get@host", "backend.get@durable",
          "backend.delete@host", "index.script", "migration", "commit"]
KINDS = ["exception", "timeout", "partial", "corrupt", "slow"]
CASES = [(p, k) for p in POINTS for k in KINDS]
# a fault that damages the only copy of an object before it is replicated can lose a step (fail closed:
# the migration refuses to upload a copy that fails its checksum, and a read names the object).
# A silently corrupted durable write is no longer a loss: eviction verifies the durable copy first.
DAMAGES_ONLY_COPY = {("backend.put@host", "corrupt")}


@pytest.mark.parametrize("point,kind", CASES, ids=[f"{p}-{k}" for p, k in CASES])
def test_fault_matrix(point, kind, tmp_path, redis_url, shm_root):
    run_case(point, kind, tmp_path, redis_url, shm_root, seed=7, probability=0.5)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [11, 12, 13])
@pytest.mark.parametrize("point,kind", CASES, ids=[f"{p}-{k}" for p, k in CASES])
def test_fault_matrix_more_seeds(point, kind, seed, tmp_path, redis_url, shm_root):
    """The long variant: more seeds, sparser faults (the default run covers seed 7 at p=0.5)."""
    run_case(point, kind, tmp_path, redis_url, shm_root, seed=seed, probability=0.25)


def run_case(point: str, kind: str, tmp_path, redis_url, shm_root, *, seed: int, probability: float) -> None:
    store = make_store(tmp_path, redis_url, shm_root)
    plan = install(store, FaultPlan([FaultRule(point, kind, probability, delay_s=0.01)], seed=seed))
    errors: list = []
    try:
        with plan.paused():
            store.open_epoch(MODEL)
            for step in (1, 2):
                commit_clean(store, step)
            store.flush()
        for step in (3, 4, 5, 6):
            evict_all(store, errors)  # older steps now read from the durable tier
            save_step(store, step, errors)
            for old in (1, step - 1):  # reads during the window: right bytes or a typed error, never wrong bytes
                try:
                    shard = store.get(ShardKey(MODEL, "h0", old, 1))
                    assert shard is None or same(shard, tensors(old, 1, "h0"))
                except TierStoreError as e:
                    check_error(e, errors)
            try:
                store.flush()
            except TierStoreError as e:
                check_error(e, errors)
            with plan.paused():
                state = store.steps.state(MODEL, step)
            if state not in ("committed", "durable"):
                for rank in range(WORLD):
                    for layer in LAYERS:
                        try:
                            store.delete(ShardKey(MODEL, layer, step, rank))
                        except TierStoreError as e:
                            check_error(e, errors)
        with plan.paused():
            try:
                store.flush()
            except TierStoreError as e:
                check_error(e, errors)
            for step in (1, 2):
                assert read_step(store, step, errors, damaged_ok=False)
            final = dict(store.steps.steps(MODEL))
            readable = [1, 2]
            for step in (3, 4, 5, 6):
                if final.get(step) in ("committed", "durable"):
                    if read_step(store, step, errors, damaged_ok=(point, kind) in DAMAGES_ONLY_COPY):
                        readable.append(step)
            res = store.resolve(MODEL)
            assert final[res.step] in ("committed", "durable")
            assert res.step >= max(readable)
            if res.step in readable:
                for (layer, rank), info in res.objects.items():
                    assert same(store.get(info.key), tensors(info.key.step, rank, layer))
    finally:
        store.close() if not store._closed else None
    TRIED[(point, kind)] += plan.total_fired()
    assert probability < 0.5 or plan.total_fired() > 0 or kind == "slow" or point.startswith("backend.delete"), \
        f"the plan never fired at {point} ({dict(plan.calls)})"


# -- kill: SIGKILL the writer at a point; the survivors' view stays consistent ---------------------------

KILL_POINTS = ["backend.put@host", "backend.put@durable", "migration", "index.script"]

_CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    from pathlib import Path
    from tests.test_faults_matrix import make_store, save_step, commit_clean, MODEL
    from tierstore.testing.faults import FaultPlan, FaultRule, install
    store = make_store(Path({tmp!r}), {url!r}, Path({shm!r}))
    plan = install(store, FaultPlan([FaultRule({point!r}, "kill", 1.0, after={after})], seed=3))
    with plan.paused():
        store.open_epoch(MODEL)
        for step in (1, 2):
            commit_clean(store, step)
        store.flush()
    save_step(store, 3, [])
    store.flush()
    print("SURVIVED")
""")


@pytest.mark.parametrize("point", KILL_POINTS)
def test_kill_at_point(point, tmp_path, redis_url, shm_root):
    root = str(Path(__file__).resolve().parents[1])
    code = _CHILD.format(root=root, tmp=str(tmp_path), url=redis_url, shm=str(shm_root), point=point,
                         after=1 if point.startswith("backend") else 0)
    p = _warm.run([sys.executable, "-c", code], timeout=120, cwd=root)  # forked warm: tests/_warm.py
    assert p.returncode == -9, f"child was not killed at {point}: rc={p.returncode}\n{p.stdout}\n{p.stderr[-2000:]}"
    TRIED[(point, "kill")] += 1
    store = make_store(tmp_path, redis_url, shm_root)
    try:
        errors: list = []
        for step in (1, 2):
            assert read_step(store, step, errors, damaged_ok=False)
        state = store.steps.state(MODEL, 3)
        if state in ("committed", "durable"):
            # every vote was in before the kill: the migration runs beside the votes, so a kill in it may come
            # after the commit. The committed step must then be whole (its host copies outlive the process)
            assert point in ("backend.put@durable", "migration"), f"step 3 decided without all votes: {state}"
            assert read_step(store, 3, errors, damaged_ok=False)
            assert store.resolve(MODEL).step == 3
        else:
            assert state in (None, "preparing"), f"step 3 is {state}"
            assert store.resolve(MODEL).step == 2
        # a new incarnation fences the dead one and commits the next step
        store.open_epoch(MODEL)
        commit_clean(store, 4)
        assert read_step(store, 4, errors, damaged_ok=False)
    finally:
        store.close()


# -- the index server restarted ------------------------------------------------------------------------


@pytest.fixture
def own_redis(tmp_path):
    rp = RedisProcess(tmp_path / "redis-own")
    rp.workdir.mkdir()
    rp.start()
    yield rp
    rp.stop(kill=True)


def test_redis_restart_with_aof_keeps_state(tmp_path, own_redis, shm_root):
    store = make_store(tmp_path, own_redis.url, shm_root)
    try:
        store.open_epoch(MODEL)
        commit_clean(store, 1)
        store.flush()
        own_redis.stop(kill=True)
        with pytest.raises(TierUnavailableError) as ei:
            store.put(ShardKey(MODEL, "emb", 2, 0), tensors(2, 0, "emb"))
        assert "index" in str(ei.value)
        own_redis.start()  # same port, same directory: the AOF is replayed
        errors: list = []
        assert read_step(store, 1, errors, damaged_ok=False)
        assert store.steps.state(MODEL, 1) == "durable"
        commit_clean(store, 2)
        assert store.resolve(MODEL).step == 2
    finally:
        store.close()


def test_redis_restart_without_aof_loses_index_not_data(tmp_path, shm_root):
    rp = RedisProcess(tmp_path / "redis-noaof", appendonly=False)
    rp.workdir.mkdir()
    rp.start()
    store = make_store(tmp_path, rp.url, shm_root)
    try:
        store.open_epoch(MODEL)
        commit_clean(store, 1)
        store.flush()
        assert store.steps.state(MODEL, 1) == "durable"
        rp.restart(wipe=True)
        with pytest.raises(IndexLostError, match="rebuild-index"):  # never "nothing committed"
            store.resolve(MODEL)
        assert store.steps.state(MODEL, 1) is None
        store.rebuild_index()
        assert store.resolve(MODEL).step == 1
        # the durable data and its manifest are still on disk and read back bitwise
        raw = store.durable.get(durable_manifest_name(MODEL, 1))
        m = parse_manifest(bytes(raw), model=MODEL, step=1)
        for rank, vote in m["ranks"].items():
            for o in vote["objects"]:
                from tierstore import codec
                key = ShardKey.parse(o["key"])
                blob = store.durable.get(o["name"])
                assert codec.verify(blob) == o["checksum"]
                assert same(codec.decode(blob), tensors(1, int(rank), key.layer) | {})  # bitwise from disk
    finally:
        store.close()
        rp.stop(kill=True)


# -- S3: throttling, 500s and AccessDenied via botocore event hooks in front of moto ----------------


class _Raw:
    def __init__(self, body: bytes):
        self.body = body

    def stream(self, **_kw):
        yield self.body


def _s3_error(status: int, code: str):
    from botocore.awsrequest import AWSResponse

    body = f"<?xml version='1.0'?><Error><Code>{code}</Code><Message>injected</Message></Error>".encode()
    return AWSResponse("https://injected", status, {"Content-Type": "application/xml"}, _Raw(body))


def _s3_store(tmp_path, redis_url, shm_root, s3_bucket):
    from backends.s3 import S3Backend, S3Config

    endpoint, bucket = s3_bucket
    dur = S3Backend(bucket, "ck", endpoint_url=endpoint, region_name="us-east-1",
                    config=S3Config(max_attempts=5), sleep=lambda s: None)
    return make_store(tmp_path, redis_url, shm_root, durable=dur), dur


def _hook(dur, op: str, status: int, code: str, times: int) -> Counter:
    seen: Counter = Counter()

    def handler(**_kw):
        seen["calls"] += 1
        if seen["calls"] <= times:
            return _s3_error(status, code)
        return None

    dur.client.meta.events.register(f"before-send.s3.{op}", handler)
    return seen


@pytest.mark.parametrize("status,code", [(503, "SlowDown"), (500, "InternalError")])
def test_s3_transient_errors_are_retried(status, code, tmp_path, redis_url, shm_root, s3_bucket):
    store, dur = _s3_store(tmp_path, redis_url, shm_root, s3_bucket)
    try:
        puts = _hook(dur, "PutObject", status, code, 3)
        gets = _hook(dur, "GetObject", status, code, 2)
        store.open_epoch(MODEL)
        commit_clean(store, 1)
        store.flush()  # migration succeeded after the retries
        assert puts["calls"] > 3 and store.steps.state(MODEL, 1) == "durable"
        blob = dur.get(store.info(ShardKey(MODEL, "h0", 1, 1)).name)  # first GETs fail, the retry succeeds
        from tierstore import codec
        assert gets["calls"] >= 3 and same(codec.decode(blob), tensors(1, 1, "h0"))
        TRIED[(f"s3.{code}", "exception")] += 5
    finally:
        store.close()


def test_s3_access_denied_fails_fast_with_clear_error(tmp_path, redis_url, shm_root, s3_bucket):
    store, dur = _s3_store(tmp_path, redis_url, shm_root, s3_bucket)
    try:
        seen = _hook(dur, "PutObject", 403, "AccessDenied", 10**6)
        with pytest.raises(AccessDeniedError) as ei:
            dur.put("x/y", b"data")
        assert seen["calls"] == 1 and ei.value.attempts == 1 and "x/y" in str(ei.value)
        store.open_epoch(MODEL)
        commit_clean(store, 1)  # committed in memory
        with pytest.raises(TierUnavailableError) as ei2:
            store.flush()
        assert isinstance(ei2.value.__cause__, AccessDeniedError) and f"{MODEL}/" in str(ei2.value)
        assert store.steps.state(MODEL, 1) == "committed"  # never marked durable
        assert read_step(store, 1, [], damaged_ok=False)  # still served from the host tier
        TRIED[("s3.AccessDenied", "exception")] += seen["calls"]
    finally:
        store.close()


# -- full media --------------------------------------------------------------------------------------


def test_dev_shm_full_is_typed_and_loses_nothing(tmp_path, redis_url, shm_root):
    # two steps fit (4 objects of 3 pages each per step); the 512 KiB object cannot, even after eviction
    store = make_store(tmp_path, redis_url, shm_root, host_capacity=128 << 10)
    try:
        store.open_epoch(MODEL)
        for step in (1, 2):
            commit_clean(store, step)
            store.flush()
        with pytest.raises(TierFullError) as ei:
            store.put(ShardKey(MODEL, "big", 3, 0), {"w": torch.zeros(1 << 17)})
        assert ei.value.tier == "host"
        errors: list = []
        for step in (1, 2):  # older steps may have been evicted from the host tier: read from durable
            assert read_step(store, step, errors, damaged_ok=False)
        TRIED[("shm.full", "exception")] += 1
    finally:
        store.close()


@pytest.fixture
def tiny_tmpfs(tmp_path):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tiny tmpfs for the disk-full case needs root")
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {p.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_durable_disk_full(tmp_path, redis_url, shm_root, tiny_tmpfs):
    store = make_store(tmp_path, redis_url, shm_root, durable=LocalFSBackend(tiny_tmpfs, fsync=False))
    try:
        store.open_epoch(MODEL)
        commit_clean(store, 1)
        store.flush()
        store.begin_step(MODEL, 2, 1)
        big = {"w": torch.arange(1 << 17, dtype=torch.float32)}
        info = store.put(ShardKey(MODEL, "big", 2, 0), big)
        assert store.vote(MODEL, 2, 0, [info]) == "committed"
        with pytest.raises(TierUnavailableError) as ei:
            store.flush()
        assert isinstance(ei.value.__cause__, TierFullError) and f"{MODEL}/big/2/0" in str(ei.value)
        assert store.steps.state(MODEL, 2) == "committed"  # in memory, not durable
        assert torch.equal(store.get(ShardKey(MODEL, "big", 2, 0)).tensors["w"], big["w"])
        assert read_step(store, 1, [], damaged_ok=False)
        TRIED[("disk.full", "exception")] += 1
    finally:
        store.close()


# -- clock skew: the protocol's timeouts use the server's TIME ---------------------------------------


@pytest.mark.parametrize("skew", [+3600.0, -3600.0])
def test_clock_skew_cannot_abort_or_extend(skew, tmp_path, redis_url, monkeypatch):
    from consistency.twophase import StepProtocol

    steps = StepProtocol(Index(redis_url), step_timeout_s=1.0)
    steps.begin(MODEL, 1, 2)
    steps.begin(MODEL, 2, 2)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + skew)  # this "rank" runs an hour off
    # a skewed rank cannot abort a fresh step by believing it old
    assert steps.vote(MODEL, 1, 0, []) == "preparing"
    assert steps.abort_if_stale(MODEL, 1) == "preparing"
    assert steps.vote(MODEL, 1, 1, []) == "committed"
    # nor extend a step past its timeout by believing it young
    deadline = time.monotonic() + 10
    while steps.abort_if_stale(MODEL, 2) == "preparing":  # server time passes the 1 s timeout
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert steps.vote(MODEL, 2, 0, []) == "aborted"
    with pytest.raises(StepAbortedError):
        steps.require_committed(MODEL, 2, timeout=5)
    TRIED[("clock.skew", "slow")] += 1


@pytest.fixture(autouse=True)
def _short_settle(monkeypatch):
    """A tenth of the pauses a failed migration gives a concurrent delete before it counts as a failure
    (``tierstore.migration._DELETE_SETTLE_S``): the same checks in the same order. A fault on half the host
    reads fails many migrations, and each one waited 0.75 s, most of what the matrix took."""
    import tierstore.migration as migration

    monkeypatch.setattr(migration, "_DELETE_SETTLE_S", tuple(p / 10 for p in migration._DELETE_SETTLE_S))


@pytest.fixture(autouse=True)
def _faults_tried(report_counts):
    """How many (point, kind) cells were tried and faults injected, in the run's summary (tests/conftest.py)."""
    before = Counter(TRIED)
    yield
    report_counts(f"fault matrix ({len(KINDS)} kinds x {len(POINTS)} points in-process, kills in subprocesses), "
                  "faults injected by cell", Counter({f"{p} {k}": n for (p, k), n in (TRIED - before).items()}))


def test_a_hang_blocks_until_the_plan_is_armed_again_or_its_bound():
    """The ``hang`` kind (a stuck mount that recovers): a call blocks until the plan is armed again, then goes
    on; never longer than ``delay_s``."""
    import threading

    plan = FaultPlan([FaultRule("backend.put@durable", "hang", delay_s=60.0)])
    rule = plan.decide("backend.put", "durable")
    assert rule is not None and rule.kind == "hang"
    ended = threading.Event()

    def call() -> None:
        plan.act(rule, "backend.put", "durable", "k")
        ended.set()

    t = threading.Thread(target=call, daemon=True)
    t.start()
    assert not ended.wait(0.3), "a hang returned before the plan was armed again"
    plan.arm()  # the mount recovers
    assert ended.wait(30), "a hang did not end when the plan was armed again"
    bounded = FaultPlan([FaultRule("backend.put", "hang", delay_s=0.2)])
    t0 = time.monotonic()
    bounded.act(bounded.rules[0], "backend.put", None, "k")  # never armed again: its bound ends it
    assert time.monotonic() - t0 < 30
