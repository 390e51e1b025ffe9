"""Soak: save/commit/restore loops on several rank processes with a random fault every few seconds.

``python -m bench.soak [--duration 3600] [--ranks 2] [--fault-every 3] [--seed 0] [--out FILE]``

The parent starts a private index server (the embedded default's binary,
append-only file on) and a durable directory, then spawns ``--ranks``
processes. Each rank loops: begin step, put its shards, vote, wait for the
outcome (lock-step with the others), every few steps a restore (resolve +
read every object, compared bitwise); every ``--fault-every`` seconds it arms
one random fault (``tierstore.testing.faults``; ``TIERSTORE_FAULTS`` adds standing
rules through :func:`tierstore.testing.faults.plan_from_env`). Host copies of durable
steps older than 16 are evicted, so the host tier stays bounded.

At the end the parent re-reads every committed step bitwise (faults off):
``bytes_lost`` must be 0. Each rank samples its RSS and open descriptors
after a warm-up and at the end (they must stay flat). The report is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODEL = "soak"
LAYERS = ("emb", "h0", "h1")
# faults a save/restore loop must survive without losing a committed step (no silent write corruption:
# the fault matrix shows that loses the only copy, by design detected on read)
SOAK_FAULTS = [
    ("backend.put@durable", "exception"), ("backend.put@durable", "partial"), ("backend.put@durable", "timeout"),
    ("backend.put@host", "exception"), ("backend.put@host", "partial"), ("backend.get@host", "corrupt"),
    ("backend.get@host", "exception"), ("backend.get@durable", "corrupt"), ("backend.delete@host", "exception"),
    ("index.script", "exception"), ("index.script", "partial"), ("index.script", "timeout"),
    ("migration", "exception"), ("commit", "exception"), ("commit", "partial"), ("backend.put@host", "slow"),
]


def tensors(step: int, rank: int, layer: str):
    import torch

    g = torch.Generator().manual_seed(step * 7919 + rank * 101 + LAYERS.index(layer))
    return {"w": torch.randn(32, 32, generator=g), "exp_avg": torch.randn(32, 32, generator=g)}


def same(shard, want) -> bool:
    import torch

    def raw(t):
        return t.contiguous().reshape(-1).view(torch.uint8)

    return shard is not None and set(shard.tensors) == set(want) and all(
        torch.equal(raw(shard.tensors[n]), raw(t)) for n, t in want.items())


def open_store(home: Path, url: str, node: str):
    from backends.host import HostBackend
    from backends.localfs import LocalFSBackend
    from consistency.index import Index
    from tierstore.config import StoreConfig
    from tierstore.store import TierStore

    cfg = StoreConfig(home=str(home), redis_url=url, durable_url="file://" + str(home / "durable"),
                      host_root=str(home / "shm" / node), node_id=node).resolved()
    return TierStore(cfg, Index(url), HostBackend(cfg.host_root, recycle_grace_s=0.5),
                     LocalFSBackend(home / "durable", fsync=False))


def sample() -> tuple[int, int]:
    rss = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    return rss, len(os.listdir("/proc/self/fd"))


def rank_main(a: argparse.Namespace) -> dict[str, Any]:
    from tierstore.errors import TierStoreError
    from tierstore.keys import ShardKey
    from tierstore.testing.faults import FaultPlan, FaultRule, install, plan_from_env

    home = Path(a.home)
    tensors(0, a.rank, LAYERS[0])  # torch imported and warm before the clock starts (the store imports it lazily)
    store = open_store(home, a.redis, "node0")
    env_plan = plan_from_env()
    plan = install(store, FaultPlan(env_plan.rules if env_plan else [], seed=a.seed * 100 + a.rank))
    rnd = random.Random(a.seed * 1000 + a.rank)
    c = {"rank": a.rank, "steps": 0, "committed": 0, "aborted": 0, "restores": 0, "restore_failures": 0,
         "errors": 0, "error_types": {}}
    start = time.monotonic()
    end = start + a.duration
    next_fault = start + a.fault_every * (1 + rnd.random())
    first = last = None
    step = 0
    while time.monotonic() < end:
        step += 1
        now = time.monotonic()
        if now >= next_fault:
            point, kind = rnd.choice(SOAK_FAULTS)
            plan.arm(FaultRule(point, kind, 1.0, limit=1, delay_s=0.05), *(env_plan.rules if env_plan else []))
            next_fault = now + a.fault_every * (0.5 + rnd.random())
        if first is None and now - start > min(60.0, a.duration / 4):  # after warm-up (pools filled)
            first = sample()
        infos, ok = [], True
        try:
            store.begin_step(MODEL, step, a.ranks, layout={"layers": list(LAYERS)})
            for layer in LAYERS:
                infos.append(store.put(ShardKey(MODEL, layer, step, a.rank), tensors(step, a.rank, layer)))
        except TierStoreError as e:
            ok = False
            c["errors"] += 1
            c["error_types"][type(e).__name__] = c["error_types"].get(type(e).__name__, 0) + 1
        for attempt in range(3):
            try:
                store.vote(MODEL, step, a.rank, infos if ok else [], ok=ok)
                break
            except TierStoreError as e:
                ok = False  # the vote's outcome is unknown: vote no (a no after a landed yes is harmless)
                c["errors"] += 1
                c["error_types"][type(e).__name__] = c["error_types"].get(type(e).__name__, 0) + 1
        with plan.paused():
            try:
                state = store.wait_step(MODEL, step, timeout=60)
            except TierStoreError:
                state = "undecided"
        c["steps"] += 1
        c["committed" if state in ("committed", "durable") else "aborted"] += 1
        if step % 10 == 0:
            try:
                res = store.resolve(MODEL)
                for (layer, rank), info in res.objects.items():
                    if not same(store.get(info.key), tensors(info.key.step, rank, layer)):
                        raise AssertionError(f"restore of {info.key} returned wrong bytes")
                c["restores"] += 1
            except TierStoreError:
                c["restore_failures"] += 1
            if a.rank == 0 and step > 16:
                with plan.paused():
                    try:
                        store.flush()
                    except TierStoreError:
                        pass
                    _evict_old(store, step - 16)
        if a.interval:
            time.sleep(a.interval)
    with plan.paused():
        try:
            store.flush()
        except TierStoreError:
            pass
    last = sample()
    first = first or last
    c.update(rss_first=first[0], rss_last=last[0], fds_first=first[1], fds_last=last[1],
             faults_injected=plan.total_fired(), faults={f"{p}:{k}": n for (p, k), n in plan.fired.items()})
    store.close()
    return c


def _evict_old(store, below: int) -> None:
    """Drop host copies of durable objects of steps below ``below`` (the durable copy stays)."""
    from tierstore.keys import ShardKey

    for key in store.index.list_objects(MODEL):
        if key.step < below:
            rec = store.index.get_object(key)
            if rec and "host" in rec.tiers and "durable" in rec.tiers:
                store.index.remove_tier(ShardKey(key.model, key.layer, key.step, key.rank), "host", name=rec.name)
                store.host.delete(rec.name)  # the live copy's physical name


def verify_all(home: Path, url: str) -> dict[str, Any]:
    """Re-read every committed step bitwise; count the bytes of any shard that is gone or changed."""
    from tierstore.errors import TierStoreError
    from tierstore.keys import ShardKey

    store = open_store(home, url, "node0")
    lost = checked = steps = 0
    bad: list[str] = []
    try:
        for step, state in store.steps.steps(MODEL):
            if state not in ("committed", "durable"):
                continue
            steps += 1
            m = store.steps.manifest(MODEL, step)
            for rank, vote in m["ranks"].items():
                for o in vote["objects"]:
                    key = ShardKey.parse(o["key"])
                    want = tensors(key.step, int(rank), key.layer)
                    try:
                        ok = same(store.get(key), want)
                    except TierStoreError as e:
                        ok, e_ = False, e
                        bad.append(f"{key}: {e_}")
                    if not ok:
                        lost += o["size"]
                        bad.append(str(key))
                    checked += o["size"]
    finally:
        store.close()
    return {"steps_verified": steps, "bytes_verified": checked, "bytes_lost": lost, "lost": bad[:10]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=3600.0, help="seconds of save/commit/restore loops")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--fault-every", type=float, default=3.0, help="mean seconds between injected faults")
    p.add_argument("--interval", type=float, default=0.02, help="pause between steps (seconds)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the JSON report here too")
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--home", default=None, help=argparse.SUPPRESS)
    p.add_argument("--redis", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.rank is not None:
        print(json.dumps(rank_main(a)))
        return 0
    from tests.redis_server import RedisProcess

    home = Path(tempfile.mkdtemp(prefix="tierstore-soak-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    (home / "redis").mkdir()
    rp = RedisProcess(home / "redis")
    rp.start()
    t0 = time.monotonic()
    try:
        procs = [subprocess.Popen([sys.executable, "-m", "bench.soak", "--rank", str(r), "--ranks", str(a.ranks),
                                   "--home", str(home), "--redis", rp.url, "--duration", str(a.duration),
                                   "--fault-every", str(a.fault_every), "--interval", str(a.interval),
                                   "--seed", str(a.seed)], stdout=subprocess.PIPE, text=True,
                                  cwd=str(Path(__file__).resolve().parents[1]))
                 for r in range(a.ranks)]
        ranks = []
        for pr in procs:
            out, _ = pr.communicate(timeout=a.duration + 600)
            if pr.returncode != 0:
                raise SystemExit(f"a soak rank failed with exit code {pr.returncode}")
            ranks.append(json.loads(out.strip().splitlines()[-1]))
        report = {
            "duration_s": round(time.monotonic() - t0, 1), "ranks": ranks,
            "checkpoints_committed": min(r["committed"] for r in ranks),
            "faults_injected": sum(r["faults_injected"] for r in ranks),
            "restores": sum(r["restores"] for r in ranks),
            **verify_all(home, rp.url),
        }
    finally:
        rp.stop(kill=True)
        shutil.rmtree(home, ignore_errors=True)
    text = json.dumps(report, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    return 0 if report["bytes_lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
