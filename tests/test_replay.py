"""Gradient-log checkpoints with optimizer replay, against the real store.

Single-process tests train the small GPT, save every step (bases every few
steps, gradient logs between), restore into a fresh model and compare bitwise
with the uninterrupted run; tampered log entries must be detected and the
restore must fall back. The two-rank test runs real gloo processes, kills one
mid-run, restarts and checks the rest of the loss curve bitwise.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from tierstore.errors import ConfigError
from tierstore.testing.gpt import (
    GPTConfig,
    char_dataset,
    get_batch,
    make_model,
    setup_determinism,
    train_step,
)
from tierstore.keys import ShardKey
from tierstore.train.replay import LOG_LAYER, ReplayCheckpointer, ReplayFallbackWarning

ROOT = Path(__file__).resolve().parents[1]
CFG = GPTConfig(d_model=32, n_layer=2, n_head=2, block=32)


def _train(store, name, optim, steps, base_every=4, ckpt=True):
    """Train ``steps`` steps saving each; return (model, opt, rc, states after each step, losses)."""
    setup_determinism(0)
    model, opt = make_model(CFG, seed=0, optim=optim)
    rc = ReplayCheckpointer(store, name, model, opt, base_every=base_every) if ckpt else None
    data = char_dataset()
    states, losses = [], []
    for step in range(steps):
        x, y = get_batch(data, step, 0, 4, CFG.block)
        losses.append(train_step(model, opt, x, y))
        states.append({n: p.detach().clone() for n, p in model.named_parameters()})
        if rc is not None:
            rc.save(step, extra={"next": step + 1})
    if rc is not None:
        assert rc.wait() == "committed"
    return model, opt, rc, states, losses


def _fresh(store, name, optim, base_every=4):
    setup_determinism(0)
    model, opt = make_model(CFG, seed=1, optim=optim)  # other init: restore must overwrite it
    return model, opt, ReplayCheckpointer(store, name, model, opt, base_every=base_every)


def _equal(model, state) -> bool:
    return all(torch.equal(p.detach().view(torch.uint8), state[n].view(torch.uint8))
               for n, p in model.named_parameters())


def test_unsupported_optimizer_is_refused(store):
    model, _ = make_model(CFG)
    opt = torch.optim.RMSprop(model.parameters())
    with pytest.raises(ConfigError, match="RMSprop"):
        ReplayCheckpointer(store, "m", model, opt)


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_restore_replays_log_bitwise(store, optim):
    _, _, rc, states, _ = _train(store, f"rp-{optim}", optim, 7)
    rc.close()
    assert rc.stats.objects["full"] > 0
    model, opt, rc2 = _fresh(store, f"rp-{optim}", optim)
    step, extra = rc2.restore()
    rep = rc2.report
    assert (step, extra) == (6, {"next": 7})
    assert rep.base_step == 4 and rep.replayed == [5, 6] and not rep.fell_back
    assert _equal(model, states[6])
    # the run continues bitwise: same losses as the uninterrupted run for 3 more steps
    _, _, _, _, ref_losses = _train(store, "unused", optim, 10, ckpt=False)
    data = char_dataset()
    for s in range(7, 10):
        x, y = get_batch(data, s, 0, 4, CFG.block)
        assert train_step(model, opt, x, y) == ref_losses[s]
        rc2.save(s, extra={"next": s + 1})
    assert rc2.wait() == "committed"
    rc2.close()


def test_log_entry_is_smaller_than_base(store):
    _, _, rc, _, _ = _train(store, "rp-size", "adamw", 3, base_every=10)
    rc.close()
    base = rc.stats.per_step[0]
    logs = [rc.stats.per_step[s] for s in (1, 2)]
    assert store.info(ShardKey("rp-size", LOG_LAYER, 1, 0)).kind == "full"
    # AdamW: weights + exp_avg + exp_avg_sq (+ buffers) vs one gradient per weight
    assert all(b < base / 2.5 for b in logs), (base, logs)


def _flip(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    mid = len(raw) // 2
    raw[mid : mid + 8] = bytes(b ^ 0xFF for b in raw[mid : mid + 8])
    path.write_bytes(bytes(raw))


def test_flipped_bytes_in_every_tier_fall_back(store):
    _, _, rc, states, _ = _train(store, "rp-flip", "adamw", 7)
    rc.close()
    store.flush()
    key = ShardKey("rp-flip", LOG_LAYER, 5, 0)
    name = store.info(key).name  # the live copy's physical name
    paths = [Path(store.host._path(name)), Path(store.durable._path(name))]
    assert all(p.is_file() for p in paths)
    for p in paths:
        _flip(p)
    model, _, rc2 = _fresh(store, "rp-flip", "adamw")
    with pytest.warns(ReplayFallbackWarning):
        step, extra = rc2.restore()
    rep = rc2.report
    assert step == 4 and extra == {"next": 5} and rep.fell_back and rep.newest == 6
    assert "log step 5" in rep.reason
    assert _equal(model, states[4])
    # the resumed run can write steps 5.. again (newer steps were retired)
    rc2.save(5)
    assert rc2.wait() == "committed"
    rc2.close()


def test_substituted_gradient_is_detected_by_the_digest(store):
    _, _, rc, states, _ = _train(store, "rp-sub", "sgd", 7)
    rc.close()
    store.flush()  # the original's migration must not race the substitution
    key = ShardKey("rp-sub", LOG_LAYER, 6, 0)
    shard = store.get(key)
    # an adversary with write access to the tiers and the index (a committed key cannot be put again):
    # a valid object with wrong bytes under the live copy's name, and its checksum in the index
    fake = store.put(ShardKey("rp-sub-fake", LOG_LAYER, 6, 0), {n: t * 1.5 for n, t in shard.tensors.items()},
                     shard.metadata)
    blob = bytes(store.host.get(fake.name))
    rec = store.info(key)
    for tier in (store.host, store.durable):
        tier.put(rec.name, blob)
    store.index.record_object(key, kind=rec.kind, size=len(blob), checksum=fake.checksum, tiers=sorted(rec.tiers),
                              name=rec.name, restore=True)
    model, _, rc2 = _fresh(store, "rp-sub", "sgd")
    with pytest.warns(ReplayFallbackWarning):
        step, _ = rc2.restore()
    rep = rc2.report
    assert step == 5 and rep.replayed == [5] and "replay of step 6" in rep.reason
    assert _equal(model, states[5])
    rc2.close()


# ---- two real ranks, killed and restarted ---------------------------------------------------------

KILL = 7
STOP = KILL + 4
TAMPER = 6  # the tampered model's log step (rank 1's entry, both tiers)


def worker(rank: int, world: int, port: int, home: str, out: str, kill_at: int) -> None:
    """One rank of one incarnation (``python -m tests.test_replay ...``)."""
    from datetime import timedelta

    import torch.distributed as dist

    import tierstore

    setup_determinism(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    store = tierstore.open(home=home)
    data = char_dataset()
    jobs = {}
    for name in ("clean", "tamper"):
        model, opt = make_model(CFG, seed=0)
        rc = ReplayCheckpointer(store, f"gpt-replay-{name}", model, opt, base_every=5)
        with __import__("warnings").catch_warnings(record=True):
            step, extra = rc.restore()
        rep = rc.report
        start = 0 if step is None else step + 1
        jobs[name] = dict(model=model, opt=opt, rc=rc, start=start, losses={},
                          report={"step": step, "base": rep.base_step, "replayed": rep.replayed,
                                  "fell_back": rep.fell_back, "reason": rep.reason, "extra": extra})
    for step in range(min(j["start"] for j in jobs.values()), STOP):
        x, y = get_batch(data, step, rank, 4, CFG.block, 0)
        for j in jobs.values():
            if step >= j["start"]:
                j["losses"][step] = train_step(j["model"], j["opt"], x, y, world)
                j["rc"].save(step, extra={"next": step + 1})
        if step == kill_at:
            for j in jobs.values():
                j["rc"].wait()  # the log of step KILL is committed: a restore has a chain to replay
            if rank == 1:
                os._exit(17)
    result = {}
    for name, j in jobs.items():
        result[name] = {"report": j["report"], "losses": j["losses"], "outcome": j["rc"].wait()}
        j["rc"].close()
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(result, f)
    dist.barrier()
    store.close()
    dist.destroy_process_group()


from tests._ranks import run_ranks  # noqa: E402


def _run(home: Path, out: Path, kill_at: int) -> list[int]:
    job = run_ranks("tests.test_replay", lambda r, port: [str(r), "2", str(port), str(home), str(out), str(kill_at)],
                    timeout_s=150, torchrun=False, dies_with=17)
    if job.codes[1] != 17 and job.codes != [0, 0]:
        print(job.tail())
    return job.codes


def _tamper(home: Path) -> None:
    import tierstore

    with tierstore.open(home=home) as s:
        s.flush()
        key = ShardKey("gpt-replay-tamper", LOG_LAYER, TAMPER, 1)
        for tier in (s.host, s.durable):
            p = Path(tier._path(s.info(key).name))
            if p.is_file():
                _flip(p)


def test_two_ranks_kill_restart_replay_is_bitwise(tmp_path):
    from tierstore.testing.gpt import train_emulated

    home = tmp_path / "home"
    assert _run(home, tmp_path / "first", KILL)[1] == 17
    _tamper(home)
    assert _run(home, tmp_path / "second", -1) == [0, 0]
    res = [json.loads((tmp_path / f"second.{r}.json").read_text()) for r in range(2)]
    setup_determinism(0)
    model, opt = make_model(CFG, seed=0)
    ref = train_emulated(model, opt, 0, STOP, world_size=2, batch_size=4)
    for rank in range(2):
        clean, tamp = res[rank]["clean"], res[rank]["tamper"]
        assert clean["report"]["step"] == KILL and clean["report"]["base"] == 5
        assert clean["report"]["replayed"] == [6, 7] and not clean["report"]["fell_back"]
        # rank 1's entry of step 6 is corrupt in every tier: both ranks agree on the base
        assert tamp["report"]["step"] == 5 and tamp["report"]["fell_back"]
        assert tamp["report"]["extra"] == {"next": 6}
        for r in (clean, tamp):
            losses = {int(k): v for k, v in r["losses"].items()}
            assert sorted(losses) == list(range(r["report"]["step"] + 1, STOP))
            for s, loss in losses.items():
                assert loss == ref[rank][s], (rank, s, loss, ref[rank][s])
            assert r["outcome"] == "committed"


if __name__ == "__main__":
    a = sys.argv[1:]
    worker(int(a[0]), int(a[1]), int(a[2]), a[3], a[4], int(a[5]))
