"""``tierstore bench [--quick] [--size-gib G] [--ranks 2] [--repeats N] [--systems a,b] [--sweep] [--out DIR]``.

Spawns ``--ranks`` processes (gloo on loopback), runs :func:`tierstore.bench.harness.rank_main`
in each, and prints the markdown table rank 0 wrote to ``OUT/results.md``
(raw figures in ``OUT/results.json``). :func:`main` is what ``tierstore bench``
calls.

``--sweep`` (the default for a full run on the CPU; ``--no-sweep`` leaves it out) adds the growth with the
number of tensors: after the main run, a
sub-run of ``--sweep-systems`` (:data:`SWEEP_SYSTEMS`, no slowdown pass) per point
of :func:`sweep_points` (:data:`SWEEP_TENSORS` tensors per rank at ``--ranks``,
and at one rank, where a core is free), each under ``OUT/sweep/r<R>-t<N>``; the
table of their ratios to the copy bound is appended to ``results.md``
(``OUT/sweep.json``: its figures).

Progress goes to stderr (:mod:`tierstore.bench.progress`): at once a line with
the plan and the scratch directories, then a line per system and round (a
redrawn bar on a terminal). SIGTERM or Ctrl-C stops the ranks (SIGTERM, then
SIGKILL after ``--stop-ranks-s``, default :data:`STOP_RANKS_S`), stops every index server of a home under the
run's scratch directory and removes the scratch directories (``/dev/shm`` and
disk), then exits 143 (130); what the benchmark already wrote to ``--out``
stays.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from tierstore.bench.harness import rank_main
from tierstore.bench.report import growth_rows, machine_info, render_growth
from tierstore.cli.common import HelpFormatter, Interrupted, interruptible, uninterrupted
from tierstore.embedded import find_servers, stop_server
from tierstore.ports import free_port

__all__ = ["DEFAULT_SYSTEMS", "STOP_RANKS_S", "SWEEP_SYSTEMS", "SWEEP_TENSORS", "build_parser", "main", "sweep_points",
           "sweeps"]

#: after an interrupt or a failure, how long the ranks get to exit on SIGTERM before SIGKILL
STOP_RANKS_S = 10.0

DEFAULT_SYSTEMS = [
    "copy", "torch_save_shm", "torch_save_disk", "dcp_save", "dcp_async", "dcp_async_staged",
    "tierstore_host", "dcp_async_staged_lazy", "tierstore_lazy", "torchsnapshot", "torchsnapshot_async",
]

#: ``--sweep``: the tensors per rank of the sweep, and the systems its sub-runs measure
SWEEP_TENSORS = (200, 1000, 4000)
SWEEP_SYSTEMS = ("copy", "tierstore_host", "dcp_async_staged", "torchsnapshot_async")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (defaults: the full benchmark of BENCHMARKS.md)."""
    p = argparse.ArgumentParser(prog="tierstore bench", formatter_class=HelpFormatter,
                                description="Benchmarks of tierstore side by side with torch.save and DCP "
                                            "(BENCHMARKS.md): save stall, commit, restore, memory, slowdown.")
    p.add_argument("--quick", action="store_true",
                   help="small state (64 MiB/rank), 2 rounds, short slowdown pass (default: the full run)")
    p.add_argument("--size-gib", type=float, default=None, help="params + AdamW state per rank (default: 1, quick 1/16)")
    p.add_argument("--tensors", type=int, default=200, help="tensors per rank (--tensors-per-layer per layer)")
    p.add_argument("--tensors-per-layer", type=int, default=4,
                   help="tensors per layer (one checkpoint object): a multiple of 4, a parameter and its AdamW state "
                        "(default: %(default)s, one parameter per object; a transformer block of 9 is 36)")
    p.add_argument("--ranks", type=int, default=2, help="ranks (processes, gloo on loopback)")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default: 3, quick 2)")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help="comma-separated; see tierstore.bench.systems (default: %(default)s)")
    p.add_argument("--out", default=None, help="output directory (default: bench/results/<timestamp>)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: CPUs // ranks)")
    p.add_argument("--disk-dir", default=None, help="where torch_save_disk writes (default: a temp dir)")
    p.add_argument("--matmul-n", type=int, default=512, help="size of the stand-in training step")
    p.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=None,
                   help="also: the growth with the number of tensors and where a core is free: a sub-run of "
                        "--sweep-systems (no slowdown pass) per point of --sweep-tensors at --ranks and at one "
                        "rank; a table of ratios to the copy bound, per point, appended to the report "
                        "(default: on for a full run on the CPU, off with --quick or --device cuda)")
    p.add_argument("--sweep-tensors", default=",".join(map(str, SWEEP_TENSORS)),
                   help="--sweep: tensors per rank of its points (default: %(default)s)")
    p.add_argument("--sweep-systems", default=",".join(SWEEP_SYSTEMS),
                   help="--sweep: the systems of its sub-runs (default: %(default)s)")
    p.add_argument("--durable", action="store_true",
                   help="instead: time to durable on a local-directory durable tier against a plain copy of the "
                        "same bytes, and the durable lag under a slow durable tier (--size-gib of state, "
                        "--slow-ms per put, a save every --interval-ms)")
    p.add_argument("--slow-ms", type=float, default=20.0, help="--durable: extra time of each durable put")
    p.add_argument("--interval-ms", type=float, default=50.0, help="--durable: the stand-in step between saves")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the state lives (cuda: one GPU per rank; bench/gpu_check.sh)")
    p.add_argument("--stop-ranks-s", type=float, default=STOP_RANKS_S,
                   help="after SIGTERM, Ctrl-C or a failed rank: seconds the ranks get to exit on SIGTERM "
                        "before SIGKILL")
    p.add_argument("--fwd-bwd-ms", type=float, default=None,
                   help="lazy systems: the stand-in forward/backward between a save and the next update, "
                        "in ms idle (default: 1000 per GiB of state, at least 100)")
    return p


