"""``tierstore demo``: train a small GPT on N ranks, kill one, restart, restore, continue, report.

What it does (no set-up needed: the embedded default of ``--home``):

1. Phase 0: spawns ``--ranks`` processes (gloo, loopback) that train
   :class:`tierstore.testing.gpt.GPT` and checkpoint every step with a
   :class:`~tierstore.train.checkpointer.Checkpointer` (``--policy``).
2. At step ``--kill-at`` the last rank SIGKILLs itself right after its
   training step (a crash: no clean-up, its last save may be in flight);
   the launcher then kills the survivors, as torchrun would.
3. Phase 1: spawns the ranks again; each restores (the newest step every
   rank can rebuild, from the fastest tier holding it) and trains on to
   ``--steps``.
4. After training, each rank times ``torch.save`` and ``torch.load`` of the
   same state to a file beside the host tier, ``--compare-repeats`` times
   (:func:`torch_save_baseline`): what a user would do instead.
5. Prints a summary (stall per save against ``torch.save``'s, bytes per tier
   and policy, commit latency, restore time and tier against ``torch.load``'s,
   loss before and after the failure, whether the replayed steps reproduce
   the lost run bitwise) and writes ``demo.png`` (the loss with the failure
   marked; the stall and the restore against ``torch.save``/``torch.load``;
   the bytes per step by kind against a full checkpoint) and
   ``summary.json`` to ``--out``. The summary's figures and the plot's come
   from one function of the summary record
   (:func:`tierstore.cli.demo_plot.figures`); the PNG records the ones it drew.

Protocol between the launcher and its ranks: each rank appends JSON lines
to ``OUT/rank<r>.phase<p>.jsonl`` (``restore``, ``step``, ``done``, ``torch_save`` events)
and logs to ``rank<r>.phase<p>.log``; the launcher tails rank 0's file for
progress and reads the rest from the index.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

import tierstore
from consistency.gc import Retention
from tierstore.cli import views as V
from tierstore.cli.admin import human_bytes
from tierstore.cli.common import HelpFormatter
from tierstore.errors import ConfigError
from tierstore.ports import free_port

__all__ = ["build_parser", "draw", "main", "make_policy", "torch_save_baseline"]


def draw(summary: dict[str, Any], path: Path) -> Any:
    """The demo's plot (:func:`tierstore.cli.demo_plot.draw`), imported when drawn: ``tierstore demo --help``
    and the launcher import no plotting (and no torch; the ranks do)."""
    from tierstore.cli.demo_plot import draw as _draw  # lazy: matplotlib, only when a plot is drawn

    return _draw(summary, path)

_PHASE_TIMEOUT_S = 600.0


def make_policy(spec: str) -> Any:
    """A policy from ``exact``, ``layerwise``, ``differential``, ``dedup`` or a ``+``-joined mix."""
    from tierstore.train import policies as P  # lazy: imports torch, which the launcher and --help need not

    table = {"exact": P.exact, "layerwise": lambda: P.layerwise(tau=0.01, max_staleness=5),
             "differential": lambda: P.differential(base_every=5), "dedup": P.dedup}
    parts = [p.strip() for p in spec.split("+") if p.strip()]
    unknown = [p for p in parts if p not in table]
    if not parts or unknown:
        raise ConfigError(f"unknown policy {spec!r}: use {', '.join(table)} or a '+'-joined mix", field="policy")
    return P.compose(*(table[p]() for p in parts))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tierstore demo", description=__doc__.split("\n\n")[0].split(": ", 1)[-1],
                                formatter_class=HelpFormatter)
    p.add_argument("--home", default=None,
                   help="embedded store's data directory (default: $TIERSTORE_HOME, else .tierstore)")
    p.add_argument("--redis", default=None, help="index URL (default: the embedded server of --home)")
    p.add_argument("--s3", default=None, help="durable tier: s3://bucket/prefix (default: HOME/durable)")
    p.add_argument("--s3-endpoint", default=None, help="S3-compatible endpoint URL, MinIO or moto (default: AWS)")
    p.add_argument("--host-root", default=None, help="host tier directory (default: derived in /dev/shm)")
    p.add_argument("--steps", type=int, default=30, help="training steps in all")
    p.add_argument("--ranks", type=int, default=2, help="ranks (processes, gloo)")
    p.add_argument("--kill-at", type=int, default=None, help="step at which the last rank dies (default: steps/2)")
    p.add_argument("--policy", default="differential+dedup",
                   help="exact | layerwise | differential | dedup, or a '+'-joined mix")
    p.add_argument("--model-name", default=None, help="key namespace (default: demo-<time>-<pid>)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank and step")
    p.add_argument("--seed", type=int, default=0, help="seed of the model's weights and of the data order")
    p.add_argument("--out", default="demo-out", help="where the plot, summary and logs go")
    p.add_argument("--keep-all", action="store_true", help="keep every step (default: gc keeps the last 2)")
    p.add_argument("--compare-repeats", type=int, default=5,
                   help="after training, each rank times torch.save and torch.load of the same state this many "
                        "times, the baseline the summary and plot compare against (0: not measured)")
    p.add_argument("--torchrun", action="store_true",
                   help="be one rank under torchrun (RANK/WORLD_SIZE from its environment): restore, train, save")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # JSON config of one rank
    return p


# -- one rank ---------------------------------------------------------------------------------
def _open_store(cfg: dict[str, Any], **extra: Any) -> Any:
    kw: dict[str, Any] = dict(extra)
    for opt in ("node_id", "peer_replicas", "peer_secret_file"):  # set by the testbed
        if cfg.get(opt):
            kw[opt] = cfg[opt]
    if cfg.get("host_root"):
        kw["host_root"] = cfg["host_root"]
    if cfg.get("s3_endpoint"):
        kw["s3_endpoint_url"] = cfg["s3_endpoint"]
    return tierstore.open(cfg["home"], redis=cfg.get("redis"), durable=cfg.get("durable"), **kw)


def _restore_tiers(store: Any, model: str, rank: int, staleness: int) -> dict[str, int]:
    """Which tier each of this rank's restored objects is read from (the fastest holding it)."""
    res = store.resolve(model, max_staleness=staleness)
    counts: dict[str, int] = {}
    for (_layer, r), info in res.objects.items():
        if r != rank % res.world_size:
            continue
        for tier in store.tiers:
            try:
                if tier.exists(info.name):  # the physical name of the copy the step reads
                    counts[tier.tier] = counts.get(tier.tier, 0) + 1
                    break
            except Exception:  # noqa: BLE001 - an unreachable tier is skipped, as the read path does
                continue
    return counts


