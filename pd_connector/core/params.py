"""``kv_transfer_params``: what P returns and D consumes, a superset of vLLM NixlConnector's
fields (so routers that forward the dict opaquely keep working), validated by D with a message
naming the field. Versioned with the side-channel protocol (``protocol.PROTOCOL_VERSION``).

Pure: no vLLM, torch, NIXL or sockets.
"""

from __future__ import annotations

import reprlib
from typing import Annotated

import msgspec

# MAX_BLOCK_ID and BlockId are the params' block ids too (re-exported: tests and callers import them here).
from pd_connector.core import trust
from pd_connector.core.protocol import (  # noqa: F401
    MAX_BLOCK_ID,
    MAX_TP,
    PROTOCOL_VERSION,
    BlockId,
    CheckpointBlocks,
    ProtocolError,
)

# kv_transfer_params keys added to vLLM NixlConnector's (a superset, so routers that forward the
# dict opaquely keep working).
KEY_REPLAY_OFFSET = "replay_offset"
KEY_VERSION = "pd_protocol_version"
# Router -> P: the decode instance's minimum recompute tail, so P backs off far enough.
KEY_MIN_RECOMPUTE = "pd_min_recompute_tokens"
# Router -> P: how many decode requests will load this handoff (the client's n, when the router
# prefills once for n samples); P's lease waits for each of them.
KEY_DECODE_REQUESTS = "pd_decode_requests"
# P -> D: the prompt fingerprint (core/fingerprint.py) and how long P keeps the blocks before
# a claim or an extension (D's queued handoffs are extended every third of it).
KEY_PROMPT_FINGERPRINT = "pd_prompt_fingerprint"
KEY_LEASE_SECONDS = "pd_lease_seconds"
# P -> D: prompt checkpoints below the offset (core/checkpoints.py), versioned on their own so
# a D that cannot place them refuses them alone, never the handoff:
# {"version": CHECKPOINTS_VERSION, "states": [{"position": p, "block_ids": [[...], ...]}]}.
KEY_CHECKPOINTS = "pd_checkpoints"
# P -> D: P's block size per transfer group (0 for a Mamba group): D pairs P's blocks by the
# tokens they hold (core/pairing.py sub_block_pairs) and checks them against P's handshake.
KEY_BLOCK_SIZES = "pd_block_sizes"
# Router -> P: how the router resumes D (RESUME_MODES). "first_token": the router carries P's
# first sampled token to D (D's prompt is P's N tokens plus it), so P computes the whole prompt
# and hands over R = N (zero replay); "replay" (the default: routers that send D the client's
# request unchanged): P hands over R < N and D recomputes [R, N).
KEY_RESUME = "pd_resume"
RESUME_FIRST_TOKEN = "first_token"
RESUME_REPLAY = "replay"
RESUME_MODES = (RESUME_FIRST_TOKEN, RESUME_REPLAY)
# P -> D: the first token P sampled, when P resumed D there (zero replay); D's prompt token R
# must be it. Sealed with the rest (core/trust.py).
KEY_FIRST_TOKEN = "pd_first_token"
# Largest block size a peer may announce (vLLM's hybrid alignment reaches a few thousand).
MAX_BLOCK_SIZE = 1 << 20
CHECKPOINTS_VERSION = 1
# Largest token id a handoff may name (vocabularies stay far below; bounds the field).
MAX_TOKEN_ID = (1 << 31) - 1
# Most checkpoints one handoff may carry (vLLM keeps at most two per prompt; bounds the claim).
MAX_CHECKPOINTS = 16
# Largest pd_decode_requests P accepts (vLLM's own n is unbounded; a lease waits for each).
MAX_DECODE_REQUESTS = 1024

# What a router sends P with the prompt (vLLM's toy-proxy fields): keep the blocks for a remote
# decode. The remote_* fields are present as None because vLLM's NIXL connector reads them
# unconditionally, and routers may point the same body at either connector.
PREFILL_REQUEST_PARAMS: dict = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class LeaseRef(msgspec.Struct, frozen=True):
    """One handoff on its prefill engine: which engine, where its side channel listens, P's
    request id, and P's tensor-parallel size (rank r listens on ``port + r``)."""

    engine_id: str
    host: str
    port: int
    request_id: str
    tp_size: int = 1

    def rank_port(self, rank: int) -> int:
        return self.port + rank


