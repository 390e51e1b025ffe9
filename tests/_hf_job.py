"""A tiny but real Hugging Face Trainer job for tests/test_huggingface.py: a 2-layer GPT-2 built from its
config (no download; its dropout draws from the RNG the checkpoint must restore), random token windows.

:func:`run_all` trains uninterrupted (A, saving every 4 steps), resumes from ``checkpoint-4`` (first epoch, B)
and from ``checkpoint-8`` (a later epoch, C) into fresh Trainers, then continues A's run directory with
``resume_from_checkpoint=True`` and ``save_total_limit=2`` (D, rotation). ``python -m tests._hf_job OUT HOME``
is one rank of a 2-rank job launched by the test with the launcher's environment.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

ROWS = 24  # per rank: 6 steps an epoch, checkpoints at 4 (epoch 0), 8 (epoch 1), 12
SEQ = 16
STEPS = 12


class Windows(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(5)
        self.ids = torch.randint(0, 64, (ROWS * int(os.environ.get("WORLD_SIZE", "1")), SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def model() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                                      bos_token_id=0, eos_token_id=0))


def args(out: str, max_steps: int = STEPS, **kw: Any) -> Any:
    from transformers import TrainingArguments

    world = int(os.environ.get("WORLD_SIZE", "1"))
    base = dict(output_dir=out, max_steps=max_steps, per_device_train_batch_size=4, save_steps=4,
                save_strategy="steps", logging_steps=1, report_to=[], use_cpu=True, seed=0, learning_rate=5e-3,
                warmup_steps=2, lr_scheduler_type="linear", disable_tqdm=True, dataloader_num_workers=0,
                ddp_backend="gloo" if world > 1 else None)
    return TrainingArguments(**{**base, **kw})


def steps_logged(trainer: Any) -> dict[int, dict[str, Any]]:
    """The per-step log entries (loss, grad_norm, learning_rate, epoch), by step."""
    return {e["step"]: {k: v for k, v in e.items() if k != "step"} for e in trainer.state.log_history
            if "loss" in e}


def params(m: torch.nn.Module) -> dict[str, list]:
    return {n: [*p.detach().flatten()[:8].tolist(), float(p.detach().double().sum())]
            for n, p in m.named_parameters()}


def live_groups() -> int:
    """How many process groups ``torch.distributed`` holds (0 without it): each run's own group must go."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    return len(c10d._world.pg_map) if dist.is_initialized() else 0


def run_all(store: Any, root: str, **kw: Any) -> dict[str, Any]:
    """A, B, C and D (see the module docstring); ``kw`` goes to every ``TierStoreTrainer`` (``store_lazy=True``)."""
    from tierstore.interop import huggingface

    def TierStoreTrainer(**more: Any) -> Any:  # the class, with kw
        return huggingface.TierStoreTrainer(**more, **kw)

    out: dict[str, Any] = {"groups": []}
    a = TierStoreTrainer(model=model(), args=args(f"{root}/A"), train_dataset=Windows(), store=store)
    a.train()
    out["groups"].append(live_groups())
    out["A"] = {"log": steps_logged(a), "params": params(a.model),
                "dirs": sorted(os.listdir(f"{root}/A")), "files": sorted(os.listdir(f"{root}/A/checkpoint-8"))}
    for tag, start in (("B", 4), ("C", 8)):
        t = TierStoreTrainer(model=model(), args=args(f"{root}/{tag}"), train_dataset=Windows(), store=store)
        t.train(resume_from_checkpoint=f"{root}/A/checkpoint-{start}")
        out["groups"].append(live_groups())
        out[tag] = {"log": steps_logged(t), "params": params(t.model), "start": start,
                    "epoch_at_start": t.state.log_history[start - 1]["epoch"]}
    d = TierStoreTrainer(model=model(), args=args(f"{root}/A", max_steps=16, save_total_limit=2),
                         train_dataset=Windows(), store=store)
    d.train(resume_from_checkpoint=True)
    out["groups"].append(live_groups())
    from tierstore.interop.pointer import model_name, read_pointer

    run = os.path.abspath(f"{root}/A")
    pointers = {os.path.join(run, c): read_pointer(os.path.join(run, c, "tierstore.json")) for c in os.listdir(run)}
    out["D"] = {"log": steps_logged(d), "dirs": sorted(os.listdir(run)), "model": model_name("hf", run),
                "pointer_models": sorted({p.model for p in pointers.values()}),
                "pins": store.steps.pins(model_name("hf", run)),
                "want": {k: p.step for k, p in pointers.items()},
                "per_directory": sorted(m for m in store.models() if m.startswith("hf.checkpoint-"))}
    return out


def main(argv: list[str]) -> int:
    import tierstore

    out, home = argv[0], argv[1]
    store = tierstore.open(home)
    res = run_all(store, os.path.dirname(out))
    with open(f"{out}.{os.environ.get('RANK', '0')}.json", "w") as f:
        json.dump(res, f)
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
