"""The side channel: every message between P's and D's workers, each a versioned
``msgspec.Struct`` with decoders built once (``kv_transfer_params`` live in ``params.py``).

Pure: no vLLM, torch, NIXL or sockets. Bump ``PROTOCOL_VERSION`` on any incompatible change to
these types *or their meaning* (e.g. what ``replay_offset`` counts).
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated

import msgspec


# Increment on any incompatible change to these types or their meaning; one line per version:
#   1: replay offset, claim/grant/release/extend, per-state page maps.
#   2: tensor parallelism: P's TP size in the params, one side channel per P rank
#      (port + rank), rank and shard segments in Welcome, readers in Claim/Release/ReadDone.
#   3: the prompt fingerprint (pd_prompt_digest in the params and the claim), P's initial lease
#      length in the params, the model identity in EngineCompat.
#   4: Extend is answered with Extended (which requests P still holds, and for how long);
#      Granted.lease_seconds is what P holds the lease from the claim on (it may be less than
#      P's lease_seconds near max_hold_seconds); D trusts a READ only inside that hold. A KV
#      head's segment is the head's own bytes (never a share of a padded page), a "replicated"
#      segment for pages every rank holds whole, and LayerRegion.reason.
#   5: one name for the prompt check: pd_prompt_fingerprint in the params (was pd_prompt_fingerprint),
#      Claim.fingerprint (was prompt_digest).
#   6: prompt checkpoints below the offset: pd_checkpoints in the params (their own version,
#      CHECKPOINTS_VERSION in params.py), the ones D reads in Claim.checkpoints.
#   7: attention blocks of different sizes: pd_block_sizes in the params, LayerRegion.token_layout.
#   8: the resume contract and trust: pd_first_token (zero replay), pd_expires_at and, with a
#      shared secret, pd_handoff_seal over every field D acts on (core/trust.py).
PROTOCOL_VERSION = 8

# Largest tensor-parallel size a peer may announce (bounds the ports and peers D derives).
MAX_TP = 1024
# Longest P holds a claim's answer for a lease still on its way (Claim.wait_ms), whatever a
# peer asks; D asks for at most half of it.
MAX_CLAIM_PARK_MS = 2000
# Completions a P rank waits for: one per D rank reading from it.
Readers = Annotated[int, msgspec.Meta(ge=1, le=MAX_TP)]

# Largest side-channel message we accept; bounds memory a misbehaving peer can make us use.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024

MAX_BLOCK_ID = 2**31 - 1
# A block id a peer may send: block 0 is vLLM's null block; NIXL descriptor indices are int32.
# Checked by msgspec while decoding (in C: D validates every handoff inside vLLM's scheduling
# step, and a long prompt carries hundreds of ids; see benchmarks.scheduler).
BlockId = Annotated[int, msgspec.Meta(gt=0, lt=MAX_BLOCK_ID)]


class ProtocolError(ValueError):
    """Malformed or incompatible input. ``kind`` is a stable metrics label."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class Segment(msgspec.Struct, frozen=True, array_like=True):
    """Units ``first .. first + count`` of a global tensor axis ``unit`` (e.g. ``kv_head``,
    ``x@0`` for conv channels of row 0, ``ssm_head``) held in a page, unit i at ``offset + i *
    unit_bytes``; what lets ranks of different TP sizes find each other's bytes
    (``shards.py``)."""

    unit: str
    first: int
    count: int
    offset: int
    unit_bytes: int


class LayerRegion(msgspec.Struct, frozen=True, array_like=True):
    """Where one layer's per-block pages (or one recurrent state of a Mamba layer) live.

    Page of block b: ``[addr + b * block_stride, + page_bytes)``. Derived from vLLM's
    ``KVCacheTensor`` placement, so it is exact for every layout vLLM allocates. A Mamba layer
    contributes one region per state (``name#i``), because the width of its conv state depends
    on the engine's speculative token count (``conv_kernel - 1 + num_spec`` rows, see
    ``MambaStateShapeCalculator`` in vLLM), which moves every later state inside the page.
    ``rows`` is the state's leading dimension and ``scratch_rows`` the engine's speculative token
    count; ``descriptors.reconcile_regions`` uses them to copy only the rows both engines hold.
    """

    name: str
    group: int
    addr: int
    block_stride: int
    page_bytes: int
    num_blocks: int
    rows: int = 0
    scratch_rows: int = 0
    # This rank's shard of the layer, for peers of another TP size (empty: not described, so
    # only an equal-TP peer can read it).
    segments: tuple[Segment, ...] = ()
    # Why ``segments`` is empty (named when a peer of another TP size is refused).
    reason: str = ""
    # Attention: where a token's bytes sit inside a KV head's run, as the layer's backend (and
    # CPU ISA) writes them (core/block_phases.py token_parts; "": no backend known). P and D
    # must name the same; only a layout token_parts knows is cut for another block size.
    token_layout: str = ""


