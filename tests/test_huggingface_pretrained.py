"""A TierStoreTrainer checkpoint exported as a directory ``from_pretrained`` reads
(tierstore.interop.hf_pretrained.export_pretrained), with the real transformers, CPU.

A 2-layer GPT-2 (tied ``lm_head``) trains 8 steps saving every 4; ``checkpoint-4`` and ``checkpoint-8`` are
exported and loaded with ``AutoModelForCausalLM.from_pretrained``: every tensor equals the trained model's at that
step bit for bit (the tied ``lm_head`` included, tied again), the logits on a fixed input are equal, the
tokenizer the run directory holds loads from the export. Then the refusals, each typed and leaving no
``out_dir``: no pointer, an ``out_dir`` that is not empty, no config, a step whose objects are gone, a step not
in the store.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="needs transformers (the hf extra)")

import torch
from safetensors import safe_open
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
)

from tierstore.errors import CheckpointGoneError, CheckpointNotFoundError, ConfigError, KeyExistsError
from tierstore.interop.hf_pretrained import export_pretrained
from tierstore.interop.huggingface import TierStoreTrainer

IDS = torch.tensor([[1, 5, 9, 2, 33, 63, 0, 7]])  # the fixed input of the logits check


def _model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                      bos_token_id=0, eos_token_id=0))


def _data() -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 64, (16, 16), generator=torch.Generator().manual_seed(5))
    return [{"input_ids": r, "labels": r} for r in ids]


def _args(out: Path, max_steps: int, save_steps: int) -> TrainingArguments:
    return TrainingArguments(output_dir=str(out), max_steps=max_steps, save_steps=save_steps, save_strategy="steps",
                             per_device_train_batch_size=4, learning_rate=5e-3, report_to=[], use_cpu=True, seed=0,
                             disable_tqdm=True, dataloader_num_workers=0)


def _tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(64)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0", eos_token="t0")


class Keep(TrainerCallback):
    """The model's full state dict (tied names included) at each save, cloned."""

    def __init__(self) -> None:
        self.at: dict[int, dict[str, torch.Tensor]] = {}

    def on_save(self, args, state, control, model=None, **kw):
        self.at[state.global_step] = {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(autouse=True)
def _one_process(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)


def _train(store, run: Path, max_steps: int, save_steps: int, **kw) -> tuple[TierStoreTrainer, Keep]:
    keep = Keep()
    t = TierStoreTrainer(model=_model(), args=_args(run, max_steps, save_steps), train_dataset=_data(), store=store,
                         data_collator=default_data_collator, callbacks=[keep], **kw)
    t.train()
    return t, keep


def _listing(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def _assert_bitwise(loaded: torch.nn.Module, want: dict[str, torch.Tensor]) -> None:
    got = loaded.state_dict()
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()  # tied again


def test_an_exported_checkpoint_loads_with_from_pretrained_bitwise(store, tmp_path, redis_url, shm_root):
    run = tmp_path / "out"
    trainer, keep = _train(store, run, max_steps=8, save_steps=4, processing_class=_tokenizer())
    assert sorted(keep.at) == [4, 8]
    assert not torch.equal(keep.at[4]["transformer.wte.weight"], keep.at[8]["transformer.wte.weight"])
    assert sorted(os.listdir(run / "checkpoint-8")) == ["tierstore.json", "trainer_state.json"]
    trainer.save_model()  # the Trainer's own final files in the run directory: config, generation config, tokenizer
    before = {d: _listing(run / d) for d in ("checkpoint-4", "checkpoint-8")}

    for step in (4, 8):
        out = tmp_path / f"hf-{step}"
        assert export_pretrained(run / f"checkpoint-{step}", out, store=store) == str(out)
        names = sorted(os.listdir(out))
        assert "model.safetensors" in names and "config.json" in names and "generation_config.json" in names
        assert "tokenizer.json" in names and "tokenizer_config.json" in names
        assert not {"tierstore.json", "trainer_state.json", "training_args.bin"} & set(names)
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            stored = set(f.keys())
        assert "lm_head.weight" not in stored and "transformer.wte.weight" in stored  # a tied weight once
        loaded = AutoModelForCausalLM.from_pretrained(out)
        _assert_bitwise(loaded, keep.at[step])
        assert AutoTokenizer.from_pretrained(out)("t5 t9").input_ids == [5, 9]

    trained = trainer.model.eval()  # its weights are checkpoint-8's: the run ended there
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf-8").eval()
    with torch.no_grad():
        want, got = trained(IDS).logits, loaded(IDS).logits
    assert want.shape == (1, 8, 64) and torch.equal(got, want)

    # a config object instead of the run directory's files: the same weights
    export_pretrained(run / "checkpoint-4", tmp_path / "from-config", store=store, config=trainer.model.config)
    assert sorted(os.listdir(tmp_path / "from-config")) == ["config.json", "model.safetensors"]
    _assert_bitwise(AutoModelForCausalLM.from_pretrained(tmp_path / "from-config"), keep.at[4])

    # the command line writes the same file
    from tierstore.cli.transfer import export_main

    (tmp_path / "cli").mkdir()  # an empty directory is filled
    assert export_main(["--pretrained", str(run / "checkpoint-8"), "--out", str(tmp_path / "cli"), "--quiet",
                        "--home", str(tmp_path / "home"), "--redis", redis_url,
                        "--durable", f"file://{tmp_path / 'durable'}", "--host-root", str(shm_root / "node0"),
                        "--node", "node0"]) == 0
    assert (tmp_path / "cli" / "model.safetensors").read_bytes() == (tmp_path / "hf-8" / "model.safetensors").read_bytes()

    assert {d: _listing(run / d) for d in before} == before  # nothing written in the checkpoint directories
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]


def test_a_directory_without_a_pointer_is_refused(store, tmp_path):
    empty, pending, own = tmp_path / "empty", tmp_path / "pending", tmp_path / "own"
    for d in (empty, pending, own):
        d.mkdir()
    (pending / "trainer_state.json").write_text("{}")  # a save whose commit never finished
    (own / "trainer_state.json").write_text("{}")
    (own / "model.safetensors").write_bytes(b"")  # the Trainer's own checkpoint
    for d, says in ((empty, "holds no tierstore.json"), (pending, "never committed"),
                    (own, "from_pretrained reads it as it is"), (tmp_path / "missing", "is not a directory")):
        with pytest.raises(CheckpointNotFoundError, match=says) as e:
            export_pretrained(d, tmp_path / "x", store=store)
        assert e.value.path == str(d)
    assert not (tmp_path / "x").exists()


def test_a_taken_out_dir_no_config_and_a_gone_step_are_refused(store, tmp_path, shm_root):
    run = tmp_path / "out"
    trainer, _ = _train(store, run, max_steps=4, save_steps=2)
    ckpt = run / "checkpoint-4"
    before = _listing(ckpt)

    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    with pytest.raises(KeyExistsError, match="not empty"):
        export_pretrained(ckpt, taken, store=store, config=trainer.model.config)
    assert _listing(taken) == {"notes.txt": b"mine"}
    (tmp_path / "afile").write_text("x")
    with pytest.raises(KeyExistsError, match="is a file"):
        export_pretrained(ckpt, tmp_path / "afile", store=store, config=trainer.model.config)
    with pytest.raises(ConfigError, match="inside the checkpoint directory"):
        export_pretrained(ckpt, ckpt / "hf", store=store, config=trainer.model.config)
    with pytest.raises(ConfigError, match=r"no config\.json") as e:  # no save_model(): no config.json anywhere
        export_pretrained(ckpt, tmp_path / "hf", store=store)
    assert e.value.field == "config"
    with pytest.raises(ConfigError, match="transformers config"):
        export_pretrained(ckpt, tmp_path / "hf", store=store, config=trainer.model)

    ptr = json.loads((ckpt / "tierstore.json").read_text())
    store.flush()  # durable, then every copy lost: the index still records the step, no tier holds it
    for root in (shm_root / "node0", tmp_path / "durable"):
        for p in root.iterdir():
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    with pytest.raises(CheckpointGoneError, match=f"step {ptr['step']} of {ptr['model']}") as gone:
        export_pretrained(ckpt, tmp_path / "hf", store=store, config=trainer.model.config)
    assert gone.value.step == ptr["step"] and gone.value.model == ptr["model"] and gone.value.newest is None

    store.delete_model(ptr["model"], force=True)
    with pytest.raises(CheckpointNotFoundError, match="not in this store"):
        export_pretrained(ckpt, tmp_path / "hf", store=store, config=trainer.model.config)

    assert not (tmp_path / "hf").exists() and not (ckpt / "hf").exists()
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]  # no half-written sibling either
    assert _listing(ckpt) == before


