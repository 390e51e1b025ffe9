"""Elastic restore: a 2-rank FSDP2 checkpoint restored on 4 ranks and on 1, against the same sharding and DCP.

Run: ``python bench/bench_reshard.py [--layers 8] [--width 1024] [--repeats 3] [--json out.json]``

One run, four phases of real processes (gloo, CPU), one embedded store:

1. **save**, 2 ranks: ``Linear(width, width)`` x ``layers``, each ``fully_shard``-ed, AdamW, one step;
   saved by the Checkpointer (``exact``) and, the same state, by ``dcp.save`` through the DCP adapter
   (:mod:`tierstore.interop.dcp`, the same store).
2. **same sharding**, 2 ranks: the Checkpointer's restore (read whole, the layout matches) and
   ``dcp.load`` through the adapter, alternating, ``--repeats`` times each.
3. **4 ranks** (FSDP2 on a mesh of 4): the Checkpointer's resharding restore (ranged reads) and
   ``dcp.load`` resharding, alternating.
4. **1 process**, a plain module and AdamW (no FSDP, no ``torch.distributed``): the same two.

Per phase: the restore time (median, min-max, of the slowest rank; read-only restores into the live
module and optimizer, so no epoch is taken), the time of the resolve inside it (choosing the step and
verifying every copy it reads: ``restore_verify="auto"`` hashes each copy in a local tier), the bound (a ``copy_`` of the rank's shard bytes into
pre-allocated tensors), and per rank the bytes the restore read against the bytes its shard holds.
Ratios: the Checkpointer against DCP in the same phase, and each phase against the same-sharding one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _model(layers: int, width: int) -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))


def _shard_bytes(model: Any, opt: Any) -> int:
    from torch.distributed.tensor import DTensor

    def nb(t: Any) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    return (sum(nb(t) for t in model.state_dict().values())
            + sum(nb(v) for st in opt.state.values() for v in st.values() if hasattr(v, "numel")))


def _copy_bound(model: Any, opt: Any, repeats: int) -> float:
    """Seconds of a ``copy_`` of this rank's shard (model and optimizer) into pre-allocated tensors."""
    import torch
    from torch.distributed.tensor import DTensor

    def loc(t: Any) -> Any:
        return t.to_local() if isinstance(t, DTensor) else t

    src = [loc(t) for t in model.state_dict().values()]
    src += [loc(v) for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    dst = [torch.empty_like(t) for t in src]
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        for d, s in zip(dst, src):
            d.copy_(s)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def worker(phase: str, rank: int, world: int, port: int, home: str, out: str, layers: int, width: int,
           repeats: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import tierstore
    from tierstore.interop.dcp import TierStoreReader, TierStoreWriter
    from tierstore.interop.dcp import load as dcp_load
    from tierstore.interop.dcp import save as dcp_save
    from tierstore.train.checkpointer import Checkpointer

    torch.set_num_threads(1)
    distributed = phase != "one"
    if distributed:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    store = tierstore.open(home=home)
    model = _model(layers, width)
    if distributed:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, width)).sum().backward()  # every phase: optimizer state exists (DCP loads into it)
    opt.step()
    opt.zero_grad(set_to_none=True)

    def slowest(seconds: float) -> float:
        if not distributed:
            return seconds
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t[0])

    def barrier() -> None:
        if distributed:
            dist.barrier()

    result: dict[str, Any] = {"rank": rank, "world": world}
    if phase == "save":
        ck = Checkpointer(store, "rs", model, opt)
        ck.save(1)
        assert ck.wait() == "committed"
        ck.close()
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp_save({"model": model_sd, "optim": optim_sd}, TierStoreWriter(store, "rsdcp", step=1))
        result["saved_bytes"] = _shard_bytes(model, opt)
    else:
        ck = Checkpointer(store, "rs", model, opt, preallocate=False)
        times: dict[str, list[float]] = {"tierstore": [], "dcp": [], "resolve": []}
        for _ in range(repeats):
            barrier()
            t0 = time.perf_counter()
            assert ck.restore(read_only=True).step == 1
            times["tierstore"].append(slowest(time.perf_counter() - t0))
            barrier()
            t0 = time.perf_counter()
            store.resolve("rs")  # the part of a restore that picks and verifies the step (every copy it reads)
            times["resolve"].append(slowest(time.perf_counter() - t0))
            barrier()
            t0 = time.perf_counter()
            model_sd, optim_sd = get_state_dict(model, opt)
            state = {"model": model_sd, "optim": optim_sd}
            dcp_load(state, TierStoreReader(store, "rsdcp", step=1))
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            times["dcp"].append(slowest(time.perf_counter() - t0))
        result.update(times=times, bytes_read=ck.report.bytes_read, resharded=len(ck.report.resharded),
                      shard_bytes=_shard_bytes(model, opt),
                      bound=slowest(_copy_bound(model, opt, repeats)))
        ck.close()
    Path(f"{out}.{phase}.{rank}.json").write_text(json.dumps(result))
    barrier()
    store.close()
    if distributed:
        dist.destroy_process_group()


