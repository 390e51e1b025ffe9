"""The ``tierstore`` command: ``demo``, ``agent``, ``admin``, ``bench``, ``server``, ``testbed``, ``export``, ``import``.

Each subcommand lives in its own module, imported only when used; the
library never imports this module.
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib import import_module
from pathlib import Path

from tierstore.embedded import ensure_server, ping, socket_path, stop_server
from tierstore.errors import TierStoreError

__all__ = ["main"]

_COMMANDS = {
    "demo": ("tierstore.cli.demo", "main", "train a small GPT on 2 ranks, kill one, restore, report"),
    "agent": ("tierstore.cli.agent", "main", "run this node's agent (host tier served to peers over UCX)"),
    "admin": ("tierstore.cli.admin", "main", "inspect (and gc) the Redis index"),
    "bench": ("tierstore.cli.bench.run", "main", "benchmarks side by side with torch.save and DCP"),
    "server": ("tierstore.cli", "_server", "the embedded index server: status | stop"),
    "testbed": ("tierstore.cli.testbed", "main", "the docker-compose topology as local processes"),
    "export": ("tierstore.cli.transfer", "export_main", "write a committed step as safetensors or torch.save"),
    "import": ("tierstore.cli.transfer", "import_main", "make step 0 of a model from safetensors or torch.save"),
}


def _usage() -> str:
    lines = ["usage: tierstore COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<9} {help_}" for name, (_m, _f, help_) in _COMMANDS.items()]
    lines += ["", "`tierstore COMMAND --help` for a command's options."]
    return "\n".join(lines)


def _server(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="tierstore server", description="the embedded index server")
    p.add_argument("action", choices=["status", "start", "stop"])
    p.add_argument("--home", default=os.environ.get("TIERSTORE_HOME", ".tierstore"))
    a = p.parse_args(argv)
    if a.action == "start":
        print(ensure_server(a.home))
    elif a.action == "stop":
        print("stopped" if stop_server(a.home) else "not running")
    else:
        sock = socket_path(Path(a.home).resolve())
        running = ping(sock)
        print(f"{'running' if running else 'not running'} on unix://{sock}")
        return 0 if running else 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in _COMMANDS:
        print(f"tierstore: unknown command {cmd!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module, func, _help = _COMMANDS[cmd]
    try:
        fn = getattr(import_module(module), func)
    except ImportError as e:
        print(f"tierstore {cmd}: not available: {e}", file=sys.stderr)
        return 2

    try:
        return int(fn(rest) or 0)
    except TierStoreError as e:
        print(f"tierstore {cmd}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130

