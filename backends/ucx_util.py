"""UCX environment defaults and the lazy ``ucxx`` import, shared by the agent and the peer tier.

UCX reads its configuration from the environment when ``ucxx`` is first
imported, so :func:`import_ucxx` applies :data:`UCX_ENV_DEFAULTS` (only the
variables the user has not set) before importing. Call it, never ``import
ucxx`` directly, in any process that serves or reaches the peer tier.

Defaults (measured on a 2-core loopback host):

* ``UCX_NET_DEVICES=lo``: runs without an RDMA NIC or GPU; set it to your
  fabric (``mlx5_0:1``, ...) on a real cluster.
* ``UCXPY_PROGRESS_MODE=blocking``: wakes on the worker's event fd instead of
  polling; about twice the throughput of the default on 2 cores.
* ``UCX_WARN_UNUSED_ENV_VARS=n``: silence UCX's warning about the above.
* ``UCX_TCP_CM_REUSEADDR=y``: an agent restarted on its fixed port can listen
  again at once (the killed one's connections linger in TIME_WAIT).
* ``UCX_TLS=^cma``: every transport but CMA (``process_vm_readv``). The peer
  tier's shared-memory lane runs without UCX error handling, and there a
  CMA transfer with a process that died aborts the survivor (seen here: a
  SIGKILLed client took its node agent down within a few kills). The posix
  shared-memory transport has no such failure, and measured faster here
  (~4.9 against ~3 GB/s). The agent offers lanes only while CMA is
  excluded (:func:`cma_excluded`).

A process that serves peers (the node agent) asks :func:`import_ucxx` for
``server=True``, which adds :data:`UCX_SERVER_ENV_DEFAULTS`:

* ``UCX_LOG_LEVEL=error``: a peer can make UCX warn once per message it
  sends (an active message, which the agent does not accept, is dropped
  with a warning and a backtrace), so a flood would become a log flood.
* ``UCX_LOG_FILE=stderr``: UCX's log goes where the agent's own log goes;
  stdout carries only the agent's ready line (UCX writes to stdout by
  default, and a full stdout pipe nobody reads would block the agent).

``UCX_NET_DEVICES`` is a default only: inside a network namespace (the
testbed's ``--netns`` nodes) it must name that namespace's interface, since
``lo`` there reaches no other node and UCX's TCP transport would advertise
``127.0.0.1`` to peers. Shared-memory transports are not network devices and
are not affected by it.

Besides the environment, this module holds the few calls that reach below
ucxx's public asynchronous API (tag receives posted synchronously, draining
unexpected messages is :mod:`backends.ucx_server`'s): :func:`post_recv`.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import MutableMapping
from types import ModuleType, SimpleNamespace
from typing import Any

from tierstore.errors import MissingDependencyError

__all__ = [
    "UCX_ENV_DEFAULTS",
    "UCX_SERVER_ENV_DEFAULTS",
    "apply_ucx_env_defaults",
    "cma_excluded",
    "import_ucxx",
    "post_recv",
    "ucx_loop",
    "ucxx_available",
]

UCX_ENV_DEFAULTS: dict[str, str] = {
    "UCX_NET_DEVICES": "lo",
    "UCXPY_PROGRESS_MODE": "blocking",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    "UCX_TCP_CM_REUSEADDR": "y",
    "UCX_TLS": "^cma",
}

#: added for a process that serves peers (see the module docstring)
UCX_SERVER_ENV_DEFAULTS: dict[str, str] = {
    "UCX_LOG_LEVEL": "error",
    "UCX_LOG_FILE": "stderr",
}

_ucxx: ModuleType | None = None
_low: Any = None  # ucxx's Array, Tag, TagMaskFull, filled by import_ucxx
_loop: asyncio.AbstractEventLoop | None = None
_loop_pid: int | None = None
_loop_lock = threading.Lock()


def apply_ucx_env_defaults(environ: MutableMapping[str, str] | None = None, *, server: bool = False) -> dict[str, str]:
    """Set each of :data:`UCX_ENV_DEFAULTS` (and with ``server`` :data:`UCX_SERVER_ENV_DEFAULTS`) where unset.

    ``environ`` defaults to ``os.environ``. Returns the variables it set.
    Has an effect only before ``ucxx`` is imported.
    """
    env = os.environ if environ is None else environ
    applied = {}
    for name, value in {**UCX_ENV_DEFAULTS, **(UCX_SERVER_ENV_DEFAULTS if server else {})}.items():
        if name not in env:
            env[name] = value
            applied[name] = value
    return applied


_SHM_ALIASES = {"cma", "sm", "shm", "all"}


def cma_excluded(environ: MutableMapping[str, str] | None = None) -> bool:
    """Whether UCX's transport list (``UCX_TLS``, after the defaults) leaves CMA out."""
    env = os.environ if environ is None else environ
    tls = env.get("UCX_TLS", UCX_ENV_DEFAULTS["UCX_TLS"]).replace(" ", "")
    if tls.startswith("^"):
        return bool(set(tls[1:].split(",")) & {"cma", "sm", "shm"})
    return not set(tls.split(",")) & _SHM_ALIASES


