"""Progress of ``tierstore bench`` on stderr: a line per system and round, or a redrawn bar on a terminal.

Rank 0 reports (:func:`tierstore.bench.harness.rank_main`); the other ranks are silent. A unit is one
system's setup (its warm-up save and restore), one system's save and restore in one round, or one
system's slowdown pass: ``systems * (1 + repeats + 1)`` in all, fewer as systems are skipped. Each line
reads ``bench: [k/N] WHAT`` (``WHAT``: ``setup SYSTEM``, ``round R/REPEATS SYSTEM: save ... s``,
``slowdown SYSTEM``, ``skipped SYSTEM: REASON``), so a log or a test can follow it; on a terminal the
same text is redrawn on one line after a bar, ending with a newline when done.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["BenchProgress"]

_BAR = 24


class BenchProgress:
    """Counts units of the benchmark and reports each on ``stream`` (default stderr).

    Args:
        total: the units planned (see the module docstring).
        stream: where to write (default ``sys.stderr``).
        enabled: ``False`` writes nothing (the ranks other than 0).
        tty: redraw a bar instead of writing lines (default: whether ``stream`` is a terminal).
    """

    def __init__(self, total: int, *, stream: TextIO | None = None, enabled: bool = True,
                 tty: bool | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.total = max(0, total)
        self.done = 0
        self.enabled = enabled
        self.tty = self.stream.isatty() if tty is None else tty
        self.t0 = time.monotonic()

    def note(self, text: str) -> None:
        """A line that is not a unit (what the benchmark is doing before its first unit)."""
        self._write(f"bench: {text}", final=True)

    def skip(self, units: int, text: str) -> None:
        """``units`` planned units will not run (a system was skipped); say why."""
        self.total = max(self.done, self.total - units)
        self._write(f"bench: {text}", final=True)

    def advance(self, text: str) -> None:
        """One unit finished: ``text`` says which and how it went."""
        self.done += 1
        self._write(f"bench: [{self.done}/{self.total}] {text}", final=self.done >= self.total)

    def _write(self, line: str, *, final: bool) -> None:
        if not self.enabled:
            return
        if self.tty:
            frac = self.done / self.total if self.total else 1.0
            bar = "#" * int(frac * _BAR)
            elapsed = time.monotonic() - self.t0
            self.stream.write(f"\r\x1b[2K[{bar:<{_BAR}}] {elapsed:5.0f}s {line}" + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