class GroupDesc(msgspec.Struct, frozen=True, array_like=True):
    """One KV-cache group, as far as a peer must agree on it."""

    kind: str  # "attention" | "sliding_window" | "mamba"
    block_size: int
    page_bytes: int
    layer_names: list[str]


class EngineCompat(msgspec.Struct, frozen=True):
    """Settings P and D must share for raw page copies to be meaningful."""

    model: str
    dtype: str
    kv_cache_dtype: str
    groups: list[GroupDesc]
    conv_state_layout: str
    tensor_parallel_size: int
    device: str
    # Method and draft model of a drafter with its own KV cache (EAGLE/EAGLE3/MTP/draft model;
    # "none" without one, e.g. ngram): a D that drafts needs the drafter's KV for the prefix,
    # which only a P running the same drafter computed. The token count may differ (the replay
    # offset absorbs that).
    speculative: str = "none"
    # The model's identity as vLLM resolved it (engine/from_vllm/identity.py model_identity): weights and
    # tokenizer (HF id or local directory name, revisions), a local directory's content
    # (``model_files``: config, tokenizer, weight files sampled, so another model under the same
    # directory name differs), quantization, and what decides positions: the RoPE parameters
    # after --hf-overrides, and max_model_len where a scaled RoPE depends on it (0 otherwise).
    # Hub weights swapped under the same id and revision stay invisible.
    model_files: str = ""
    model_revision: str = ""
    tokenizer: str = ""
    tokenizer_revision: str = ""
    quantization: str = ""
    rope: str = ""
    max_model_len: int = 0


class Hello(msgspec.Struct, tag="hello", frozen=True):
    """D -> P: open a session. Carries D's compat so P can log what differs too."""

    engine_id: str
    compat: EngineCompat


class Welcome(msgspec.Struct, tag="welcome", frozen=True):
    """P -> D: NIXL agent metadata and the page map D reads from."""

    engine_id: str
    agent_name: str
    agent_metadata: bytes
    regions: list[LayerRegion]
    compat: EngineCompat
    # This answer comes from rank ``tp_rank`` of P's ``tp_size`` ranks (one side channel each).
    tp_rank: int = 0
    tp_size: int = 1


class Release(msgspec.Struct, tag="release", frozen=True):
    """D -> P: D will not read these requests' blocks (refused, or its own prefix hit
    covered them); P may free them now instead of at lease expiry. From one reader (a D rank)
    it counts as that reader's completion (``leases.LeaseTable.complete``); without a reader
    (D's scheduler) it ends the lease. ``reason`` goes into P's log."""

    request_ids: list[str]
    reason: str = ""
    reader: str = ""
    readers: Readers = 1


class CheckpointBlocks(msgspec.Struct, frozen=True):
    """A prompt checkpoint below the offset (core/checkpoints.py): the recurrent state after
    ``position`` tokens, in P's blocks ``block_ids``, one list per transfer group (empty for an
    attention group, the state's block for a Mamba group). In the params and in the claim."""

    position: Annotated[int, msgspec.Meta(gt=0)]
    block_ids: list[list[BlockId]]


class Claim(msgspec.Struct, tag="claim", frozen=True):
    """D -> P, before every READ: "I am about to read these blocks of your request at this
    offset". P grants it only if that is exactly what it leased for the request, and extends
    the lease; so parameters rewritten in transit, or a lease that already expired (its blocks
    possibly reused), are refused before a single byte is read."""

    engine_id: str
    request_id: str
    replay_offset: int
    block_ids: list[list[int]]
    # How long P may hold the answer while the lease is still on its way from P's scheduler to
    # its worker (one engine step; the claim can overtake it): P answers the moment it lands
    # instead of D polling. 0 (and P without this field): answer at once, Pending if unknown.
    wait_ms: Annotated[int, msgspec.Meta(ge=0)] = 0  # P holds at most MAX_CLAIM_PARK_MS
    # Who reads (a D rank) and how many readers this P rank waits for before it frees.
    reader: str = ""
    readers: Readers = 1
    # D's own fingerprint of its prompt[:replay_offset] (core/fingerprint.py): P grants only
    # if it is the one P computed, so a fingerprint rewritten in the params cannot pass.
    fingerprint: str = ""
    # The prompt checkpoints D reads with the offset's blocks: each one P leased (D may read
    # fewer than P offered, never another).
    checkpoints: list[CheckpointBlocks] = []


