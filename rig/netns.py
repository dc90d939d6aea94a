"""Two "hosts" on one machine: a network namespace each, joined by a bridge the test process
also sits on, for P and D that can reach each other only over TCP.

Layout (one private /24, ``10.77.X.0``, the first one no interface of this machine uses)::

    namespace <prefix>a "p-host"      root namespace           namespace <prefix>b "d-host"
      <veth> 10.77.X.1  <--->  <bridge> 10.77.X.254  <--->  <veth> 10.77.X.2

Traffic only ever goes to these addresses: everything the harness creates, it deletes on exit
(``close``, also from ``atexit``), and leftovers of a killed run are reclaimed by name.

What makes the two namespaces two hosts to UCX (measured on the UCX NIXL 1.5.1 bundles): a
network namespace alone does not, since UCX decides that two peers share a machine (and so
shared memory and cma) by its *system id*, which comes from ``/proc/sys/kernel/random/boot_id``
(``ucs_get_system_id``), the same in every namespace of one kernel. Each host therefore runs in
its own mount namespace with a boot id of its own bound over that file, and its own UTS
namespace with its own hostname (``host_command``). UCX then finds only ``tcp`` reachable and
picks it by itself; ``UCX_TLS`` stays unset.
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import shlex
import shutil
import subprocess
import tempfile
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

__all__ = ["Host", "TwoHosts", "unavailable_reason"]

SUBNET_PREFIX = "10.77"
DEFAULT_PREFIX = "pdnet"

_live: "weakref.WeakSet[TwoHosts]" = weakref.WeakSet()


@atexit.register
def _close_all_at_exit() -> None:
    for hosts in list(_live):
        hosts.close()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable_reason() -> str | None:
    """Why two namespaced hosts cannot be made here, or None when they can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root (ip netns add, veth, bridge, mount --bind)"
    for tool in ("ip", "tc", "unshare", "mount", "hostname"):
        if shutil.which(tool) is None:
            return f"needs the {tool!r} command"
    probe = f"{DEFAULT_PREFIX}probe{os.getpid() % 100000}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _used_subnets() -> set[str]:
    out = _ip("-o", "-4", "addr", "show", check=False).stdout
    used = set()
    for line in out.splitlines():
        for word in line.split():
            if "/" in word and word[0].isdigit():
                used.add(str(ipaddress.ip_interface(word).network))
    return used


@dataclass(frozen=True)
class Host:
    """One namespaced host: its namespace, interface, address and the name it calls itself."""

    netns: str
    veth: str
    peer: str  # the veth's other end, on the bridge in the root namespace
    address: str
    hostname: str
    boot_id_file: Path | None  # None: the machine's own (UCX then sees one machine, see above)

    @property
    def prefix(self) -> list[str]:
        """What to put before a command to run it on this host: in its network namespace, with
        its own hostname and boot id (UTS and mount namespaces). Every step execs in place (``ip
        netns exec``, ``unshare``, ``sh``'s ``exec``), so the PID a caller starts is the program's
        own and so is its process group: ``servers.VllmServer.stop`` and a SIGKILL of the group
        reach it."""
        boot_id = (
            f"mount --bind {shlex.quote(str(self.boot_id_file))} /proc/sys/kernel/random/boot_id && "
            if self.boot_id_file is not None else ""
        )
        script = f'hostname {shlex.quote(self.hostname)} && {boot_id}exec "$@"'

        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "--mount", "sh", "-c", script, "sh"]

    def command(self, argv: Sequence[str]) -> list[str]:
        return [*self.prefix, *argv]

    def set_link(self, up: bool) -> None:
        """Take this host's link down (the cable pulled) or up again."""
        _ip("-n", self.netns, "link", "set", self.veth, "up" if up else "down")

    def limit_rate(self, rate: str | None) -> None:
        """Cap what this host sends (``tc`` token bucket, e.g. "2mbit"), so that a READ from it
        lasts long enough to act during it; None lifts the cap."""
        if rate is None:
            subprocess.run(["tc", "-n", self.netns, "qdisc", "del", "dev", self.veth, "root"],
                           capture_output=True, timeout=30)
            return
        subprocess.run(["tc", "-n", self.netns, "qdisc", "replace", "dev", self.veth, "root", "tbf", "rate", rate,
                        "burst", "16kb", "limit", "256kb"], capture_output=True, text=True, check=True, timeout=30)