def _run(phase: str, world: int, args: argparse.Namespace, home: str, out: str) -> list[dict]:
    from tests.redis_server import free_port

    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", phase, str(r), str(world), str(port), home, out,
                               str(args.layers), str(args.width), str(args.repeats)], cwd=REPO, env=env)
             for r in range(world)]
    codes = [p.wait(timeout=900) for p in procs]
    if any(codes):
        raise SystemExit(f"phase {phase}: workers exited {codes}")
    return [json.loads(Path(f"{out}.{phase}.{r}.json").read_text()) for r in range(world)]


def _ms(ts: list[float]) -> str:
    return f"{statistics.median(ts) * 1e3:.0f} ms ({min(ts) * 1e3:.0f}-{max(ts) * 1e3:.0f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-reshard-") as tmp:
        home, out = str(Path(tmp) / "home"), str(Path(tmp) / "run")
        try:
            saved = _run("save", 2, args, home, out)
            phases = {"same sharding (2 -> 2)": _run("same", 2, args, home, out),
                      "resharded (2 -> 4)": _run("four", 4, args, home, out),
                      "resharded (2 -> 1, plain)": _run("one", 1, args, home, out)}
        finally:  # the ranks' embedded index server and host tier outlive them: nothing is left behind
            from tierstore.embedded import stop_server
            from tierstore.home import host_dir

            stop_server(home)
            shutil.rmtree(host_dir(home), ignore_errors=True)
    state = sum(r["saved_bytes"] for r in saved)
    print(f"state: {args.layers} x Linear({args.width}, {args.width}) + AdamW, {state / 2**20:.1f} MiB in all, "
          f"saved by 2 FSDP2 ranks; medians of {args.repeats} (min-max), slowest rank\n")
    print("| restore | tierstore | of which resolve | DCP adapter | tierstore / DCP | tierstore / same sharding | "
          "copy bound | tierstore / bound | bytes read / shard bytes, per rank |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    base = statistics.median(phases["same sharding (2 -> 2)"][0]["times"]["tierstore"])
    figures: dict[str, Any] = {"state_bytes": state, "args": vars(args), "phases": {}}
    for label, ranks in phases.items():
        t, d = ranks[0]["times"]["tierstore"], ranks[0]["times"]["dcp"]
        bound = max(r["bound"] for r in ranks)
        reads = [r["bytes_read"] / r["shard_bytes"] for r in ranks]
        print(f"| {label} | {_ms(t)} | {_ms(ranks[0]['times']['resolve'])} | {_ms(d)} | "
              f"{statistics.median(t) / statistics.median(d):.2f}x | "
              f"{statistics.median(t) / base:.2f}x | {bound * 1e3:.1f} ms | {statistics.median(t) / bound:.1f}x | "
              f"{', '.join(f'{x:.2f}' for x in reads)} |")
        figures["phases"][label] = {"tierstore_s": t, "dcp_s": d, "bound_s": bound,
                                    "resolve_s": ranks[0]["times"]["resolve"],
                                    "bytes_read": [r["bytes_read"] for r in ranks],
                                    "shard_bytes": [r["shard_bytes"] for r in ranks],
                                    "resharded_layers": [r["resharded"] for r in ranks]}
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        a = sys.argv[2:]
        worker(a[0], int(a[1]), int(a[2]), int(a[3]), a[4], a[5], int(a[6]), int(a[7]), int(a[8]))
    else:
        main()
