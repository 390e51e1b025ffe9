"""Free TCP ports on loopback, for a server or a rendezvous this process is about to start (the one owner).

A port from ``bind(("127.0.0.1", 0))`` comes from the kernel's ephemeral range, the same range every outgoing
connection takes its source port from: between the probe closing its socket and the server binding the port,
any connection on the machine (another test worker's client, a rank's rendezvous) may take it, and the server
then fails with "Address already in use". :func:`free_port` hands out ports *below* that range instead, which
no outgoing connection is given, each probed free (nothing bound, nothing listening) and none twice in one
process. Each process starts at a random point of the range, so two processes rarely walk the same ports, and
the probe catches a port that another has bound meanwhile.
"""

from __future__ import annotations

import os
import random
import socket
import threading

__all__ = ["free_port"]

_LOW = 10000  # below: well-known and registered services are commoner
_lock = threading.Lock()
_next: int | None = None
_given: set[int] = set()


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (Linux; 32768 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _probe(port: int, host: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing holds now, outside the ephemeral range where the machine allows
    (``ip_local_port_range`` starting above 11000), never handed out before by this process. Falls back to
    the kernel's choice (``bind(0)``) when no port of the range is free."""
    global _next
    high = _ephemeral_low()
    with _lock:
        if high - _LOW >= 1000:
            span = high - _LOW
            if _next is None:
                _next = _LOW + random.Random(os.getpid() ^ int.from_bytes(os.urandom(4), "big")).randrange(span)
            for _ in range(span):
                port = _next
                _next = _LOW + (_next + 1 - _LOW) % span
                if port not in _given and _probe(port, host):
                    _given.add(port)
                    return port
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        _given.add(port)
        return port