class TwoHosts:
    """``with TwoHosts() as net:`` creates both hosts and the bridge; leaving the block deletes
    them (namespaces, veths, bridge, the boot-id files), also on failure. ``own_boot_ids=False``
    leaves both on the machine's boot id: one machine to UCX, which then reads over cma (the
    negative control of the transport checks)."""

    def __init__(self, prefix: str = DEFAULT_PREFIX, hostnames: tuple[str, str] = ("p-host", "d-host"),
                 own_boot_ids: bool = True):
        self.prefix = prefix
        self.own_boot_ids = own_boot_ids
        tag = f"{os.getpid() % 100000}"
        self._tag = tag
        self._tmp = Path(tempfile.mkdtemp(prefix="pd-netns-"))
        self.bridge = f"{prefix}br{tag}"[:15]
        self.subnet: ipaddress.IPv4Network | None = None
        self.gateway = ""
        self.hosts: list[Host] = []
        self._hostnames = hostnames
        self._created: list[tuple[str, ...]] = []  # undo commands, run in reverse

    @property
    def a(self) -> Host:
        return self.hosts[0]

    @property
    def b(self) -> Host:
        return self.hosts[1]

    def _free_subnet(self) -> ipaddress.IPv4Network:
        used = _used_subnets()
        for x in range(256):
            net = f"{SUBNET_PREFIX}.{x}.0/24"
            if net not in used:
                return ipaddress.IPv4Network(net)
        raise RuntimeError(f"no free {SUBNET_PREFIX}.X.0/24 subnet on this machine")

    def _reclaim_leftovers(self) -> None:
        """Namespaces and bridges of this harness whose creating process is gone (a killed test
        run skips its teardown); deleting a namespace deletes its veth and the peer with it."""
        alive = {str(pid % 100000) for pid in map(int, filter(str.isdigit, os.listdir("/proc")))}
        for line in _ip("netns", "list", check=False).stdout.splitlines():
            name = line.split()[0] if line.split() else ""
            tag = name[len(self.prefix) + 1:] if name.startswith(self.prefix) else ""
            if tag and name[len(self.prefix)] in "ab" and tag.isdigit() and tag not in alive:
                _ip("netns", "del", name, check=False)
        for line in _ip("-o", "link", "show", "type", "bridge", check=False).stdout.splitlines():
            name = line.split(":")[1].strip() if ":" in line else ""
            tag = name[len(self.prefix) + 2:] if name.startswith(self.prefix + "br") else ""
            if tag.isdigit() and tag not in alive:
                _ip("link", "del", name, check=False)

    def open(self) -> "TwoHosts":
        try:
            self._reclaim_leftovers()
            self.subnet = self._free_subnet()
            addrs = list(self.subnet.hosts())
            self.gateway = str(addrs[-1])
            _ip("link", "add", self.bridge, "type", "bridge")
            self._created.append(("link", "del", self.bridge))
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, (side, hostname) in enumerate(zip("ab", self._hostnames)):
                ns = f"{self.prefix}{side}{self._tag}"
                veth, peer = f"{self.prefix}{side}{self._tag}"[:15], f"{self.prefix}{side}h{self._tag}"[:15]
                _ip("netns", "add", ns)
                self._created.append(("netns", "del", ns))
                _ip("link", "add", veth, "type", "veth", "peer", "name", peer)
                self._created.append(("link", "del", peer))  # gone with the namespace already
                _ip("link", "set", veth, "netns", ns)
                _ip("link", "set", peer, "master", self.bridge)
                _ip("link", "set", peer, "up")
                address = str(addrs[i])
                _ip("-n", ns, "addr", "add", f"{address}/24", "dev", veth)
                _ip("-n", ns, "link", "set", veth, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                boot_id = self._tmp / f"{side}.boot_id" if self.own_boot_ids else None
                if boot_id is not None:
                    boot_id.write_text(str(uuid.uuid4()) + "\n")
                self.hosts.append(Host(ns, veth, peer, address, hostname, boot_id))
        except BaseException:
            self.close()
            raise
        _live.add(self)
        return self

    def close(self) -> None:
        for undo in reversed(self._created):
            _ip(*undo, check=False)
        self._created.clear()
        shutil.rmtree(self._tmp, ignore_errors=True)
        _live.discard(self)

    def __enter__(self) -> "TwoHosts":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()
