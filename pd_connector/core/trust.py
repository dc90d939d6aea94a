"""Which handoffs D may act on: P seals what it issues, D checks the seal (or, without a shared
secret, P's host against an allow-list) before it contacts anyone.

The client that sends D a request also sends its ``kv_transfer_params``, and D claims from,
handshakes with and READs from whatever P those name; what it loads then enters its prefix
cache. So the params are untrusted input until one of two things holds:

- **a seal**: with a shared secret, P returns ``pd_handoff_seal``, an HMAC-SHA256 under a key
  derived from the secret over every field D acts on (engine, address, request, offset, block
  ids, block sizes, lease, fingerprint, checkpoints, first token, expiry). D recomputes it from
  the values it decoded, so a router may re-serialize the JSON (key order, ``30`` for ``30.0``)
  but cannot change a value;
- **an allow-list**: without a secret, P's host must be on ``allowed_prefill_hosts`` (by
  default this host's own addresses), compared as written: a name is never resolved here,
  because a resolver the client can influence would move the target after the check.

A handoff that passes neither is refused before any network contact, the release to P
included: P frees the blocks at its claim deadline. Replays of a sealed handoff are bounded by
its expiry, P's lease and P's single grant per reader (core/leases.py).

Pure: hashlib/hmac and msgspec only; the adapter gathers this host's addresses.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Iterable
import msgspec

from pd_connector.core.protocol import CheckpointBlocks

KEY_SEAL = "pd_handoff_seal"
KEY_EXPIRES_AT = "pd_expires_at"
# What allowed_prefill_hosts may name besides addresses, networks and host names.
ANY_HOST = "*"
LOCAL_HOST = "local"
# Slack on D's side of the expiry for clocks that disagree across hosts (NTP keeps them far
# closer); a replay inside it still meets P's lease and single grant.
CLOCK_SKEW_SECONDS = 60.0
# The side channel's HMAC key is the secret itself (transport/side_channel.py); the seal's is
# derived apart, so a sealed params dict can never pass for a side-channel message or back.
_SEAL_DOMAIN = b"pd_connector handoff seal v1"


def seal_key(secret: bytes) -> bytes:
    """The key that seals handoffs, derived from the shared secret (b"" without one)."""
    return hmac.new(secret, _SEAL_DOMAIN, hashlib.sha256).digest() if secret else b""


class SealedFields(msgspec.Struct, frozen=True, array_like=True):
    """Every value D acts on, in one fixed order; the seal is an HMAC of its encoding. Typed
    values, not the JSON text: a router that re-serializes P's answer changes no value."""

    protocol_version: int
    replay_offset: int
    remote_num_tokens: int | None
    engine_id: str
    request_id: str
    host: str
    port: int
    tp_size: int
    block_ids: list[list[int]]
    block_sizes: list[int] | None
    fingerprint: str
    lease_seconds: float | None
    checkpoints: list[CheckpointBlocks]
    first_token: int | None
    expires_at: float


_encoder = msgspec.json.Encoder()


def seal(key: bytes, fields: SealedFields) -> str:
    """P's seal over ``fields`` (hex)."""
    return hmac.new(key, _encoder.encode(fields), hashlib.sha256).hexdigest()


def seal_refusal(key: bytes, fields: SealedFields, presented: object, now: float) -> tuple[str, str] | None:
    """Why D may not act on a handoff under a shared secret, as ``(kind, reason)``, or None:
    no seal, a seal that does not match what D decoded, or a handoff past its expiry."""
    if not isinstance(presented, str) or not presented:
        return (
            "unauthenticated",
            f"the handoff carries no {KEY_SEAL}: it was not issued by a pd_connector prefill "
            "instance that shares this instance's secret (or a router dropped the field)",
        )
    if not hmac.compare_digest(presented.encode(), seal(key, fields).encode()):
        return (
            "unauthenticated",
            f"{KEY_SEAL} does not match the handoff's fields: they were altered after the prefill "
            "instance issued them, or it uses another shared secret",
        )
    if now > fields.expires_at + CLOCK_SKEW_SECONDS:
        return (
            "handoff_expired",
            f"the handoff expired {now - fields.expires_at:.0f} s ago (the prefill instance's hold "
            "cap has passed; replayed or long-queued parameters)",
        )
    return None


