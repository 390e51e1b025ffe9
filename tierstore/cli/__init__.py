"""The ``tierstore`` command: ``demo``, ``admin``, ``server``, ``agent``, ``bench``, ``testbed``, ``export``, ``import``.

Each subcommand lives in its own module, imported only when used; the
library never imports this package. ``admin`` and ``server`` never import
torch. A missing optional dependency is reported with the ``pip install``
line that brings it; a closed stdout (``... --json | head -1``) ends the
command quietly. SIGTERM or Ctrl-C during a long command (``bench``, ``demo``,
``import``, ``export``) raises :class:`~tierstore.cli.common.Interrupted`
where it runs, so it stops what it started and removes what it made on the
way out; it exits ``128 + signal`` (143, 130).
"""

from __future__ import annotations

import sys
from importlib import import_module

from tierstore.cli.common import Interrupted, install_hint, interruptible, quiet_closed_stdout
from tierstore.errors import TierStoreError

__all__ = ["main"]

# name: (module, function, summary, what it needs beyond the base install)
_COMMANDS = {
    "demo": ("tierstore.cli.demo", "main", "train a small GPT on 2 ranks, kill one, restore, report",
             "tierstore[plot] for its plot"),
    "admin": ("tierstore.cli.admin", "main",
              "inspect the index and tiers (models, steps, show, where, verify, gc, ...)", ""),
    "server": ("tierstore.cli.server", "main",
               "the embedded index server: status | start | stop [--purge] | list", ""),
    "agent": ("tierstore.cli.agent", "main", "run this node's agent (host tier served to peers over UCX)",
              "tierstore[ucx]"),
    "bench": ("tierstore.bench.run", "main", "benchmarks side by side with torch.save and DCP", ""),
    "testbed": ("tierstore.cli.testbed", "main", "the docker-compose topology as local processes",
                "tierstore[testbed] (and tierstore[ucx] for the peer tier)"),
    "export": ("tierstore.cli.transfer", "export_main", "write a committed step as safetensors or torch.save", ""),
    "import": ("tierstore.cli.transfer", "import_main", "make step 0 of a model from safetensors or torch.save",
               ""),
}


#: the long commands: SIGTERM and Ctrl-C end them through their cleanup (tierstore.cli.common.interruptible)
_LONG = frozenset({"bench", "demo", "import", "export"})


def _usage() -> str:
    lines = ["usage: tierstore COMMAND [ARGS...]", "", "commands:"]
    for name, (_m, _f, summary, needs) in _COMMANDS.items():
        lines.append(f"  {name:<9} {summary}")
        if needs:
            lines.append(f"  {'':<9}   needs {needs}")
    lines += ["", "`tierstore COMMAND --help` for a command's options (with their defaults)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``tierstore``; returns the exit code. A closed stdout ends it quietly (exit 0)."""
    try:
        rc = _dispatch(list(sys.argv[1:] if argv is None else argv))
        sys.stdout.flush()  # inside the try: a closed pipe surfaces here, not at the interpreter's exit
        return rc
    except BrokenPipeError:
        quiet_closed_stdout()
        return 0
    except SystemExit:  # a subcommand's argparse (--help, a usage error) exits from inside
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            quiet_closed_stdout()
        raise


def _dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in _COMMANDS:
        print(f"tierstore: unknown command {cmd!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module, func, _summary, _needs = _COMMANDS[cmd]
    try:
        fn = getattr(import_module(module), func)
    except ImportError as e:
        print(f"tierstore {cmd}: needs {e.name or 'a module'} ({e}): {install_hint(e.name)}", file=sys.stderr)
        return 1
    try:
        if cmd in _LONG:
            with interruptible():
                return int(fn(rest) or 0)
        return int(fn(rest) or 0)
    except Interrupted as e:
        print(f"tierstore {cmd}: {e}", file=sys.stderr)
        return 128 + e.signum
    except TierStoreError as e:  # MissingDependencyError included: its message names the extra
        print(f"tierstore {cmd}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except ImportError as e:  # an optional dependency a command imports when it needs it
        print(f"tierstore {cmd}: needs {e.name or 'a module'} ({e}): {install_hint(e.name)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
