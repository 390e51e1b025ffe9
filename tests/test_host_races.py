"""The host tier's reuse pool against other processes working on the same tier in the unlucky order.

A writer claims a pooled segment for a reservation (an atomic rename out of the
pool into ``.tmp``) while another process drains the pool (``drain_pool``: the
first store to hold the tier, or the last to let it go), cleans abandoned
reservations (``cleanup_temp``) or pre-allocates segments. None of these may
make a reservation fail, publish wrong bytes, or leave a segment in a pool that
a drain just emptied.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

from backends.host import HostBackend

SIZE = 1 << 20


def _drain_loop(root: str, seconds: float, ready) -> None:
    b = HostBackend(root)
    ready.set()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        b.drain_pool()
        b.cleanup_temp(max_age_s=3600)  # an operator's sweep of abandoned reservations
    b.close()


def _pattern(i: int) -> bytes:
    return bytes([i % 251]) * SIZE


def test_reserve_cycle_against_a_draining_process_keeps_every_object_intact(shm_root):
    """Objects of one size are written, read back and deleted (so every write claims the previous one's segment
    from the pool) while another process drains the pool and sweeps abandoned temporaries as fast as it can: no
    reservation fails and every published object holds exactly what was written."""
    root = str(shm_root / "node0")
    b = HostBackend(root)
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    p = ctx.Process(target=_drain_loop, args=(root, 4.0, ready))
    p.start()
    try:
        assert ready.wait(60)
        errors = []
        for i in range(300):
            name = f"m/l/{i}/0"
            try:
                res = b.reserve(name, SIZE)
                res.buffer[:] = _pattern(i)
                res.commit(if_absent=True)
            except Exception as e:  # noqa: BLE001 - collected: the test reports every failure
                errors.append((i, repr(e)))
                continue
            got = b.get(name)
            assert got is not None and bytes(got) == _pattern(i), f"object {i} does not hold what was written"
            del got
            assert b.delete(name)
        assert errors == []
    finally:
        p.join(30)
    assert p.exitcode == 0
    b.close()


def test_a_claimed_segment_still_being_read_does_not_go_back_to_a_drained_pool(shm_root):
    """A writer finds the pooled segment it claimed still mapped by a reader: it must not put it back into
    the pool, where it would outlive the drain that the last holder of the tier ran meanwhile."""
    b = HostBackend(shm_root / "node0")
    b.put("m/l/0/0", _pattern(1))
    view = b.get("m/l/0/0")  # a reader (a migration, a peer) still maps the object...
    assert b.delete("m/l/0/0")  # ...which is deleted: its segment goes to the pool
    pool = Path(b.root) / ".pool"
    assert len(os.listdir(pool)) == 1
    res = b.reserve("m/l/1/0", SIZE)  # claims the segment, finds it read: must take a fresh one instead
    res.buffer[:] = _pattern(2)
    res.commit()
    assert bytes(view) == _pattern(1)  # the reader's view never changed
    assert os.listdir(pool) == []  # nothing went back to the pool
    assert bytes(b.get("m/l/1/0")) == _pattern(2)
    del view
    b.close()


def test_cleanup_temp_never_takes_a_reservation_made_from_an_old_pooled_segment(shm_root):
    """A pooled segment last written hours ago is claimed for a reservation; an operator's sweep of abandoned
    reservations (older than an hour) runs before it is committed: the reservation is not abandoned."""
    b = HostBackend(shm_root / "node0")
    b.put("m/l/0/0", _pattern(1))
    assert b.delete("m/l/0/0")
    pool = Path(b.root) / ".pool"
    (entry,) = os.listdir(pool)
    old = time.time() - 7200
    os.utime(pool / entry, (old, old))  # written two hours ago
    res = b.reserve("m/l/1/0", SIZE)  # claims that segment
    assert os.listdir(pool) == []
    sweeper = HostBackend(shm_root / "node0")  # another process's view of the tier
    assert sweeper.cleanup_temp(max_age_s=3600) == 0
    res.buffer[:] = _pattern(2)
    res.commit()
    assert bytes(b.get("m/l/1/0")) == _pattern(2)
    sweeper.close()
    b.close()
