"""tierstore.ports.free_port: ports no outgoing connection is given, probed free, none twice in a process."""

from __future__ import annotations

import socket

from tierstore import ports


def test_ports_are_below_the_ephemeral_range_and_never_repeat():
    low = ports._ephemeral_low()
    got = [ports.free_port() for _ in range(300)]
    assert len(set(got)) == len(got)
    assert all(ports._LOW <= p < low for p in got), (low, min(got), max(got))


def test_a_port_someone_listens_on_is_skipped(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: taken + 1000)  # the range then holds `taken`
        monkeypatch.setattr(ports, "_next", taken)
        monkeypatch.setattr(ports, "_given", set())
        got = ports.free_port()  # the walk starts at `taken`
        assert got != taken and taken not in ports._given


def test_a_machine_whose_ephemeral_range_starts_low_gets_the_kernels_choice(monkeypatch):
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: 1024)
    monkeypatch.setattr(ports, "_given", set())
    p = ports.free_port()
    assert p in ports._given and 0 < p < 65536
    with socket.socket() as s:
        s.bind(("127.0.0.1", p))  # free: the kernel chose it just now
        assert s.getsockname()[1] == p
