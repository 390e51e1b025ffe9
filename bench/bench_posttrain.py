"""Post-training: bytes per step of each checkpoint policy, iteration time against exact, post-restore loss.

The workload (issue 15 item 6): the demo GPT (:mod:`tierstore.testing.gpt`)
is pretrained on one corpus (the standard library's Python sources, lr 3e-3),
then fine-tuned on another (English prose: the documentation topics shipped in
``pydoc_data/topics.py``) at a lower learning rate with a schedule (linear
warm-up, cosine decay to a tenth), ``--steps`` fine-tuning steps, a save after
every step. Every policy fine-tunes its own copy of the pretrained state, on
the same batches, so all trajectories are bitwise the same.

Policies run in alternating chunks of ``--chunk`` steps (exact first in each
round); a chunk ends with ``wait()`` so no policy's background work runs
during another's chunk, and that wait counts as the chunk's time. The
*iteration time* of a policy is its chunks' wall time (train step + save +
the final wait) per step: median of its chunks, min-max.

After the last step each policy's newest committed state is restored into a
fresh model, optimizer and scheduler; the original and the restored copy
train ``--after`` more steps side by side without saving: the *post-restore
deviation* is ``max |loss_restored - loss| / loss`` over those steps.

Figures per policy (one rank, where dedup has nothing to share: see ``bench.bench_policies`` for 2 ranks):

* bytes/step: bytes of the objects written to the host tier, per fine-tuning step;
  ``x fewer`` = exact's bytes/step over the policy's;
* objects written: full / delta;
* iteration ms and its ratio to exact's in the same run;
* per layer (differential): the payoff's decision, averaged delta ratio and encode CPU
  (:mod:`tierstore.train.payoff`), and how far the layer moves per step.

Run: ``python -m bench.bench_posttrain`` (default: d_model 128, 4 layers,
200 pretraining + 200 fine-tuning steps, a few minutes on 2 shared cores);
``--d-model 256 --pretrain 1000`` for a larger run. ``--json PATH`` writes the figures.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import sysconfig
import tempfile
import time
from typing import Any

import torch

import tierstore
from tierstore.embedded import stop_server
from tierstore.testing.gpt import GPTConfig, char_dataset, get_batch, make_model, setup_determinism, train_step
from tierstore.train import policies as P
from tierstore.train.checkpointer import Checkpointer
from tierstore.train.layers import default_layer_fn


def prose_dataset(max_bytes: int = 1 << 20) -> torch.Tensor:
    """Tokens (int64, 0..127) of the English documentation topics in ``pydoc_data/topics.py``."""
    path = os.path.join(sysconfig.get_paths()["stdlib"], "pydoc_data", "topics.py")
    with open(path, "rb") as f:
        raw = f.read(max_bytes)
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()
    return torch.where(data < 128, data, torch.full_like(data, ord("?"))).long()


def policies(a: argparse.Namespace) -> dict[str, P.Policy]:
    lw = P.layerwise(tau=a.tau, max_staleness=a.staleness)
    diff = P.differential(base_every=a.base_every)
    return {
        "exact": P.exact(),
        "differential": diff,
        "differential (no payoff)": P.differential(base_every=a.base_every, payoff=None),
        "layerwise": lw,
        "layerwise+differential": P.compose(lw, diff),
    }


def schedule(opt: torch.optim.Optimizer, steps: int, warmup: int) -> torch.optim.lr_scheduler.LambdaLR:
    def f(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (s - warmup) / max(1, steps - warmup))))

    return torch.optim.lr_scheduler.LambdaLR(opt, f)


def _job(cfg: GPTConfig, pre: dict[str, Any], a: argparse.Namespace):
    model, opt = make_model(cfg, seed=0, lr=a.lr)
    model.load_state_dict(pre["model"])
    opt.load_state_dict(copy.deepcopy(pre["optim"]))  # load_state_dict keeps the given tensors: no sharing
    for g in opt.param_groups:
        g["lr"] = g["initial_lr"] = a.lr
    sched = schedule(opt, a.steps, a.warmup)
    return model, opt, sched


def _layer_motion(model: torch.nn.Module, prev: dict[str, torch.Tensor], acc: dict[str, list[float]]) -> None:
    """Per layer: ||W - W_prev|| / ||W_prev|| of this step (the parameters)."""
    num: dict[str, float] = {}
    den: dict[str, float] = {}
    for n, p in model.named_parameters():
        ln = default_layer_fn(n)
        num[ln] = num.get(ln, 0.0) + float((p.detach().double() - prev[n].double()).pow(2).sum())
        den[ln] = den.get(ln, 0.0) + float(prev[n].double().pow(2).sum())
        prev[n] = p.detach().clone()
    for ln in num:
        acc.setdefault(ln, []).append((num[ln] / den[ln]) ** 0.5 if den[ln] else 0.0)


def run(a: argparse.Namespace) -> dict[str, Any]:
    setup_determinism(0)
    cfg = GPTConfig(d_model=a.d_model, n_layer=a.n_layer, n_head=a.n_head, block=a.block)
    code, prose = char_dataset(), prose_dataset()
    # pretraining (not checkpointed: the fine-tuning is the workload)
    t0 = time.perf_counter()
    model, opt = make_model(cfg, seed=0, lr=a.pretrain_lr)
    pre_losses = [train_step(model, opt, *get_batch(code, s, 0, a.batch, cfg.block, 0)) for s in range(a.pretrain)]
    pre = copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict()})
    pretrain_s = time.perf_counter() - t0
    nparams = sum(p.numel() for p in model.parameters())

    with tempfile.TemporaryDirectory(prefix="bench-posttrain-") as tmp:
        home = os.path.join(tmp, "home")
        try:
            store = tierstore.open(home=home)
            jobs: dict[str, dict[str, Any]] = {}
            for i, (name, pol) in enumerate(policies(a).items()):
                m, o, s = _job(cfg, pre, a)
                ck = Checkpointer(store, f"ft{i}", state={"model": m, "optim": o, "sched": s}, policy=pol)
                jobs[name] = {"model": m, "opt": o, "sched": s, "ck": ck, "chunks": [], "losses": []}
            motion: dict[str, list[float]] = {}
            prev = {n: p.detach().clone() for n, p in jobs["exact"]["model"].named_parameters()}
            for start in range(0, a.steps, a.chunk):
                stop = min(a.steps, start + a.chunk)
                for name, j in jobs.items():
                    t = time.perf_counter()
                    for step in range(start, stop):
                        x, y = get_batch(prose, step, 0, a.batch, cfg.block, 1)
                        j["losses"].append(train_step(j["model"], j["opt"], x, y))
                        j["sched"].step()
                        j["ck"].save(step)
                    state = j["ck"].wait()
                    j["chunks"].append((time.perf_counter() - t) / (stop - start))
                    if state != "committed":
                        raise RuntimeError(f"{name}: step {stop - 1} {state}")
                # layer motion over the chunk, from the exact copy, outside the timed chunks
                _layer_motion(jobs["exact"]["model"], prev, motion)
            rows: dict[str, dict[str, Any]] = {}
            for name, j in jobs.items():
                ck = j["ck"]
                st = ck.stats.as_dict()
                payoff = ck.plan.payoff_report()
                ck.close()
                m2, o2, s2 = _job(cfg, pre, a)
                ck2 = Checkpointer(store, ck.model, state={"model": m2, "optim": o2, "sched": s2}, policy=ck.policy)
                t = time.perf_counter()
                restored = ck2.restore().step
                restore_s = time.perf_counter() - t
                ck2.close()
                dev = 0.0
                for step in range(a.steps, a.steps + a.after):
                    x, y = get_batch(prose, step, 0, a.batch, cfg.block, 1)
                    lo = train_step(j["model"], j["opt"], x, y)
                    j["sched"].step()
                    lr_ = train_step(m2, o2, x, y)
                    s2.step()
                    dev = max(dev, abs(lr_ - lo) / lo)
                rows[name] = {
                    "bytes_per_step": st["bytes"] / a.steps,
                    "logical_bytes_per_step": st["logical_bytes"] / a.steps,
                    "objects": st["objects"],
                    "layers_saved": st["layers_saved"],
                    "iter_ms_median": 1e3 * statistics.median(j["chunks"]),
                    "iter_ms_min": 1e3 * min(j["chunks"]),
                    "iter_ms_max": 1e3 * max(j["chunks"]),
                    "restored_step": restored,
                    "restore_ms": 1e3 * restore_s,
                    "deviation": dev,
                    "payoff": payoff,
                    "final_loss": j["losses"][-1],
                }
            store.close()
        finally:
            stop_server(home)  # the embedded index server the run started
    return {
        "args": vars(a), "params": nparams, "pretrain_s": pretrain_s,
        "pretrain_loss": [pre_losses[0], pre_losses[-1]],
        "finetune_loss": [jobs["exact"]["losses"][0], jobs["exact"]["losses"][-1]],
        "motion": {ln: statistics.median(v) for ln, v in sorted(motion.items())},
        "rows": rows,
        "uptime": open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else None,
    }


def report(r: dict[str, Any]) -> str:
    a = r["args"]
    rows = r["rows"]
    ex = rows["exact"]
    out = [
        (f"GPT d_model={a['d_model']} n_layer={a['n_layer']} ({r['params']:,} params, fp32 + AdamW), 1 rank; "
        f"pretrain {a['pretrain']} steps on Python sources (loss {r['pretrain_loss'][0]:.2f} -> "
        f"{r['pretrain_loss'][1]:.2f}), fine-tune {a['steps']} steps on English prose at lr {a['lr']} "
        f"(warm-up {a['warmup']}, cosine to 0.1x; loss {r['finetune_loss'][0]:.2f} -> {r['finetune_loss'][1]:.2f}), "
        f"a save every step; layerwise tau={a['tau']} S={a['staleness']}; differential base every "
        f"{a['base_every']}; deviation over {a['after']} steps after restore; load {r['uptime']}"),
        "",
        ("| policy | bytes/step | x fewer than exact | objects full/delta | iteration ms median (min-max) "
        "| x exact | restore ms | post-restore deviation |"),
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for n, row in rows.items():
        o = row["objects"]
        out.append(
            f"| {n} | {row['bytes_per_step']:,.0f} | {ex['bytes_per_step'] / row['bytes_per_step']:.1f} | "
            f"{o.get('full', 0)}/{o.get('delta', 0)} | {row['iter_ms_median']:.1f} "
            f"({row['iter_ms_min']:.1f}-{row['iter_ms_max']:.1f}) | "
            f"{row['iter_ms_median'] / ex['iter_ms_median']:.2f} | {row['restore_ms']:.0f} | {row['deviation']:.3%} |"
        )
    pay = rows["differential"]["payoff"] or {}
    out += ["", (f"| layer | median relative change per {a['chunk']} steps | differential: mode | delta ratio | encode CPU ms "
                "| deltas / staged fulls / direct fulls |"), "| --- | ---: | --- | ---: | ---: | --- |"]
    for ln, mv in r["motion"].items():
        p = pay.get(ln, {})
        out.append(f"| {ln} | {mv:.2e} | {p.get('mode')} | {p.get('ratio')} | {p.get('cpu_ms')} | "
                   f"{p.get('deltas')} / {p.get('staged_fulls')} / {p.get('direct_fulls')} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pretrain", type=int, default=200, help="pretraining steps (lr --pretrain-lr)")
    p.add_argument("--pretrain-lr", type=float, default=3e-3)
    p.add_argument("--steps", type=int, default=200, help="fine-tuning steps, a save after each")
    p.add_argument("--lr", type=float, default=3e-4, help="fine-tuning peak learning rate")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--after", type=int, default=10, help="steps compared after the restore")
    p.add_argument("--chunk", type=int, default=10, help="steps per policy before the next one runs")
    p.add_argument("--tau", type=float, default=0.02)
    p.add_argument("--staleness", type=int, default=50)
    p.add_argument("--base-every", type=int, default=20)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--json", help="write the figures here too")
    a = p.parse_args(argv)
    r = run(a)
    print(report(r))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
