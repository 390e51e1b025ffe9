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


def flip_everywhere(store, key: ShardKey) -> None:
    """Flip one byte in the middle of the live copy of ``key`` in the host tier and, if it is a local
    directory, the durable tier: a corruption every tier that holds it shares."""
    roots = [store.host.root] + ([store.durable.root] if getattr(store.durable, "root", None) else [])
    for root in roots:
        p = live_path(root, store, key)
        raw = bytearray(p.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        p.write_bytes(bytes(raw))
