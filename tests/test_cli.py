"""The ``tierstore`` command as a person or a script meets it, each case run as a subprocess.

Help texts (every option says its default), the bench's name, commands that start without
torch, ``--json`` into a closed pipe, read-only commands that create nothing, no stray blank
lines, missing optional dependencies named with their ``pip install``, and the server's
lifecycle: ``stop --purge`` (asks, refuses while the home is held, removes what the home holds)
and servers whose home was deleted under them (found and stopped by pid).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import tierstore
from consistency.gc import Retention
from tierstore.embedded import ensure_server, find_servers, socket_path, stop_server
from tierstore.home import host_dir
from tierstore.keys import ShardKey

REPO = Path(__file__).resolve().parents[1]
M = "gpt"

# Runs the command as ``python -m tierstore.cli`` would, then says on stderr whether torch was imported.
PROBE = ("import sys, runpy\nsys.argv = ['tierstore'] + sys.argv[1:]\n"
         "try:\n    runpy.run_module('tierstore.cli', run_name='__main__')\n"
         "finally:\n    sys.stderr.write('TORCH=%d' % ('torch' in sys.modules))\n")
# Runs the command with the modules named in argv[1] missing (as if not installed).
WITHOUT = ("import sys, runpy\nfor m in sys.argv[1].split(','):\n    sys.modules[m] = None\n"
           "sys.argv = ['tierstore'] + sys.argv[2:]\nrunpy.run_module('tierstore.cli', run_name='__main__')\n")


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(extra)
    return env


def cli(*args: str, input: str | None = None, cwd: Path | None = None, timeout: float = 120,
        **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tierstore.cli", *args], capture_output=True, text=True,
                          input=input, cwd=cwd, env=_env(**env), timeout=timeout, check=False)


@pytest.fixture
def home(tmp_path):
    """An embedded home with model gpt: layers a, b; ranks 0, 1; steps 1-3 committed and durable."""
    h = tmp_path / "home"
    store = tierstore.open(h)
    try:
        for step in (1, 2, 3):
            store.begin_step(M, step, 2, layout={"layers": ["a", "b"]})
            for rank in (0, 1):
                objs = [store.put(ShardKey(M, layer, step, rank), {"w": torch.full((64,), float(step))})
                        for layer in ("a", "b")]
                store.vote(M, step, rank, objs)
            store.flush()  # each step migrated before the next (a lagging migration skips the ones between)
        for step in (1, 2, 3):
            assert store.wait_step(M, step, timeout=30) == "durable"
    finally:
        store.close()
    yield h
    stop_server(h)


# -- help ---------------------------------------------------------------------------------------------
def test_top_level_help_lists_every_command_with_what_it_needs():
    p = cli("--help")
    assert p.returncode == 0 and p.stderr == ""
    for word in ("demo", "admin", "server", "agent", "bench", "testbed", "start", "stop [--purge]",
                 "tierstore[plot]", "tierstore[testbed]", "tierstore[ucx]"):
        assert word in p.stdout, word
    p = cli("frobnicate")
    assert p.returncode == 2 and "unknown command" in p.stderr


def _parser_of(main, monkeypatch) -> argparse.ArgumentParser:
    """The parser a command's ``main`` builds (captured as it parses, before it does anything)."""

    class Got(Exception):
        pass

    def capture(self, *_a, **_k):
        raise Got(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(Got) as got:
        main([])
    monkeypatch.undo()
    return got.value.args[0]


def _parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                yield from _parsers(sub)


@pytest.mark.parametrize("command", ["admin", "server", "demo", "testbed", "agent", "bench"])
def test_every_option_has_help_that_says_its_default(command, monkeypatch):
    from importlib import import_module

    from tierstore.cli import _COMMANDS

    module, func, *_ = _COMMANDS[command]
    parser = _parser_of(getattr(import_module(module), func), monkeypatch)
    bad = []
    for p in _parsers(parser):
        formatter = p._get_formatter()
        for a in p._actions:
            if not a.option_strings or isinstance(a, argparse._HelpAction) or a.help == argparse.SUPPRESS:
                continue
            text = formatter._expand_help(a) if a.help else ""
            name = f"{p.prog} {a.option_strings[-1]}"
            if not text.strip():
                bad.append(f"{name}: no help")
            elif a.default not in (None, False, argparse.SUPPRESS) and "default" not in text:
                bad.append(f"{name}: the help does not say the default {a.default!r}")
            elif a.default in (None, argparse.SUPPRESS) and not a.required and a.nargs != 0 and "default" not in text:
                bad.append(f"{name}: the help does not say what happens without it")
    assert bad == []


def test_bench_names_itself_tierstore_bench():
    p = cli("bench", "--help")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("usage: tierstore bench") and "python -m" not in p.stdout
    assert "(default: 200)" in p.stdout  # --tensors


# -- start without torch ------------------------------------------------------------------------------
@pytest.mark.parametrize("args", [
    ["admin", "models"], ["admin", "steps", M], ["admin", "show", M, "2"], ["admin", "layers", M],
    ["admin", "where", f"{M}/a/2/1"], ["admin", "du"], ["admin", "nodes"], ["admin", "verify", M],
    ["admin", "gc", M], ["admin", "--json", "watch", M, "--timeout", "0.1"], ["server", "status"],
], ids=lambda a: " ".join(a[:2]))
def test_admin_and_server_commands_do_not_import_torch(home, args):
    p = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True,
                       env=_env(TIERSTORE_HOME=str(home)), timeout=120, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stderr.endswith("TORCH=0"), p.stderr


# -- output -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args", [["models"], ["steps", M], ["show", M, "2"], ["verify", M]], ids=lambda a: a[0])
def test_json_output_survives_a_closed_pipe(home, args):
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first byte: every write fails (EPIPE)
    try:
        p = subprocess.run([sys.executable, "-m", "tierstore.cli", "admin", "--home", str(home), "--json", *args],
                           stdout=write, stderr=subprocess.PIPE, text=True, env=_env(), timeout=120, check=False)
    finally:
        os.close(write)
    assert p.returncode == 0 and p.stderr == "", p.stderr


@pytest.mark.parametrize("args", [["--help"], ["demo", "--help"], ["server", "--help"], ["server", "list"]],
                         ids=lambda a: " ".join(a))
def test_help_into_a_closed_pipe_is_quiet(args):
    read, write = os.pipe()
    os.close(read)
    try:
        p = subprocess.run([sys.executable, "-m", "tierstore.cli", *args], stdout=write, stderr=subprocess.PIPE,
                           text=True, env=_env(), timeout=120, check=False)
    finally:
        os.close(write)
    assert p.returncode == 0 and p.stderr == "", p.stderr


@pytest.mark.parametrize("args", [["models"], ["steps", M], ["show", M, "2"]], ids=lambda a: a[0])
def test_json_into_head_as_a_person_types_it(home, args):
    """``--json | head -1`` is one whole JSON document: a listing's first record, or the one report."""
    cmd = f"{sys.executable} -m tierstore.cli admin --home {home} --json {' '.join(args)} | head -1"
    p = subprocess.run(cmd, shell=True, capture_output=True, text=True, env=_env(), timeout=120, check=False)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    first = json.loads(p.stdout)
    assert p.stdout.count("\n") == 1 and isinstance(first, dict), p.stdout
    full = cli("admin", "--home", str(home), "--json", *args).stdout
    same = lambda d: {k: v for k, v in d.items() if k != "age_s"}  # noqa: E731  (the age moves on)
    assert same(json.loads(full.splitlines()[0])) == same(first)
    if args[0] == "steps":  # one line per step, as `wc -l` counts them
        assert [json.loads(line)["step"] for line in full.splitlines()] == [1, 2, 3]
    if args[0] == "models":
        assert first["model"] == M


def test_server_list_json_is_one_record_per_line(home):
    p = cli("server", "list", "--json")
    assert p.returncode == 0, p.stderr
    records = [json.loads(line) for line in p.stdout.splitlines()]
    assert all(set(r) == {"pid", "socket", "home", "home_exists"} for r in records), records
    mine = [r for r in records if Path(r["home"]) == home.resolve()]
    assert len(mine) == 1 and mine[0]["home_exists"] is True and mine[0]["socket"].endswith(".sock")
    status = cli("server", "status", "--json", "--home", str(home))
    d = json.loads(status.stdout)
    assert status.returncode == 0 and d["running"] is True and d["pids"] == [mine[0]["pid"]]
    assert {p["what"] for p in d["paths"]} >= {"index", "durable tier"}, d["paths"]


def test_verify_and_server_status_print_no_blank_line(home):
    for args in (["admin", "--home", str(home), "verify", M], ["server", "status", "--home", str(home)],
                 ["admin", "--home", str(home), "gc", M]):
        p = cli(*args)
        assert p.returncode == 0, p.stderr
        assert p.stderr == "" and p.stdout.endswith("\n") and "" not in p.stdout[:-1].split("\n"), repr(p.stdout)
    assert "all copies verify" in cli("admin", "--home", str(home), "verify", M).stdout


def test_gc_dry_run_json_says_would_delete(home):
    p = cli("admin", "--home", str(home), "--json", "gc", M, "--keep-last", "2")
    d = json.loads(p.stdout)
    assert p.returncode == 0 and d["dry_run"] is True and len(d["would_delete"]) == 4
    assert "deleted" not in d and "bytes_freed" not in d and d["would_free_bytes"] > 0


def test_watch_says_when_nothing_happened(home):
    p = cli("admin", "--home", str(home), "watch", M, "--timeout", "0.2")
    assert p.returncode == 0 and f"no step events of {M} in 0.2 s" in p.stdout


# -- read-only commands never create state -----------------------------------------------------------
@pytest.mark.parametrize("args", [
    ["models"], ["steps", M], ["show", M, "1"], ["layers", M], ["where", f"{M}/a/1/0"], ["nodes"], ["du"],
    ["verify", M], ["watch", M, "--timeout", "0.1"], ["gc", M], ["gc", M, "--yes"], ["rebuild-index", "--yes"],
], ids=lambda a: " ".join(a))
def test_a_mistyped_home_is_an_error_and_creates_nothing(tmp_path, args):
    typo, shm = tmp_path / "no" / "such-home", tmp_path / "shm"
    shm.mkdir()
    p = cli("admin", "--home", str(typo), *args, TIERSTORE_SHM_DIR=str(shm))
    assert p.returncode == 1, p.stdout + p.stderr
    assert f"no tierstore home at {typo}" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "no").exists() and list(shm.iterdir()) == []
    assert find_servers(typo) == []


