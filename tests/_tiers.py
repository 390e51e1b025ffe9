"""Test helpers: find the physical copies of a key in a tier (names carry a per-write tag)."""

from __future__ import annotations

from pathlib import Path

from tierstore.errors import InvalidKeyError
from tierstore.keys import ShardKey, split_object_name


def copies(tier, key: ShardKey) -> list[str]:
    """Names of every copy of ``key`` that ``tier`` holds (any tag)."""
    out = []
    for name in tier.list(f"{key.model}/{key.layer}/{key.step}/"):
        try:
            if split_object_name(name)[0] == key:
                out.append(name)
        except InvalidKeyError:
            continue
    return out


def live_name(store, key: ShardKey) -> str:
    """The physical name of the copy of ``key`` the index records."""
    rec = store.info(key)
    assert rec is not None, f"{key} is not in the index"
    return rec.name


def live_path(root, store, key: ShardKey) -> Path:
    """The file of the live copy of ``key`` below a tier's ``root`` (host or local durable)."""
    return Path(root) / live_name(store, key)