class HostAllowList(msgspec.Struct, frozen=True):
    """The P hosts D may contact without a seal: addresses and networks (parsed once), and
    names compared case-insensitively as written."""

    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()
    names: frozenset[str] = frozenset()
    any_host: bool = False

    def allows(self, host: str) -> bool:
        if self.any_host:
            return True
        address = _address(host)
        if address is None:
            return host.rstrip(".").lower() in self.names
        return any(address in network for network in self.networks)

    def describe(self) -> str:
        if self.any_host:
            return ANY_HOST
        return ", ".join([str(n) for n in self.networks] + sorted(self.names)) or "(none)"


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    # An IPv4-mapped IPv6 address is the IPv4 host it maps.
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped or address


def parse_allow_list(entries: Iterable[str], local: Iterable[str] = ()) -> HostAllowList:
    """``allowed_prefill_hosts`` as written: an address, a network (``10.0.0.0/16``), a host
    name, ``local`` (loopback and ``local``, this host's names and addresses) or ``*``.
    Raises ValueError naming an entry that is none of those."""
    networks: list = []
    names: set[str] = set()
    any_host = False
    pending = list(entries)
    while pending:
        entry = pending.pop(0).strip()
        if entry == ANY_HOST:
            any_host = True
        elif entry == LOCAL_HOST:
            networks += [ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128")]
            names.add("localhost")
            pending += [h for h in local if h and h != LOCAL_HOST]
        elif "/" in entry:
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                raise ValueError(f"allowed_prefill_hosts entry {entry!r} is not a network (e.g. 10.0.0.0/16)") from None
        elif _address(entry) is not None:
            networks.append(ipaddress.ip_network(_address(entry)))
        elif entry and all(_is_label(part) for part in entry.rstrip(".").split(".")):
            names.add(entry.rstrip(".").lower())
        else:
            raise ValueError(
                f"allowed_prefill_hosts entry {entry!r} is not an address, a network, a host name, "
                f"{LOCAL_HOST!r} or {ANY_HOST!r}"
            )
    return HostAllowList(tuple(networks), frozenset(names), any_host)


def _is_label(part: str) -> bool:
    return 0 < len(part) <= 63 and all(c.isalnum() or c in "-_" for c in part)


class Trust(msgspec.Struct, frozen=True):
    """D's trust settings for one decision: the seal key (b"": no shared secret) and the hosts
    it may contact (applied with or without a secret; ``*`` when a secret alone decides)."""

    key: bytes = b""
    hosts: HostAllowList = HostAllowList(any_host=True)


def host_refusal(hosts: HostAllowList, host: str, sealed: bool) -> tuple[str, str] | None:
    """Why D may not contact ``host`` (``(kind, reason)``), or None."""
    if hosts.allows(host):
        return None
    how = (
        "it is not on allowed_prefill_hosts"
        if sealed
        else "without a shared secret this instance contacts only prefill hosts on allowed_prefill_hosts"
    )
    return (
        "host_not_allowed",
        f"the handoff names prefill host {host!r}; {how} ({hosts.describe()}). Set "
        "PD_CONNECTOR_SHARED_SECRET on P and D, or add P's address to allowed_prefill_hosts",
    )


def exposure_warning(side_channel_host: str, has_secret: bool) -> str:
    """What P's start-up says when its side channel listens beyond loopback without a secret
    ("" otherwise): what a peer that reaches it can do, and how to close it."""
    address = _address(side_channel_host)
    if has_secret or (address is not None and address.is_loopback) or side_channel_host == "localhost":
        return ""
    return (
        f"the side channel listens on {side_channel_host} without a shared secret: any host that "
        "reaches it can handshake (and learn this engine's NIXL agent metadata, with which NIXL "
        "lets a peer READ any registered KV page), and claim or release a handoff whose request "
        "id it learns. Set PD_CONNECTOR_SHARED_SECRET (or shared_secret_file) on every P and D, "
        "or bind side_channel_host to a network only P and D share (docs/security.md)"
    )
