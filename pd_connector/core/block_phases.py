"""Attention blocks of different sizes on P and D: which bytes of which block feed D's pages.

Pure. With block sizes B_P and B_D, one a multiple ``k`` of the other (s the smaller), every
block of the larger side is cut into ``k`` *phases* of s tokens, and phase j of a larger block
holds the same tokens as one whole block of the smaller side. D's scheduler pairs sub-blocks
and names each pair's phase (``pairing.sub_block_pairs``); here, once per peer, each layer of a
re-cut group becomes one region per phase (``name~j``) in its own *phase group*, on both sides,
so the descriptor machinery (``descriptors.py``, ``read_plan.Planner``) moves phase j's pairs like a
group of whole pages. A page's bytes are found from its segments and its token layout: each KV
head of each kernel block is one run (``shards.attention_page_segments``), and the layer's
attention backend decides where a token sits inside it (``token_parts``), so token t of head h
is at a known offset on each side, whatever the two block sizes, kernel blocks and TP shards;
the pieces are then planned per P rank by ``shards.shard_regions``, as for unequal TP.

What is not described per head and token (MLA's latent, a backend or CPU ISA whose layout is not
known), and a sub-block that would split a layout's pack of tokens (``token_granule``), is refused
by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import numpy as np

from pd_connector.core.descriptors import reconcile_regions
from pd_connector.core.pairing import recut_ratio
from pd_connector.core.protocol import LayerRegion, Segment
from pd_connector.core.shards import ShardError, shard_regions


class BlockSizeError(ShardError):
    """P's and D's attention block sizes cannot be paired for this layer or group."""


KV_HEAD = "kv_head"
# Bounds on what a peer's page map may make us build: heads per segment, parts of a token, phases.
MAX_PARTS = 1 << 12
# Where token t of an N-token run of one KV head sits (C bytes of K and V per token), by how the
# attention backend writes and reads it. INTERLEAVED: token t's K and V at t*C (vLLM's page view
# [H, N, C] as FlashAttention splits it, v1/attention/backends/flash_attn.py forward:
# ``kv_cache.transpose(1, 2).split(head_size, dim=-1)``). K_COLUMNS_V_ROWS/d: the run read as
# [2N, C/2] and split in halves (cpu_attn.py forward: ``kv_cache.view(blocks, heads,
# 2 * block_size, -1).chunk(2, dim=2)``), K kept column-major [d, N] and V row-major [N, d]
# (csrc/cpu/cpu_attn_vec.hpp reshape_and_cache, vLLM CPU's "vec" ISA): element i of token t's
# K at (i*N + t)*e, its V at N*C/2 + t*C/2. AMX_VNNI/d: vLLM CPU's "amx" ISA (bf16 model on a
# host with AMX tiles, block size a multiple of 32; csrc/cpu/cpu_attn_amx.hpp reshape_and_cache,
# read off vLLM 0.32's own kernel in tests/vllm/test_block_size_layout.py, bf16 and fp8 pages
# alike in elements): K as [N/16][d/2][16][2] (groups of 16 tokens, each dim pair of a token
# adjacent, a group's 16 tokens side by side per pair: AMX's VNNI B tiles), then V as
# [d/16][N/2][16][2] (per 16 dims, pairs of tokens: dim j of tokens 2u and 2u+1 adjacent). One
# token's bytes are scattered, but a span of whole groups of 16 tokens is one run in K and one
# per 16 dims in V, so those pages are cut at multiples of ``AMX_TOKEN_GROUP`` only
# (``token_granule``). Any other layout name is opaque: pages of equal block sizes and the same
# name are copied whole, nothing else is cut.
INTERLEAVED, K_COLUMNS_V_ROWS, AMX_VNNI = "interleaved", "k_columns_v_rows", "amx_vnni"
AMX_TOKEN_GROUP = 16  # tokens per K group (AMX_TILE_ROW_BYTES / 4); V pairs (2) divide it
AMX_DIM_GROUP = 16  # head dims per V group (the B tile's N)
_WITH_HEAD_DIM = (K_COLUMNS_V_ROWS, AMX_VNNI)


def token_layout_name(layout: str, head_dim: int = 0) -> str:
    """The ``LayerRegion.token_layout`` of a layout (K_COLUMNS_V_ROWS and AMX_VNNI carry
    their head dim)."""
    return f"{layout}/{head_dim}" if layout in _WITH_HEAD_DIM else layout


def token_granule(layout: str) -> int:
    """The tokens a layout packs together: a span of tokens is cut out of a page (a kernel
    block, a phase) only where it starts and ends at multiples of this."""
    return AMX_TOKEN_GROUP if layout.partition("/")[0] == AMX_VNNI else 1


def token_parts(layout: str, tokens: int, token_bytes: int) -> list[tuple[int, int]] | None:
    """A head's run of ``tokens`` tokens of ``token_bytes`` each as runs in which consecutive
    tokens are adjacent: (offset in the run, bytes of one token there); for a layout packing
    tokens (``token_granule`` g > 1), the tokens [a, b) with a and b multiples of g sit at
    [offset + a*bytes, offset + b*bytes) of each run, whatever the order inside a pack. None:
    not cuttable."""
    if layout == INTERLEAVED:
        return [(0, token_bytes)]
    name, _, dim = layout.partition("/")
    if name not in _WITH_HEAD_DIM or not dim.isdigit() or int(dim) <= 0 or token_bytes % (2 * int(dim)):
        return None
    head_dim = int(dim)
    elem = token_bytes // (2 * head_dim)
    half = tokens * head_dim * elem
    if name == AMX_VNNI:
        if head_dim % AMX_DIM_GROUP or head_dim // AMX_DIM_GROUP >= MAX_PARTS or tokens % AMX_TOKEN_GROUP:
            return None
        v_group = tokens * AMX_DIM_GROUP * elem
        v_runs = [(half + g * v_group, AMX_DIM_GROUP * elem) for g in range(head_dim // AMX_DIM_GROUP)]
        return [(0, head_dim * elem)] + v_runs
    if head_dim > MAX_PARTS:
        return None
    return [(i * tokens * elem, elem) for i in range(head_dim)] + [(half, head_dim * elem)]


def _cuts_packs(region: LayerRegion, tokens: int, what: str) -> None:
    """``BlockSizeError`` naming the layout when spans of ``tokens`` would split its packs."""
    granule = token_granule(region.token_layout)
    if tokens % granule:
        raise BlockSizeError(
            f"{region.name}: token layout {region.token_layout!r} packs {granule} tokens together, "
            f"{what} of {tokens} tokens would split them"
        )


def _kernel_block(unit: str) -> int | None:
    """Kernel block of a KV-head segment (``kv_head`` or ``kv_head@k``), None for others."""
    axis, _, kernel = unit.partition("@")
    if axis != KV_HEAD:
        return None
    return int(kernel) if kernel else 0


def token_segments(region: LayerRegion, block_size: int) -> tuple[Segment, ...]:
    """``region``'s KV heads as runs of tokens: per head, kernel block and part of a token's
    bytes (``token_parts``) one segment of unit ``kv_head:h:part`` whose units are the block's
    token positions. ``BlockSizeError`` for a page not described per head and token."""
    kernels = [_kernel_block(seg.unit) for seg in region.segments]
    if not region.segments or None in kernels:
        units = sorted({seg.unit for seg in region.segments})
        raise BlockSizeError(
            f"{region.name}: its page is not described per KV head and token "
            + (f"(units {units})" if units else f"({region.reason or 'no layout described'})")
        )
    per_kernel = block_size // len(set(kernels))
    if per_kernel * len(set(kernels)) != block_size:
        raise BlockSizeError(f"{region.name}: {len(set(kernels))} kernel blocks do not split {block_size} tokens")
    _cuts_packs(region, per_kernel, "kernel blocks" if per_kernel < block_size else "blocks")
    out = []
    for seg, kernel in zip(region.segments, kernels):
        parts = token_parts(region.token_layout, per_kernel, seg.unit_bytes // per_kernel)
        if parts is None or seg.unit_bytes % per_kernel or not 0 < seg.count <= MAX_PARTS:
            raise BlockSizeError(
                f"{region.name}: where a token sits in a KV head's page is not known for its attention backend "
                f"(token layout {region.token_layout!r}, {seg.unit_bytes} B per head)"
            )
        for i in range(seg.count):
            for part, (offset, token_bytes) in enumerate(parts):
                at = seg.offset + i * seg.unit_bytes + offset
                out.append(Segment(f"{KV_HEAD}:{seg.first + i}:{part}", kernel * per_kernel, per_kernel, at, token_bytes))
    return tuple(out)


def window(segments: Sequence[Segment], first: int, count: int) -> tuple[Segment, ...]:
    """The tokens ``[first, first + count)`` of token segments, renumbered from 0."""
    out = []
    for seg in segments:
        lo, hi = max(seg.first, first), min(seg.first + seg.count, first + count)
        if lo < hi:
            out.append(Segment(seg.unit, lo - first, hi - lo, seg.offset + (lo - seg.first) * seg.unit_bytes, seg.unit_bytes))
    return tuple(out)


@dataclass(frozen=True)
class PhasePlan:
    """The re-cut groups of one peer: ``ratio[g]`` phases for group g, phase j of g moved as
    group ``groups[(g, j)]`` (g itself for phase 0, numbers after the real groups for the
    others)."""

    ratio: dict[int, int]
    groups: dict[tuple[int, int], int]
    num_groups: int  # real and phase groups together

    @classmethod
    def of(cls, remote_sizes: Sequence[int], local_sizes: Sequence[int], kinds: Sequence[str]) -> "PhasePlan":
        """From both sides' block sizes per group (0: a Mamba group, never re-cut)."""
        if len(remote_sizes) != len(local_sizes):
            raise BlockSizeError(f"{len(remote_sizes)} prefill groups, {len(local_sizes)} here")
        ratio, groups, next_group = {}, {}, len(local_sizes)
        for g, (p, d, kind) in enumerate(zip(remote_sizes, local_sizes, kinds)):
            if p == d:
                continue
            k = recut_ratio(kind, p, d)
            if k is None or k > MAX_PARTS:
                raise BlockSizeError(f"group {g} ({kind}): block sizes {p} (prefill) and {d} (decode) cannot be re-cut")
            ratio[g] = k
            groups[(g, 0)] = g
            for j in range(1, ratio[g]):
                groups[(g, j)] = next_group
                next_group += 1
        return cls(ratio, groups, next_group)


