"""Python processes started from a warm interpreter: real processes, without paying ``import torch`` each time.

A test that runs ``python -m tests._some_job`` or a docs snippet as a process pays, before its first line,
what the interpreter pays to import torch (2-3.5 s on this machine), torch's compiler front end (torch 2.13
imports ``torch._dynamo`` at an optimizer's first ``step``, 1.5-2.7 s more) and, for the framework jobs,
Lightning or ``transformers`` (another 1-3 s). Across the suite that is most of the time its subprocesses
take. A :class:`Server` is one interpreter per test worker that has imported those modules and nothing else
(not tierstore, not the tests), and forks a child per request: a real process with its own pid, memory,
sockets, signals and exit code, that then becomes the ``python`` the test asked for:

- ``python [-u] [-P] -c CODE ARGS``, ``python ... -m MODULE ARGS`` or ``python ... SCRIPT ARGS``, with the
  request's working directory, environment (replaced whole, ``PYTHONPATH`` included), standard streams
  (the caller's file descriptors, passed over the socket), ``sys.argv``, ``sys.path`` as that interpreter
  would compute it, a fresh ``__main__``, its own random seed, the caller's ``TMPDIR`` (``tempfile`` forgets
  the directory it cached) and ``OMP_NUM_THREADS``;
- and it ends as an interpreter ends: an uncaught exception is printed and exits 1, ``SystemExit`` gives its
  code, non-daemon threads are joined, ``atexit`` handlers run, the streams are flushed.

What cannot be emulated after the fact (``PYTHONHASHSEED``, ``PYTHONWARNINGS``, interpreter flags other than
``-u``, ``-P`` and ``-B``) makes :func:`popen` start a plain subprocess instead, as does
``TIERSTORE_TEST_WARM=0`` (the whole suite without warm interpreters). The processes a test must see start
from nothing (the README's fresh venv, the CLI's own start-up) do not come here.
"""

from __future__ import annotations

import io
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

ENABLED = os.environ.get("TIERSTORE_TEST_WARM", "1") != "0"
TORCH = ("torch", "torch._dynamo", "torch.distributed", "torch.distributed.checkpoint")
LIGHTNING = (*TORCH, "lightning.pytorch")
HF = (*TORCH, "transformers", "accelerate")
_FLAGS = {"-u", "-P", "-B"}
_POPEN_KW = {"cwd", "env", "stdin", "stdout", "stderr", "start_new_session", "text"}
_UNSUPPORTED_ENV = ("PYTHONHASHSEED", "PYTHONWARNINGS", "PYTHONDEVMODE", "PYTHONTRACEMALLOC", "PYTHONHOME",
                    "PYTHONOPTIMIZE", "PYTHONNOUSERSITE", "PYTHONSTARTUP", "PYTHONINSPECT", "PYTHONUTF8")