def test_an_existing_home_is_read_without_creating_its_host_tier(home, tmp_path):
    shm = tmp_path / "other-shm"  # the host tier would be derived here: it does not exist
    shm.mkdir()
    for args in (["models"], ["where", f"{M}/a/2/1"]):
        p = cli("admin", "--home", str(home), *args, TIERSTORE_SHM_DIR=str(shm))
        assert p.returncode == 0, p.stdout + p.stderr
    p = cli("admin", "--home", str(home), "verify", M, TIERSTORE_SHM_DIR=str(shm))  # the host copies are not there
    assert p.returncode == 3 and "host: the index says it holds a copy, but it does not" in p.stdout
    assert list(shm.iterdir()) == []


def test_admin_on_a_stopped_home_starts_nothing_and_names_the_start_command(home):
    """Issue 31 item 7: ``admin`` after ``server stop`` started the index server again and left it running."""
    assert stop_server(home)
    for args in (["models"], ["steps", M], ["--json", "du"]):
        p = cli("admin", "--home", str(home), *args)
        assert p.returncode == 1, p.stdout + p.stderr
        assert f"start it with `tierstore server start --home {home.resolve()}`" in p.stderr, p.stderr
        assert "--start-server" in p.stderr and "Traceback" not in p.stderr
        assert find_servers(home) == []
    p = cli("admin", "--home", str(home), "--start-server", "steps", M)  # asked for: started, and it stays
    assert p.returncode == 0, p.stdout + p.stderr
    assert find_servers(home) != []
    p = cli("admin", "--home", str(home), "models")  # running: read as before
    assert p.returncode == 0 and M in p.stdout, p.stderr


