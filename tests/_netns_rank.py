"""A scripted trainer rank for the partition tests: one JSON command per stdin line, one JSON result per stdout line.

Run inside a node's namespace (``python -m tests._netns_rank``) by
:mod:`tests.test_netns`. Commands (``cmd`` plus arguments):

* ``open``: ``tierstore.open`` with the given options; ``gate`` (a path) holds
  every migration to the durable tier until that file exists.
* ``epoch``: ``bump`` true opens a new epoch, else reads the current one.
* ``put``: this rank's shards of ``step`` (layers ``block0``, ``block1`` of
  ``mib`` MiB each, contents a function of model, step, rank and layer).
* ``begin`` / ``vote`` / ``wait`` / ``state`` / ``flush``: the commit protocol.
* ``restore``: resolve, read ``rank``'s shards and compare them bit for bit.

Every result is ``{"ok": true, ...}`` or ``{"ok": false, "error": <type>, "message": ...}``
with the seconds the command took.
"""

from __future__ import annotations

import json
import os
import sys
import time
import zlib

import torch

import tierstore
from tierstore import ShardKey

LAYERS = ("block0", "block1")


def tensors(model: str, step: int, rank: int, layer: str, mib: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(zlib.crc32(f"{model}/{layer}/{step}/{rank}".encode()))
    n = max(1, int(mib * (1 << 20)) // 4)
    return {"w": torch.randn(n, generator=g), "m": torch.randn(64, generator=g)}


class Rank:
    def __init__(self) -> None:
        self.store = None
        self.model = ""
        self.records: dict[int, list] = {}
        self.mib = 1.0

    def open(self, a: dict) -> dict:
        self.model = a.pop("model")
        gate = a.pop("gate", None)
        home = a.pop("home")
        self.store = tierstore.open(home, **a)
        if gate:
            def wait_gate(_key) -> None:
                while not os.path.exists(gate):
                    time.sleep(0.05)

            self.store.rewire(before_migrate=wait_gate)
        return {}

    def epoch(self, a: dict) -> dict:
        if a.get("bump"):
            return {"epoch": self.store.open_epoch(self.model)}
        return {"epoch": self.store.index.epoch(self.model)}

    def put(self, a: dict) -> dict:
        step, rank, mib = a["step"], a["rank"], a.get("mib", 1.0)
        self.records[step] = [self.store.put(ShardKey(self.model, layer, step, rank),
                                             tensors(self.model, step, rank, layer, mib), epoch=a.get("epoch"))
                              for layer in LAYERS]
        return {"keys": [str(r.key) for r in self.records[step]]}

    def begin(self, a: dict) -> dict:
        self.store.steps.begin(self.model, a["step"], a["world"], layout={"layers": list(LAYERS)},
                               epoch=a.get("epoch"), timeout_s=a.get("step_timeout"))
        return {}

    def vote(self, a: dict) -> dict:
        return {"state": self.store.vote(self.model, a["step"], a["rank"], self.records[a["step"]],
                                         epoch=a.get("epoch"))}

    def wait(self, a: dict) -> dict:
        return {"state": self.store.wait_step(self.model, a["step"], timeout=a.get("wait_s"))}

    def state(self, a: dict) -> dict:
        return {"state": self.store.steps.state(self.model, a["step"])}

    def flush(self, a: dict) -> dict:
        self.store.flush()
        return {}

    def exit(self, a: dict) -> dict:
        return {}

    def restore(self, a: dict) -> dict:
        res = self.store.resolve(self.model)
        rank, mib = a["rank"], a.get("mib", 1.0)
        for layer in LAYERS:
            want = tensors(self.model, res.step, rank, layer, mib)
            got = self.store.get(res.objects[(layer, rank)].key)
            if got is None or any(not torch.equal(got.tensors[n], want[n]) for n in want):
                raise AssertionError(f"{layer} of rank {rank} at step {res.step} differs from what was saved")
        return {"step": res.step}


def main() -> None:
    rank = Rank()
    for line in sys.stdin:
        a = json.loads(line)
        cmd = a.pop("cmd")
        t0 = time.monotonic()
        try:
            out = {"ok": True, **getattr(rank, cmd)(a)}
        except Exception as e:  # noqa: BLE001 - reported to the test, which decides
            out = {"ok": False, "error": type(e).__name__, "message": str(e)[:500]}
        out["seconds"] = round(time.monotonic() - t0, 3)
        print(json.dumps(out), flush=True)
        if cmd == "exit":
            os._exit(0)  # no flush: a zombie's queued work must not delay the test


if __name__ == "__main__":
    main()
