"""Listening ports for the servers tests and benchmarks start (HTTP, side channels).

A port is chosen, then bound later by another process (a vLLM server binds its side channel
only once its KV cache is allocated, 30 s or more after start). A port picked the usual way,
``bind(0)`` then close, lies in the kernel's ephemeral range (``ip_local_port_range``), where
every ``bind(0)`` and every outgoing connection on the host draws too: vLLM's own ZMQ and
torch.distributed ports, UCX's tcp endpoints, HTTP clients, so D's side-channel port can be
taken in that window ("Address already in use") and every test of that server configuration
errors. Ports handed out here lie below the ephemeral range, where nothing is assigned without
being asked for by number.
"""

from __future__ import annotations

import random
import socket
import threading
from collections.abc import Iterator

# Lowest port handed out; [_FLOOR, ephemeral low) is ~12k ports with Linux's default range.
_FLOOR = 20000
_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"

_lock = threading.Lock()
_handed_out: set[int] = set()
_cursor: int | None = None  # next candidate; starts at a random point, so two processes rarely meet


def ephemeral_low(path: str = _EPHEMERAL_RANGE) -> int | None:
    """The lowest port the kernel assigns on its own, or None where unknown (not Linux)."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def candidates(floor: int, ceiling: int, start: int) -> Iterator[int]:
    """Every port of [floor, ceiling) once, from ``start`` round to just before it."""
    span = ceiling - floor
    return (floor + (start - floor + i) % span for i in range(span))


def _bindable(host: str, port: int) -> bool:
    # No SO_REUSEADDR: a port still in TIME_WAIT is skipped rather than handed out.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now, not handed out before by this process, and (on Linux)
    below the ephemeral range so nothing else on the host is given it meanwhile."""
    global _cursor
    with _lock:
        low = ephemeral_low()
        if low is not None and low - _FLOOR >= 1000:
            if _cursor is None or not _FLOOR <= _cursor < low:
                _cursor = random.SystemRandom().randrange(_FLOOR, low)
            for port in candidates(_FLOOR, low, _cursor):
                if port not in _handed_out and _bindable(host, port):
                    _handed_out.add(port)
                    _cursor = _FLOOR + (port + 1 - _FLOOR) % (low - _FLOOR)
                    return port
        for _ in range(100):  # elsewhere: the kernel's pick, never the same one twice
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
            if port not in _handed_out:
                _handed_out.add(port)
                return port
    raise RuntimeError("could not find a free port")


def free_ports(count: int, host: str = "127.0.0.1") -> int:
    """The first of ``count`` consecutive free ports (a TP engine's side channels listen on
    ``side_channel_port + rank``)."""
    for _ in range(1000):
        base = free_port(host)
        rest = range(base + 1, base + count)
        with _lock:
            if all(p not in _handed_out and _bindable(host, p) for p in rest):
                _handed_out.update(rest)
                return base
    raise RuntimeError(f"could not find {count} consecutive free ports")