def test_admin_steps_says_how_many_steps_retention_kept_and_why(home):
    """Issue 31 item 7: after the demo ``admin steps`` listed 2 of 30 committed steps, saying nothing of the rest."""
    p = cli("admin", "--home", str(home), "steps", M)
    assert p.returncode == 0, p.stderr
    assert "3 step(s) committed, 3 listed: retention retired none (newest durable 3)" in p.stdout, p.stdout
    store = tierstore.open(home)
    try:
        store.gc(M, Retention(keep_last=1), dry_run=False)
    finally:
        store.close()
    p = cli("admin", "--home", str(home), "steps", M)
    assert p.returncode == 0, p.stderr
    assert ("3 step(s) committed, 1 listed: retention retired 2 (newest retired 2); the last pass kept step 3 in "
            "memory (keep_last=1); newest durable 3") in p.stdout, p.stdout
    p = cli("admin", "--home", str(home), "--json", "steps", M)  # JSON lines stay one record per step
    assert p.returncode == 0 and [json.loads(x)["step"] for x in p.stdout.splitlines()] == [3]


# -- missing optional dependencies --------------------------------------------------------------------
def _without(modules: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT, modules, *args], capture_output=True, text=True,
                          env=_env(**env), timeout=120, check=False)


def test_testbed_without_moto_says_which_extra(tmp_path):
    p = _without("moto", "testbed", "--workdir", str(tmp_path / "tb"))
    assert p.returncode == 1 and "pip install 'tierstore[testbed]'" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and "exited with" not in p.stderr


