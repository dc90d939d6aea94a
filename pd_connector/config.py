"""``kv_connector_extra_config`` keys: parsing, defaults and validation (pure).

Every key is documented in docs/configuration.md. Unknown keys and wrong types are refused at
start-up with a message naming the key, instead of being silently ignored.
"""

from __future__ import annotations

import os
from typing import Any, Literal

import msgspec

DEFAULT_SIDE_CHANNEL_PORT = 5660


class ConnectorSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # Address P's side channel binds to and advertises to D in kv_transfer_params. Must be
    # reachable from D; loopback by default so nothing is exposed unless configured.
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = DEFAULT_SIDE_CHANNEL_PORT
    # How long P keeps a finished request's blocks for D before freeing them.
    lease_seconds: float = 120.0
    # D gives up on a P that does not answer the handshake within this time (recompute).
    handshake_timeout_seconds: float = 10.0
    # What D does when a load fails: "recompute" the prompt locally (no request is lost) or
    # "fail" the request with an error. Sets vLLM's kv_load_failure_policy accordingly.
    load_failure_policy: Literal["recompute", "fail"] = "recompute"
    nixl_backends: list[str] = msgspec.field(default_factory=lambda: ["UCX"])
    nixl_num_threads: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.side_channel_port < 65536:
            raise ValueError(f"side_channel_port={self.side_channel_port} is not a TCP port")
        if self.lease_seconds <= 0:
            raise ValueError(f"lease_seconds must be positive, got {self.lease_seconds}")
        if self.handshake_timeout_seconds <= 0:
            raise ValueError("handshake_timeout_seconds must be positive")
        if not self.nixl_backends:
            raise ValueError("nixl_backends must name at least one NIXL backend")


ENV_PREFIX = "PD_CONNECTOR_"


def parse_settings(extra_config: dict[str, Any] | None, environ=os.environ) -> ConnectorSettings:
    """Settings from ``kv_connector_extra_config``, then ``PD_CONNECTOR_<KEY>`` environment
    variables for keys the config leaves out, then defaults."""
    raw = dict(extra_config or {})
    for field in ConnectorSettings.__struct_fields__:
        env = environ.get(ENV_PREFIX + field.upper())
        if field not in raw and env is not None:
            raw[field] = env.split(",") if field == "nixl_backends" else env
    try:
        # strict=False: environment values are strings ("5660" -> 5660).
        return msgspec.convert(raw, ConnectorSettings, strict=False)
    except msgspec.ValidationError as exc:
        known = ", ".join(ConnectorSettings.__struct_fields__)
        raise ValueError(
            f"pd_connector: invalid kv_connector_extra_config: {exc}. Known keys: {known}"
        ) from None