# -- the server: runs in its own interpreter (``python -c SERVER preload...``); stdlib only -----------------
SERVER = r'''
import builtins, importlib, io, json, os, random, selectors, signal, socket, struct, sys, threading, traceback, types
import atexit
for name in sys.argv[2:]:
    importlib.import_module(name)
BASE_PATH = [p for p in sys.path if p not in ("", os.getcwd())]
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(sys.argv[1])
listener.listen(64)
wake_r, wake_w = os.pipe()
os.set_blocking(wake_w, False)
signal.set_wakeup_fd(wake_w)
signal.signal(signal.SIGCHLD, lambda *a: None)
sel = selectors.DefaultSelector()
sel.register(listener, selectors.EVENT_READ, "accept")
sel.register(wake_r, selectors.EVENT_READ, "child")
sel.register(sys.stdin.fileno(), selectors.EVENT_READ, "parent")
children = {}  # pid -> the connection that waits for it
print("ready", flush=True)


def stream(fd, write, unbuffered, enc):
    raw = io.FileIO(fd, "w" if write else "r", closefd=False)
    if not write:
        return io.TextIOWrapper(io.BufferedReader(raw), encoding=enc, errors="strict")
    if fd == 2:
        return io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), encoding=enc,
                                errors="backslashreplace", line_buffering=True, write_through=unbuffered)
    return io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), encoding=enc, errors="strict",
                            line_buffering=os.isatty(fd), write_through=unbuffered)


def become(req, fds, server_fds):
    """In the child: become ``python FLAGS MODE ARGS`` and never return."""
    code = 0
    interrupted = False
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        for fd in server_fds:
            try:
                os.close(fd)
            except OSError:
                pass
        if req.get("new_session"):
            os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in set(fds):
            if fd > 2:
                os.close(fd)
        os.chdir(req["cwd"])
        env = req["env"]
        os.environ.clear()
        os.environ.update(env)
        flags, mode, target, args = req["flags"], req["mode"], req["target"], req["args"]
        unbuffered = "-u" in flags or bool(env.get("PYTHONUNBUFFERED"))
        enc = env.get("PYTHONIOENCODING", "utf-8").split(":")[0] or "utf-8"
        sys.stdin = sys.__stdin__ = stream(0, False, unbuffered, enc)
        sys.stdout = sys.__stdout__ = stream(1, True, unbuffered, enc)
        sys.stderr = sys.__stderr__ = stream(2, True, unbuffered, enc)
        sys.dont_write_bytecode = "-B" in flags or bool(env.get("PYTHONDONTWRITEBYTECODE"))
        if env.get("PYTHONFAULTHANDLER"):
            import faulthandler
            faulthandler.enable()
        safe = "-P" in flags or bool(env.get("PYTHONSAFEPATH"))
        if mode == "-c":
            first = ""
        elif mode == "-m":
            first = os.getcwd()
        else:
            first = os.path.dirname(os.path.realpath(os.path.abspath(target)))
        extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = ([] if safe else [first]) + extra + BASE_PATH
        sys.path_importer_cache.clear()
        importlib.invalidate_caches()
        random.seed()
        if "tempfile" in sys.modules:  # gettempdir() caches what TMPDIR said when the server first asked
            sys.modules["tempfile"].tempdir = None
        threads = env.get("OMP_NUM_THREADS")
        if threads and threads.isdigit() and "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(int(threads))
        main = types.ModuleType("__main__")
        main.__builtins__ = builtins
        sys.modules["__main__"] = main
        if mode == "-c":
            sys.argv = ["-c", *args]
            exec(compile(target, "<string>", "exec"), main.__dict__)
        elif mode == "-m":
            import runpy
            sys.argv = [target, *args]
            runpy._run_module_as_main(target, alter_argv=True)
        else:
            sys.argv = [target, *args]
            main.__file__ = path = os.path.abspath(target)  # absolute, as python makes it; argv[0] as given
            with io.open_code(path) as f:
                source = f.read()
            exec(compile(source, path, "exec"), main.__dict__)
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code & 0xFF
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        kind, value, tb = sys.exc_info()
        traceback.print_exception(kind, value, tb.tb_next if tb is not None else tb)
        interrupted = True
    except BaseException:
        kind, value, tb = sys.exc_info()
        tb = tb.tb_next if tb is not None else tb  # not this frame: as python prints it
        sys.excepthook(kind, value.with_traceback(tb), tb)
        code = 1
    try:
        threading._shutdown()
    except BaseException:
        pass
    try:
        atexit._run_exitfuncs()
    except BaseException:
        pass
    for s in (sys.stdout, sys.stderr):
        try:
            s.flush()
        except BaseException:
            pass
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def recv_request(conn):
    head, fds, _flags, _addr = socket.recv_fds(conn, 8, 3)
    (n,) = struct.unpack("!Q", head)
    body = b""
    while len(body) < n:
        chunk = conn.recv(n - len(body))
        if not chunk:
            raise EOFError
        body += chunk
    return json.loads(body), fds


while True:
    for key, _ in sel.select():
        if key.data == "parent":
            if not os.read(sys.stdin.fileno(), 4096):
                os._exit(0)
        elif key.data == "accept":
            conn, _ = listener.accept()
            try:
                req, fds = recv_request(conn)
            except Exception:
                conn.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            server_fds = [listener.fileno(), wake_r, wake_w, sel.fileno(), conn.fileno()] + [
                c.fileno() for c in children.values()]
            pid = os.fork()
            if pid == 0:
                become(req, fds, server_fds)
            for fd in fds:
                os.close(fd)
            conn.sendall(b"pid %d\n" % pid)
            children[pid] = conn
        else:
            try:
                os.read(wake_r, 4096)
            except BlockingIOError:
                pass
            while children:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                conn = children.pop(pid, None)
                if conn is not None:
                    try:
                        conn.sendall(b"exit %d\n" % os.waitstatus_to_exitcode(status))
                    except OSError:
                        pass
                    conn.close()
'''


class Server:
    """One warm interpreter: ``preload`` imported, listening on a Unix socket; forks a child per request."""

    def __init__(self, preload: Sequence[str]) -> None:
        self.preload = tuple(preload)
        self._dir = tempfile.mkdtemp(prefix="warm-")
        self.path = os.path.join(self._dir, "s")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OMP_NUM_THREADS")}
        # its own stderr to a file (import warnings): a pipe nobody reads could fill and block it
        self._err = open(os.path.join(self._dir, "stderr"), "w+b")  # noqa: SIM115 - closed in close()
        self._proc = subprocess.Popen([sys.executable, "-c", SERVER, self.path, *self.preload], cwd="/", env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err)
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if line.strip() != b"ready":
            self._err.seek(0)
            err = self._err.read().decode(errors="replace")
            self.close()
            raise RuntimeError(f"the warm interpreter ({', '.join(self.preload)}) did not start: {err[-2000:]}")

    def close(self) -> None:
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        self._err.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def alive(self) -> bool:
        return self._proc.poll() is None