def test_a_resumable_export_resumes_in_the_plain_trainer_bitwise(store, tmp_path, redis_url, shm_root):
    """``resumable=True``: a plain ``transformers.Trainer`` (not ``TierStoreTrainer``) resumes from the exported
    ``checkpoint-4`` (its weights, optimizer, scheduler, RNG and trainer state files) and trains steps 5-8 exactly
    as the uninterrupted run did: the same losses and the same final weights, bit for bit. A model-only
    checkpoint is refused, and leaves nothing."""
    from transformers import Trainer

    class Losses(TrainerCallback):
        def __init__(self) -> None:
            self.at: dict[int, float] = {}

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                self.at[state.global_step] = logs["loss"]

    def args(out: Path) -> TrainingArguments:
        a = _args(out, max_steps=8, save_steps=4)
        a.logging_steps = 1
        return a

    run, ref_losses = tmp_path / "out", Losses()
    ref = TierStoreTrainer(model=_model(), args=args(run), train_dataset=_data(), store=store,
                           data_collator=default_data_collator, callbacks=[ref_losses])
    ref.train()
    exported = tmp_path / "resumable"
    export_pretrained(run / "checkpoint-4", exported, store=store, config=ref.model.config, resumable=True)
    names = sorted(os.listdir(exported))
    assert names == ["config.json", "model.safetensors", "optimizer.pt", "rng_state.pth", "scheduler.pt",
                     "trainer_state.json"], names
    assert (exported / "trainer_state.json").read_bytes() == (run / "checkpoint-4" / "trainer_state.json").read_bytes()
    from tierstore.cli.transfer import export_main  # the command line writes the same files

    assert export_main(["--pretrained", str(run / "checkpoint-4"), "--out", str(tmp_path / "cli"), "--resumable",
                        "--config", str(exported), "--quiet", "--home", str(tmp_path / "home"), "--redis", redis_url,
                        "--durable", f"file://{tmp_path / 'durable'}", "--host-root", str(shm_root / "node0"),
                        "--node", "node0"]) == 0
    assert sorted(os.listdir(tmp_path / "cli")) == names
    for n in ("model.safetensors", "trainer_state.json"):
        assert (tmp_path / "cli" / n).read_bytes() == (exported / n).read_bytes(), n

    losses = Losses()
    plain = Trainer(model=_model(), args=args(tmp_path / "plain"), train_dataset=_data(),
                    data_collator=default_data_collator, callbacks=[losses])
    plain.train(resume_from_checkpoint=str(exported))
    assert sorted(losses.at) == [5, 6, 7, 8]  # resumed after step 4
    assert all(losses.at[s] == ref_losses.at[s] for s in losses.at), (losses.at, ref_losses.at)
    want, got = ref.model.state_dict(), plain.model.state_dict()
    assert all(torch.equal(got[n], want[n]) for n in want)

    only = tmp_path / "only"
    kw = dict(model=_model(), args=_args(only, max_steps=4, save_steps=4), train_dataset=_data(), store=store,
              data_collator=default_data_collator)
    kw["args"].save_only_model = True
    TierStoreTrainer(**kw).train()
    with pytest.raises(ConfigError, match="save_only_model"):
        export_pretrained(only / "checkpoint-4", tmp_path / "refused", store=store, config=ref.model.config,
                          resumable=True)
    assert not (tmp_path / "refused").exists()
