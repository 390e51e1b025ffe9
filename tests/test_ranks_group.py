"""The gloo group a Checkpointer makes is destroyed by its close; a group the caller gave survives it.

Two real gloo ranks (``tests._ranks.run_ranks``) build and close Checkpointers over and over, as Lightning's
FSDP2 integration does when the state's objects change between saves: the live process groups
(``torch.distributed``'s registry) and this process's open descriptors (the groups' sockets) must not grow.
Then: a caller's group survives the close and still runs collectives; a constructor that fails releases its
group; a close is idempotent, bounded with the other rank gone, and harmless after the default group (and with
it every group) was destroyed first.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

from tests._ranks import run_ranks

M = "groups"
REBUILDS = 6


def _live_groups() -> int:
    from torch.distributed import distributed_c10d as c10d

    return len(c10d._world.pg_map)


def _fds() -> int:
    gc.collect()
    return len(os.listdir("/proc/self/fd"))


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, IndexError):
        return True


def worker(rank: int, port: int, home: str, out: str) -> None:
    import torch.distributed as dist

    import tierstore
    from tierstore.errors import InvalidValueError
    from tierstore.train.checkpointer import Checkpointer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    store = tierstore.open(home)
    got: dict = {"base": _live_groups(), "open": [], "closed": [], "fds": [], "close_s": []}
    for i in range(REBUILDS):  # a new state's objects each time: Lightning rebuilds its Checkpointer
        net = torch.nn.Linear(4, 4)
        ck = Checkpointer(store, M, state={"model": net, "optim": torch.optim.SGD(net.parameters(), lr=0.1)},
                          keep_last=1, preallocate=False, timeout=30)
        got["open"].append(_live_groups())
        got["owns"] = ck.ranks.owns_group
        ck.save(i)
        got["outcome"] = ck.wait()
        t0 = time.monotonic()
        ck.close()
        got["close_s"].append(time.monotonic() - t0)
        ck.close()  # idempotent
        got["closed"].append(_live_groups())
        del ck, net
        got["fds"].append(_fds())

    mine = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
    ck = Checkpointer(store, M, torch.nn.Linear(4, 4), group=mine, preallocate=False, timeout=30)
    got["given_owned"] = ck.ranks.owns_group
    ck.close()
    ck.close()
    t = torch.tensor([rank + 1])
    dist.all_reduce(t, group=mine)  # the caller's group still runs collectives after the close
    got["given_sum"], got["given_live"] = int(t[0]), _live_groups()
    dist.destroy_process_group(mine)

    class Refuses:
        def state_dict(self):
            return self.missing  # an AttributeError: the constructor refuses the state after making its group

        def load_state_dict(self, sd):
            pass

    try:
        Checkpointer(store, M, state={"model": torch.nn.Linear(4, 4), "odd": Refuses()}, preallocate=False)
        got["refused"] = False
    except InvalidValueError:
        got["refused"] = True
    got["after_refusal"] = _live_groups()

    # the other rank goes away (without closing anything); this rank's closes must not wait for it
    first = Checkpointer(store, M, torch.nn.Linear(4, 4), preallocate=False, timeout=30)
    second = Checkpointer(store, M, torch.nn.Linear(4, 4), preallocate=False, timeout=30)
    pids = [torch.tensor([0]), torch.tensor([0])]
    dist.all_gather(pids, torch.tensor([os.getpid()]))
    if rank == 1:
        store.close()
        sys.stdout.flush()
        os._exit(0)
    deadline = time.monotonic() + 60
    while not _gone(int(pids[1][0])) and time.monotonic() < deadline:
        time.sleep(0.05)
    got["peer_gone"] = _gone(int(pids[1][0]))
    t0 = time.monotonic()
    first.close()
    got["lone_close_s"], got["lone_live"] = time.monotonic() - t0, _live_groups()
    dist.destroy_process_group()  # the default group, and with it every group, before the last close
    second.close()
    got["after_world"] = second.ranks.owns_group
    store.close()
    Path(out).write_text(json.dumps(got))


def test_a_checkpointer_releases_the_group_it_made_and_keeps_a_given_one(tmp_path):
    out = tmp_path / "rank0.json"
    job = run_ranks("tests.test_ranks_group", lambda r, port: [str(r), str(port), str(tmp_path / "home"), str(out)],
                    torchrun=False, timeout_s=180)
    assert job.codes == [0, 0], job.tail()
    got = json.loads(out.read_text())
    base = got["base"]
    assert got["outcome"] == "committed" and got["owns"]
    assert got["open"] == [base + 1] * REBUILDS  # each Checkpointer made a group ...
    assert got["closed"] == [base] * REBUILDS  # ... and its close destroyed it
    # the groups' sockets do not pile up: a gloo group of two ranks holds 5 descriptors, a leak of one per rebuild
    # would add 20 here (another descriptor of the store's may open once)
    assert got["fds"][-1] - got["fds"][1] < 5, got["fds"]
    assert max(got["close_s"]) < 10, got["close_s"]
    assert got["given_owned"] is False and got["given_sum"] == 3 and got["given_live"] == base + 1
    assert got["refused"] and got["after_refusal"] == base
    assert got["peer_gone"] and got["lone_close_s"] < 10 and got["lone_live"] == base + 1
    assert got["after_world"] is False


if __name__ == "__main__":
    a = sys.argv[1:]
    worker(int(a[0]), int(a[1]), a[2], a[3])