_servers: dict[tuple[str, ...], Server] = {}
_lock = threading.Lock()


def server(preload: Sequence[str] = TORCH) -> Server:
    """This process's warm interpreter for ``preload`` (started on first use, once)."""
    key = tuple(preload)
    with _lock:
        s = _servers.get(key)
        if s is None or not s.alive():
            s = _servers[key] = Server(key)
        return s


def shutdown() -> None:
    """Stop every warm interpreter this process started (the session's end, before the leak check)."""
    with _lock:
        for s in _servers.values():
            s.close()
        _servers.clear()


def _split(args: Sequence[str]) -> tuple[list[str], str, str, list[str]] | None:
    """``[python, FLAGS..., -c CODE | -m MOD | SCRIPT, ARGS...]`` -> (flags, mode, target, args), or None."""
    if not args or os.path.realpath(args[0]) != os.path.realpath(sys.executable):
        return None
    flags, i = [], 1
    while i < len(args) and args[i].startswith("-") and args[i] not in ("-c", "-m"):
        if args[i] not in _FLAGS:
            return None
        flags.append(args[i])
        i += 1
    if i >= len(args) or args[i] == "-":
        return None
    if args[i] in ("-c", "-m"):
        if i + 1 >= len(args):
            return None
        return flags, args[i], args[i + 1], list(args[i + 2:])
    return flags, "script", args[i], list(args[i + 1:])


def _fd(stream, default: int) -> tuple[int, bool]:
    """(a file descriptor for ``stream``, whether it was opened here and must be closed)."""
    if stream is None:
        return default, False
    if stream == subprocess.DEVNULL:
        return os.open(os.devnull, os.O_RDWR), True
    if isinstance(stream, int):
        return stream, False
    return stream.fileno(), False


