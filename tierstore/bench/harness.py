"""The per-rank benchmark loop (one process per rank, gloo).

Per rank: build the workload, set every system up (memory measured from
before ``setup`` through a warm-up save), then ``repeats`` rounds in which the
systems take turns (the order rotates each round), a barrier around every
save and restore; then the slowdown pass (training steps idle, while each system
saves, idle again; idle and busy in the same window; skipped where ``cfg["slowdown"]`` is false: a
sweep's sub-runs); then the extras. Each rank writes ``raw/rank<r>.json``; rank 0
merges them (:mod:`tierstore.bench.report`).
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import signal
import statistics
import threading
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from tierstore.bench import systems as S
from tierstore.bench.progress import BenchProgress
from tierstore.bench.report import merge_and_write
from tierstore.bench.workload import (
    Peak,
    make_workload,
    matmul_step,
    rss_bytes,
    rss_shmem_bytes,
    set_step_device,
    shm_used_bytes,
)

__all__ = ["load_builtin", "rank_main"]


def load_builtin() -> None:
    """Import the built-in systems (the bound, the peers, tierstore's): each registers itself in
    :data:`tierstore.bench.systems.SYSTEMS` when imported. Here, not in ``systems``, which they import."""
    import tierstore.bench.peers  # lazy: torch.distributed.checkpoint, only in a rank
    import tierstore.bench.tierstore_systems  # noqa: F401  # lazy: the store and the checkpointer, only in a rank


def _agree(ok: bool) -> bool:
    """True on every rank iff ``ok`` on every rank."""
    t = torch.tensor([0 if ok else 1], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t.item()) == 0


def _shm(system: S.System, before: int, world: int) -> tuple[int, str]:
    own = system.shm_bytes()
    if own is not None:
        return own, "own files"
    return max(0, shm_used_bytes() - before) // world, "statvfs /dev/shm delta / ranks"


def _secs(timing: dict[str, Any]) -> str:
    """A save's stall and, where it has one, its time to complete (the figures of BENCHMARKS.md)."""
    stall, done = timing.get("stall_s"), timing.get("complete_s")
    text = f"stall {stall:.3f} s" if isinstance(stall, (int, float)) else "done"
    if isinstance(done, (int, float)) and done != stall:
        text += f", complete {done:.3f} s"
    return text


def _steps(n: int, size: int) -> list[float]:
    return [matmul_step(size) for _ in range(n)]


def _idle(seconds: float, size: int) -> list[float]:
    """Training steps for ``seconds`` (at least 5), nothing else running on this rank."""
    times: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 5:
        times.append(matmul_step(size))
    return times


def _overlapped(system: S.System, step: int, size: int) -> dict[str, Any]:
    """Run training steps while ``system`` saves; return the step times and the save's timings."""
    times: list[float] = []
    t0 = time.perf_counter()
    if system.background:
        marks = system.begin(step)
        t1 = time.perf_counter()
        while not system.done():
            times.append(matmul_step(size))
        events = system.finish()
        timing = S.timings(t0, t1, marks, events)
        mode = "after the stall, while the system's background work runs"
    else:
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["t"] = system.save(step)
            except BaseException as e:  # noqa: BLE001
                box["e"] = e

        th = threading.Thread(target=run, daemon=True)
        th.start()
        while th.is_alive():
            times.append(matmul_step(size))
        th.join()
        if "e" in box:
            raise box["e"]
        timing = box["t"]
        mode = "whole save in a side thread (what it would cost off the critical path)"
    return {"step_s": times, "timing": timing, "mode": mode}


def rank_main(rank: int, cfg: dict[str, Any]) -> None:
    """Entry point of one rank (``torch.multiprocessing.spawn`` target)."""
    world = cfg["ranks"]
    # Ctrl-C reaches the whole process group: the parent (tierstore.bench.run) stops the ranks and removes
    # what they made, so a rank does not die on its own half-way through a save.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(cfg["threads"])
    dist.init_process_group(
        "gloo",
        init_method=cfg["init_method"],
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=cfg["pg_timeout_s"]),
    )
    try:
        _run(rank, world, cfg)
    finally:
        dist.destroy_process_group()


