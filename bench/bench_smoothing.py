"""Smoothed checkpoint I/O (LayerCheck): bytes written per step with and without staggering.

A 200-step run is simulated with the real layer sizes of the char-level GPT
(``tierstore.train.layers.StateMap`` of the model and an AdamW that has stepped:
weights, buffers, exp_avg, exp_avg_sq per layer) and the policy decisions of
:mod:`tierstore.train.stagger`:

* ``layerwise``: each layer is saved when the staleness bound forces it
  (``forced_save``) or, voluntarily, when its change exceeds tau, modelled as
  a seeded per-layer probability (``--busy``: the fraction of layers that
  change fast, saved with probability 0.5 per step; the others are quiet);
* ``differential``: per layer a base (full shard) on its base steps, a delta
  of ``--delta-frac`` of the shard otherwise;
* ``replay``: a base of each layer on its base steps (staggered: per layer,
  valid since SGD/Adam/AdamW update parameters elementwise), and every step
  the gradient log (4 bytes per parameter).

Flat: every layer on the same slot (all at step 0 mod period). Staggered:
``balanced_slots`` by bytes (and ``stagger_first`` for the first saves).
Printed: max, p95, mean bytes per step and peak-to-mean over the whole run
and in steady state (after the first period); a PNG of bytes per step.

    python -m bench.bench_smoothing [--steps 200] [--period 10] [--layers 12] [--png bench_smoothing.png]
"""

from __future__ import annotations

import argparse
import random

import numpy as np
import torch

from tierstore.testing.gpt import GPTConfig, make_model
from tierstore.train.layers import PARAM, StateMap
from tierstore.train.stagger import balanced_slots, forced_save, is_base_step


def layer_sizes(cfg: GPTConfig) -> tuple[list[str], list[int], list[int]]:
    """(layer names, shard bytes, parameter bytes) of the GPT with AdamW state."""
    model, opt = make_model(cfg, seed=0)
    model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)).backward()
    opt.step()
    sm = StateMap(model, opt)
    names = sorted(sm.layers)
    full = [sum(t.numel() * t.element_size() for t in sm.layer_tensors(n).values()) for n in names]
    par = [sum(t.numel() * t.element_size() for k, t in sm.layer_tensors(n).items() if k.startswith(PARAM))
           for n in names]
    return names, full, par


def simulate(policy: str, full: list[int], par: list[int], slots: list[int], period: int, steps: int,
             busy: set[int], delta_frac: float, first: bool, seed: int = 0) -> np.ndarray:
    rng = random.Random(seed)
    out = np.zeros(steps)
    last: list[int | None] = [None] * len(full)
    for s in range(steps):
        for i, nb in enumerate(full):
            if policy == "layerwise":
                vol = last[i] is not None and i in busy and rng.random() < 0.5
                if forced_save(s, last[i], slots[i], period, stagger_first=first) or vol:
                    out[s] += nb
                    last[i] = s
            else:
                base = is_base_step(s, slots[i], period) or (last[i] is None and not first)
                if policy == "differential":
                    out[s] += nb if base else (delta_frac * nb if last[i] is not None else 0)
                else:  # replay: per-layer base + the gradient log every step
                    out[s] += (nb if base else 0) + par[i]
                if base:
                    last[i] = s
    return out


def stats(x: np.ndarray) -> tuple[float, float, float, float]:
    return float(x.max()), float(np.percentile(x, 95)), float(x.mean()), float(x.max() / x.mean())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--period", type=int, default=10, help="max_staleness / base_every")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--busy", type=float, default=0.25, help="fraction of layers that change fast")
    ap.add_argument("--delta-frac", type=float, default=0.3)
    ap.add_argument("--png", default="bench_smoothing.png")
    a = ap.parse_args(argv)
    names, full, par = layer_sizes(GPTConfig(d_model=a.d_model, n_layer=a.layers))
    busy = set(random.Random(1).sample(range(len(names)), int(a.busy * len(names))))
    flat = [0] * len(names)
    bal = balanced_slots(full, a.period)
    print(f"## bytes per step, {a.steps} steps, period {a.period}, {len(names)} layers "
          f"({sum(full)} B of state), {len(busy)} busy layers\n")
    print("| policy | staggered | max B | p95 B | mean B | peak/mean | steady max | steady peak/mean |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    series = {}
    for pol in ("layerwise", "differential", "replay"):
        for label, slots, first in (("no", flat, False), ("yes", bal, True)):
            x = simulate(pol, full, par, slots, a.period, a.steps, busy, a.delta_frac, first)
            series[(pol, label)] = x
            mx, p95, mean, ptm = stats(x)
            smx, _, _, sptm = stats(x[a.period:])
            print(f"| {pol} | {label} | {mx:.0f} | {p95:.0f} | {mean:.0f} | {ptm:.2f} | {smx:.0f} | {sptm:.2f} |")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("\n(matplotlib missing: no plot)")
        return
    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    for ax, pol in zip(axes, ("layerwise", "differential", "replay")):
        for label in ("no", "yes"):
            ax.plot(series[(pol, label)] / 1e6, label=f"staggered: {label}", lw=1)
        ax.set_title(pol)
        ax.set_ylabel("MB written")
        ax.legend(loc="upper right")
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(a.png, dpi=100)
    print(f"\nplot: {a.png}")


if __name__ == "__main__":
    main()
