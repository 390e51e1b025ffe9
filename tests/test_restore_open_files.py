"""A restore of a state of many layers under the common default of 1,024 open files (here a quarter of it).

Each host-tier read view holds its object's descriptor (its shared lock); a restore keeps a view of every
object it aliases until the load, and a resharding one of every piece it verified. Past half the soft limit
the host tier hands out private copies instead (:func:`backends.host.read_view_budget`), so the restore
succeeds, bitwise, in every verify mode and resharded, where it used to fail with ``EMFILE`` ("no valid copy
in any tier"). A child process, so the limit is its own; its own embedded index server, stopped at the end.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = textwrap.dedent("""
    import json, resource, sys
    import torch
    import tierstore
    from tierstore.embedded import stop_server
    from tierstore.train.checkpointer import Checkpointer

    home, shm, layers = sys.argv[1], sys.argv[2], int(sys.argv[3])
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    out = {}

    def build(seed, part=None):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(layers)])
        params = list(m.parameters())
        mine = params if part is None else params[part[0]::part[1]]
        opt = torch.optim.SGD(mine, lr=0.1, momentum=0.9)
        m(torch.randn(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return m, opt

    def state(m, opt):
        s = {k: v.clone() for k, v in m.state_dict().items()}
        names = {id(p): n for n, p in m.named_parameters()}
        s.update({names[id(p)] + "/m": st["momentum_buffer"].clone() for p, st in opt.state.items()})
        return s

    store = tierstore.open(home=home, host_root=shm, durable="none")
    try:
        m, opt = build(1)
        ck = Checkpointer(store, "many", m, opt)
        ck.save(1)
        assert ck.wait() == "committed"
        want = state(m, opt)
        ck.close()
        for mode in ("in_pass", "before_return", "before_update"):
            t, topt = build(2)
            c = Checkpointer(store, "many", t, topt)
            try:
                got = c.restore(verify=mode, read_only=mode != "before_update").step
                if mode == "before_update":
                    c.before_update()
                have = state(t, topt)
                out[mode] = [got, sorted(have) == sorted(want) and all(torch.equal(have[k], want[k]) for k in want)]
            except Exception as e:
                out[mode] = repr(e)[:300]
            c.close()
        # two ranks' partitioned momentum (saved by two Checkpointers of world_size=2) restored on one: resharded
        ms = [build(3, (r, 2)) for r in range(2)]
        with torch.no_grad():
            for p in ms[1][0].parameters():
                p.copy_(dict(ms[0][0].named_parameters())[[n for n, q in ms[1][0].named_parameters() if q is p][0]])
        cks = [Checkpointer(store, "many2", mm, oo, rank=r, world_size=2) for r, (mm, oo) in enumerate(ms)]
        for c in cks:
            c.save(1)
        assert [c.wait() for c in cks] == ["committed", "committed"]
        want2 = {**state(*ms[0]), **state(*ms[1])}
        for c in cks:
            c.close()
        t, topt = build(4)
        c = Checkpointer(store, "many2", t, topt)
        try:
            got = c.restore(read_only=True).step
            have = state(t, topt)
            out["resharded"] = [got, bool(c.report.resharded), sorted(have) == sorted(want2)
                                and all(torch.equal(have[k], want2[k]) for k in want2)]
        except Exception as e:
            out["resharded"] = repr(e)[:300]
        c.close()
    finally:
        store.close()
        stop_server(home)
    print(json.dumps(out))
""")


def test_a_restore_of_many_layers_stays_within_a_low_open_file_limit(tmp_path, shm_root):
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "home"), str(shm_root / "host"), "300"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"in_pass": [1, True], "before_return": [1, True], "before_update": [1, True],
                   "resharded": [1, True, True]}, (out, proc.stderr[-2000:])