def phase_regions(
    regions: Sequence[LayerRegion], plan: PhasePlan, sizes: Sequence[int], smaller: Sequence[int]
) -> tuple[LayerRegion, ...]:
    """One side's regions of the re-cut groups, one per (layer, phase) as ``name~j`` in its
    phase group, with token segments for that phase's s tokens: the larger side's phase j holds
    tokens [j*s, (j+1)*s) of its block; the smaller side's page is the same s tokens in every
    phase (its block ids differ per pair)."""
    out = []
    for region in regions:
        k = plan.ratio.get(region.group)
        if k is None:
            continue
        size, small = sizes[region.group], smaller[region.group]
        tokens = token_segments(region, size)
        _cuts_packs(region, small, "sub-blocks")
        for j in range(k):
            segments = window(tokens, j * small, small) if size > small else tokens
            out.append(
                msgspec.structs.replace(
                    region, name=f"{region.name}~{j}", group=plan.groups[(region.group, j)], segments=segments
                )
            )
    return tuple(out)


def paired_for_other_sizes(paired: Sequence[int] | None, handshake: Sequence[int]) -> str:
    """Why pairs cut for P block sizes ``paired`` (D's scheduler: the params' or its own; None:
    not said) cannot be read from a P whose handshake shows ``handshake`` ("": they can)."""
    if paired is None or tuple(paired) == tuple(handshake):
        return ""
    return f"the handoff was paired for prefill block sizes {list(paired)}, the prefill engine's handshake shows {list(handshake)}"


