"""Test helpers: find the physical copies of a key in a tier (names carry a per-write tag)."""

from __future__ import annotations

from pathlib import Path

from tierstore.keys import ShardKey


def copies(tier, key: ShardKey) -> list[str]:
    """Names of every copy of ``key`` that ``tier`` holds: ``model/layer/step/rank`` plus any ``.tag``."""
    prefix = f"{key.model}/{key.layer}/{key.step}/"
    return [n for n in tier.list(prefix) if "/" not in n[len(prefix):]
            and n[len(prefix):].partition(".")[0] == str(key.rank)]


def live_name(store, key: ShardKey) -> str:
    """The physical name of the copy of ``key`` the index records."""
    rec = store.info(key)
    assert rec is not None, f"{key} is not in the index"
    return getattr(rec, "name", str(key))


def live_path(root, store, key: ShardKey) -> Path:
    """The file of the live copy of ``key`` below a tier's ``root`` (host or local durable)."""
    return Path(root) / live_name(store, key)