def _worker(cfg: dict[str, Any]) -> int:
    # lazy: the rank's imports (torch, prometheus); the launcher and --help import none of them
    import torch.distributed as dist

    from tierstore.cli import metrics  # lazy: see above
    from tierstore.testing import gpt  # lazy: see above
    from tierstore.train.checkpointer import Checkpointer  # lazy: see above

    rank, world, phase = cfg["rank"], cfg["world"], cfg["phase"]
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(name)s %(levelname)s %(message)s")
    events = open(cfg["events"], "a", buffering=1)

    def emit(**e: Any) -> None:
        events.write(json.dumps(e) + "\n")

    init = f"tcp://127.0.0.1:{cfg['port']}" if cfg.get("port") else "env://"  # env://: under torchrun
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    gpt.setup_determinism(cfg["seed"])
    model, opt = gpt.make_model(seed=cfg["seed"])
    policy = make_policy(cfg["policy"])
    store = _open_store(cfg)
    ckpt = Checkpointer(store, cfg["model"], model, opt, policy=policy, keep_last=None)  # the summary reads every step; gc runs at the end
    m = metrics.Metrics()
    t = time.perf_counter()
    step, _extra = ckpt.restore()
    restore_s = time.perf_counter() - t
    tiers = _restore_tiers(store, cfg["model"], rank, policy.max_staleness) if step is not None else {}
    emit(event="restore", step=step, seconds=restore_s, tiers=tiers,
         phases={k: round(v, 4) for k, v in ckpt.report.phases.items()})
    if step is not None:
        m.record_restore(cfg["model"], max(tiers, key=lambda t: tiers[t]) if tiers else "-", restore_s, step)
    data = gpt.char_dataset()
    block = model.config.block
    last_wall, last_stall = 0.0, 0.0
    for s in range(0 if step is None else step + 1, cfg["steps"]):
        x, y = gpt.get_batch(data, s, rank, cfg["batch_size"], block, cfg["seed"])
        loss = gpt.train_step(model, opt, x, y, world)
        if phase == 0 and rank == world - 1 and s == cfg.get("kill_at"):
            emit(event="kill", step=s, loss=loss)
            events.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        wall = time.time()
        t = time.perf_counter()
        ckpt.save(s, extra={"data_pos": s + 1})
        stall = time.perf_counter() - t
        emit(event="step", step=s, loss=loss, stall_s=stall, t_save=wall, full_bytes=full_checkpoint_bytes(model, opt))
        if phase == 0 and s == cfg.get("hold_after"):
            while True:  # the testbed kills a whole node here, mid-run
                time.sleep(1)
        prev = ckpt.stats.per_step.get(s - 1)
        if prev is not None:  # the previous save's background work is done now: log it
            (srec,) = store.steps.records(cfg["model"], [s - 1])
            lat = srec.decided - last_wall if srec.decided is not None else None
            m.record_step(metrics.StepFigures(cfg["model"], s - 1, rank, stall_s=last_stall, bytes_by_tier={"host": prev},
                                              commit_latency_s=lat if lat is None or lat >= 0 else None,
                                              state=srec.state or None))
        last_wall, last_stall = wall, stall
    state = ckpt.wait()
    emit(event="done", state=state, stats=ckpt.stats.as_dict(), per_step=ckpt.stats.per_step)
    where = Path(store.config.host_root).parent  # torch.save's file beside the host tier: the same medium
    ckpt.close()
    store.close()
    if phase == 1 and cfg.get("compare_repeats"):
        dist.barrier()  # every rank at once, as the saves ran
        emit(event="torch_save", **torch_save_baseline(model, opt, cfg["compare_repeats"], where))
    dist.destroy_process_group()
    return 0


