"""One checkpoint save through each framework integration against the framework's own default, same model, same run.

Lightning: a LightningModule of ``--blocks`` Linear(``--width``) blocks with AdamW state. Each round trains
one step, then saves the same state with each system, alternating: Lightning's default ``TorchCheckpointIO``
(``torch.save`` to a local directory), ``TierStoreCheckpointIO`` bound to the trainer (the module's layers,
``exact``), the same unbound (Lightning's dict as it is), and ``TierStoreCheckpoint``'s re-save of one path
under ``differential`` (the ``last.ckpt`` pattern), and the bound IO as ``fit``'s own saves see it (the trainer
running: ``async_save`` returns after the snapshot; its commit is waited for before the durable time). Hugging Face: a GPT-2 of ``--hf-layers`` x ``--hf-width``
with AdamW; each round trains one step, then one ``_save_checkpoint`` of the Trainer's own flow (weights as
safetensors, optimizer.pt, scheduler.pt, rng_state.pth) and one of ``TierStoreTrainer``'s, on the same trainer.

Reported: the median (min-max) seconds until ``save`` returns (tierstore: committed in host memory; the
framework: the files written, page cache) and, for tierstore, until the step is also durable in the store's
local durable directory (``store.flush()``), with ratios to the framework's default.

Then the **training-thread stall**, what a run pays per save: rounds of one training step, a save, and one more
training step, against rounds of two training steps without a save; the stall is the difference (median). It
counts everything the training thread waits for: the save's own return, and for a lazy save
(``lazy_save=True`` / ``store_lazy=True``) the next optimizer step's wait for the copy, and the background
commit's share of the cores. The systems: the framework's default save, tierstore's asynchronous save (the
copy before it returns) and the lazy one (the copy during the next step's forward and backward).

    python -m bench.bench_frameworks [--repeats 5] [--blocks 16] [--width 1024] [--hf-layers 8] [--hf-width 512]
                                     [--stall-batch 64] [--which lightning,hf] [--train-threads N]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch

import tierstore
from tierstore.embedded import stop_server
from tierstore.home import host_dir


def _fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:8.1f} ms ({min(xs) * 1e3:.1f}-{max(xs) * 1e3:.1f})"


def _table(title: str, rows: dict[str, list[float]], base: str, state_bytes: int) -> None:
    print(f"\n## {title}: state {state_bytes / 2**20:.0f} MiB (params + AdamW)\n")
    print("| system | seconds to return (median, min-max) | ratio to the framework's default |")
    print("| --- | --- | --- |")
    ref = statistics.median(rows[base])
    for name, xs in rows.items():
        print(f"| {name} | {_fmt(xs)} | {statistics.median(xs) / ref:.2f}x |")


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _stall_table(title: str, step: Any, saves: dict[str, Any], repeats: int) -> None:
    """The training-thread stall of each save in ``saves`` (see the module docstring), alternating systems."""
    plain: list[float] = []
    raw: dict[str, list[float]] = {n: [] for n in saves}
    calls: dict[str, list[float]] = {n: [] for n in saves}
    for r in range(repeats + 1):
        for name, (save, done) in saves.items():
            step()
            plain.append(_timed(step))  # a step without a save
            t0 = time.perf_counter()
            save(r)
            t1 = time.perf_counter()
            step()  # the step after the save: a lazy copy's wait and the background work's share of the cores
            t2 = time.perf_counter()
            done()  # untimed: the save's background part, before the next system's round
            if r:  # the first round warms each system's buffers
                raw[name].append(t2 - t0)
                calls[name].append(t1 - t0)
    one = statistics.median(plain)
    stall = {n: [t - one for t in xs] for n, xs in raw.items()}
    ref = max(statistics.median(stall[next(iter(saves))]), 1e-9)
    print(f"\n## {title}: training-thread stall per save (one step ~{one * 1e3:.1f} ms)\n")
    print("| system | stall per save (median, min-max) | ratio to the framework's default | of it, the save call "
          "| the next step's extra time |")
    print("| --- | --- | --- | --- | --- |")
    for name, xs in stall.items():
        call = statistics.median(calls[name])
        print(f"| {name} | {_fmt(xs)} | {statistics.median(xs) / ref:.2f}x | {call * 1e3:.1f} ms | "
              f"{(statistics.median(xs) - call) * 1e3:.1f} ms |")


def lightning(store: Any, work: str, repeats: int, blocks: int, width: int, stall_batch: int = 64) -> None:
    import lightning.pytorch as pl
    from lightning.fabric.plugins import TorchCheckpointIO
    from lightning.pytorch.trainer.states import TrainerStatus

    from tierstore.interop.lightning import TierStoreCheckpointIO
    from tierstore.train.policies import differential

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(width, width) for _ in range(blocks)])

        def training_step(self, batch: Any, i: int) -> torch.Tensor:
            x = batch[0]
            for b in self.blocks:
                x = torch.tanh(b(x))
            return x.square().mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    net = Net()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8 * (repeats + 1), width)),
                                       batch_size=8)
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(net, data)
    opt = trainer.optimizers[0]
    systems: dict[str, Any] = {"Lightning TorchCheckpointIO (torch.save, local disk)": TorchCheckpointIO()}
    bound = TierStoreCheckpointIO(store, name="bench-lit")
    bound.bind(trainer)
    systems["tierstore, bound (module layers, exact)"] = bound
    systems["tierstore, plain dict"] = TierStoreCheckpointIO(store, name="bench-lit-dict")
    diff = TierStoreCheckpointIO(store, name="bench-lit-diff", policy=differential(base_every=4))
    diff.bind(trainer)
    systems["tierstore, bound, differential re-save of last.ckpt"] = diff
    during = TierStoreCheckpointIO(store, name="bench-lit-fit")
    during.bind(trainer)
    # as fit's own saves (ModelCheckpoint's, the trainer running): async_save returns after the snapshot
    systems["tierstore, bound, during fit (async_save)"] = during
    times: dict[str, list[float]] = {n: [] for n in systems}
    durable: dict[str, list[float]] = {n: [] for n in systems if "tierstore" in n}
    batches = iter(data)
    for r in range(repeats):
        x = next(batches)[0]  # one training step between rounds: every system saves the same, changed state
        loss = net.training_step((x,), 0)
        loss.backward()
        opt.step()
        opt.zero_grad()
        for name, io in systems.items():
            trainer.strategy.checkpoint_io = io
            path = os.path.join(work, "lit", f"{name[:12].replace(' ', '_')}-{r}.ckpt" if "last" not in name
                                else "last.ckpt")
            running = "during fit" in name
            if running:
                trainer.state.status = TrainerStatus.RUNNING
            times[name].append(_timed(lambda p=path: trainer.save_checkpoint(p)))
            if running:
                trainer.state.status = TrainerStatus.FINISHED
            if name in durable:
                durable[name].append(times[name][-1] + _timed(lambda i=io: (i.wait(), store.flush())))
            if "last" not in name:  # untimed: one round's copies at a time in memory and on disk
                io.remove_checkpoint(path)
    nbytes = sum(p.numel() * 4 * 3 for p in net.parameters())
    _table("Lightning: trainer.save_checkpoint(path)", times, next(iter(systems)), nbytes)
    print("\nuntil durable in the store's local durable directory (save + store.flush()):\n")
    ref = statistics.median(times[next(iter(systems))])
    for name, xs in durable.items():
        print(f"- {name}: {_fmt(xs)}, {statistics.median(xs) / ref:.2f}x")
    for io in systems.values():
        io.teardown()

    lazy = TierStoreCheckpointIO(store, name="bench-lit-lazy", lazy_save=True)
    lazy.bind(trainer)
    staller = {"Lightning TorchCheckpointIO (torch.save, local disk)": TorchCheckpointIO(),
               "tierstore, during fit (async_save)": TierStoreCheckpointIO(store, name="bench-lit-async"),
               "tierstore, during fit (async_save + lazy_save)": lazy}
    staller["tierstore, during fit (async_save)"].bind(trainer)

    def step() -> None:
        x = next(batches, None)
        loss = net.training_step(((x[0] if x is not None else torch.randn(stall_batch, width)),), 0)
        loss.backward()
        opt.step()
        opt.zero_grad()

    def saver(io: Any) -> tuple[Any, Any]:
        def save(r: int) -> None:
            trainer.strategy.checkpoint_io = io
            trainer.state.status = TrainerStatus.RUNNING  # fit's own saves
            trainer.save_checkpoint(os.path.join(work, "lit-stall", f"{id(io)}-{r}.ckpt"))

        def done() -> None:
            trainer.state.status = TrainerStatus.FINISHED
            if hasattr(io, "wait"):
                io.wait()
            shutil.rmtree(os.path.join(work, "lit-stall"), ignore_errors=True)

        return save, done

    batches = iter(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
        torch.randn(stall_batch * 8 * (repeats + 2), width)), batch_size=stall_batch))
    _stall_table("Lightning", step, {n: saver(io) for n, io in staller.items()}, repeats)
    for io in staller.values():
        io.teardown()


def huggingface(store: Any, work: str, repeats: int, layers: int, width: int) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from tierstore.interop.huggingface import TierStoreTrainer
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=1024, n_positions=64, n_embd=width, n_layer=layers, n_head=8,
                                       bos_token_id=0, eos_token_id=0))
    ids = torch.randint(0, 1024, (8 * (repeats + 2), 64))
    ds = [{"input_ids": r, "labels": r} for r in ids]
    args = TrainingArguments(output_dir=os.path.join(work, "hf"), max_steps=1, per_device_train_batch_size=8,
                             save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, logging_steps=100)
    t = TierStoreTrainer(model=model, args=args, train_dataset=ds, store=store, store_name="bench-hf")
    t.train()
    times: dict[str, list[float]] = {"HF Trainer's own _save_checkpoint (safetensors + torch.save, local disk)": [],
                                     "TierStoreTrainer._save_checkpoint": []}
    durable: list[float] = []
    batch = {"input_ids": ids[:8], "labels": ids[:8]}
    for r in range(repeats):
        out = t.model(**batch)  # one training step between rounds
        out.loss.backward()
        t.optimizer.step()
        t.lr_scheduler.step()
        t.optimizer.zero_grad()
        t.state.global_step = 1 + r
        t.args.output_dir = os.path.join(work, "hf", "own")
        times["HF Trainer's own _save_checkpoint (safetensors + torch.save, local disk)"].append(
            _timed(lambda: Trainer._save_checkpoint(t, t.model, None)))
        t.args.output_dir = os.path.join(work, "hf", "tierstore")
        times["TierStoreTrainer._save_checkpoint"].append(_timed(lambda: t._save_checkpoint(t.model, None)))
        # the async save's commit first (it enqueues the migration), then the migration itself
        durable.append(times["TierStoreTrainer._save_checkpoint"][-1] + _timed(lambda: (t._ts_wait(), store.flush())))
        shutil.rmtree(os.path.join(work, "hf", "own"), ignore_errors=True)  # untimed: one round's copies at a time
        # as save_total_limit's rotation does: the directory goes, the next save drops its pin and collects it
        shutil.rmtree(os.path.join(work, "hf", "tierstore", f"checkpoint-{1 + r}"), ignore_errors=True)
    nbytes = sum(p.numel() * 4 * 3 for p in model.parameters())
    _table("Hugging Face: Trainer._save_checkpoint", times, next(iter(times)), nbytes)
    ref = statistics.median(next(iter(times.values())))
    print(f"\nuntil durable (save + its commit + store.flush()): {_fmt(durable)}, "
          f"{statistics.median(durable) / ref:.2f}x")

    lazy = TierStoreTrainer(model=model, args=args, train_dataset=ds, store=store, store_name="bench-hf-lazy",
                            store_lazy=True)
    lazy.optimizer, lazy.lr_scheduler = t.optimizer, t.lr_scheduler  # the same state as the other systems'
    lazy.state = t.state

    def step() -> None:
        out = t.model(**batch)
        out.loss.backward()
        t.optimizer.step()
        t.lr_scheduler.step()
        t.optimizer.zero_grad()

    def saver(kind: str, trainer: Any) -> tuple[Any, Any]:
        d = os.path.join(work, "hf", f"stall-{kind}")

        def save(r: int) -> None:
            trainer.args.output_dir = d
            trainer.state.global_step = 100 + r
            if kind == "own":
                Trainer._save_checkpoint(trainer, trainer.model, None)
            else:
                trainer._save_checkpoint(trainer.model, None)

        def done() -> None:
            if kind != "own":
                trainer._ts_wait()
            shutil.rmtree(os.path.join(d, "checkpoint-" + str(trainer.state.global_step)), ignore_errors=True)

        return save, done

    _stall_table("Hugging Face", step, {"HF Trainer's own _save_checkpoint": saver("own", t),
                                        "TierStoreTrainer (store_async)": saver("async", t),
                                        "TierStoreTrainer (store_async + store_lazy)": saver("lazy", lazy)},
                 repeats)
    lazy._ts_close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--blocks", type=int, default=16)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--hf-layers", type=int, default=8)
    p.add_argument("--hf-width", type=int, default=512)
    p.add_argument("--which", default="lightning,hf")
    p.add_argument("--stall-batch", type=int, default=64,
                   help="the Lightning stall rounds' batch (their step's forward and backward, which a lazy copy "
                        "overlaps)")
    p.add_argument("--train-threads", type=int, default=None,
                   help="torch's intra-op threads for the training steps (default: torch's, every core); fewer "
                        "leaves cores to the background work, as a GPU trainer does")
    a = p.parse_args(argv)
    if a.train_threads:
        torch.set_num_threads(a.train_threads)
    work = tempfile.mkdtemp(prefix="tierstore-bench-frameworks-", dir=os.environ.get("TMPDIR"))
    home = os.path.join(work, "home")
    store = tierstore.open(home)
    try:
        print(f"# tierstore vs the frameworks' own checkpoints ({a.repeats} rounds, torch {torch.__version__}, "
              f"{os.cpu_count()} CPUs, {torch.get_num_threads()} training threads)")
        if "lightning" in a.which:
            lightning(store, work, a.repeats, a.blocks, a.width, a.stall_batch)
        if "hf" in a.which:
            huggingface(store, work, a.repeats, a.hf_layers, a.hf_width)
    finally:
        store.close()
        stop_server(home)
        shutil.rmtree(host_dir(home), ignore_errors=True)  # the host tier's shared memory of this home
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
