"""Scheduler -> worker messages for one engine step (in-process types, pickled by vLLM)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import msgspec
from pd_connector.core.params import LeaseRef
from pd_connector.core.protocol import CheckpointBlocks
from pd_connector.engine.from_vllm.bases import KVConnectorMetadata


# slots: one of these per handoff, built inside vLLM's scheduling step (D's RecvTask: a Struct).
@dataclass(slots=True)
class SendLease:
    """P: blocks of a finished request held for D until ``deadline`` (time.monotonic)."""

    deadline: float
    replay_offset: int
    block_ids: list[list[int]]
    # The prompt fingerprint D's claim must match (core/fingerprint.py).
    fingerprint: str = ""
    # Decode requests that will read it (the router's pd_decode_requests: the client's n).
    requests: int = 1
    # Prompt checkpoints below the offset leased with it (core/checkpoints.py).
    checkpoints: list[CheckpointBlocks] = field(default_factory=list)


class RecvTask(msgspec.Struct):
    """D: read these block pairs from P. ``pairs`` None = the handoff could not be paired;
    the worker reports the load failed so vLLM recomputes the prompt.

    A msgspec Struct, not a dataclass: built once per handoff inside vLLM's scheduling step,
    where it is the cheaper to construct (docs/benchmarks.md, "Scheduler-side cost"). Never encoded by msgspec (vLLM pickles the metadata), so fields are not validated: the
    scheduler fills them from already decoded ``HandoffParams``."""

    lease: LeaseRef
    # Per group, (P block, D block) pairs: lists of tuples or pairing.BlockPairs (the
    # scheduler's; same sequence behaviour, no tuple per block).
    pairs: list[Sequence[tuple[int, int]]] | None
    num_tokens: int
    # What D claims from P before reading (P's offset and the block ids P sent).
    replay_offset: int = 0
    remote_block_ids: list[list[int]] | None = None
    # The prompt fingerprint D verified against its own prompt; the claim carries it.
    fingerprint: str = ""
    # Prompt checkpoints D reads in the same READ: the claimed states (P's blocks) and, per
    # group, their (P block, D block) pairs, kept apart from ``pairs`` (the state digest and
    # the claim's block lists cover the offset's blocks only).
    checkpoints: list[CheckpointBlocks] = []
    checkpoint_pairs: list[Sequence[tuple[int, int]]] | None = None
    # P's block sizes the pairs were cut for (pd_block_sizes, or D's own when P sent none);
    # the worker reads only from a P whose handshake shows the same.
    remote_block_sizes: tuple[int, ...] | None = None


class ReleaseTask(msgspec.Struct, frozen=True):
    """D's scheduler: tell every rank of P that nothing will be read, and why (P logs it).
    ``request_id``: the D request that will not read (each D rank then releases as that
    request's reader, so its siblings of an n > 1 request keep the lease); "" releases the
    handoff whole."""

    lease: LeaseRef
    reason: str
    request_id: str = ""


class ExtendTask(msgspec.Struct, frozen=True):
    """D: ask each rank of one P engine to extend the leases of these requests (still waiting
    for admission on D, or with a READ in flight)."""

    host: str
    port: int
    tp_size: int
    request_ids: list[str]


def extend_tasks(refs: Iterable[LeaseRef]) -> list[ExtendTask]:
    """One ExtendTask per P engine (side-channel address and TP size)."""
    by_peer: dict[tuple[str, int, int], dict[str, None]] = {}
    for ref in refs:  # n > 1 siblings on D read one P request: name it once
        by_peer.setdefault((ref.host, ref.port, ref.tp_size), {})[ref.request_id] = None
    return [ExtendTask(host, port, tp, list(ids)) for (host, port, tp), ids in by_peer.items()]


@dataclass
class PDMetadata(KVConnectorMetadata):
    to_send: dict[str, SendLease] = field(default_factory=dict)
    to_recv: dict[str, RecvTask] = field(default_factory=dict)
    to_release: list[ReleaseTask] = field(default_factory=list)
    to_extend: list[ExtendTask] = field(default_factory=list)
    # The engine step scheduled no tokens: vLLM steps anyway while a connector holds requests
    # (Scheduler.has_requests), so the worker may wait a little instead of spinning.
    idle: bool = False