class WarmPopen:
    """A child of a warm interpreter, driven like :class:`subprocess.Popen` (``pid``, ``poll``, ``wait``,
    ``send_signal``, ``kill``, ``terminate``, ``returncode``: negative for the signal that ended it)."""

    def __init__(self, args: Sequence[str], *, cwd: str | os.PathLike | None = None,
                 env: dict[str, str] | None = None, stdin=None, stdout=None, stderr=None,
                 start_new_session: bool = False, text: bool = False, preload: Sequence[str] = TORCH,
                 socket_path: str | None = None) -> None:
        split = _split(args)
        if split is None:
            raise ValueError(f"not a command a warm interpreter runs: {list(args)[:3]}")
        flags, mode, target, rest = split
        self.args = list(args)
        self.returncode: int | None = None
        self.stdin = self.stdout = self.stderr = None
        in_fd, close_in = self._pipe("stdin", text) if stdin == subprocess.PIPE else _fd(
            stdin if stdin is not None else subprocess.DEVNULL, 0)
        out_fd, close_out = self._pipe("stdout", text) if stdout == subprocess.PIPE else _fd(stdout, 1)
        if stderr == subprocess.STDOUT:
            err_fd, close_err = out_fd, False
        elif stderr == subprocess.PIPE:
            err_fd, close_err = self._pipe("stderr", text)
        else:
            err_fd, close_err = _fd(stderr, 2)
        cwd = os.fspath(cwd) if cwd is not None else os.getcwd()
        req = {"flags": flags, "mode": mode, "target": target, "args": rest, "cwd": cwd,
               "env": dict(os.environ if env is None else env), "new_session": start_new_session}
        body = json.dumps(req).encode()
        path = socket_path if socket_path is not None else server(preload).path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.connect(path)
            socket.send_fds(self._sock, [struct.pack("!Q", len(body))], [in_fd, out_fd, err_fd])
            self._sock.sendall(body)
        finally:
            for fd, close in ((in_fd, close_in), (out_fd, close_out), (err_fd, close_err)):
                if close:
                    os.close(fd)
        self._buf = b""
        line = self._line(timeout=60)
        if line is None or not line.startswith(b"pid "):
            raise RuntimeError(f"the warm interpreter did not start {target!r}: {line!r}")
        self.pid = int(line.split()[1])

    def _pipe(self, name: str, text: bool) -> tuple[int, bool]:
        """A pipe for ``name`` (``subprocess.PIPE``): this end kept as ``self.<name>``, the child's returned."""
        r, w = os.pipe()
        if name == "stdin":
            raw = open(w, "wb")  # noqa: SIM115 - closed by communicate() or __exit__
            setattr(self, name, io.TextIOWrapper(raw, encoding="utf-8", write_through=True) if text else raw)
            return r, True
        setattr(self, name, open(r, encoding="utf-8", errors="replace") if text else open(r, "rb"))  # noqa: SIM115
        return w, True

    def communicate(self, input=None, timeout: float | None = None):
        """As :meth:`subprocess.Popen.communicate`: ``input`` to stdin, then (stdout, stderr) read to the end."""
        out: dict[str, object] = {}

        def drain(name: str) -> None:
            f = getattr(self, name)
            out[name] = f.read()
            f.close()

        readers = [threading.Thread(target=drain, args=(n,), daemon=True) for n in ("stdout", "stderr")
                   if getattr(self, n) is not None]
        for t in readers:
            t.start()
        if self.stdin is not None:
            if input:
                self.stdin.write(input)
            self.stdin.close()
        self.wait(timeout)
        for t in readers:
            t.join()
        return out.get("stdout"), out.get("stderr")

    def __enter__(self) -> WarmPopen:
        return self

    def __exit__(self, *exc) -> None:
        for f in (self.stdin, self.stdout, self.stderr):
            if f is not None:
                f.close()
        self.wait()

    def _line(self, timeout: float | None) -> bytes | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self._sock], [], [], left)
            if not ready:
                return None
            chunk = self._sock.recv(4096)
            if not chunk:
                return b""
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def poll(self) -> int | None:
        if self.returncode is None:
            self._collect(0)
        return self.returncode

    def _collect(self, timeout: float | None) -> None:
        line = self._line(timeout)
        if line is None:
            return
        if line.startswith(b"exit "):
            self.returncode = int(line.split()[1])
        else:  # the server went away: the child's fate is unknown, which no test may read as success
            self.returncode = -signal.SIGKILL
        self._sock.close()

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._collect(timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def supported(args: Sequence[str], env: dict[str, str] | None) -> bool:
    e = os.environ if env is None else env
    return ENABLED and _split(args) is not None and not any(k in e for k in _UNSUPPORTED_ENV)


def popen(args: Sequence[str], *, preload: Sequence[str] = TORCH, **kw):
    """A :class:`WarmPopen` where the command allows it, else a :class:`subprocess.Popen` of the same."""
    if supported(args, kw.get("env")) and set(kw) <= _POPEN_KW:
        return WarmPopen(args, preload=preload, **kw)
    return subprocess.Popen(list(args), **kw)


def run(args: Sequence[str], *, cwd=None, env: dict[str, str] | None = None, timeout: float | None = None,
        text: bool = True, check: bool = False, preload: Sequence[str] = TORCH,
        input: str | None = None) -> subprocess.CompletedProcess:
    """:func:`subprocess.run` with the output captured, in a warm child where the command allows it."""
    if not supported(args, env):
        return subprocess.run(list(args), cwd=cwd, env=env, capture_output=True, text=text, timeout=timeout,
                              check=check, input=input)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, tempfile.TemporaryFile() as inp:
        if input is not None:
            inp.write(input.encode())
            inp.seek(0)
        p = WarmPopen(args, cwd=cwd, env=env, stdin=inp if input is not None else None, stdout=out, stderr=err,
                      preload=preload)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            raise
        out.seek(0)
        err.seek(0)
        o, e = out.read(), err.read()
    so: str | bytes = o.decode(errors="replace") if text else o
    se: str | bytes = e.decode(errors="replace") if text else e
    result = subprocess.CompletedProcess(list(args), p.returncode, so, se)
    if check:
        result.check_returncode()
    return result


CLIENT = Path(__file__).with_name("_warm_client.py")


def shim(python_args: Sequence[str] = (), preload: Sequence[str] = TORCH) -> str:
    """A shell command line that runs ``python PYTHON_ARGS "$@"`` in a child of this process's warm interpreter
    (``tests/_warm_client.py``: a stdlib-only client that passes its streams, directory and environment and exits
    as the child did), for a script a shell runs (a docs block's ``tierstore``); plain ``python`` when warm
    interpreters are off."""
    import shlex

    exe = shlex.quote(sys.executable)
    args = " ".join(shlex.quote(a) for a in python_args)
    if not ENABLED:
        return f'exec {exe} {args} "$@"'
    return f'exec {exe} -S {shlex.quote(str(CLIENT))} {shlex.quote(server(preload).path)} {args} "$@"'


__all__ = ["CLIENT", "HF", "LIGHTNING", "TORCH", "Server", "WarmPopen", "popen", "run", "server", "shim", "shutdown",
           "supported"]
