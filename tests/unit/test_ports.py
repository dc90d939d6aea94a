"""Ports the test servers listen on come from below the kernel's ephemeral range."""

from __future__ import annotations

import socket
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rig import ports


@given(st.integers(1, 500), st.integers(1, 400), st.data())
def test_candidates_visit_every_port_once_starting_at_start(floor, span, data):
    start = data.draw(st.integers(floor, floor + span - 1))
    got = list(ports.candidates(floor, floor + span, start))
    assert got[0] == start and sorted(got) == list(range(floor, floor + span))


def test_ephemeral_low_reads_the_range_and_is_none_when_unknown(tmp_path):
    path = tmp_path / "range"
    path.write_text("32768\t60999\n")
    assert ports.ephemeral_low(str(path)) == 32768
    path.write_text("garbage")
    assert ports.ephemeral_low(str(path)) is None
    assert ports.ephemeral_low(str(tmp_path / "missing")) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the ephemeral range is read from /proc")
def test_side_channel_port_taken_between_pick_and_bind_cannot_happen_by_bind_zero():
    """Regression: a port picked by bind(0) lay in the ephemeral range, and vLLM or an outgoing
    connection took it before the server bound it ("Address already in use"). Handed-out ports
    are below the range, never repeat, and are free to bind."""
    low = ports.ephemeral_low()
    got = [ports.free_port() for _ in range(50)]
    assert len(set(got)) == len(got)
    assert all(port < low for port in got)
    with socket.socket() as s:
        s.bind(("127.0.0.1", got[-1]))


def test_a_port_someone_listens_on_is_skipped(monkeypatch):
    taken = ports.free_port()
    monkeypatch.setattr(ports, "_handed_out", set())  # only the bind check can skip it now
    monkeypatch.setattr(ports, "_cursor", taken)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", taken))
        holder.listen()
        assert ports.free_port() != taken
