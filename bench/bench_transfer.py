"""Export and import throughput against ``safetensors.torch.save_file`` / ``load_file`` of the same tensors.

Run: ``python -m bench.bench_transfer [--mib 256] [--layers 16] [--reps 3] [--shard 1GB]``.

A model of ``--layers`` square linear layers (fp32, ``--mib`` MiB of weights in
all) is saved once with the Checkpointer (exact policy) into an embedded store
in a temporary directory. Then, in the same run and the same directory:

* export: ``export_model(..., model_only=True)`` (resolve, read every object
  from the host tier with its checksum verified, write HF safetensors shards
  and the index), against ``safetensors.torch.save_file`` of the live state
  dict split into the same shards (tensors already in memory: a lower bound
  for any export; it does not fsync, the export does);
* import: ``import_model`` of that export into a new model (read the shards
  lazily, write step 0 into the host tier and commit it), against
  ``safetensors.torch.load_file`` of the same shards, each tensor cloned (the
  file is mapped lazily: the clone reads it);
* torch: ``export_model(format="torch")`` against ``torch.save`` of the state dict.

Prints medians (min-max) and MB/s, and tierstore's time over the baseline's.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

import tierstore
from tierstore.embedded import stop_server
from tierstore.interop.export import export_model
from tierstore.interop.importing import import_model
from tierstore.interop.weights_files import INDEX_FILE, parse_size
from tierstore.train.checkpointer import Checkpointer


def timeit(fn: Callable[[int], object], reps: int, clean: Callable[[], None]) -> tuple[float, float, float]:
    ts = []
    for i in range(reps + 1):
        clean()
        t0 = time.perf_counter()
        fn(i)
        if i:  # the first is a warm-up
            ts.append(time.perf_counter() - t0)
    return statistics.median(ts), min(ts), max(ts)


def shards_of(sd: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    out: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for n, t in sd.items():
        b = t.numel() * t.element_size()
        if out[-1] and size + b > max_bytes:
            out.append({})
            size = 0
        out[-1][n] = t
        size += b
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--shard", default="1GB", help="max shard size for both sides")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    hidden = int((a.mib * 2**20 / 4 / a.layers) ** 0.5)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(hidden, hidden, bias=False) for _ in range(a.layers)])
    sd = {n: t.detach() for n, t in model.state_dict().items()}
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    shard = parse_size(a.shard)
    root = Path(a.dir or tempfile.mkdtemp(prefix="bench-transfer-"))
    root.mkdir(parents=True, exist_ok=True)
    store = tierstore.open(root / "home", migrate=False)
    rows: dict[str, tuple[float, float, float]] = {}
    try:
        ck = Checkpointer(store, "bench", model)
        ck.save(0)
        assert ck.wait() == "committed"
        ck.close()

        def clean(*paths: Path) -> Callable[[], None]:
            return lambda: [shutil.rmtree(p, ignore_errors=True) for p in paths]  # type: ignore[func-returns-value]

        out, base = root / "export", root / "baseline"
        rows["export safetensors"] = timeit(lambda i: export_model(store, "bench", out, max_shard_size=shard,
                                                                   model_only=True), a.reps, clean(out))

        def st_save(i: int) -> None:
            base.mkdir()
            parts = shards_of(sd, shard)
            names = [f"model-{k + 1:05d}-of-{len(parts):05d}.safetensors" for k in range(len(parts))]
            for p, f in zip(parts, names):
                save_file(p, base / f, metadata={"format": "pt"})
            (base / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": nbytes},
                                                       "weight_map": {n: f for p, f in zip(parts, names) for n in p}}))

        rows["safetensors.save_file"] = timeit(st_save, a.reps, clean(base))
        export_model(store, "bench", out, max_shard_size=shard, model_only=True, overwrite=True)
        files = sorted(out.glob("*.safetensors"))

        def imp(i: int) -> None:
            import_model(store, out, f"imported{i}", module=model)

        rows["import safetensors"] = timeit(imp, a.reps, lambda: None)
        # load_file maps the file lazily: clone so that the bytes are read, as an import reads them
        rows["safetensors.load_file"] = timeit(
            lambda i: [{n: t.clone() for n, t in load_file(f).items()} for f in files], a.reps, lambda: None)
        tout, tbase = root / "export-torch", root / "torch-save"
        rows["export torch"] = timeit(lambda i: export_model(store, "bench", tout, format="torch", model_only=True),
                                      a.reps, clean(tout))
        rows["torch.save"] = timeit(lambda i: (tbase.mkdir(), torch.save(sd, tbase / "pytorch_model.bin")),
                                    a.reps, clean(tbase))
    finally:
        store.close()
        if a.dir is None:
            stop_server(root / "home")  # the embedded index server the run started
            shutil.rmtree(root, ignore_errors=True)
    ratios = {"export/save_file": rows["export safetensors"][0] / rows["safetensors.save_file"][0],
              "import/load_file": rows["import safetensors"][0] / rows["safetensors.load_file"][0],
              "export torch/torch.save": rows["export torch"][0] / rows["torch.save"][0]}
    if a.json:
        print(json.dumps({"bytes": nbytes, "rows": rows, "time_ratios": ratios}))
        return
    print(f"{a.layers} layers of {hidden}x{hidden} fp32: {nbytes / 2**20:.0f} MiB, shards of {a.shard}, "
          f"median of {a.reps}")
    for label, (med, lo, hi) in rows.items():
        print(f"  {label:<24} {med * 1e3:8.1f} ms ({lo * 1e3:.1f}-{hi * 1e3:.1f})  {nbytes / med / 1e6:7.0f} MB/s")
    for k, v in ratios.items():
        print(f"  time {k:<24} {v:5.2f}x")


if __name__ == "__main__":
    main()
