"""``tierstore bench --durable``: time to durable on a local-directory durable tier, and the durable lag.

Two figures of BENCHMARKS.md, in one run, one process:

* **time to durable**: from ``save()`` to the step's durable manifest, with the
  durable tier a local directory, against the bound: a plain copy of the same
  bytes into the same kind of directory (each shard written to a temp file,
  fsynced, renamed, as the tier writes it), alternating rounds, medians and
  the ratio;
* **durable lag under a slow durable tier**: a save every ``--interval-ms``
  (the stand-in training step) while every durable put takes ``--slow-ms``
  longer; after each save, the lag in committed steps newer than the newest
  durable one and in seconds (:func:`consistency.steprecords.durable_lag`),
  median and max, and how many steps migration skipped.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import tierstore
from consistency.steprecords import durable_lag
from tierstore.embedded import stop_server
from tierstore.testing.faults import FaultPlan, FaultRule, install
from tierstore.train.checkpointer import Checkpointer

__all__ = ["run_durable"]


def _state(mib: float, layers: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n = int(mib * (1 << 20) / 4 / layers)
    return {f"l{i}": torch.randn(n, generator=g) for i in range(layers)}


def _plain_copy(state: dict[str, torch.Tensor], root: Path) -> float:
    """Seconds to write every tensor's bytes as its own file (temp, fsync, rename): the bound."""
    t0 = time.perf_counter()
    for name, t in state.items():
        d = root / name
        d.mkdir(parents=True, exist_ok=True)
        tmp, final = d / ".tmp~copy", d / "0"
        with open(tmp, "wb") as f:
            t.numpy().tofile(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return time.perf_counter() - t0


def _module(state: dict[str, torch.Tensor]) -> torch.nn.Module:
    m = torch.nn.Module()
    for name, t in state.items():
        m.register_parameter(name, torch.nn.Parameter(t.clone(), requires_grad=False))
    return m


def _open(home: Path, slow_s: float = 0.0) -> Any:
    store = tierstore.open(home, durable=f"file://{home / 'durable'}",
                           host_root=tempfile.mkdtemp(prefix="ts-bench-durable-", dir=_shm()))
    if slow_s:
        install(store, FaultPlan([FaultRule("backend.put@durable", "slow", delay_s=slow_s)]))
    return store


def _shm() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _time_to_durable(mib: float, layers: int, repeats: int, work: Path) -> dict[str, Any]:
    state = _state(mib, layers)
    store = _open(work / "ttd")
    module = _module(state)
    ck = Checkpointer(store, "ttd", module, keep_last=2, preallocate=True)
    ck.restore()
    ours, bound = [], []
    try:
        for r in range(repeats + 1):  # round 0 warms the pool and the page cache
            with torch.no_grad():
                for p in module.parameters():
                    p.add_(1.0)
            t0 = time.perf_counter()
            ck.save(r)
            ck.wait()
            store.flush()  # returns once the migration's callbacks ran: the durable manifest is written
            took = time.perf_counter() - t0
            assert store.steps.state("ttd", r) == "durable", store.steps.records("ttd", [r])
            copy_root = work / f"copy{r}"
            copy = _plain_copy(state, copy_root)
            shutil.rmtree(copy_root, ignore_errors=True)
            if r:
                ours.append(took)
                bound.append(copy)
    finally:
        ck.close()
        store.close()
        shutil.rmtree(store.host.root, ignore_errors=True)
    mo, mb = statistics.median(ours), statistics.median(bound)
    return {"mib": mib, "layers": layers, "tierstore_s": ours, "copy_s": bound, "median_s": mo,
            "copy_median_s": mb, "ratio": mo / mb}


def _lag(steps: int, interval_s: float, slow_s: float, mib: float, layers: int, work: Path) -> dict[str, Any]:
    store = _open(work / "lag", slow_s=slow_s)
    module = _module(_state(mib, layers))
    ck = Checkpointer(store, "lag", module, keep_last=3)
    ck.restore()
    lags, secs = [], []
    try:
        for s in range(steps):
            time.sleep(interval_s)  # the stand-in forward/backward
            with torch.no_grad():
                for p in module.parameters():
                    p.add_(1.0)
            ck.save(s)
            ck.wait()
            lag = durable_lag(store.steps.records("lag"), store.index.server_time())
            lags.append(lag.steps)
            secs.append(lag.seconds)
        skipped = store._migrator.skipped_steps if store._migrator is not None else 0
    finally:
        ck.close()
        store.close()
        shutil.rmtree(store.host.root, ignore_errors=True)
    return {"steps": steps, "interval_s": interval_s, "slow_put_s": slow_s, "layers": layers,
            "lag_steps_median": statistics.median(lags), "lag_steps_max": max(lags),
            "lag_s_median": statistics.median(secs), "lag_s_max": max(secs), "skipped_steps": skipped}


def run_durable(*, mib: float = 64.0, layers: int = 16, repeats: int = 3, lag_steps: int = 30,
                interval_ms: float = 50.0, slow_ms: float = 20.0) -> tuple[dict[str, Any], str]:
    """Both figures; returns ``(results, markdown)``."""
    work = Path(tempfile.mkdtemp(prefix="ts-bench-durable-"))
    try:
        ttd = _time_to_durable(mib, layers, repeats, work)
        lag = _lag(lag_steps, interval_ms / 1e3, slow_ms / 1e3, mib / 4, layers, work)
    finally:
        for home in (work / "ttd", work / "lag"):
            try:
                stop_server(home)
            except Exception as e:  # noqa: BLE001 - best effort: a server that never started
                print(f"could not stop the benchmark's index server in {home}: {e}")
        shutil.rmtree(work, ignore_errors=True)
    md = "\n".join([
        (f"time to durable (local directory, {mib:g} MiB in {layers} layers, exact, {repeats} rounds): "
        f"tierstore {ttd['median_s'] * 1e3:.0f} ms, plain copy of the same bytes {ttd['copy_median_s'] * 1e3:.0f} ms: "
        f"{ttd['ratio']:.2f}x the copy"),
        (f"durable lag, a save every {interval_ms:g} ms, every durable put {slow_ms:g} ms slower, {lag_steps} saves "
        f"of {mib / 4:g} MiB in {layers} layers: median {lag['lag_steps_median']:g} step(s) "
        f"({lag['lag_s_median']:.2f} s), max {lag['lag_steps_max']} step(s) ({lag['lag_s_max']:.2f} s); "
        f"{lag['skipped_steps']} intermediate step(s) skipped by migration"),
    ])
    return {"time_to_durable": ttd, "lag": lag}, md
