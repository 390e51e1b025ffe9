"""``python -S tests/_warm_client.py SOCKET PYTHON_ARGS...``: run ``python PYTHON_ARGS`` in a child of the warm
interpreter listening at ``SOCKET`` (``tests/_warm.py``), for a command a shell starts (``_warm.shim``).

The child gets this process's standard streams, working directory and environment; SIGINT and SIGTERM are
passed on to it; this process exits with the child's code, or by the signal that ended it. A command the warm
interpreter cannot stand in for (``_warm.supported``) is exec'd as a plain ``python``, as is every command when
the socket is gone."""

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests import _warm  # noqa: E402 - stdlib only; the checkout is put on the path above


def main() -> None:
    sock, args = sys.argv[1], [sys.executable, *sys.argv[2:]]
    if not _warm.supported(args, None) or not os.path.exists(sock):
        os.execv(sys.executable, args)
    child = _warm.WarmPopen(args, stdin=0, stdout=1, stderr=2, socket_path=sock)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, _f: child.send_signal(s))
    code = child.wait()
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
