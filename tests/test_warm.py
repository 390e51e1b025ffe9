"""The warm interpreter the rank jobs and docs snippets are forked from (``tests/_warm.py``) behaves as the
``python`` it stands in for: what a test reads from a child (its exit code, output, argv, path, environment)
is what a fresh interpreter would have given, or the tests built on it would pass where the real one fails."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests import _warm

pytestmark = pytest.mark.skipif(not _warm.ENABLED, reason="TIERSTORE_TEST_WARM=0: no warm interpreters")


def _both(args, **kw):
    """The same command in a warm child and in a fresh interpreter."""
    return _warm.run(args, **kw), subprocess.run(args, capture_output=True, text=True, timeout=120, **kw)


def test_a_child_sees_its_own_argv_cwd_environment_and_path(tmp_path):
    code = ("import os, sys, json, tempfile; print(json.dumps([sys.argv, os.getcwd(), os.environ.get('X'), "
            "sys.path[0], os.environ.get('PYTHONPATH'), tempfile.gettempdir(), __name__]))")
    env = {**os.environ, "X": "seen", "PYTHONPATH": str(tmp_path), "TMPDIR": str(tmp_path)}
    warm, fresh = _both([sys.executable, "-c", code, "a", "b"], cwd=tmp_path, env=env)
    assert warm.returncode == fresh.returncode == 0, warm.stderr
    assert warm.stdout == fresh.stdout
    assert str(tmp_path) in warm.stdout


def test_a_script_and_a_module_run_as_main_with_their_directory_first(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "job.py").write_text("import sys\nprint(__name__, sys.argv[1:], sys.path[0])\n")
    (tmp_path / "script.py").write_text("import sys\nprint(__name__, __file__, sys.argv, sys.path[0])\n")
    for args in ([sys.executable, "script.py", "x"], [sys.executable, "-m", "pkg.job", "y"]):
        warm, fresh = _both(args, cwd=tmp_path)
        assert (warm.returncode, warm.stdout) == (fresh.returncode, fresh.stdout), (warm.stderr, fresh.stderr)


@pytest.mark.parametrize("body, code", [("raise SystemExit(3)", 3), ("raise ValueError('boom')", 1),
                                        ("import sys; sys.exit('a message')", 1), ("pass", 0)])
def test_exit_codes_and_tracebacks_are_the_interpreters(body, code):
    warm, fresh = _both([sys.executable, "-c", body])
    assert warm.returncode == fresh.returncode == code
    assert warm.stderr == fresh.stderr


def test_threads_are_joined_and_atexit_runs_before_the_exit():
    body = ("import atexit, threading, time\natexit.register(lambda: print('atexit', flush=True))\n"
            "threading.Thread(target=lambda: (time.sleep(0.3), print('thread', flush=True))).start()")
    warm, fresh = _both([sys.executable, "-c", body])
    assert warm.stdout == fresh.stdout == "thread\natexit\n"


def test_a_signal_ends_a_child_as_it_ends_a_process():
    p = _warm.popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                    stdout=subprocess.DEVNULL)
    assert isinstance(p, _warm.WarmPopen)
    time.sleep(0.5)
    assert p.poll() is None
    p.send_signal(signal.SIGKILL)
    assert p.wait(30) == -signal.SIGKILL
    interrupted = _warm.run([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGINT)"])
    assert interrupted.returncode == -signal.SIGINT
    assert "KeyboardInterrupt" in interrupted.stderr


def test_a_wait_past_its_bound_raises_and_kills():
    with pytest.raises(subprocess.TimeoutExpired):
        _warm.run([sys.executable, "-c", "import time; time.sleep(60)"], timeout=1)


def test_children_are_independent_processes_with_their_own_randomness():
    body = "import os, random, torch; print(os.getpid(), random.random(), torch.get_num_threads())"
    a = _warm.run([sys.executable, "-c", body], env={**os.environ, "OMP_NUM_THREADS": "1"})
    b = _warm.run([sys.executable, "-c", body], env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert a.returncode == b.returncode == 0, a.stderr
    (pid_a, rand_a, threads_a), (pid_b, rand_b, threads_b) = a.stdout.split(), b.stdout.split()
    assert pid_a != pid_b and pid_a != str(os.getpid())
    assert rand_a != rand_b
    assert threads_a == threads_b == "1"


def test_what_cannot_be_emulated_runs_in_a_fresh_interpreter():
    assert not _warm.supported([sys.executable, "-X", "dev", "-c", "pass"], None)
    assert not _warm.supported([sys.executable, "-c", "pass"], {**os.environ, "PYTHONHASHSEED": "1"})
    assert not _warm.supported(["/bin/true"], None)
    p = _warm.popen([sys.executable, "-c", "pass"], env={**os.environ, "PYTHONHASHSEED": "1"})
    assert isinstance(p, subprocess.Popen) and p.wait(60) == 0


def test_pipes_carry_a_conversation_and_communicate_reads_to_the_end():
    body = "import sys\nprint('ready', flush=True)\nline = sys.stdin.readline()\nprint('got', line.strip())\n" \
           "print('to stderr', file=sys.stderr)"
    p = _warm.popen([sys.executable, "-c", body], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, text=True)
    assert isinstance(p, _warm.WarmPopen)
    assert p.stdout.readline() == "ready\n"
    out, err = p.communicate("hello\n", timeout=60)
    assert (out, err, p.returncode) == ("got hello\n", "to stderr\n", 0)


def test_a_shell_command_through_the_client_exits_and_prints_as_python_does(tmp_path):
    """``_warm.shim``: what a docs block's ``tierstore`` and ``python`` are; the shell sees the child's output,
    exit code and death by a signal, as from the interpreter itself."""
    py = tmp_path / "python"
    py.write_text("#!/bin/sh\n" + _warm.shim() + "\n")
    py.chmod(0o755)
    body = "import os, sys; print(os.getcwd(), sys.argv[1:]); sys.stdout.flush(); sys.exit(int(sys.argv[1]))"
    for code in (0, 5):
        p = subprocess.run([str(py), "-c", body, str(code)], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert (p.returncode, p.stdout) == (code, f"{tmp_path} ['{code}']\n"), p.stderr
    killed = subprocess.run([str(py), "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"],
                            capture_output=True, timeout=60)
    assert killed.returncode == -signal.SIGTERM
    piped = subprocess.run(f"echo hello | {py} -c 'import sys; print(sys.stdin.read().upper())'", shell=True,
                           capture_output=True, text=True, timeout=60)
    assert piped.stdout == "HELLO\n\n"