def route_pairs(pairs: Sequence[Sequence[tuple[int, int]]], plan: PhasePlan) -> list:
    """Per-group pairs (``pairing.BlockPairs`` with phases for the re-cut groups) as pairs per
    real and phase group. ``BlockSizeError`` when the pairs' cut is not this peer's (the
    scheduler paired with block sizes the handshake does not confirm)."""
    out: list = [()] * plan.num_groups
    for g, group_pairs in enumerate(pairs):
        phases = getattr(group_pairs, "phases", None)
        k = plan.ratio.get(g)
        if phases is None:
            if k is not None and len(group_pairs):
                raise BlockSizeError(f"group {g}: paired as whole blocks, but this prefill engine's are {k}x apart")
            out[g] = group_pairs
            continue
        if k is None:
            raise BlockSizeError(f"group {g}: paired as sub-blocks, but this prefill engine's block size is ours")
        phase = np.asarray(phases, dtype=np.int64)
        if phase.size and (phase.min() < 0 or phase.max() >= k):
            raise BlockSizeError(f"group {g}: phase {int(phase.max())} of {k}")
        both = np.array(group_pairs, dtype=np.int64).reshape(-1, 2)
        for j in range(k):
            out[plan.groups[(g, j)]] = both[phase == j]
    return out


def recut_regions(
    local: Sequence[LayerRegion],
    remote_by_rank: dict[int, Sequence[LayerRegion]],
    order: Sequence[int],
    plan: PhasePlan,
    local_sizes: Sequence[int],
    remote_sizes: Sequence[int],
) -> dict[int, tuple[tuple[LayerRegion, ...], tuple[LayerRegion, ...]]]:
    """Per P rank: (D's, P's) page ranges of the re-cut groups, matched one to one per phase
    group (``shards.shard_regions`` over ``phase_regions``, at any two TP sizes)."""
    smaller = [min(a, b) for a, b in zip(local_sizes, remote_sizes)]
    mine = phase_regions(local, plan, local_sizes, smaller)
    theirs = {rank: phase_regions(regions, plan, remote_sizes, smaller) for rank, regions in remote_by_rank.items()}
    return shard_regions(mine, theirs, order)


