"""Gradient-log checkpoints (``replay``) against the Checkpointer's policies, same run.

Part 1: one process trains one copy of the char-level GPT per policy in
lock-step (same data), each saving every step into the same embedded store:
``exact``, ``differential`` (base every ``--base-every``), ``layerwise``
(tau 0.02, staleness ``--base-every``) through the Checkpointer, and
``replay`` (base every ``--base-every``), all through the one Checkpointer.
Reported: bytes written per step (median, mean) and the ratio to ``exact``.

Part 2: restore time as a function of the chain length L: a job saves a base
and L log steps, a fresh model restores it (base load + L replayed,
digest-verified steps). Reported: base load, replay time per logged step,
and the time of one forward+backward+step of the same model for comparison.

    python -m bench.bench_replay [--steps 30] [--base-every 10] [--chains 0,4,8,16,32]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import tierstore
from tierstore.embedded import stop_server
from tierstore.testing.gpt import (
    GPTConfig,
    char_dataset,
    get_batch,
    make_model,
    setup_determinism,
    train_step,
)
from tierstore.train import policies as P
from tierstore.train.checkpointer import Checkpointer


def bytes_per_step(store, cfg: GPTConfig, steps: int, base_every: int) -> None:
    data = char_dataset()
    jobs = {}
    for name, pol in (("exact", P.exact()), ("differential", P.differential(base_every=base_every)),
                      ("layerwise", P.layerwise(tau=0.02, max_staleness=base_every)), ("replay", None)):
        model, opt = make_model(cfg, seed=0)
        ck = Checkpointer(store, f"bench-{name}", model, opt, pol or P.replay(base_every=base_every))
        jobs[name] = (model, opt, ck)
    for step in range(steps):
        x, y = get_batch(data, step, 0, 8, cfg.block)
        for model, opt, ck in jobs.values():
            train_step(model, opt, x, y)
            ck.save(step)
    rows = {}
    for name, (_, _, ck) in jobs.items():
        ck.wait()
        ck.close()
        per = [ck.stats.per_step.get(s, 0) for s in range(steps)]
        rows[name] = (statistics.median(per), statistics.fmean(per), max(per))
    ex = rows["exact"][1]
    print(f"## bytes written per step ({steps} steps, base/staleness every {base_every}, "
          f"GPT {sum(p.numel() for p in jobs['exact'][0].parameters())} params, AdamW fp32)\n")
    print("| policy | median B/step | mean B/step | max B/step | mean / exact |\n| --- | --- | --- | --- | --- |")
    for name, (med, mean, mx) in rows.items():
        print(f"| {name} | {med:.0f} | {mean:.0f} | {mx:.0f} | {mean / ex:.3f} |")


def restore_vs_chain(store, cfg: GPTConfig, chains: list[int]) -> None:
    data = char_dataset()
    print("\n## restore through replay vs chain length\n")
    print("| chain L | restore s | base load s | replay s | replay per step ms | fwd+bwd+step ms | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for n in chains:
        model, opt = make_model(cfg, seed=0)
        rc = Checkpointer(store, f"chain-{n}", model, opt, P.replay(base_every=10_000))
        t_step = []
        for step in range(n + 1):
            x, y = get_batch(data, step, 0, 8, cfg.block)
            t0 = time.perf_counter()
            train_step(model, opt, x, y)
            t_step.append(time.perf_counter() - t0)
            rc.save(step)
        rc.wait()
        rc.close()
        store.flush()  # the restore below takes a new epoch: let the old writer's migration finish first
        m2, o2 = make_model(cfg, seed=1)
        rc2 = Checkpointer(store, f"chain-{n}", m2, o2, P.replay(base_every=10_000))
        t0 = time.perf_counter()
        step, _ = rc2.restore()
        rep = rc2.report
        total = time.perf_counter() - t0
        rc2.close()
        assert step == n and len(rep.replayed) == n and not rep.fell_back
        per = rep.replay_s / n * 1e3 if n else 0.0
        fb = statistics.median(t_step) * 1e3
        print(f"| {n} | {total:.3f} | {rep.base_s:.3f} | {rep.replay_s:.3f} | {per:.2f} | {fb:.2f} "
              f"| {per / fb if n else 0:.2f} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--base-every", type=int, default=10)
    ap.add_argument("--chains", default="0,4,8,16,32")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=64)
    a = ap.parse_args(argv)
    setup_determinism(0)
    cfg = GPTConfig(d_model=a.d_model, n_layer=a.layers)
    with tempfile.TemporaryDirectory() as home:
        try:
            with tierstore.open(home=home) as store:
                bytes_per_step(store, cfg, a.steps, a.base_every)
                restore_vs_chain(store, cfg, [int(c) for c in a.chains.split(",")])
        finally:
            stop_server(home)  # the embedded index server the run started


if __name__ == "__main__":
    main()