def _stop_embedded(root: str) -> None:
    """Stop every embedded index server of a home under ``root`` (the ranks' stores live there): those a
    failed or interrupted run left, found by process (:func:`tierstore.embedded.find_servers`), so one whose
    rank died half-way through starting it is found too."""
    base = Path(root).resolve()
    homes = {s.home for s in find_servers() if s.home.is_relative_to(base)}
    for home in sorted(homes):
        try:
            stop_server(home)
        except Exception as e:  # noqa: BLE001 - best effort on the way out
            print(f"bench: could not stop the index server of {home}: {e}", file=sys.stderr)


def _stop_ranks(ctx: Any, grace_s: float = STOP_RANKS_S) -> None:
    """SIGTERM the ranks still running, SIGKILL those left after ``grace_s`` (``--stop-ranks-s``), reap them."""
    procs = [p for p in getattr(ctx, "processes", []) if p.is_alive()]
    for p in procs:
        p.terminate()
    for p in procs:
        p.join(grace_s)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5.0)


def _spawn(cfg: dict[str, Any], nprocs: int, grace_s: float = STOP_RANKS_S) -> None:
    """Run the ranks to their end; on any exception (a rank failed, :class:`Interrupted`) stop the others."""
    ctx = mp.start_processes(rank_main, args=(cfg,), nprocs=nprocs, join=False, start_method="spawn")
    try:
        while not ctx.join():
            pass
    finally:
        with uninterrupted():
            _stop_ranks(ctx, grace_s)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table; return 0 on success, 1 on failure (an :class:`Interrupted`
    propagates, after the cleanup, to the caller: ``tierstore bench`` exits 143 or 130)."""
    with interruptible():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.tensors_per_layer < 4 or args.tensors_per_layer % 4:
        print(f"bench: --tensors-per-layer must be a positive multiple of 4 (a parameter and its AdamW state), "
              f"got {args.tensors_per_layer}", file=sys.stderr)
        return 2
    if args.device == "cuda":
        import torch  # lazy: the CLI starts without it

        if not torch.cuda.is_available():
            print("bench: --device cuda needs a CUDA device", file=sys.stderr)
            return 2
    size = args.size_gib if args.size_gib is not None else (1 / 16 if args.quick else 1.0)
    repeats = args.repeats if args.repeats is not None else (2 if args.quick else 3)
    if args.durable:
        from tierstore.bench.durable import run_durable  # lazy: only this mode needs it

        _, md = run_durable(mib=size * 1024 if args.size_gib is not None else 64.0, repeats=repeats,
                            slow_ms=args.slow_ms, interval_ms=args.interval_ms)
        print(md)
        return 0
    fwd_bwd_s = (args.fwd_bwd_ms if args.fwd_bwd_ms is not None else max(100.0, 1000.0 * size)) / 1e3
    now = datetime.datetime.now(datetime.UTC)
    out = args.out or os.path.join("bench", "results", now.strftime("%Y%m%dT%H%M%SZ"))
    out = os.path.abspath(out)
    os.makedirs(out, exist_ok=True)
    # Freed large blocks go straight back to the OS, so RSS shows what a system really holds.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    command = "tierstore bench " + " ".join(argv if argv is not None else sys.argv[1:])
    base: dict[str, Any] = {
        "date": now.isoformat(timespec="seconds"),
        "machine": machine_info(),
        "size_gib": size,
        "repeats": repeats,
        "quick": args.quick,
        "device": args.device,
        "idle_s": 0.6 if args.quick else 2.0,
        "matmul_n": args.matmul_n,
        "fwd_bwd_s": fwd_bwd_s,
        "options": {"fwd_bwd_s": fwd_bwd_s, "matmul_n": args.matmul_n},
        "pg_timeout_s": 600,
        "malloc_mmap_threshold": os.environ["MALLOC_MMAP_THRESHOLD_"],
        "command": command,
        "tensors_per_layer": args.tensors_per_layer,
    }
    systems = [s for s in args.systems.split(",") if s]
    rc = _one_run(args, base, out, ranks=args.ranks, tensors=args.tensors, systems=systems, slowdown=True)
    if rc != 0:
        return rc
    md_path = os.path.join(out, "results.md")
    if sweeps(args):
        rc = _sweep(args, base, out, systems)
        if rc != 0:
            return rc
    with open(md_path, encoding="utf-8") as f:
        print(f.read())
    print(f"results: {md_path} and {os.path.join(out, 'results.json')}")
    return 0


def sweeps(args: argparse.Namespace) -> bool:
    """Whether the run adds the sweep: ``--sweep`` / ``--no-sweep`` where given, else a full run on the CPU
    does (the growth with the number of tensors is part of the report) and ``--quick`` or CUDA does not."""
    if args.sweep is not None:
        return bool(args.sweep)
    return not args.quick and args.device == "cpu"


def sweep_points(ranks: int, tensors: int, sweep: list[int]) -> list[tuple[int, int]]:
    """The ``(ranks, tensors)`` runs of ``--sweep``: each of ``sweep`` at ``ranks``, then one rank at each of
    ``sweep`` (where a core is free), in that order, without repeats; the main run's point is among them."""
    points: list[tuple[int, int]] = []
    for p in [(ranks, n) for n in sweep] + [(1, n) for n in sweep]:
        if p not in points:
            points.append(p)
    if (ranks, tensors) not in points:
        points.insert(0, (ranks, tensors))
    return points