def test_agent_without_ucxx_says_which_extra(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    p = _without("ucxx", "agent", "--node-id", "n0", "--host-root", str(tmp_path / "host"),
                 "--secret-file", str(secret))
    assert p.returncode == 1 and "tierstore[ucx]" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_demo_without_matplotlib_says_the_plot_was_not_drawn(tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None\nfrom pathlib import Path\n"
            "from tierstore.cli.demo import draw\nprint(draw({}, Path(sys.argv[1])))\n")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "demo.png")], capture_output=True, text=True,
                       env=_env(), timeout=120, check=False)
    assert p.returncode == 0 and "pip install 'tierstore[plot]'" in p.stdout, p.stderr
    assert not (tmp_path / "demo.png").exists()


def test_demo_plot_draws_a_full_checkpoint_baseline_beside_the_bytes_written(tmp_path, monkeypatch):
    """The bytes panel shows what each step saved against a full checkpoint of the same state, legend clear of it."""
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (tierstore[plot])")
    from matplotlib.figure import Figure

    from tierstore.cli.demo_plot import draw

    mib = 1 << 20
    summary = {"world": 2, "policy": "differential+dedup", "kill_at": 3, "restore": {"step": 2},
               "loss_curve": {"phase0": [[0, 3.0], [1, 2.5], [2, 2.2], [3, 2.1]], "phase1": [[3, 2.1], [4, 2.0]]},
               "bytes_per_step": {str(s): {"full": mib, "ref": 1024} if s != 1 else {"delta": mib // 2}
                                  for s in range(5)},
               "full_bytes_per_step": {str(s): 2 * mib for s in range(5)}}
    figures = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: figures.append(fig))
    draw(summary, tmp_path / "demo.png")
    (fig,) = figures
    bytes_ax = fig.axes[1]
    assert "against 10.0 MiB of full checkpoints (2.2x smaller)" in bytes_ax.get_title(), bytes_ax.get_title()
    (baseline,) = [ln for ln in bytes_ax.get_lines() if "full checkpoint" in ln.get_label()]
    assert list(baseline.get_ydata()) == [2.0] * 5 and bytes_ax.get_ylim()[1] > 2.0
    legend = bytes_ax.get_legend()
    texts = [t.get_text() for t in legend.get_texts()]
    assert texts[1:4] == ["written: full", "written: delta", "written: ref (4.0 KiB in all)"], texts
    assert texts[4].startswith("not written:\nthe ranks' identical tensors, stored once (dedup: refs)"), texts
    fig.canvas.draw()
    box, axes_box = legend.get_window_extent(), bytes_ax.get_window_extent()
    assert box.x0 >= axes_box.x1, "the legend covers the bars"


def test_metrics_without_prometheus_client_say_which_extra():
    code = ("import sys, logging; sys.modules['prometheus_client'] = None; logging.basicConfig()\n"
            "from tierstore.cli import metrics\nprint(metrics.serve(0))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=120,
                       check=False)
    assert p.returncode == 0 and p.stdout.strip() == "None" and "pip install 'tierstore[metrics]'" in p.stderr


def test_a_command_whose_module_is_missing_names_the_install():
    p = _without("torch", "bench", "--help")
    assert p.returncode == 1 and "needs torch" in p.stderr and "pip install torch==2.13.0" in p.stderr, p.stderr