class HandoffParams(msgspec.Struct, frozen=True):
    """The ``kv_transfer_params`` P returns and D consumes (fields D relies on).

    NixlConnector-compatible names; ``replay_offset`` and ``pd_protocol_version`` are ours.
    """

    pd_protocol_version: int
    replay_offset: int
    remote_engine_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int
    # One list per KV-cache transfer group of P, in group order: P's block ids carrying KV of
    # [0, replay_offset) (attention) or the recurrent state at replay_offset (Mamba).
    remote_block_ids: list[list[BlockId]]
    do_remote_prefill: bool = True
    remote_num_tokens: int | None = None
    # P's tensor-parallel size (NixlConnector's key): D reads each rank's shard.
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_TP)] = 1
    # The prompt fingerprint of [0, replay_offset) (core/fingerprint.py); "" with offset 0.
    pd_prompt_fingerprint: Annotated[str, msgspec.Meta(max_length=128)] = ""
    # How long P keeps the blocks unless claimed or extended (None: a P that does not say).
    pd_lease_seconds: Annotated[float, msgspec.Meta(gt=0, le=1e7)] | None = None
    # P's block size per transfer group, 0 for Mamba groups (None: a P that does not say; D
    # then pairs with its own sizes, which the handshake confirms or refuses).
    pd_block_sizes: list[Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCK_SIZE)]] | None = None
    # The first token P sampled when it resumed D there (zero replay): D's prompt is P's R
    # tokens plus this one. None: D recomputes [R, N) of the client's prompt (replay).
    pd_first_token: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)] | None = None
    # P's wall clock (Unix seconds) past which no D should act on the handoff: P's hold cap.
    pd_expires_at: Annotated[float, msgspec.Meta(ge=0, le=1e11)] | None = None
    # HMAC-SHA256 over every field above and the checkpoints, with a shared secret (core/trust.py).
    pd_handoff_seal: Annotated[str, msgspec.Meta(max_length=64)] | None = None

    @property
    def lease(self) -> LeaseRef:
        return LeaseRef(
            self.remote_engine_id, self.remote_host, self.remote_port, self.remote_request_id, self.tp_size
        )


def encode_handoff_params(
    offset: int,
    source: list[list[int]],
    *,
    engine_id: str,
    request_id: str,
    host: str,
    port: int,
    tp_size: int = 1,
    fingerprint: str = "",
    lease_seconds: float | None = None,
    checkpoints: list[CheckpointBlocks] | None = None,
    block_sizes: list[int] | None = None,
    first_token: int | None = None,
    expires_at: float = 0.0,
    seal_key: bytes = b"",
) -> dict:
    """The ``kv_transfer_params`` P returns: NixlConnector's fields (vllm/distributed/
    kv_transfer/kv_connector/v1/nixl/pull_scheduler.py request_finished), so existing routers
    work unchanged, plus ``replay_offset``, the protocol version, the prompt fingerprint,
    P's initial lease length, its block sizes, the prompt checkpoints below the offset when there
    are any, the first token P sampled when it resumed D there, the expiry and, with a shared
    secret (``seal_key``), the seal over all of it."""
    params = {
        "do_remote_prefill": offset > 0,
        "do_remote_decode": False,
        "remote_block_ids": source,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "remote_num_tokens": offset,
        "remote_blocks_expiry_time": None,
        "tp_size": tp_size,
        "dcp_size": 1,
        "pp_size": 1,
        "transfer_mode": "pull",
        KEY_REPLAY_OFFSET: offset,
        KEY_VERSION: PROTOCOL_VERSION,
        KEY_PROMPT_FINGERPRINT: fingerprint,
        KEY_LEASE_SECONDS: lease_seconds,
    }
    if block_sizes is not None:
        params[KEY_BLOCK_SIZES] = block_sizes
    if checkpoints:
        params[KEY_CHECKPOINTS] = {
            "version": CHECKPOINTS_VERSION,
            "states": [{"position": c.position, "block_ids": c.block_ids} for c in checkpoints],
        }
    if first_token is not None:
        params[KEY_FIRST_TOKEN] = first_token
    params[trust.KEY_EXPIRES_AT] = expires_at
    if seal_key:
        decoded = msgspec.convert({k: v for k, v in params.items() if k in HandoffParams.__struct_fields__}, HandoffParams)
        params[trust.KEY_SEAL] = trust.seal(seal_key, sealed_fields(decoded, list(checkpoints or ())))
    return params


def sealed_fields(params: HandoffParams, checkpoints: list[CheckpointBlocks]) -> trust.SealedFields:
    """What the seal covers, from decoded values (the same on P, which issues them, and D)."""
    return trust.SealedFields(
        protocol_version=params.pd_protocol_version,
        replay_offset=params.replay_offset,
        remote_num_tokens=params.remote_num_tokens,
        engine_id=params.remote_engine_id,
        request_id=params.remote_request_id,
        host=params.remote_host,
        port=params.remote_port,
        tp_size=params.tp_size,
        block_ids=params.remote_block_ids,
        block_sizes=params.pd_block_sizes,
        fingerprint=params.pd_prompt_fingerprint,
        lease_seconds=params.pd_lease_seconds,
        checkpoints=checkpoints,
        first_token=params.pd_first_token,
        expires_at=params.pd_expires_at or 0.0,
    )