class Extend(msgspec.Struct, tag="extend", frozen=True):
    """D -> P, periodically: D still intends to read these requests (they wait for admission
    on D, or their READ is in flight); P extends their leases and answers ``Extended``."""

    request_ids: list[str]


class Extended(msgspec.Struct, tag="extended", frozen=True):
    """P -> D, the answer to ``Extend``: ``held`` maps each request P still holds to the seconds
    it keeps it from receiving the Extend; a request left out is no longer held (expired,
    ended or unknown), so a READ of it that D has not seen complete cannot be trusted
    (``core/read_hold.py``)."""

    held: dict[str, float]


class Granted(msgspec.Struct, tag="granted", frozen=True):
    """P -> D: the claim matches a live lease, which P now holds ``lease_seconds`` from receiving
    the claim (D's READ must complete inside that hold or an extension of it).
    ``state_digest`` (optional): SHA-256 of the recurrent-state pages, for D to verify."""

    lease_seconds: float
    state_digest: bytes = b""
    # The granting rank's NIXL agent: another one than D connected to means P restarted.
    agent_name: str = ""


class Pending(msgspec.Struct, tag="pending", frozen=True):
    """P -> D: no lease for that request *yet* (its grant travels with P's next engine step);
    ask again shortly. Keeps P's side-channel thread from ever waiting on one peer."""

    reason: str


class Ack(msgspec.Struct, tag="ack", frozen=True):
    pass


class Reject(msgspec.Struct, tag="reject", frozen=True):
    """P -> D: the request was refused; ``reason`` says why."""

    reason: str


class ReadDone(msgspec.Struct, frozen=True, array_like=True):
    """D -> P as the NIXL notification riding on a READ's last post: ``reader`` has read its
    share of ``request_id`` (P frees after ``readers`` of them)."""

    request_id: str
    reader: str = ""
    readers: Readers = 1


_read_done_decoder = msgspec.msgpack.Decoder(ReadDone)


def encode_read_done(done: ReadDone) -> bytes:
    return _envelope_encoder.encode(done)


def decode_read_done(data: bytes) -> ReadDone:
    """A READ's notification, or ``ProtocolError`` (P logs and ignores it)."""
    try:
        return _read_done_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError("malformed", f"READ notification {data[:64]!r}: {exc}") from None


Message = Hello | Welcome | Release | Claim | Extend | Extended | Granted | Pending | Ack | Reject


class Envelope(msgspec.Struct, frozen=True, array_like=True):
    """Stable outer frame: the version is checked before the body is decoded, so a peer with a
    different schema fails with "protocol version X vs Y", not a decode error. ``mac`` is
    HMAC-SHA256(shared secret, body) when a secret is configured."""

    protocol_version: int
    body: bytes
    mac: bytes = b""


_envelope_encoder = msgspec.msgpack.Encoder()
_envelope_decoder = msgspec.msgpack.Decoder(Envelope)
_message_decoder = msgspec.msgpack.Decoder(Message)


def _mac(secret: bytes, body: bytes) -> bytes:
    return hmac.new(secret, body, hashlib.sha256).digest()


def encode_message(message: Message, secret: bytes = b"") -> bytes:
    body = _envelope_encoder.encode(message)
    mac = _mac(secret, body) if secret else b""
    return _envelope_encoder.encode(Envelope(PROTOCOL_VERSION, body, mac))


def decode_message(data: bytes, secret: bytes = b"") -> Message:
    """Decode a side-channel frame or raise ``ProtocolError`` saying what was wrong. With a
    ``secret``, frames without a valid MAC are refused before their body is decoded."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(
            "oversized", f"message of {len(data)} bytes exceeds the {MAX_MESSAGE_BYTES} limit"
        )
    try:
        envelope = _envelope_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError("malformed", f"side-channel frame: {exc}") from None
    except RecursionError:
        raise ProtocolError("malformed", "side-channel frame nested too deeply") from None
    if envelope.protocol_version != PROTOCOL_VERSION:
        raise ProtocolError(
            "version_mismatch",
            f"peer speaks pd_connector protocol {envelope.protocol_version}, "
            f"this instance {PROTOCOL_VERSION}",
        )
    if secret and not hmac.compare_digest(envelope.mac, _mac(secret, envelope.body)):
        raise ProtocolError(
            "unauthenticated",
            "side-channel message without a valid MAC: the peer's shared_secret differs or is unset",
        )
    try:
        return _message_decoder.decode(envelope.body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError("malformed", f"side-channel message: {exc}") from None
    except RecursionError:
        raise ProtocolError("malformed", "side-channel message nested too deeply") from None