# -- the server and the home's state ------------------------------------------------------------------
def _holder(home: Path) -> subprocess.Popen:
    """A trainer-like process holding a store open on ``home`` until its stdin closes."""
    code = ("import sys, tierstore\ns = tierstore.open(sys.argv[1])\nprint('ready', flush=True)\n"
            "sys.stdin.read()\ns.close()\n")
    p = subprocess.Popen([sys.executable, "-c", code, str(home)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, env=_env())
    assert p.stdout.readline().strip() == "ready"
    return p


def _state_of(home: Path) -> list[Path]:
    return [p for p in (home / "index", home / "durable", host_dir(home)) if p.exists()]


def test_purge_refuses_while_a_trainer_holds_the_home_and_a_killed_one_lets_go(home):
    before = _state_of(home)
    assert len(before) == 3
    trainer = _holder(home)
    try:
        p = cli("server", "stop", "--purge", "--yes", "--home", str(home))
        assert p.returncode == 1 and "in use" in p.stderr and "host tier" in p.stderr, p.stderr
        assert _state_of(home) == before and find_servers(home)
    finally:
        trainer.send_signal(signal.SIGKILL)  # a crash: no close(); the kernel drops its lock and connection
        trainer.wait(30)
    time.sleep(0.2)  # the server notices the closed connection
    p = cli("server", "stop", "--purge", "--yes", "--home", str(home))
    assert p.returncode == 0, p.stderr
    assert _state_of(home) == [] and not home.exists() and find_servers(home) == []


def test_purge_asks_first(home):
    before = _state_of(home)
    for answer in ("n\n", "", "maybe\n"):
        p = cli("server", "stop", "--purge", "--home", str(home), input=answer)
        assert p.returncode == 1 and "nothing removed" in p.stderr, p.stderr
        assert _state_of(home) == before
    p = cli("server", "stop", "--purge", "--home", str(home), input="y\n")
    assert p.returncode == 0 and "remove it?" in p.stderr and str(host_dir(home)) in p.stderr, p.stderr
    assert _state_of(home) == [] and find_servers(home) == []


def test_purge_keeps_what_is_not_tierstore_state(home):
    (home / "notes.txt").write_text("mine")
    p = cli("server", "stop", "--purge", "--yes", "--home", str(home))
    assert p.returncode == 0, p.stderr
    assert _state_of(home) == [] and (home / "notes.txt").read_text() == "mine"
    other = home.parent / "not-a-home"
    (other / "index").mkdir(parents=True)
    (other / "durable").mkdir()
    p = cli("server", "stop", "--purge", "--yes", "--home", str(other))
    assert p.returncode == 0 and (other / "index").is_dir() and (other / "durable").is_dir(), p.stdout


def test_server_start_status_stop(tmp_path):
    h = tmp_path / "h"
    p = cli("server", "status", "--home", str(h))
    assert p.returncode == 1 and "not running" in p.stdout and not h.exists()
    p = cli("server", "start", "--home", str(h))
    assert p.returncode == 0 and p.stdout.strip() == f"unix://{socket_path(h)}"
    p = cli("server", "status", "--home", str(h))
    (server,) = find_servers(h)
    assert p.returncode == 0 and f"pid {server.pid}" in p.stdout
    p = cli("server", "stop", "--home", str(h))
    assert p.returncode == 0 and "stopped" in p.stdout and find_servers(h) == []
    assert (h / "index").is_dir()  # stop keeps the data
    p = cli("server", "stop", "--home", str(h))
    assert p.returncode == 0 and "not running" in p.stdout
    # a purge after the stop says what it did: it removed the data, and there was no server to stop
    p = cli("server", "stop", "--purge", "--yes", "--home", str(h))
    assert p.returncode == 0 and not h.exists(), p.stdout + p.stderr
    assert f"no index server of {h.resolve()} was running; removed" in p.stdout and "stopped" not in p.stdout, p.stdout


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"


@pytest.mark.parametrize("long_path", [False, True], ids=["socket-in-home", "socket-in-tmp"])
def test_a_server_whose_home_was_deleted_is_found_and_stopped(tmp_path, long_path):
    """Issue 13 item 12: ``rm -rf HOME`` leaves its server running; ``server stop --home HOME`` stops it."""
    h = tmp_path / ("x" * 90 if long_path else "x") / "home"
    assert (socket_path(h).parent == Path("/tmp")) is long_path
    assert cli("server", "start", "--home", str(h)).returncode == 0
    (server,) = find_servers(h)
    shutil.rmtree(h)
    p = cli("server", "list")
    assert p.returncode == 0 and f"pid {server.pid}" in p.stdout and "deleted" in p.stdout
    p = cli("server", "status", "--home", str(h))
    assert p.returncode == 1 and str(server.pid) in p.stdout and "no tierstore home" in p.stdout
    if long_path:  # its socket outlived the home: the next open must not use the orphan, whose data is gone
        ensure_server(h)
        (fresh,) = find_servers(h)
        assert fresh.pid != server.pid and fresh.home_exists and not _alive(server.pid)
        server = fresh
        shutil.rmtree(h)
    p = cli("server", "stop", "--home", str(h))
    assert p.returncode == 0 and "stopped" in p.stdout, p.stdout + p.stderr
    deadline = time.monotonic() + 10
    while _alive(server.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(server.pid) and find_servers(h) == []
    assert not socket_path(h).exists()
