"""A model's lifecycle: ``store.delete_model`` and ``tierstore admin delete``, against a real index server,
a host tier and a local durable directory.

The model is written by the Checkpointer itself (two committed, durable steps) and deleted from every
tier: its index keys, host copies, durable objects, durable manifests and epoch records; a writer that
looks live refuses the delete unless forced; a model whose index is gone but whose durable tier still
holds its manifests is deletable too; after a delete the name starts afresh (no IndexLostError, epoch 1,
listed again by ``store.models()``).
"""

from __future__ import annotations

import json

import pytest
import torch

from tierstore.cli import admin
from tierstore.errors import ModelInUseError, UnknownError
from tierstore.train.checkpointer import Checkpointer

M = "doomed"


def _everything(store, model):
    """What the store holds of ``model``, per place."""
    return {"listed": model in store.models(), "index_keys": store.index.model_keys(model),
            **{t.tier: sorted(t.list(f"{model}/")) for t in store.tiers}}


def _save(store, model, steps=(0, 1)):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    ck = Checkpointer(store, model, m, torch.optim.SGD(m.parameters(), lr=0.1), rank=0, world_size=1)
    for s in steps:
        ck.save(s)
        assert ck.wait() == "committed"
        store.flush()  # each durable before the next: a lagging migration skips the steps between
    ck.close()
    for s in steps:
        assert store.wait_step(model, s, timeout=10) == "durable"
    return m


def test_delete_model_removes_it_from_every_tier_and_the_name_starts_afresh(store):
    _save(store, M)
    _save(store, "kept")  # another model is untouched
    before = _everything(store, M)
    assert before["listed"] and before["index_keys"] and before["host"]
    assert any("/_manifest/" in n for n in before["durable"]) and any("/_epoch/" in n for n in before["durable"])
    kept = _everything(store, "kept")

    dry = store.delete_model(M, dry_run=True)
    assert dry.dry_run and dry.steps == [0, 1] and dry.durable_manifests == [0, 1] and dry.epoch_records >= 1
    assert dry.live is not None  # saved a moment ago
    assert _everything(store, M) == before  # a dry run deletes nothing

    with pytest.raises(ModelInUseError) as ei:  # a writer looks live: refused, nothing deleted
        store.delete_model(M)
    assert ei.value.model == M and "saved" in ei.value.reason
    assert _everything(store, M) == before

    report = store.delete_model(M, idle_s=0)  # nothing in flight, and nothing newer than 0 s counts as live
    assert not report.dry_run and report.live is None and report.copies["host"] == len(before["host"])
    after = _everything(store, M)
    assert after == {"listed": False, "index_keys": [], **{t.tier: [] for t in store.tiers}}
    assert _everything(store, "kept") == kept

    # the name starts afresh in this very process: nothing restored, no IndexLostError, epoch 1, listed again
    m = torch.nn.Linear(3, 3)
    ck = Checkpointer(store, M, m, rank=0, world_size=1)
    assert ck.restore() == (None, None)
    assert ck.epoch == 1
    ck.save(5)
    assert ck.wait() == "committed"
    ck.close()
    assert M in store.models() and [s for s, _ in store.steps.steps(M)] == [5]
    with pytest.raises(UnknownError):
        store.delete_model("never-saved", force=True)


def test_a_step_being_saved_refuses_the_delete_unless_forced(store):
    _save(store, M, steps=(0,))
    store.begin_step(M, 1, 2)  # begun, no vote: a writer is saving it right now
    assert "being saved" in store.delete_model(M, dry_run=True, idle_s=0).live
    with pytest.raises(ModelInUseError, match="step 1 is being saved"):
        store.delete_model(M, idle_s=0)
    assert store.steps.state(M, 1) == "preparing"
    store.delete_model(M, force=True)
    assert _everything(store, M)["index_keys"] == [] and M not in store.models()


def test_a_model_whose_index_is_gone_is_deletable_from_its_durable_tier(store):
    _save(store, M)
    store.index.drop_model(M)  # the index lost the model; the durable tier still holds its manifests
    with pytest.raises(Exception, match="index was lost"):
        store.begin_step(M, 2, 1)
    report = store.delete_model(M)
    assert report.steps == [] and report.durable_manifests == [0, 1] and report.live is None
    assert all(not names for t, names in _everything(store, M).items() if t not in ("listed", "index_keys"))
    store.begin_step(M, 2, 1)  # no durable history left: a fresh model, not a lost index


@pytest.fixture
def conn(tmp_path, redis_url, shm_root):
    return ["--redis", redis_url, "--home", str(tmp_path / "home"), "--durable", f"file://{tmp_path / 'durable'}",
            "--host-root", str(shm_root / "node0")]


def _admin(capsys, conn, *args):
    capsys.readouterr()
    rc = admin.main([*conn, "--json", *args])
    out, err = capsys.readouterr()
    return rc, (json.loads(out) if out.strip() else None), err


def test_admin_delete_dry_run_refusal_force(store, conn, capsys):
    _save(store, M)
    rc, data, _ = _admin(capsys, conn, "delete", M)
    assert rc == 0 and data["dry_run"] and data["steps"] == [0, 1] and data["live"]
    assert data["copies"]["host"] > 0 and data["durable_manifests"] == [0, 1]
    assert M in store.models()
    rc, data, err = _admin(capsys, conn, "delete", M, "--yes")
    assert rc == 1 and "live writer" in err and "--force" in err
    assert M in store.models()
    rc, data, _ = _admin(capsys, conn, "delete", M, "--yes", "--force")
    assert rc == 0 and not data["dry_run"]
    assert M not in store.models() and store.index.model_keys(M) == []
    rc, _, err = _admin(capsys, conn, "delete", M, "--yes")
    assert rc == 1 and "no model" in err
    capsys.readouterr()
    _save(store, M, steps=(0,))
    assert admin.main([*conn, "delete", M]) == 0  # the table output
    assert "dry run: nothing was deleted" in capsys.readouterr().out


def test_a_superseded_manifest_is_counted_as_a_record_not_a_copy_and_deleted_with_the_model(store):
    """A step set aside by a newer incarnation leaves its durable manifest under ``_superseded/``: the delete
    reports it apart from the copies (the operator reads "copies" as objects) and removes it with the rest."""
    _save(store, M)
    durable = store.steps.durable
    objects = [n for n in durable.list(f"{M}/") if "/_" not in n]
    out = store.steps.supersede(M, 1, epoch=store.index.epoch(M) + 1, reason="a newer incarnation")
    assert out in ("committed", "durable")
    aside = [n for n in durable.list(f"{M}/") if "/_superseded/" in n]
    assert len(aside) == 1

    dry = store.delete_model(M, dry_run=True, idle_s=0)
    assert dry.superseded_manifests == 1 and dry.copies["durable"] == len(objects)
    assert dry.to_json()["superseded_manifests"] == 1
    assert list(durable.list(f"{M}/_superseded/")) == aside  # a dry run deletes nothing

    report = store.delete_model(M, idle_s=0)
    assert report.superseded_manifests == 1
    assert list(durable.list(f"{M}/")) == []
