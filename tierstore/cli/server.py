"""``tierstore server``: the embedded default's index server, and the state of its home.

Usage::

    tierstore server status [--home H]              running or not, its pid, connections, what the home holds
    tierstore server start  [--home H]              start it (or find it running); prints its unix:// URL
    tierstore server stop   [--home H]              stop it (by its socket, or by its pid when the home is gone)
    tierstore server stop --purge [--yes] [--home H]
                                                    stop it and remove the home's index, durable tier and
                                                    host tier (with its pool); refuses while anyone holds it
    tierstore server list [--json]                  every embedded server of this user, orphans included

``status`` and ``list`` take ``--json``: ``list`` prints one JSON record per
server per line (``pid``, ``socket``, ``home``, ``home_exists``; nothing when
none runs), ``status`` one document (``running``, ``pids``, ``paths``, ...).

Exit codes: 0 ok; 1 ``status`` of a server that is not running, a purge
refused (in use, or not confirmed) or a tierstore error; 2 bad arguments.
Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from tierstore.cli.common import HelpFormatter, confirm, print_json
from tierstore.embedded import client_count, ensure_server, find_servers, ping, socket_path, stop_server
from tierstore.home import describe, purge, users

__all__ = ["build_parser", "main"]

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2


def _default_home() -> str:
    return os.environ.get("TIERSTORE_HOME") or ".tierstore"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tierstore server", formatter_class=HelpFormatter,
                                description="The embedded default's index server and the state of its home.")
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")

    def add(name: str, help_: str) -> argparse.ArgumentParser:
        s = sub.add_parser(name, help=help_, description=help_, formatter_class=HelpFormatter)
        if name != "list":
            s.add_argument("--home", default=_default_home(),
                           help="the embedded store's data directory (default: $TIERSTORE_HOME, else .tierstore)")
        if name in ("list", "status"):
            s.add_argument("--json", action="store_true",
                           help="JSON instead of text (list: one record per server per line)")
        return s

    add("status", "whether the server runs; its pid, connections and what the home holds")
    add("start", "start the server (or find it running) and print its unix:// URL")
    s = add("stop", "stop the server: by its socket, or by its pid when its home is gone")
    s.add_argument("--purge", action="store_true",
                   help="also remove the home's index, durable tier and host tier with its pool "
                        "(refused while a trainer, agent or admin command holds the home)")
    s.add_argument("--yes", action="store_true", help="with --purge: do not ask for confirmation")
    add("list", "every embedded index server of this user, with its home (orphans: home deleted)")
    return p


def _human(n: int) -> str:
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if x < 1024 or unit == "GiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{n} B"


def _status(home: Path, as_json: bool = False) -> int:
    sock = socket_path(home)
    state = describe(home)
    running = ping(sock)
    orphans = [s for s in state.servers if not s.home_exists]
    if as_json:
        running = running and not orphans
        print_json({"home": str(home), "exists": state.exists, "running": running, "socket": str(sock),
                    "pids": [s.pid for s in state.servers], "orphaned_pids": [s.pid for s in orphans],
                    "connections": (client_count(sock) or 0) if running else None,
                    "paths": [{"what": what, "path": str(path), "bytes": size} for what, path, size in state.paths]})
        return EXIT_OK if running else EXIT_ERROR
    if orphans:  # its index directory was deleted under it: what it serves is gone
        pids = ", ".join(str(s.pid) for s in orphans)
        print(f"an orphaned server runs (pid {pids}): its home {home} was deleted under it; "
              f"stop it with `tierstore server stop --home {home}`")
        running = False
    elif running:
        pids = ", ".join(str(s.pid) for s in state.servers) or "?"
        print(f"running on unix://{sock} (pid {pids}, {client_count(sock) or 0} other connection(s))")
    elif state.servers:
        pids = ", ".join(str(s.pid) for s in state.servers)
        print(f"not answering on unix://{sock}, but its server runs (pid {pids}): "
              f"stop it with `tierstore server stop --home {home}`")
    else:
        print(f"not running (its socket would be unix://{sock})")
    if not state.exists:
        print(f"no tierstore home at {home}")
    for what, path, size in state.paths:
        print(f"  {what}: {path} ({_human(size)})")
    return EXIT_OK if running else EXIT_ERROR


def _stop(home: Path, purge_: bool, yes: bool) -> int:
    if not purge_:
        stopped = stop_server(home)
        print(f"stopped the index server of {home}" if stopped else f"not running: no index server of {home}")
        return EXIT_OK
    state = describe(home)
    if state.empty:
        print(f"nothing to purge: no tierstore home at {home} and no server of it")
        return EXIT_OK
    holders = users(home)
    if holders:
        print(f"tierstore server stop --purge: {home} is in use ({holders.describe()}); "
              "stop its trainers, agents and admin commands first", file=sys.stderr)
        return EXIT_ERROR
    lines = [f"  {what}: {path} ({_human(size)})" for what, path, size in state.paths]
    lines += [f"  index server pid {s.pid}" + ("" if s.home_exists else " (its home is gone)") for s in state.servers]
    print(f"this removes the state of {home}:\n" + "\n".join(lines), file=sys.stderr)
    if not confirm("remove it?", assume_yes=yes):
        print("nothing removed (answer y, or add --yes)", file=sys.stderr)
        return EXIT_ERROR
    was_running = bool(state.servers) or ping(socket_path(home))
    removed = purge(home)
    said = f"stopped the index server of {home}" if was_running else f"no index server of {home} was running"
    print(f"{said}; removed {len(removed)} path(s)")
    for path in removed:
        print(f"  {path}")
    for path, why in state.kept:
        print(f"  kept {path}: {why}")
    return EXIT_OK


def _list(as_json: bool = False) -> int:
    servers = find_servers()
    if as_json:
        print_json([{"pid": s.pid, "socket": str(s.socket), "home": str(s.home), "home_exists": s.home_exists}
                    for s in sorted(servers, key=lambda s: str(s.home))])
        return EXIT_OK
    if not servers:
        print("no embedded index server runs for this user")
        return EXIT_OK
    for s in sorted(servers, key=lambda s: str(s.home)):
        where = str(s.home) if s.home_exists else f"{s.home} (deleted: stop it with `tierstore server stop --home {s.home}`)"
        print(f"pid {s.pid}  unix://{s.socket}  home {where}")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``tierstore server``; returns the exit code (see the module docstring)."""
    try:
        a = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:
        return int(e.code or 0)
    if a.action == "list":
        return _list(a.json)
    home = Path(a.home).resolve()
    if a.action == "start":
        print(ensure_server(home))
        return EXIT_OK
    if a.action == "stop":
        return _stop(home, a.purge, a.yes)
    return _status(home, a.json)
