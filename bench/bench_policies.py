"""Bytes persisted per step by each checkpoint policy, on a 2-rank GPT training run.

One run, two gloo ranks, one embedded store. Each rank trains one model copy
per policy in lock-step (same data, same seeds), each with its own
Checkpointer, saving at every step. Afterwards each policy's state is
restored into a fresh copy, and original and restored copy train ``--after``
more steps side by side (no saving): the post-restore loss deviation.

Figures per policy (sums over both ranks, per training step):

* ``stored``: bytes of the objects as written to the host tier (``ObjectRecord.size``);
* ``lz4``: the same objects encoded with ``codec.encode(compress="auto")``,
  i.e. what a tier that compresses where it pays would hold (measured after
  the run by re-encoding each stored object as it is stored, raw);
* ``save()``: median time the training loop spent in ``save()`` (the stall
  seen by the caller; includes waiting for the previous save's background work).

Run: ``python -m bench.bench_policies [--steps 200] [--tau 0.02] [--staleness 4]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

from tierstore.embedded import stop_server
from tierstore.ports import free_port


def _policies(a: argparse.Namespace):
    from tierstore.train import policies as P

    return {
        "full (exact)": P.exact(),
        "layerwise": P.layerwise(tau=a.tau, max_staleness=a.staleness),
        "differential": P.differential(base_every=a.base_every),
        "dedup": P.dedup(),
        "layerwise+differential+dedup": P.compose(
            P.layerwise(tau=a.tau, max_staleness=a.staleness), P.differential(base_every=a.base_every), P.dedup()
        ),
    }


def _rank(rank: int, world: int, port: int, home: str, out: str, a: argparse.Namespace) -> None:
    import torch.distributed as dist

    import tierstore
    from tierstore import codec
    from tierstore.testing.gpt import (
        GPTConfig,
        char_dataset,
        get_batch,
        make_model,
        setup_determinism,
        train_step,
    )
    from tierstore.train.checkpointer import Checkpointer

    setup_determinism(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    store = tierstore.open(home=home)
    cfg = GPTConfig(d_model=a.d_model)
    data = char_dataset()
    jobs = {}
    for i, (name, pol) in enumerate(_policies(a).items()):
        model, opt = make_model(cfg, seed=0)
        ck = Checkpointer(store, f"bench{i}", model, opt, pol, keep_last=None)  # every step stays for the bytes column
        ck.restore()
        jobs[name] = {"model": model, "opt": opt, "ck": ck, "save_s": []}
    t0 = time.perf_counter()
    for step in range(a.steps):
        x, y = get_batch(data, step, rank, a.batch, cfg.block, 0)
        for j in jobs.values():
            train_step(j["model"], j["opt"], x, y, world)
            t = time.perf_counter()
            j["ck"].save(step)
            j["save_s"].append(time.perf_counter() - t)
    train_s = time.perf_counter() - t0
    res = {}
    for name, j in jobs.items():
        assert j["ck"].wait() == "committed"
        j["ck"].close()
        # restore into a fresh copy; both continue without saving
        m2, o2 = make_model(cfg, seed=1)
        ck2 = Checkpointer(store, j["ck"].model, m2, o2, j["ck"].policy)
        restored, _ = ck2.restore()
        ck2.close()
        dev = 0.0
        for step in range(restored + 1, restored + 1 + a.after):
            x, y = get_batch(data, step, rank, a.batch, cfg.block, 0)
            lo = train_step(j["model"], j["opt"], x, y, world)
            lr = train_step(m2, o2, x, y, world)
            dev = max(dev, abs(lr - lo) / lo)
        st = j["ck"].stats.as_dict()
        res[name] = {"stats": st, "save_med_ms": 1e3 * statistics.median(j["save_s"]), "dev": dev,
                     "restored": restored, "model": j["ck"].model}
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump({"res": res, "train_s": train_s}, f)
    dist.barrier()
    if rank == 0:  # re-encode every stored object as stored (raw) to measure what lz4 would hold
        lz = {}
        for name, r in res.items():
            total = 0
            for key in store.list(r["model"]):
                shard = store.get(key, raw=True)
                if shard is not None:
                    total += len(codec.encode(shard.tensors, shard.metadata, compress="auto"))
            lz[name] = total
        with open(f"{out}.lz4.json", "w") as f:
            json.dump(lz, f)
    dist.barrier()
    store.close()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--after", type=int, default=50, help="steps compared after the restore")
    p.add_argument("--tau", type=float, default=0.02)
    p.add_argument("--staleness", type=int, default=4)
    p.add_argument("--base-every", type=int, default=20)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--json", help="write the results here too")
    a = p.parse_args(argv)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="bench-policies-") as tmp:
        port = free_port()
        out = os.path.join(tmp, "out")
        mp.start_processes(_rank, args=(2, port, os.path.join(tmp, "home"), out, a), nprocs=2, start_method="spawn")
        stop_server(os.path.join(tmp, "home"))  # the embedded index server the ranks shared
        ranks = [json.load(open(f"{out}.{r}.json")) for r in range(2)]
        lz = json.load(open(f"{out}.lz4.json"))
    names = list(ranks[0]["res"])
    rows = {}
    for n in names:
        stored = sum(r["res"][n]["stats"]["bytes"] for r in ranks) / a.steps
        objs = {k: sum(r["res"][n]["stats"]["objects"][k] for r in ranks) for k in ("full", "delta", "ref")}
        rows[n] = {
            "stored_per_step": stored,
            "lz4_per_step": lz[n] / a.steps,
            "objects": objs,
            "save_med_ms": max(r["res"][n]["save_med_ms"] for r in ranks),
            "deviation": max(r["res"][n]["dev"] for r in ranks),
            "restored": ranks[0]["res"][n]["restored"],
        }
    base = rows[names[0]]
    print(f"\n2 ranks (gloo), GPT d_model={a.d_model}, {a.steps} steps, a save every step; "
          f"layerwise tau={a.tau} S={a.staleness}; differential base every {a.base_every}; "
          f"deviation = max |loss_restored - loss| / loss over {a.after} steps after restore\n")
    print("| policy | bytes/step stored | x smaller | bytes/step lz4 | x smaller (vs full stored) | objects full/delta/ref | save() median ms | post-restore deviation |")
    print("| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |")
    for n, r in rows.items():
        o = r["objects"]
        print(f"| {n} | {r['stored_per_step']:,.0f} | {base['stored_per_step'] / r['stored_per_step']:.1f} | "
              f"{r['lz4_per_step']:,.0f} | {base['stored_per_step'] / r['lz4_per_step']:.1f} | "
              f"{o['full']}/{o['delta']}/{o['ref']} | {r['save_med_ms']:.1f} | {r['deviation']:.3%} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