class _Checkpoints(msgspec.Struct, frozen=True):
    version: int
    states: Annotated[list[CheckpointBlocks], msgspec.Meta(max_length=MAX_CHECKPOINTS)]


def decode_checkpoints(raw: object) -> list[CheckpointBlocks]:
    """P's prompt checkpoints from D's ``kv_transfer_params`` ([] when there are none), or
    ``ProtocolError`` (kinds ``checkpoint_version``, ``checkpoint_malformed``): D then refuses
    the checkpoints only and still loads the handoff (decoded apart from ``HandoffParams``,
    whose validation would refuse it whole)."""
    if not isinstance(raw, dict) or raw.get(KEY_CHECKPOINTS) is None:
        return []
    field = raw[KEY_CHECKPOINTS]
    version = field.get("version") if isinstance(field, dict) else None
    if version != CHECKPOINTS_VERSION or isinstance(version, bool):
        raise ProtocolError(
            "checkpoint_version",
            f"{KEY_CHECKPOINTS} version {reprlib.repr(version)}, this instance reads version "
            f"{CHECKPOINTS_VERSION}; the checkpoints are not loaded (the handoff is)",
        )
    try:
        return msgspec.convert(field, _Checkpoints, strict=True).states
    except msgspec.ValidationError as exc:
        raise ProtocolError("checkpoint_malformed", f"{KEY_CHECKPOINTS}: {exc}") from None
    except RecursionError:
        raise ProtocolError("checkpoint_malformed", f"{KEY_CHECKPOINTS} nested too deeply") from None


def decode_handoff_params(raw: object) -> HandoffParams:
    """Validate D's incoming ``kv_transfer_params``; raise ``ProtocolError`` naming the field."""
    if not isinstance(raw, dict):
        raise ProtocolError(
            "malformed", f"kv_transfer_params must be an object, got {type(raw).__name__}"
        )
    if KEY_REPLAY_OFFSET not in raw:
        raise ProtocolError(
            "missing_offset",
            "kv_transfer_params carry no replay_offset (the prefill instance is not "
            "pd_connector, e.g. vLLM's NixlConnector); recomputing the prompt locally",
        )
    version = raw.get(KEY_VERSION)
    if version != PROTOCOL_VERSION or isinstance(version, bool):
        raise ProtocolError(
            "version_mismatch",
            f"{KEY_VERSION}={reprlib.repr(version)} but this instance speaks protocol "
            f"{PROTOCOL_VERSION}; upgrade the older side",
        )
    known = {k: raw[k] for k in HandoffParams.__struct_fields__ if k in raw}
    try:
        params = msgspec.convert(known, HandoffParams, strict=True)
    except msgspec.ValidationError as exc:
        raise ProtocolError("malformed", f"kv_transfer_params: {exc}") from None
    except RecursionError:
        raise ProtocolError("malformed", "kv_transfer_params nested too deeply") from None
    _check_ranges(params)
    return params


def release_target(raw: object) -> LeaseRef | None:
    """The P to release, from params too broken to decode as a whole (wrong version, bad
    offset...), so P frees the blocks now rather than at lease expiry. None if unusable, and
    None for params without ``replay_offset``: they come from another connector (vLLM's NIXL),
    whose side channel must never receive our messages (its listener dies on them)."""
    if not isinstance(raw, dict) or KEY_REPLAY_OFFSET not in raw:
        return None
    tp_size = raw.get("tp_size", 1)
    fields = {
        "engine_id": raw.get("remote_engine_id"),
        "host": raw.get("remote_host"),
        "port": raw.get("remote_port"),
        "request_id": raw.get("remote_request_id"),
        "tp_size": tp_size if isinstance(tp_size, int) and 1 <= tp_size <= MAX_TP else 1,
    }
    try:
        target = msgspec.convert(fields, LeaseRef, strict=True)
    except (msgspec.ValidationError, RecursionError):
        return None
    return target if 0 < target.port < 65536 and target.host else None


def _check_ranges(params: HandoffParams) -> None:
    if params.replay_offset < 0:
        raise ProtocolError(
            "offset_out_of_range", f"replay_offset={params.replay_offset} is negative"
        )
    if not 0 < params.remote_port <= 65536 - params.tp_size:
        raise ProtocolError(
            "malformed",
            f"remote_port={params.remote_port} with tp_size={params.tp_size}: not TCP ports "
            "(rank r listens on remote_port + r)",
        )
    if not params.remote_host or not params.remote_engine_id or not params.remote_request_id:
        raise ProtocolError(
            "malformed", "remote_host, remote_engine_id and remote_request_id must be non-empty"
        )
    # Block ids are range-checked by msgspec.convert (BlockId).
