"""``store.get(key, out=...)`` verifies while it copies: a bad copy never comes back as a success.

The one-pass read hashes 1 MiB chunks and copies each into ``out`` while it is
hot, so a corrupt copy is known only after earlier chunks were copied. These
tests corrupt the copy the user would read first, late in the object, and
check that ``out`` ends up holding the verified bytes of the next tier, or that
the call fails.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tierstore import ShardKey
from tierstore.errors import NoValidCopyError

K = ShardKey("gpt", "big", 5, 0)


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {"w": torch.randn(1 << 20, generator=g), "m": torch.randn(3, 1 << 18, generator=g),
            "step": torch.tensor(9)}


def _corrupt(path: Path, at: float) -> None:
    data = bytearray(path.read_bytes())
    data[int((len(data) - 16) * at)] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("at", [0.2, 0.95])
def test_corrupt_host_copy_read_into_out_falls_back_and_overwrites(store, at):
    t = _tensors()
    store.put(K, t)
    store.flush()
    assert set(store.info(K).tiers) == {"host", "durable"}
    _corrupt(Path(store.host.root) / store.info(K).name, at)
    out = {n: torch.zeros_like(v) for n, v in t.items()}
    shard = store.get(K, out=out)
    for n, v in t.items():
        assert shard.tensors[n] is out[n]
        assert torch.equal(out[n], v), n


def test_no_valid_copy_into_out_fails(store):
    t = _tensors()
    store.put(K, t)
    store.flush()
    _corrupt(Path(store.host.root) / store.info(K).name, 0.9)
    _corrupt(Path(store.durable.root) / store.info(K).name, 0.9)
    out = {n: torch.zeros_like(v) for n, v in t.items()}
    with pytest.raises(NoValidCopyError) as ei:
        store.get(K, out=out)
    assert "checksum" in str(ei.value)


def test_get_of_an_object_written_by_another_process_is_verified(store, tmp_path):
    """A segment this process never mapped is read through a fresh populated mapping, still verified."""
    t = _tensors()
    store.put(K, t)
    store.flush()
    from backends.host import HostBackend

    other = HostBackend(store.host.root)  # no kept mappings: the reader path of a restarted process
    try:
        blob = other.get(store.info(K).name)
        from tierstore import codec

        shard = codec.decode(blob)
        assert all(torch.equal(shard.tensors[n], v) for n, v in t.items())
    finally:
        del blob
        other.close()
