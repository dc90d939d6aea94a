"""This host's own names and addresses: what ``allowed_prefill_hosts``' ``local`` means.

Read once at start-up from the resolver's view of this host's name (``getaddrinfo`` of
``gethostname``/``getfqdn``) plus the interface addresses Linux lists in /proc, never per
request: a handoff's host is compared as written (core/trust.py), not resolved.
"""

from __future__ import annotations

import socket


def local_host_names() -> list[str]:
    """Names and addresses of this host (loopback is added by the allow-list itself)."""
    names = {socket.gethostname(), socket.getfqdn()}
    out = set(names)
    for name in names:
        try:
            out.update(info[4][0] for info in socket.getaddrinfo(name, None))
        except OSError:
            pass  # a host name the resolver does not know: its interface addresses still count
    out.update(_interface_addresses())
    return sorted(h for h in out if h)


def _interface_addresses() -> set[str]:
    """IPv4 addresses of this host's interfaces (/proc/net/fib_trie's LOCAL entries) and IPv6
    ones (/proc/net/if_inet6); empty where /proc has neither."""
    found: set[str] = set()
    try:
        with open("/proc/net/fib_trie") as f:
            previous = ""
            for line in f:
                if "/32 host LOCAL" in line and previous.strip().startswith("|--"):
                    found.add(previous.strip()[3:].strip())
                previous = line
    except OSError:
        pass
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                raw = line.split()[0]
                found.add(":".join(raw[i : i + 4] for i in range(0, 32, 4)))
    except OSError:
        pass
    return found
