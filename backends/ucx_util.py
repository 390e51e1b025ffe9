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
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import MutableMapping
from types import ModuleType

from tierstore.errors import MissingDependencyError

__all__ = ["UCX_ENV_DEFAULTS", "apply_ucx_env_defaults", "import_ucxx", "ucx_loop", "ucxx_available"]

UCX_ENV_DEFAULTS: dict[str, str] = {
    "UCX_NET_DEVICES": "lo",
    "UCXPY_PROGRESS_MODE": "blocking",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    "UCX_TCP_CM_REUSEADDR": "y",
}

_ucxx: ModuleType | None = None
_loop: asyncio.AbstractEventLoop | None = None
_loop_pid: int | None = None
_loop_lock = threading.Lock()


def apply_ucx_env_defaults(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set each of :data:`UCX_ENV_DEFAULTS` in ``environ`` (default ``os.environ``) where unset.

    Returns the variables it set. Has an effect only before ``ucxx`` is imported.
    """
    env = os.environ if environ is None else environ
    applied = {}
    for name, value in UCX_ENV_DEFAULTS.items():
        if name not in env:
            env[name] = value
            applied[name] = value
    return applied


def import_ucxx() -> ModuleType:
    """Apply the environment defaults, then import and return ``ucxx``.

    Raises:
        MissingDependencyError: ``ucxx`` is not installed or cannot load its libraries.
    """
    global _ucxx
    if _ucxx is None:
        apply_ucx_env_defaults()
        try:
            import ucxx  # lazy: optional dependency (tierstore[ucx]); its import also reads the UCX environment
        except Exception as e:  # ImportError, or OSError from a missing libucx
            raise MissingDependencyError(
                f"the peer tier needs ucxx ({type(e).__name__}: {e}); install it with "
                "`pip install ucxx-cu12` (or `pip install tierstore[ucx]`)",
                package="ucxx-cu12",
            ) from e
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
