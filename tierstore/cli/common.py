"""What every ``tierstore`` subcommand shares: help with defaults, closed pipes, install hints, confirmation."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["EXTRAS", "HelpFormatter", "Interrupted", "confirm", "install_hint", "interruptible", "print_json",
           "quiet_closed_stdout", "uninterrupted"]

#: The optional dependency (top-level module) -> the extra that installs it.
EXTRAS = {
    "matplotlib": "plot",
    "prometheus_client": "metrics",
    "moto": "testbed",
    "flask": "testbed",
    "flask_cors": "testbed",
    "ucxx": "ucx",
    "safetensors": "safetensors",
}


def install_hint(module: str | None) -> str:
    """The ``pip install`` line that brings ``module`` (an extra of tierstore where there is one)."""
    top = (module or "").split(".")[0]
    extra = EXTRAS.get(top)
    if extra is not None:
        return f"pip install 'tierstore[{extra}]'"
    if top == "torch":
        return "pip install torch==2.13.0 (the CPU wheel)"
    return f"pip install {top}" if top else "pip install tierstore"


class HelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to an option's help unless the help already says its default.

    Options without a default (``None``), flags (``False``) and hidden ones are left as written:
    their help says what happens when they are not given.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or default is None or default is False or default is argparse.SUPPRESS
                or "default" in text or "%(default)" in text):
            return text
        return f"{text} (default: %(default)s)"


def print_json(data: Any) -> None:
    """``--json`` output that composes with shell tools: one JSON document per line.

    A list (the rows of a listing command: ``admin models``, ``steps``, ``layers``, ``nodes``, ``du``,
    ``server list``) prints one record per line (JSON lines: ``| head -1`` is the first record, ``| wc -l``
    counts them, ``jq -c`` and ``grep`` work line by line; an empty list prints nothing). Anything else
    (one report: ``show``, ``where``, ``verify``, ``gc``, ...) prints as one compact document on one line.
    Keys are sorted; values JSON cannot hold are written with ``str``.
    """
    records = data if isinstance(data, list) else [data]
    for record in records:
        print(json.dumps(record, sort_keys=True, default=str, separators=(",", ":")))


def quiet_closed_stdout() -> None:
    """After a ``BrokenPipeError`` (``... --json | head -1``): point stdout at /dev/null, so the
    interpreter's final flush does not print a second traceback."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def confirm(question: str, *, assume_yes: bool) -> bool:
    """Ask ``question`` on stderr and read the answer from stdin; ``--yes`` skips it. EOF is a no."""
    if assume_yes:
        return True
    print(f"{question} [y/N] ", end="", file=sys.stderr, flush=True)
    answer = sys.stdin.readline()
    if not answer:
        print("", file=sys.stderr)
    return answer.strip().lower() in ("y", "yes")


class Interrupted(KeyboardInterrupt):
    """SIGTERM (or SIGINT) during a long command, raised where the main thread is, so the command's
    ``finally`` blocks stop what it started and remove what it made. ``signum``: the signal;
    the command exits ``128 + signum`` (143 for SIGTERM, 130 for Ctrl-C)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


def _raise_interrupted(signum: int, _frame: Any) -> None:
    raise Interrupted(signum)


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Within: SIGTERM and SIGINT raise :class:`Interrupted` in the main thread (instead of ending the
    process on the spot, or a bare ``KeyboardInterrupt``). The long commands (``bench``, ``demo``,
    ``import``, ``export``) run inside it; the handlers are restored on the way out. Outside the main
    thread (where Python delivers no signal) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {sig: signal.signal(sig, _raise_interrupted) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """Within: SIGTERM and SIGINT are ignored, so the cleanup after an :class:`Interrupted` runs to its end
    (each of its steps has its own bound). Restored on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