RegionPlans = dict[int, tuple["tuple[LayerRegion, ...] | None", tuple[LayerRegion, ...]]]


def peer_regions(
    local: Sequence[LayerRegion],
    remote_by_rank: dict[int, Sequence[LayerRegion]],
    order: Sequence[int],
    same_tp: bool,
    plan: PhasePlan,
    local_sizes: Sequence[int],
    remote_sizes: Sequence[int],
) -> RegionPlans:
    """Per P rank: (D's page ranges or None, P's) to read, for every group. Without re-cut
    groups, at equal TP P's page map as it is (None: ``read_plan.plan_engine`` reconciles it)
    and at unequal TP the shard plan; re-cut groups are planned per phase and joined to the
    rest, the two lists then matched one to one."""
    if not plan.ratio:
        if same_tp:
            return {rank: (None, tuple(regions)) for rank, regions in remote_by_rank.items()}
        return shard_regions(local, remote_by_rank, order)

    def kept(regions: Sequence[LayerRegion]) -> tuple[LayerRegion, ...]:
        return tuple(r for r in regions if r.group not in plan.ratio)

    if same_tp:
        rest = {rank: reconcile_regions(kept(local), kept(regions)) for rank, regions in remote_by_rank.items()}
    else:
        rest = shard_regions(kept(local), {rank: kept(regions) for rank, regions in remote_by_rank.items()}, order)
    recut = recut_regions(local, remote_by_rank, order, plan, local_sizes, remote_sizes)
    return {rank: (rest[rank][0] + recut[rank][0], rest[rank][1] + recut[rank][1]) for rank in rest}