def import_ucxx(*, server: bool = False) -> ModuleType:
    """Apply the environment defaults, then import and return ``ucxx``.

    ``server``: this process serves peers (the node agent): the server
    defaults too. Only the first call of a process imports, so a server
    must make it before anything else reaches ``ucxx``.

    Raises:
        MissingDependencyError: ``ucxx`` is not installed or cannot load its libraries.
    """
    global _ucxx, _low
    if _ucxx is None:
        apply_ucx_env_defaults(server=server)
        try:
            import ucxx  # lazy: optional dependency (tierstore[ucx]); its import also reads the UCX environment
        except Exception as e:  # ImportError, or OSError from a missing libucx
            raise MissingDependencyError(
                f"the peer tier needs ucxx ({type(e).__name__}: {e}); install it with "
                "`pip install ucxx-cu12` (or `pip install tierstore[ucx]`)",
                package="ucxx-cu12",
            ) from e
        from ucxx._lib.arr import Array  # lazy: optional dependency; used by post_recv
        from ucxx.types import Tag, TagMaskFull  # lazy: optional dependency, as above

        _low = SimpleNamespace(Array=Array, Tag=Tag, TagMaskFull=TagMaskFull)
        _ucxx = ucxx
    return _ucxx


def ucxx_available() -> bool:
    """Whether :func:`import_ucxx` succeeds (imports ``ucxx`` as a side effect)."""
    try:
        import_ucxx()
    except MissingDependencyError:
        return False
    return True


def ucx_loop() -> asyncio.AbstractEventLoop:
    """The process-wide event loop that drives ``ucxx`` for clients, on a daemon thread.

    ``ucxx`` has one worker per process, and every event loop that uses it
    progresses that worker; two loops on two threads would progress it
    concurrently. So every client in a process (each :class:`~backends.peer.PeerBackend`)
    submits its coroutines here with ``asyncio.run_coroutine_threadsafe``
    instead of running a loop of its own. The thread lives as long as the process.
    """
    global _loop, _loop_pid
    with _loop_lock:
        if _loop is None or _loop_pid != os.getpid() or _loop.is_closed():
            import_ucxx()
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="ts-ucx-loop", daemon=True).start()
            _loop, _loop_pid = loop, os.getpid()
        return _loop


def post_recv(ep: Any, buf: Any, tag: int) -> asyncio.Future:
    """Post a receive of ``buf`` for the exact ``tag`` on ``ep`` now; return a future of its completion.

    Unlike ``await ep.recv(...)`` (which posts only when its coroutine first
    runs), the receive is posted before this returns, so a caller can post
    it before sending the message that makes the peer send (the agent posts
    a request's payload receives before answering ``READY``). A message whose
    receive is posted never waits in UCX's unexpected queue, which
    :class:`backends.ucx_server.UnexpectedDrain` empties. Aborting ``ep`` cancels the receive.
    Call on the thread that runs the event loop.
    """
    ucxx = import_ucxx()
    low = _low
    inner = ep._ep  # ucxx.Endpoint's UCXEndpoint: its tag_recv posts synchronously
    if inner is None:
        raise ucxx.exceptions.UCXCloseError("Endpoint closed")
    inner.raise_on_error()
    arr = low.Array(buf)
    req = inner.tag_recv(arr, low.Tag(tag), low.TagMaskFull)
    return asyncio.ensure_future(_completion(req, arr))


async def _completion(req: Any, arr: Any) -> Any:
    # holds the Array (and through it the buffer) until UCX is done with it: UCX writes through a raw pointer
    return await req.wait()
