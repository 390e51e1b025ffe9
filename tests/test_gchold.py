"""Holding the cyclic garbage collector off during a save and a restore (tierstore.gchold).

A Checkpointer save of a thousand parameters allocates tens of thousands of small objects; the collections they
triggered, each walking every object of the process, were about half of ``save()`` (262 ms against 158 ms held
off, eager, 0.25 GiB). What must hold: the collector is off while ``save()`` and ``restore()`` run and back on
after, also when they raise; a program that disabled it keeps it disabled; ``hold_gc=False`` leaves it alone;
holds from several threads overlap without one turning it back on under another.
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Mapping

import pytest
import torch
from torch import nn

from tierstore import gchold
from tierstore.errors import InvalidValueError
from tierstore.train.checkpointer import Checkpointer


@pytest.fixture(autouse=True)
def _collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    if was:
        gc.enable()
    else:
        gc.disable()


def test_a_hold_turns_the_collector_off_and_back_on_also_when_the_block_raises():
    with gchold.held():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gchold.held():
        assert not gc.isenabled()
        raise RuntimeError("boom")
    assert gc.isenabled()
    with gchold.held(False):
        assert gc.isenabled()


def test_a_collector_disabled_by_the_program_stays_disabled():
    gc.disable()
    with gchold.held():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_overlapping_holds_of_two_threads_keep_it_off_until_the_last_leaves():
    a_in, b_in, a_out, b_may_leave = (threading.Event() for _ in range(4))
    seen: dict[str, bool] = {}

    def a() -> None:
        with gchold.held():
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def b() -> None:
        a_in.wait(10)
        with gchold.held():
            b_in.set()
            a_out.wait(10)
            seen["after a left"] = gc.isenabled()
            b_may_leave.wait(10)

    ta, tb = threading.Thread(target=a), threading.Thread(target=b)
    ta.start()
    tb.start()
    a_out.wait(10)
    ta.join(10)
    b_may_leave.set()
    tb.join(10)
    assert seen == {"after a left": False}, "the first holder to leave turned the collector back on"
    assert gc.isenabled()


class _Probe:
    """A Stateful entry of the state that notes whether the collector ran while it was read and loaded."""

    def __init__(self) -> None:
        self.saw: list[tuple[str, bool]] = []
        self.fail = False

    def state_dict(self) -> dict:
        self.saw.append(("save", gc.isenabled()))
        if self.fail:
            return {"bad": object()}  # not storable: the save raises InvalidValueError
        return {"n": 1}

    def load_state_dict(self, sd: dict) -> None:
        self.saw.append(("restore", gc.isenabled()))


def _state() -> dict:
    m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    return {"model": m, "optim": opt, "probe": _Probe()}


@pytest.mark.parametrize("hold", [True, False])
def test_the_checkpointer_holds_it_off_in_save_and_restore_and_gives_it_back(store, hold):
    state = _state()
    probe = state["probe"]
    ck = Checkpointer(store, f"gchold{int(hold)}", state=state, keep_last=2, hold_gc=hold)
    probe.saw.clear()  # the constructor reads the state once (outside any save)
    ck.save(1)
    assert gc.isenabled()
    assert ck.wait() == "committed"
    probe.fail = True
    with pytest.raises(InvalidValueError):
        ck.save(2)
    assert gc.isenabled(), "a save that raised left the collector off"
    probe.fail = False
    assert ck.restore().step == 1
    assert gc.isenabled()
    assert probe.saw[:2] == [("save", not hold), ("save", not hold)]
    assert probe.saw[-1] == ("restore", not hold)
    assert all(on == (not hold) for _, on in probe.saw), probe.saw  # the restore reads it too (its template)
    ck.close()


class _Watched(Mapping):
    """Tensors that note whether the collector ran whenever the store read them."""

    def __init__(self, **tensors: torch.Tensor) -> None:
        self.tensors = tensors
        self.seen: list[bool] = []

    def __getitem__(self, name: str) -> torch.Tensor:
        self.seen.append(gc.isenabled())
        return self.tensors[name]

    def __iter__(self):
        self.seen.append(gc.isenabled())
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


def test_snapshot_many_holds_it_off_and_a_failure_aborts_the_ones_before(store):
    from tierstore.keys import ShardKey

    good = [_Watched(w=torch.full((64,), float(i))) for i in range(3)]
    keys = [ShardKey("gcmany", f"l{i}", 1, 0) for i in range(3)]
    with pytest.raises(InvalidValueError):
        store.snapshot_many([(keys[0], good[0], None), (keys[1], good[1], None), (keys[2], {"w": "not a tensor"}, None)])
    assert gc.isenabled()
    assert all(g.seen and not any(g.seen) for g in good[:2]), [g.seen for g in good]
    tmp = store.host.root / ".tmp"
    left = [n for n in os.listdir(tmp) if n.startswith(".tmp-")]
    assert not left, f"the snapshots before the failure left their reservations: {left}"
    assert not list(store.host.list("gcmany/"))
    pend = store.snapshot_many([(k, g, {"i": i}) for i, (k, g) in enumerate(zip(keys, good))])
    assert [p.key for p in pend] == keys
    store.finish_many(pend)
    outs = [_Watched(w=torch.empty(64)) for _ in keys]
    got = store.get_many(keys, outs=outs)
    seen = [list(o.seen) for o in outs]
    assert gc.isenabled()
    assert all(s and not any(s) for s in seen), seen
    assert [s.metadata["i"] for s in got] == [0, 1, 2]
    assert all(torch.equal(o.tensors["w"], torch.full((64,), float(i))) for i, o in enumerate(outs))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_during_a_hold_has_the_collector_and_can_hold_again():
    """A fork while another thread holds (a save in flight): the child has no holder to give the collector back,
    so it must start with it on, and a lock nobody holds."""
    with gchold.held():
        pid = os.fork()
        if pid == 0:  # the child: exit code 0 only if every check passes
            ok = gc.isenabled()
            with gchold.held():
                ok = ok and not gc.isenabled()
            ok = ok and gc.isenabled()
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert not gc.isenabled()  # the parent's hold is untouched
    assert os.waitstatus_to_exitcode(status) == 0
    assert gc.isenabled()