def _sweep(args: argparse.Namespace, base: dict[str, Any], out: str, systems: list[str]) -> int:
    """``--sweep``: the main run's point, and a sub-run (``--sweep-systems``, no slowdown pass) per other point
    of :func:`sweep_points`, under ``OUT/sweep/r<R>-t<N>``; the growth table (:func:`report.render_growth`)
    is appended to ``OUT/results.md`` and the figures written to ``OUT/sweep.json``."""
    sub_systems = [s for s in args.sweep_systems.split(",") if s]
    sweep = [int(n) for n in args.sweep_tensors.split(",") if n]
    runs: list[tuple[int, int, dict[str, Any]]] = []
    for ranks, tensors in sweep_points(args.ranks, args.tensors, sweep):
        if (ranks, tensors) == (args.ranks, args.tensors):
            path = os.path.join(out, "results.json")
        else:
            sub = os.path.join(out, "sweep", f"r{ranks}-t{tensors}")
            rc = _one_run(args, base, sub, ranks=ranks, tensors=tensors, systems=sub_systems, slowdown=False)
            if rc != 0:
                return rc
            path = os.path.join(sub, "results.json")
        with open(path, encoding="utf-8") as f:
            runs.append((ranks, tensors, json.load(f)))
    rows = growth_rows(runs)
    with open(os.path.join(out, "sweep.json"), "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(out, "results.md"), "a", encoding="utf-8") as f:
        f.write("\n" + render_growth(rows, base["size_gib"]))
    return 0


def _one_run(args: argparse.Namespace, base: dict[str, Any], out: str, *, ranks: int, tensors: int,
             systems: list[str], slowdown: bool) -> int:
    """One run of the ranks (``ranks`` processes, ``tensors`` per rank) writing ``OUT/results.{md,json}``;
    0 on success, 1 on failure (an :class:`Interrupted` propagates after the cleanup)."""
    os.makedirs(out, exist_ok=True)
    shm_dir = tempfile.mkdtemp(prefix="tsbench-run-", dir="/dev/shm")
    disk_dir = tempfile.mkdtemp(prefix="tsbench-run-", dir=args.disk_dir)
    cfg: dict[str, Any] = {
        **base,
        "ranks": ranks,
        "tensors": tensors,
        "systems": systems,
        "slowdown": slowdown,
        "threads": args.threads or max(1, (os.cpu_count() or 1) // ranks),
        "out": out,
        "shm_dir": shm_dir,
        "disk_dir": disk_dir,
        "init_method": f"tcp://127.0.0.1:{free_port()}",
    }
    size = base["size_gib"]
    print(f"bench: {ranks} rank(s), {len(systems)} system(s), {base['repeats']} round(s), "
          f"{size * 1024:g} MiB of state per rank in {tensors} tensors ({base['tensors_per_layer']} per layer); "
          f"scratch {shm_dir} and {disk_dir}; "
          f"results in {out}", file=sys.stderr, flush=True)
    try:
        _spawn(cfg, ranks, args.stop_ranks_s)
    except Interrupted as e:
        print(f"bench: {e}: stopping the ranks and removing {shm_dir} and {disk_dir}", file=sys.stderr, flush=True)
        raise
    except Exception as e:  # noqa: BLE001 - report and fail
        print(f"bench failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        with uninterrupted():
            _stop_embedded(disk_dir)
            shutil.rmtree(shm_dir, ignore_errors=True)
            shutil.rmtree(disk_dir, ignore_errors=True)
    if not os.path.exists(os.path.join(out, "results.md")):
        print("bench failed: no results.md written", file=sys.stderr)
        return 1
    return 0

if __name__ == "__main__":
    try:
        sys.exit(main())
    except Interrupted as e:
        sys.exit(128 + e.signum)
