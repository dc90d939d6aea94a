"""Tensor parallelism: which P rank and byte range feed each byte of a D rank's pages.

Pure. Each rank describes every page region it registers as *segments*: runs of units of a
global tensor axis (an attention KV head, a conv-state channel of the x/B/C or Q/K/V segment in
one row, an SSM head) and where in the page they sit. A unit is identified by its axis name and
global index, so the same unit has the same identity on every rank of P and D whatever their TP
sizes; a D rank's page is then filled by intersecting its segments with those of the P ranks it
pairs with (``peer_ranks``). Replicated units (KV heads when TP exceeds the head count, Mamba2's
single group at TP > 1, a page every rank holds whole: ``replicated_segments``) are held by
several P ranks: each is read from exactly one of them, the first in ``peer_ranks`` order.

A layer is described only when its page is a layout this module proves it understands; any
other gets no segments and a ``reason``, and a peer of another TP size is refused naming it.

Equal TP sizes never come here: D rank r reads P rank r's pages whole (``descriptors.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import msgspec

from pd_connector.core.protocol import LayerRegion, Segment


class ShardError(ValueError):
    """P's and D's TP layouts cannot be mapped onto each other; the message names both TP sizes
    and the quantity that does not fit."""


def check_tp_pair(p: int, d: int) -> None:
    if p < 1 or d < 1 or (p % d and d % p):
        raise ShardError(
            f"prefill TP {p} and decode TP {d}: one must divide the other (ratio not integral)"
        )


def peer_ranks(p: int, d: int, d_rank: int) -> tuple[int, ...]:
    """The P ranks D rank ``d_rank`` pairs with: it claims from, reads from or releases each of
    them, and together they hold every unit the D rank holds (for vLLM's contiguous sharding).
    P > D: the ``p / d`` ranks that split D's share; P <= D: the one rank whose share holds it."""
    check_tp_pair(p, d)
    if p >= d:
        k = p // d
        return tuple(range(d_rank * k, (d_rank + 1) * k))
    return (d_rank * p // d,)


def readers_per_rank(p: int, d: int) -> int:
    """How many D ranks pair with each P rank (so how many completions a P rank waits for)."""
    check_tp_pair(p, d)
    return max(1, d // p)


# --- describing a rank's pages ----------------------------------------------------------------


def sharded(total: int, tp: int, rank: int, what: str) -> tuple[int, int]:
    """(first, count) of ``total`` units split evenly over ``tp`` ranks, or every unit's single
    owner when ``total < tp`` (vLLM replicates: rank r holds unit ``r * total // tp``)."""
    if total >= tp:
        if total % tp:
            raise ShardError(f"{what}: {total} do not divide over TP {tp}")
        per = total // tp
        return rank * per, per
    if tp % total:
        raise ShardError(f"{what}: {total} cannot be replicated evenly over TP {tp}")
    return rank * total // tp, 1


def attention_segments(
    total_heads: int, tp: int, rank: int, head_bytes: int, kernel_blocks: int = 1, kernel_stride: int = 0
) -> tuple[Segment, ...]:
    """A head-major attention page: ``kernel_blocks`` blocks ``kernel_stride`` bytes apart (1
    unless vLLM splits the page into kernel blocks), each this rank's heads back to back from
    its start, ``head_bytes`` each (vLLM's LBHNC/BLHNC: a head's tokens contiguous)."""
    first, count = sharded(total_heads, tp, rank, "KV heads")
    if kernel_blocks == 1:
        return (Segment("kv_head", first, count, 0, head_bytes),)
    return tuple(Segment(f"kv_head@{k}", first, count, k * kernel_stride, head_bytes) for k in range(kernel_blocks))


class AttentionPage(NamedTuple):
    """One layer's page as vLLM views it (``[kernel block, head slot, token, content]``, byte
    strides), next to what its spec says a plain K/V page of that layer holds."""

    page_bytes: int  # the registered page (vLLM's page_size_bytes: padding included)
    kernel_blocks: int
    kernel_stride: int
    slots: int
    slot_stride: int
    tokens: int
    token_stride: int
    content_bytes: int  # one slot's bytes for one token, contiguous
    kv_heads: int  # the spec's heads on this rank
    block_size: int  # the spec's tokens per page
    kv_bytes: int  # one head's K and V of one token: (head_size + head_size_v) x dtype size


def attention_page_segments(page: AttentionPage, total_heads: int, tp: int, rank: int) -> tuple[Segment, ...]:
    """This rank's KV heads in ``page``, or ``ShardError`` saying which part of the page is not
    one run per head at the start of each (kernel) block. Padding after the heads is allowed:
    a head's bytes come from the spec, never from the page size."""
    if page.slots != page.kv_heads:
        raise ShardError(f"{page.slots} head slots for {page.kv_heads} KV heads: a slot is not one head")
    if page.content_bytes != page.kv_bytes:
        raise ShardError(
            f"{page.content_bytes} B per head and token, {page.kv_bytes} B of K and V: packed content"
        )
    if page.kernel_blocks * page.tokens != page.block_size:
        raise ShardError(f"{page.kernel_blocks} x {page.tokens} tokens viewed in a {page.block_size}-token page")
    head_bytes = page.tokens * page.content_bytes
    if page.token_stride != page.content_bytes or page.slot_stride != head_bytes:
        raise ShardError(
            f"token stride {page.token_stride} B, head stride {page.slot_stride} B: a head is not one "
            f"run of {head_bytes} B"
        )
    heads_bytes = page.slots * head_bytes
    if page.kernel_blocks > 1 and page.kernel_stride < heads_bytes:
        raise ShardError(f"kernel blocks {page.kernel_stride} B apart overlap {heads_bytes} B of heads")
    end = (page.kernel_blocks - 1) * page.kernel_stride + heads_bytes
    if end > page.page_bytes:
        raise ShardError(f"heads end at {end} B, past the {page.page_bytes} B page")
    return attention_segments(total_heads, tp, rank, head_bytes, page.kernel_blocks, page.kernel_stride)


def layer_kv_heads(per_rank: int, tp: int, candidates: Sequence[int]) -> int:
    """The layer's total KV-head count: the one of ``candidates`` (what the model config allows
    for this layer) that gives ``per_rank`` heads at TP ``tp`` under vLLM's rule
    (``max(1, total // tp)``, total dividing TP or TP dividing it). Several (e.g. a target and a
    drafter whose heads both replicate at this TP) or none: ``ShardError``."""
    fits = sorted(
        {t for t in candidates if t > 0 and max(1, t // tp) == per_rank and (t % tp == 0 or tp % t == 0)}
    )
    if len(fits) != 1:
        raise ShardError(
            f"{per_rank} KV head(s) on this rank at TP {tp} fit "
            + (f"several head counts of the model ({fits})" if fits else f"none of the model's ({sorted(set(candidates))})")
        )
    return fits[0]


REPLICATED = "replicated"


def replicated_segments(nbytes: int) -> tuple[Segment, ...]:
    """A page every rank holds whole and identical (MLA's latent, a ``tp_replicated`` state):
    one unit of ``nbytes`` that any P rank can supply, read from the first D pairs with."""
    return (Segment(REPLICATED, 0, 1, 0, nbytes),)


def conv_segments(
    parts: Sequence[tuple[str, int, int]],
    rows: int,
    dim_first: bool,
    elem_bytes: int,
) -> tuple[Segment, ...]:
    """A conv state of ``rows`` time rows over this rank's channels ``parts`` = (axis, first
    global channel, count) in the rank's channel order (Mamba2: x, B, C; GDN: Q, K, V).
    ``dim_first`` (vLLM's DS): shape (channels, rows), a channel's rows contiguous; else (SD):
    shape (rows, channels), one segment per (row, part)."""
    width = sum(count for _, _, count in parts)
    out = []
    if dim_first:
        offset = 0
        for axis, first, count in parts:
            out.append(Segment(axis, first, count, offset, rows * elem_bytes))
            offset += count * rows * elem_bytes
        return tuple(out)
    for row in range(rows):
        offset = row * width * elem_bytes
        for axis, first, count in parts:
            out.append(Segment(f"{axis}@{row}", first, count, offset, elem_bytes))
            offset += count * elem_bytes
    return tuple(out)


def head_segments(axis: str, total: int, tp: int, rank: int, head_bytes: int) -> tuple[Segment, ...]:
    """A state sharded by heads, outermost (Mamba2 SSM (H, P, S), GDN recurrent (Hv, dv, dk))."""
    first, count = sharded(total, tp, rank, f"{axis}s")
    return (Segment(axis, first, count, 0, head_bytes),)


class ConvPart(NamedTuple):
    """One run of a conv state's channels, in the rank's channel order: ``total`` global channels
    of ``axis``, each rank holding its contiguous ``total / TP`` share, or every rank all of them
    (``replicated``: Mamba2's single group at TP > 1)."""

    axis: str
    total: int
    replicated: bool = False


class StateLayout(NamedTuple):
    """A recurrent layer's states as vLLM shards them, in global units: the conv state (state 0,
    when ``conv`` names its channel runs) by channels, every other state by ``units`` of ``axis``
    outermost (``(units / TP, ...)``: SSM heads, Mamba1's SSM channels, value heads)."""

    conv: tuple[ConvPart, ...]
    axis: str
    units: int


def state_segments(
    layout: StateLayout,
    state: int,
    shape: Sequence[int],
    elem_bytes: int,
    dim_first: bool,
    scratch_rows: int,
    tp: int,
    rank: int,
) -> tuple[Segment, ...]:
    """Segments of state ``state`` of a layer laid out as ``layout``, from this rank's ``shape``
    of it (vLLM's ``MambaSpec.shapes``, per rank); ``ShardError`` when the shape does not hold
    exactly this rank's share. Conv states (vLLM's SD ``(rows, channels)`` or DS ``(channels,
    rows)``) are read without the ``scratch_rows`` that trail an SD state's leading rows."""
    if layout.conv and state == 0:
        channels, rows = (shape[0], shape[1]) if dim_first else (shape[1], shape[0])
        parts = []
        for part in layout.conv:
            if part.replicated:
                parts.append((part.axis, 0, part.total))
                continue
            if part.total % tp:
                raise ShardError(f"{part.axis} channels: {part.total} do not divide over TP {tp}")
            parts.append((part.axis, rank * (part.total // tp), part.total // tp))
        if sum(count for _, _, count in parts) != channels or len(shape) != 2:
            raise ShardError(f"conv state {tuple(shape)} does not hold this rank's channels {parts}")
        return conv_segments(parts, rows - (0 if dim_first else scratch_rows), dim_first, elem_bytes)
    if layout.units % tp or not shape or shape[0] != layout.units // tp:
        raise ShardError(f"state {state} {tuple(shape)}: not this rank's share of {layout.units} {layout.axis}s")
    return head_segments(layout.axis, layout.units, tp, rank, math.prod(shape[1:]) * elem_bytes)


MAMBA2, GDN = "mamba2", "gdn"


def recurrent_segments(
    kind: str,
    state: int,
    conv_shape: Sequence[int],
    state_shape: Sequence[int],
    elem_bytes: Sequence[int],
    dim_first: bool,
    scratch_rows: int,
    tp: int,
    rank: int,
    groups_replicated: bool = False,
) -> tuple[Segment, ...]:
    """``state_segments`` of a Mamba2 or GDN layer whose global sizes are read off this rank's
    shapes (the synthetic ranks of tests and benchmarks): Mamba2 ``[x | B | C]`` with x = heads
    x head_dim and B, C one share of the groups each (all of them when ``groups_replicated``);
    GDN ``[Q | K | V]`` with V = value heads x head_v_dim and Q, K equal; heads outermost."""
    if state not in (0, 1):
        raise ShardError(f"{kind} layers have two states, not {state + 1}")
    heads = state_shape[0]
    channels = conv_shape[0] if dim_first else conv_shape[1]
    inner = heads * state_shape[1]
    if (channels - inner) % 2 or channels <= inner:
        raise ShardError(f"{kind} conv state of {channels} channels does not fit {inner} head channels")
    side = (channels - inner) // 2
    if kind == MAMBA2:
        group = ConvPart("B", side, True) if groups_replicated else ConvPart("B", side * tp)
        layout = StateLayout((ConvPart("x", inner * tp), group, group._replace(axis="C")), "ssm_head", heads * tp)
    elif kind == GDN:
        qk = ConvPart("q", side * tp)
        layout = StateLayout((qk, qk._replace(axis="k"), ConvPart("v", inner * tp)), "value_head", heads * tp)
    else:
        raise ShardError(f"no TP layout known for {kind} layers")
    shape = conv_shape if state == 0 else state_shape
    return state_segments(layout, state, shape, elem_bytes[state], dim_first, scratch_rows, tp, rank)


# --- pairing a D rank's regions with P ranks' -------------------------------------------------


class Piece(NamedTuple):
    """``nbytes`` at ``local_offset`` of a D page come from ``remote_offset`` of P rank
    ``source``'s page of the same region."""

    local_offset: int
    source: int
    remote_offset: int
    nbytes: int


def _units(segments: Sequence[Segment]) -> dict[str, list[Segment]]:
    by_axis: dict[str, list[Segment]] = {}
    for s in segments:
        by_axis.setdefault(s.unit, []).append(s)
    return by_axis


def plan_region(local: LayerRegion, remotes: Sequence[tuple[int, LayerRegion]]) -> list[Piece]:
    """Where each unit of ``local``'s segments comes from: the first of ``remotes`` (P rank,
    its region of the same name) that holds it, in the order given. Consecutive units that are
    contiguous on both sides and come from one rank form one piece. Raises ``ShardError`` for a
    unit no P rank holds or held with another size."""
    held = [(rank, _units(region.segments)) for rank, region in remotes]
    pieces: list[Piece] = []
    for seg in local.segments:
        start, end = seg.first, seg.first + seg.count
        while start < end:
            found = None
            for rank, units in held:
                for remote in units.get(seg.unit, ()):
                    if remote.first <= start < remote.first + remote.count:
                        found = rank, remote
                        break
                if found:
                    break
            if found is None:
                why = "".join(f"; prefill rank {r}: {region.reason}" for r, region in remotes if region.reason)
                raise ShardError(
                    f"{local.name}: no prefill rank holds {seg.unit} unit {start} "
                    f"(prefill ranks {[r for r, _ in remotes]}){why}"
                )
            rank, remote = found
            if remote.unit_bytes != seg.unit_bytes:
                raise ShardError(
                    f"{local.name}: {seg.unit} unit is {seg.unit_bytes} B here and "
                    f"{remote.unit_bytes} B on prefill rank {rank}"
                )
            stop = min(end, remote.first + remote.count)
            pieces.append(
                Piece(
                    seg.offset + (start - seg.first) * seg.unit_bytes,
                    rank,
                    remote.offset + (start - remote.first) * remote.unit_bytes,
                    (stop - start) * seg.unit_bytes,
                )
            )
            start = stop
    return merge_pieces(pieces)


def merge_pieces(pieces: Sequence[Piece]) -> list[Piece]:
    """Pieces sorted by local offset, neighbours from one rank contiguous on both sides joined."""
    out: list[Piece] = []
    for piece in sorted(pieces):
        if out:
            last = out[-1]
            if (
                last.source == piece.source
                and last.local_offset + last.nbytes == piece.local_offset
                and last.remote_offset + last.nbytes == piece.remote_offset
            ):
                out[-1] = last._replace(nbytes=last.nbytes + piece.nbytes)
                continue
        out.append(piece)
    return out


def shard_regions(
    local: Sequence[LayerRegion], remote_by_rank: dict[int, Sequence[LayerRegion]], order: Sequence[int]
) -> dict[int, tuple[tuple[LayerRegion, ...], tuple[LayerRegion, ...]]]:
    """Per P rank: (D's page ranges, P's page ranges) to copy, matched one to one, as regions
    (``name@offset``, one per piece) that the descriptor machinery (``descriptors.descriptor_rows``)
    takes like whole pages. ``order``: the P ranks to read from, preferred first."""
    by_name = {rank: {r.name: r for r in regions} for rank, regions in remote_by_rank.items()}
    out: dict[int, tuple[list[LayerRegion], list[LayerRegion]]] = {rank: ([], []) for rank in order}
    for region in local:
        if not region.segments:
            raise ShardError(
                f"{region.name}: this layer's layout is not described per TP shard: "
                + (region.reason or "unsupported layer type or KV-cache layout for different TP sizes")
            )
        remotes = []
        for rank in order:
            remote = by_name.get(rank, {}).get(region.name)
            if remote is None:
                raise ShardError(f"prefill rank {rank} has no layer {region.name}")
            if (remote.group, remote.token_layout) != (region.group, region.token_layout):
                raise ShardError(
                    f"{region.name}: group {region.group}, tokens laid out as {region.token_layout!r} here; group "
                    f"{remote.group}, {remote.token_layout!r} on prefill rank {rank} (another attention backend or CPU ISA?)"
                )
            remotes.append((rank, remote))
        remote_of = dict(remotes)
        for piece in plan_region(region, remotes):
            name = f"{region.name}@{piece.local_offset}"
            mine, theirs = out[piece.source]
            mine.append(
                msgspec.structs.replace(
                    region, name=name, addr=region.addr + piece.local_offset, page_bytes=piece.nbytes,
                    rows=0, scratch_rows=0, segments=(),
                )
            )
            source = remote_of[piece.source]
            theirs.append(
                msgspec.structs.replace(
                    source, name=name, addr=source.addr + piece.remote_offset, page_bytes=piece.nbytes,
                    rows=0, scratch_rows=0, segments=(),
                )
            )
    return {rank: (tuple(mine), tuple(theirs)) for rank, (mine, theirs) in out.items()}
