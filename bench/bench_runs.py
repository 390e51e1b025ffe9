"""A whole training run checkpointed through each framework integration against the framework's own, same run.

Issue 29's workload: a run that saves at every step and keeps the top 5 (``save_top_k=5, save_last=True`` for
Lightning; ``save_steps=1, save_total_limit=5`` for the Trainer), with most of the model frozen (``--frozen``,
the share of the parameters' bytes that never change: a fine-tune of a few layers). Each system runs the same
``--steps`` steps from the same seed, in one process, one after the other:

- Lightning: ``ModelCheckpoint`` with Lightning's ``TorchCheckpointIO`` (``torch.save`` to local disk), then
  ``TierStoreCheckpoint`` with each policy (``exact``, ``differential``, ``layerwise``).
- Hugging Face: the ``Trainer``'s own checkpoints (safetensors, ``optimizer.pt``, ...), then
  ``TierStoreTrainer`` with each policy.

Each tierstore run also once with lazy saves (``lazy_save=True`` / ``store_lazy=True``, ``exact``).

Reported per system: the training thread's stall per save (median and max of the save calls: Lightning's
``CheckpointIO.save_checkpoint``, the Trainer's ``_save_checkpoint``; for tierstore plus each save's share of
the time the optimizer's step waited for a lazy copy, ``SaveStats.wait_s``), the bytes written per checkpoint and their
ratio to one full checkpoint (tierstore: what its Checkpointer wrote, ``SaveStats.bytes``; the framework: the
files' sizes), the wall time of ``fit``/``train`` (tierstore's returns with every kept step durable in the local
durable directory: its ``teardown`` settles; the framework's with its files written), and the bytes the host
tier (``/dev/shm``) holds at the end.

    python -m bench.bench_runs [--steps 12] [--frozen 0.85] [--which lightning,hf] [--width 512]
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


def _dir_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _host_bytes(store: Any, prefix: str) -> int:
    host = store.host.tier
    total = 0
    for m in store.models():
        if m.startswith(prefix):
            keys = store.list(m)
            total += sum(r.size for r in store.index.get_objects(keys) if r is not None and host in r.tiers)
    return total


def _row(name: str, stalls: list[float], written: float, full: float, wall: float, host: int, ref: dict) -> None:
    med = statistics.median(stalls)
    ref.setdefault("stall", med)
    ref.setdefault("wall", wall)
    print(f"| {name} | {med * 1e3:.1f} ms (max {max(stalls) * 1e3:.1f}), {med / ref['stall']:.2f}x | "
          f"{written / 2**20:.2f} MiB, {written / full:.2f}x | {wall:.2f} s, {wall / ref['wall']:.2f}x | "
          f"{host / 2**20:.1f} MiB |")


def _header(title: str, full: float, steps: int, frozen: float) -> None:
    print(f"\n## {title}: {steps} steps, a save per step, full checkpoint {full / 2**20:.2f} MiB, "
          f"{frozen:.0%} of the parameters frozen\n")
    print("| system | stall per save (median), ratio | bytes per checkpoint, to a full one | run wall time, "
          "ratio | host tier at the end |")
    print("| --- | --- | --- | --- | --- |")


def _policies() -> dict[str, Any]:
    """The tierstore systems: ``name -> (policy, lazy)``."""
    from tierstore.train.policies import differential, exact, layerwise

    return {"exact": (exact(), False), "differential": (differential(base_every=8), False),
            "layerwise": (layerwise(tau=1e-3), False), "exact, lazy": (exact(), True)}


def _stalls(calls: list[float], stats: dict) -> list[float]:
    """The save calls plus each save's share of the optimizer steps' waits for lazy copies."""
    waited = stats.get("wait_s", 0.0) / max(len(calls), 1)
    return [c + waited for c in calls]


def lightning(home: str, work: str, steps: int, frozen: float, width: int, blocks: int) -> None:
    import lightning.pytorch as pl
    from lightning.fabric.plugins import TorchCheckpointIO
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tierstore.interop.lightning import TierStoreCheckpoint, TierStoreCheckpointIO

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(width, width) for _ in range(blocks)])
            n_frozen = min(blocks - 1, round(frozen * blocks))
            for b in self.blocks[:n_frozen]:
                b.requires_grad_(False)

        def training_step(self, batch: Any, i: int) -> torch.Tensor:
            x = batch[0]
            for b in self.blocks:
                x = torch.tanh(b(x))
            loss = x.square().mean()
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)

    torch.manual_seed(1)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8 * steps, width)), batch_size=8)

    def trainer(cbs: list, plugins: list) -> Any:
        return pl.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False,
                          enable_model_summary=False, callbacks=cbs, plugins=plugins)

    class TimedTorch(TorchCheckpointIO):
        stalls: list[float]
        written = 0

        def save_checkpoint(self, checkpoint: Any, path: Any, storage_options: Any = None) -> None:
            t0 = time.perf_counter()
            super().save_checkpoint(checkpoint, path, storage_options)
            self.stalls.append(time.perf_counter() - t0)
            self.written += os.path.getsize(path)

    class TimedTS(TierStoreCheckpointIO):
        stalls: list[float]
        stats: list[dict]

        def save_checkpoint(self, checkpoint: Any, path: Any, storage_options: Any = None) -> None:
            t0 = time.perf_counter()
            super().save_checkpoint(checkpoint, path, storage_options)
            self.stalls.append(time.perf_counter() - t0)

        def teardown(self) -> None:
            self.wait()
            self.stats = [ck.stats.as_dict() for ck, _ in self._cks.values()]
            super().teardown()

    kw = {"every_n_train_steps": 1, "save_top_k": 5, "save_last": True, "monitor": "train_loss"}
    own = TimedTorch()
    own.written = 0
    own.stalls = []
    d = os.path.join(work, "lit-own")
    t0 = time.perf_counter()
    trainer([ModelCheckpoint(dirpath=d, **kw)], [own]).fit(Net(), data)
    wall = time.perf_counter() - t0
    full = os.path.getsize(os.path.join(d, "last.ckpt"))
    _header("Lightning", full, steps, frozen)
    ref: dict[str, float] = {}
    _row("`ModelCheckpoint` + `TorchCheckpointIO` (torch.save, local disk)", own.stalls, own.written / len(own.stalls),
         full, wall, 0, ref)
    store = tierstore.open(home)
    try:
        for pname, (policy, lazy) in _policies().items():
            tag = pname.replace(", ", "-")
            io = TimedTS(store, name=f"bench-run-{tag}", policy=policy, lazy_save=lazy)
            io.stalls, io.stats = [], []
            cb = TierStoreCheckpoint(dirpath=os.path.join(work, f"lit-{tag}"), **kw)
            t0 = time.perf_counter()
            trainer([cb], [io]).fit(Net(), data)
            wall = time.perf_counter() - t0
            st = io.stats[0] if io.stats else {"bytes": 0, "saves": 1}
            _row(f"`TierStoreCheckpoint`, `{pname}`", _stalls(io.stalls, st), st["bytes"] / max(st["saves"], 1),
                 full, wall, _host_bytes(store, f"bench-run-{tag}."), ref)
    finally:
        store.close()


def huggingface(home: str, work: str, steps: int, frozen: float, width: int, layers: int) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from tierstore.interop.huggingface import TierStoreTrainer

    def model() -> Any:
        torch.manual_seed(0)
        m = GPT2LMHeadModel(GPT2Config(vocab_size=1024, n_positions=64, n_embd=width, n_layer=layers, n_head=8,
                                       bos_token_id=0, eos_token_id=0))
        params = list(m.named_parameters())
        total = sum(p.numel() for _, p in params)
        done = 0
        for _, p in params:  # the embeddings and the first layers, in order, up to the frozen share
            if done + p.numel() > frozen * total:
                break
            p.requires_grad_(False)
            done += p.numel()
        return m

    torch.manual_seed(1)
    ids = torch.randint(0, 1024, (8 * steps, 64))
    ds = [{"input_ids": r, "labels": r} for r in ids]

    def args(out: str) -> Any:
        return TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=8, save_steps=1,
                                 save_total_limit=5, report_to=[], use_cpu=True, disable_tqdm=True,
                                 logging_steps=100)

    class Own(Trainer):
        stalls: list[float]
        written = 0

        def _save_checkpoint(self, model: Any, trial: Any) -> None:
            t0 = time.perf_counter()
            super()._save_checkpoint(model, trial)
            self.stalls.append(time.perf_counter() - t0)
            self.written += _dir_bytes(os.path.join(self.args.output_dir, f"checkpoint-{self.state.global_step}"))

    class Timed(TierStoreTrainer):
        stalls: list[float]
        stats: dict

        def _save_checkpoint(self, model: Any, trial: Any) -> None:
            t0 = time.perf_counter()
            super()._save_checkpoint(model, trial)
            self.stalls.append(time.perf_counter() - t0)

        def _ts_close(self) -> None:
            if self._ts_ck is not None:
                self.stats = self._ts_ck[0].stats.as_dict()
            super()._ts_close()

    own = Own(model=model(), args=args(os.path.join(work, "hf-own")), train_dataset=ds)
    own.written = 0
    own.stalls = []
    t0 = time.perf_counter()
    own.train()
    wall = time.perf_counter() - t0
    last = os.path.join(work, "hf-own", f"checkpoint-{steps}")
    full = _dir_bytes(last) - _dir_bytes(os.path.join(last, "trainer_state.json"))
    _header("Hugging Face Trainer", full, steps, frozen)
    ref: dict[str, float] = {}
    _row("`Trainer`'s own checkpoints (safetensors + torch.save, local disk)", own.stalls,
         own.written / len(own.stalls), full, wall, 0, ref)
    store = tierstore.open(home)
    try:
        for pname, (policy, lazy) in _policies().items():
            tag = pname.replace(", ", "-")
            t = Timed(model=model(), args=args(os.path.join(work, f"hf-{tag}")), train_dataset=ds, store=store,
                      store_name=f"bench-run-hf-{tag}", store_policy=policy, store_lazy=lazy)
            t.stalls, t.stats = [], {}
            t0 = time.perf_counter()
            t.train()
            store.flush()  # durable, as the Lightning runs end
            wall = time.perf_counter() - t0
            _row(f"`TierStoreTrainer`, `{pname}`", _stalls(t.stalls, t.stats),
                 t.stats.get("bytes", 0) / max(t.stats.get("saves", 1), 1), full, wall,
                 _host_bytes(store, f"bench-run-hf-{tag}."), ref)
    finally:
        store.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--frozen", type=float, default=0.85, help="share of the parameters that never train")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--blocks", type=int, default=16, help="Lightning: Linear(width) blocks")
    p.add_argument("--hf-layers", type=int, default=6)
    p.add_argument("--which", default="lightning,hf")
    a = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="tierstore-bench-runs-")
    home = os.path.join(work, "home")
    try:
        which = set(a.which.split(","))
        if "lightning" in which:
            lightning(home, work, a.steps, a.frozen, a.width, a.blocks)
        if "hf" in which:
            huggingface(home, work, a.steps, a.frozen, a.width, a.hf_layers)
    finally:
        stop_server(home)
        shutil.rmtree(host_dir(home), ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