def torch_save_baseline(model: Any, opt: Any, repeats: int, where: str | os.PathLike) -> dict[str, Any]:
    """What a user would do instead: ``torch.save`` of this rank's state (the model's and the optimizer's
    ``state_dict()``, what the Checkpointer saved) to a file in a new directory under ``where``, ``repeats``
    times, each followed by ``torch.load`` + ``load_state_dict`` of it into the model and optimizer (the state
    they already hold: the run is over). Returns the seconds of each and the file's size; the directory is
    removed. Run after training, with no save in flight (the Checkpointer's stalls were measured during it)."""
    import torch  # lazy: the worker's torch, loaded there already (the launcher needs none)

    tmp = tempfile.mkdtemp(prefix="tierstore-demo-torch-save-", dir=where)
    path = os.path.join(tmp, "state.pt")
    save_s: list[float] = []
    load_s: list[float] = []
    try:
        for _ in range(repeats):
            t = time.perf_counter()
            torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
            save_s.append(time.perf_counter() - t)
            t = time.perf_counter()
            sd = torch.load(path, weights_only=True)
            model.load_state_dict(sd["model"])
            opt.load_state_dict(sd["optim"])
            load_s.append(time.perf_counter() - t)
        size = os.path.getsize(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    mount = Path(where).resolve()
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    return {"where": str(where), "filesystem": str(mount), "save_s": save_s, "load_s": load_s, "bytes": size}


def full_checkpoint_bytes(model: Any, opt: Any) -> int:
    """What a full checkpoint of this rank's state holds now: every tensor of the model and of the optimizer state
    (what ``exact`` writes, less the objects' headers): the baseline the plot measures each policy against."""
    import torch  # lazy: the worker's torch, loaded there already (the launcher needs none)

    tensors = list(model.state_dict().values())
    tensors += [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


# -- the launcher ----------------------------------------------------------------------------
def _read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line cut by a kill
    return out


def _run_phase(base: dict[str, Any], phase: int, out: Path, progress: Any, task: Any) -> list[int]:
    """Run every rank of one phase; return their exit codes (a killed rank: -9)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    root = str(Path(__file__).resolve().parents[2])  # the folder holding the tierstore package
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    port = free_port()
    procs = []
    for r in range(base["world"]):
        cfg = dict(base, rank=r, phase=phase, port=port, events=str(out / f"rank{r}.phase{phase}.jsonl"))
        Path(cfg["events"]).unlink(missing_ok=True)
        log = open(out / f"rank{r}.phase{phase}.log", "w")
        procs.append(subprocess.Popen([sys.executable, "-m", "tierstore.cli.demo", "--worker", json.dumps(cfg)],
                                      stdout=log, stderr=subprocess.STDOUT, env=env))
        log.close()
    deadline = time.monotonic() + _PHASE_TIMEOUT_S
    failed_at: float | None = None
    while any(p.poll() is None for p in procs):
        done = [e for e in _read_events(out / f"rank0.phase{phase}.jsonl") if e["event"] == "step"]
        if done:
            progress.update(task, completed=done[-1]["step"] + 1)
        if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
            failed_at = time.monotonic()
        if (failed_at is not None and time.monotonic() - failed_at > 1.0) or time.monotonic() > deadline:
            for p in procs:  # the job failed: stop the survivors, as a launcher does
                if p.poll() is None:
                    p.kill()
        time.sleep(0.1)
    return [p.wait() for p in procs]


def _tail(path: Path, n: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else "(no log)"


def _collect(store: Any, model: str, ev: dict[int, dict[int, list[dict]]], world: int, policy: str, kill_at: int,
             out: Path) -> dict[str, Any]:
    """The summary's figures from every rank's events (``ev[phase][rank]``) and the index."""
    victim = world - 1

    def of(phase: int, event: str, rank: int | None = None) -> list[dict]:
        ranks = range(world) if rank is None else [rank]
        return [e for r in ranks for e in ev.get(phase, {}).get(r, []) if e["event"] == event]

    steps0, steps1 = of(0, "step"), of(1, "step")
    restores = {r: next(iter(of(1, "restore", r)), {}) for r in range(world)}
    kill = next(iter(of(0, "kill", victim)), {})
    stalls = [e["stall_s"] for e in steps0 + steps1]
    steps = {s: st for s, st in store.steps.steps(model)}
    t_save = {e["step"]: e["t_save"] for e in of(0, "step", 0) + of(1, "step", 0)}  # rank 0's newest save
    commit = []
    for rec in store.steps.records(model, list(steps)):
        if rec.state in ("committed", "durable") and rec.decided is not None and rec.step in t_save:
            lat = rec.decided - t_save[rec.step]
            commit.append(lat if lat >= 0 else rec.commit_latency_s)
    aborted = {row["step"]: row["reason"] for row in V.steps_view(store, model) if row["state"] == "aborted"}
    per_step: dict[int, dict[str, int]] = {}
    for row in V.steps_view(store, model):
        kinds: dict[str, int] = {}
        for rec in store.index.get_objects(store.list(model, step=row["step"])):
            if rec is not None:
                kinds[rec.kind] = kinds.get(rec.kind, 0) + rec.size
        per_step[row["step"]] = kinds
    full: dict[int, int] = {}  # a full checkpoint of the state each step saved, all ranks (the saves that made it)
    for phase in (0, 1):
        by_step: dict[int, int] = {}
        for e in of(phase, "step"):
            by_step[e["step"]] = by_step.get(e["step"], 0) + int(e.get("full_bytes") or 0)
        full.update(by_step)
    loss0 = {e["step"]: e["loss"] for e in of(0, "step", 0)}
    loss1 = {e["step"]: e["loss"] for e in of(1, "step", 0)}
    replayed = sorted(set(loss0) & set(loss1))
    same = all({e["step"]: e["loss"] for e in of(0, "step", r)}.get(s) ==
               {e["step"]: e["loss"] for e in of(1, "step", r)}.get(s)
               for r in range(world) for s in sorted({e["step"] for e in of(0, "step", r)} &
                                                      {e["step"] for e in of(1, "step", r)}))
    done = of(1, "done")
    baseline = of(1, "torch_save")  # what torch.save and torch.load of the same state took, per rank
    saves = [x for e in baseline for x in e["save_s"]]
    loads = [statistics.median(e["load_s"]) for e in baseline if e["load_s"]]

    def med(xs: list[float]) -> float | None:
        return statistics.median(xs) if xs else None

    restore = restores.get(0, {})
    tiers: dict[str, int] = {}
    for r in restores.values():
        for t, n in (r.get("tiers") or {}).items():
            tiers[t] = tiers.get(t, 0) + n
    seconds = [r["seconds"] for r in restores.values() if r.get("seconds") is not None]
    return {
        "model": model, "policy": policy, "world": world, "kill_at": kill_at, "killed_rank": victim,
        "steps_committed": sum(1 for st in steps.values() if st in ("committed", "durable")),
        "steps_durable": sum(1 for st in steps.values() if st == "durable"),
        "steps_aborted": aborted,
        "stall_s": {"median": med(stalls), "max": max(stalls) if stalls else None, "n": len(stalls)},
        "commit_latency_s": {"median": med(commit), "max": max(commit) if commit else None, "n": len(commit)},
        "bytes_per_tier": {f"{r['tier']}/{r['kind']}": r["bytes"] for r in V.du_view(store, model)},
        "ranks_reporting": len(done),
        "torch_save": {"where": baseline[0]["where"] if baseline else None,
                       "filesystem": baseline[0]["filesystem"] if baseline else None,
                       "repeats": len(baseline[0]["save_s"]) if baseline else 0,
                       "bytes": sum(e["bytes"] for e in baseline),
                       "save_s": {"median": med(saves), "max": max(saves) if saves else None, "n": len(saves)},
                       "load_s": {"seconds": max(loads) if loads else None, "n": len(loads)}},
        "restore": {"step": restore.get("step"), "seconds": max(seconds) if seconds else None, "tiers": tiers,
                    "steps_by_rank": {r: v.get("step") for r, v in restores.items()}},
        "loss_before": loss0.get(max(loss0)) if loss0 else None,
        "loss_at_kill": kill.get("loss"),
        "loss_after": loss1.get(min(loss1)) if loss1 else None,
        "loss_final": loss1.get(max(loss1)) if loss1 else None,
        "replayed_steps": replayed,
        "replay_bitwise": bool(replayed) and same,
        "loss_curve": {"phase0": sorted(loss0.items()), "phase1": sorted(loss1.items())},
        "bytes_per_step": {s: k for s, k in sorted(per_step.items())},
        "full_bytes_per_step": {s: full[s] for s in sorted(per_step) if s in full},
        "plot": str(out / "demo.png"),
    }


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _print_summary(s: dict[str, Any]) -> None:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.1f} ms"

    f = s["figures"]  # the numbers the plot draws too (tierstore.cli.demo_plot.figures)
    ts = s["torch_save"]
    t = Table(title="tierstore demo summary", title_justify="left", show_header=False)
    t.add_column("figure")
    t.add_column("value")
    t.add_row("model / policy / ranks", f"{s['model']} / {s['policy']} / {s['world']}")
    t.add_row("stall per save (median, max)", f"{f['stall_median']}, {f['stall_max']}")
    t.add_row("torch.save of the same state (median, max)",
              f"{f['torch_save_median']}, {f['torch_save_max']} ({ts['repeats']} per rank, a file in "
              f"{ts['filesystem']})" if ts["repeats"] else "not measured (--compare-repeats 0)")
    t.add_row("commit latency (median, max)",
              f"{ms(s['commit_latency_s']['median'])}, {ms(s['commit_latency_s']['max'])}")
    for k, v in sorted(s["bytes_per_tier"].items()):
        t.add_row(f"bytes in {k}", human_bytes(v))
    t.add_row(f"written vs full checkpoints (steps {f['steps']}, {_plural(s['world'], 'rank')})",
              f"{f['written']} vs {f['full']} ({f['smaller']} smaller; refs {f['refs']})")
    t.add_row("steps committed / durable", f"{s['steps_committed']} / {s['steps_durable']}")
    r = s["restore"]
    t.add_row("failure", f"rank {s['killed_rank']} killed at step {s['kill_at']}")
    for step, reason in sorted(s["steps_aborted"].items()):
        t.add_row(f"step {step}", f"aborted: {reason or '-'}")
    tiers = ", ".join(f"{_plural(n, 'object')} from {tier}" for tier, n in sorted(r["tiers"].items())) or "-"
    t.add_row(f"restore ({_plural(s['world'], 'rank')})", f"step {r['step']} in {f['restore']}: {tiers}")
    t.add_row("torch.load + load_state_dict of that file (slowest rank, median)",
              f["torch_load"] if ts["repeats"] else "not measured (--compare-repeats 0)")
    curve = s["loss_curve"]
    at = [curve["phase0"][-1][0] if curve["phase0"] else "-", curve["phase1"][0][0] if curve["phase1"] else "-",
          curve["phase1"][-1][0] if curve["phase1"] else "-"]
    t.add_row(f"loss before failure / after restore / final (steps {at[0]} / {at[1]} / {at[2]})",
              " / ".join("-" if x is None else f"{x:.4f}" for x in (s["loss_before"], s["loss_after"], s["loss_final"])))
    t.add_row("replayed steps reproduce the lost run bitwise (every rank)",
              f"{'yes' if s['replay_bitwise'] else 'no'} ({_plural(len(s['replayed_steps']), 'step')})")
    t.add_row("plot", s["plot"])
    Console(width=None if sys.stdout.isatty() else 140).print(t)


def _torchrun_rank(a: argparse.Namespace) -> int:
    """One rank of a torchrun job (the docker-compose testbed): the store comes from ``TIERSTORE_*``."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"home": a.home or os.environ.get("TIERSTORE_HOME") or ".tierstore", "redis": a.redis, "durable": a.s3,
           "s3_endpoint": a.s3_endpoint, "host_root": a.host_root, "steps": a.steps, "world": world, "rank": rank,
           "phase": 1, "port": None, "policy": a.policy, "model": a.model_name or "demo", "batch_size": a.batch_size,
           "seed": a.seed, "events": str(out / f"rank{rank}.jsonl")}
    Path(cfg["events"]).unlink(missing_ok=True)
    rc = _worker(cfg)
    ev = _read_events(Path(cfg["events"]))
    restore = next((e for e in ev if e["event"] == "restore"), {})
    steps = [e for e in ev if e["event"] == "step"]
    print(f"rank {rank}/{world}: restored step {restore.get('step')} from {restore.get('tiers') or '-'} in "
          f"{(restore.get('seconds') or 0) * 1e3:.0f} ms; trained to step {steps[-1]['step'] if steps else '-'}, "
          f"loss {steps[-1]['loss'] if steps else float('nan'):.4f}", flush=True)
    return rc


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if a.worker:
        return _worker(json.loads(a.worker))
    if a.torchrun:
        return _torchrun_rank(a)
    if a.steps < 3 or a.ranks < 1:
        print("tierstore demo: --steps must be >= 3 and --ranks >= 1", file=sys.stderr)
        return 2
    kill_at = a.steps // 2 if a.kill_at is None else a.kill_at
    if a.compare_repeats < 0:
        print("tierstore demo: --compare-repeats must be >= 0", file=sys.stderr)
        return 2
    if not 1 <= kill_at < a.steps - 1:
        print(f"tierstore demo: --kill-at must be in 1..{a.steps - 2}", file=sys.stderr)
        return 2
    make_policy(a.policy)  # fail early on a bad name

    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    home = a.home or os.environ.get("TIERSTORE_HOME") or ".tierstore"
    base = {"home": str(Path(home).resolve()), "redis": a.redis, "durable": a.s3, "s3_endpoint": a.s3_endpoint,
            "host_root": a.host_root, "steps": a.steps, "world": a.ranks, "kill_at": kill_at, "policy": a.policy,
            "model": a.model_name or f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}",
            "batch_size": a.batch_size, "seed": a.seed, "compare_repeats": a.compare_repeats}
    store = _open_store(base, migrate=False)  # starts the embedded server before the ranks race to
    try:
        events: dict[int, dict[int, list[dict]]] = {}
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=__import__("rich.console").console.Console(stderr=True)) as progress:
            for phase, what in ((0, f"training until rank {a.ranks - 1} dies at step {kill_at}"),
                                (1, "restarted: restore and continue")):
                total = kill_at + 1 if phase == 0 else a.steps  # phase 0 ends at the kill
                task = progress.add_task(what, total=total)
                codes = _run_phase(base, phase, out, progress, task)
                events[phase] = {r: _read_events(out / f"rank{r}.phase{phase}.jsonl") for r in range(a.ranks)}
                ok = codes == [0] * a.ranks if phase == 1 else codes[-1] == -signal.SIGKILL
                if not ok:
                    bad = next((r for r, c in enumerate(codes) if c not in (0, -signal.SIGKILL)), 0)
                    print(f"tierstore demo: phase {phase} failed (exit codes {codes}); rank {bad} log:\n"
                          f"{_tail(out / f'rank{bad}.phase{phase}.log')}", file=sys.stderr)
                    return 1
                progress.update(task, completed=total)
        summary = _collect(store, base["model"], events, a.ranks, a.policy, kill_at, out)
        from tierstore.cli.demo_plot import figures  # lazy: as draw()

        summary["figures"] = figures(summary)  # the one source of the numbers the summary prints and the plot draws
        summary["plot"] = draw(summary, out / "demo.png")
        if not a.keep_all:
            summary["gc"] = store.gc(base["model"], Retention(keep_last=2), dry_run=False).to_json()
            summary["gc"].pop("deleted")
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        _print_summary(summary)
        print(f"inspect it: tierstore admin --home {home} steps {base['model']}")
        if a.redis is None and a.host_root is None:
            print(f"its state: the index and durable tier in {base['home']}, the host tier in "
                  f"{Path(store.config.host_root).parent}; remove it all with: tierstore server stop --purge --home {home}")
        elif a.redis is None:
            print(f"its state: the index and durable tier in {base['home']} (remove them with: tierstore server stop "
                  f"--purge --home {home}); the host tier in {a.host_root}, which --host-root named, is yours to remove")
    finally:
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