def _run(rank: int, world: int, cfg: dict[str, Any]) -> None:
    load_builtin()
    pg = dist.new_group(backend="gloo")
    repeats = int(cfg["repeats"])
    slowdown = bool(cfg.get("slowdown", True))  # a sweep's sub-run skips the slowdown pass (tierstore.bench.run)
    per_system = repeats + 1 + (1 if slowdown else 0)
    bar = BenchProgress(len(cfg["systems"]) * per_system, enabled=rank == 0)
    bar.note(f"{world} rank(s) up; building {cfg['size_gib'] * 1024:g} MiB of state per rank")
    device = cfg.get("device", "cpu")
    if device != "cpu":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        set_step_device(device)
    work = make_workload(rank, int(cfg["size_gib"] * 2**30), cfg["tensors"], device=device,
                         per_layer=cfg.get("tensors_per_layer", 4))
    rss_workload = rss_bytes()
    ctx = S.BenchContext(
        rank=rank, world=world, work=work, shm_dir=cfg["shm_dir"], disk_dir=cfg["disk_dir"], pg=pg,
        options=cfg.get("options", {}), device=device,
    )
    if ctx.cuda:
        matmul_step(int(cfg["matmul_n"]))  # the stand-in's buffers belong to the baseline
    gpu_base = torch.cuda.memory_allocated() if ctx.cuda else 0
    out: dict[str, Any] = {
        "rank": rank, "state_bytes": work.nbytes, "rss_workload_bytes": rss_workload,
        "systems": {}, "skipped": dict(S.SKIPPED),
    }
    active: list[S.System] = []
    step = 1
    for name in cfg["systems"]:
        cls = S.SYSTEMS.get(name)
        if cls is None:
            out["skipped"].setdefault(name, "not registered")
            bar.skip(per_system, f"skipped {name}: {out['skipped'][name]}")
            continue
        system = cls(ctx)
        rec: dict[str, Any] = {"kind": cls.kind, "describe": cls.describe, "restores": cls.restores,
                               "background": cls.background, "samples": [], "restore_s": []}
        gc.collect()
        S.barrier()
        shm0 = shm_used_bytes()
        peak = Peak().start()
        if ctx.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        reason = ""
        try:
            system.setup()
        except S.SystemUnavailable as e:
            reason = str(e)
        except Exception as e:  # noqa: BLE001 - skip the system, say why
            reason = f"setup failed: {type(e).__name__}: {e}"
        if not _agree(not reason):
            out["skipped"][name] = reason or "skipped on another rank"
            bar.skip(per_system, f"skipped {name}: {out['skipped'][name]}")
            continue
        S.barrier()
        warm = system.save(step)
        step += 1
        # Peak through the first save only: a restore that maps files (torch.load with mmap=True
        # of a /dev/shm file) would count those shared pages in RSS.
        rec["first_peak_extra_bytes"] = peak.private_extra()
        if ctx.cuda:  # GPU memory above the state: the peak of setup and the first save, and what stays
            torch.cuda.synchronize()
            rec["gpu_extra_bytes"] = torch.cuda.max_memory_allocated() - gpu_base
            rec["gpu_standing_bytes"] = torch.cuda.memory_allocated() - gpu_base
        rec["shmem_mapped_bytes"] = rss_shmem_bytes() - peak.shmem_base
        rec["shm_bytes"], rec["shm_method"] = _shm(system, shm0, world)
        S.barrier()
        if cls.restores:
            system.restore()
            system.verified()
            ctx.sync()
        S.barrier()
        system.cleanup()
        S.barrier()
        gc.collect()
        rec["standing_bytes"] = rss_bytes() - peak.base - max(0, rss_shmem_bytes() - peak.shmem_base)
        rec["peak_method"] = peak.method
        rec["warmup"] = warm
        rec["transient_bytes"] = []
        out["systems"][name] = rec
        active.append(system)
        bar.advance(f"setup {name}: warm-up save {_secs(warm)}")

    for rnd in range(repeats):
        k = rnd % max(1, len(active))
        for system in active[k:] + active[:k]:
            rec = out["systems"][system.name]
            work.perturb()
            gc.collect()
            S.barrier()
            peak = Peak().start()
            t = system.save(step)
            ctx.sync()
            step += 1
            rec["transient_bytes"].append(peak.private_extra())
            t["round"] = rnd
            rec["samples"].append(t)
            S.barrier()
            if system.restores:
                t0 = time.perf_counter()
                system.restore()
                ctx.sync()
                t1 = time.perf_counter()
                tv = system.verified()  # a restore that verifies beside the copy: when it had
                rec["restore_s"].append(t1 - t0)
                rec.setdefault("verified_s", []).append(None if tv is None else max(t1, tv) - t0)
                S.barrier()
            system.cleanup()
            S.barrier()
            restored = f", restore {rec['restore_s'][-1]:.3f} s" if system.restores else ""
            bar.advance(f"round {rnd + 1}/{repeats} {system.name}: save {_secs(t)}{restored}")

    idle_s, mm = cfg["idle_s"], cfg["matmul_n"]
    for system in active if slowdown else []:
        rec = out["systems"][system.name]
        work.perturb()
        S.barrier()
        _steps(3, mm)
        idle = _idle(idle_s / 2, mm)
        S.barrier()
        ov = _overlapped(system, step, mm)
        step += 1
        S.barrier()
        idle += _idle(idle_s / 2, mm)
        S.barrier()
        system.cleanup()
        S.barrier()
        idle_med = statistics.median(idle)
        busy_med = statistics.median(ov["step_s"]) if ov["step_s"] else None
        busy = f"{busy_med:.4f} s" if busy_med is not None else "no step ran"
        bar.advance(f"slowdown {system.name}: training step {busy} while it saved, {idle_med:.4f} s idle")
        rec["slowdown"] = {
            "idle_step_s": idle, "busy_step_s": ov["step_s"], "idle_median_s": idle_med,
            "busy_median_s": busy_med, "mode": ov["mode"], "save_under_load": ov["timing"],
            "slowdown": None if busy_med is None else busy_med / idle_med - 1.0,
        }

    for system in active:
        try:
            out["systems"][system.name]["extras"] = system.extras()
        except Exception as e:  # noqa: BLE001
            out["systems"][system.name]["extras"] = {"error": f"{type(e).__name__}: {e}"}
    S.barrier()
    for system in active:
        try:
            system.teardown()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    os.makedirs(os.path.join(cfg["out"], "raw"), exist_ok=True)
    with open(os.path.join(cfg["out"], "raw", f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
    S.barrier()
    if rank == 0:
        bar.note(f"writing {os.path.join(cfg['out'], 'results.md')}")
        merge_and_write(cfg)
    S.barrier()
