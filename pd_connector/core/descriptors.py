"""Descriptor arithmetic: from (P block, D block) pairs to NIXL descriptor indices.

Pure (numpy only). Each side prepares ONE descriptor list per peer at handshake time, made of
strided *rows* ``(addr, len, device, stride, count)``: row r contributes ``count`` descriptors,
one per block, in row order. A row is either one layer's pages (``len = page_bytes``) or, for a
*packed* group, every layer of the group at once: when the group's layer pages sit next to each
other inside a block (block-outer layouts, ``[num_blocks, layers, ...]``), block b of all its
layers is one span of ``layers * page_bytes`` bytes, so a request needs one descriptor per
(group, block) instead of one per (layer, block).

A pair of blocks in group g expands to one descriptor per row of g, on both sides; indices are
computed vectorised (a loop over groups, never over layers or blocks). NIXL 1.5.1 then merges
neighbours of the index list that are consecutive descriptors of one *dense* row (stride ==
len), on both sides; nothing else merges (adjacent pages of two different rows stay two
descriptors: pinned against NIXL's own telemetry in tests/nixl/test_worker_threads.py). ``count_runs`` models exactly that, so the
descriptor count a request reports equals the number of contiguous runs NIXL moves.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import msgspec
import numpy as np

from pd_connector.core.protocol import LayerRegion


class DescriptorError(ValueError):
    """P's and D's page maps cannot be matched."""


def region_offsets(regions: Sequence) -> np.ndarray:
    """Index of each region's (or row's) block-0 descriptor in the prepared list."""
    counts = np.fromiter((r.num_blocks for r in regions), dtype=np.int64, count=len(regions))
    return np.concatenate(([0], np.cumsum(counts)[:-1])) if len(regions) else counts


def strided_descriptors(regions: Sequence[LayerRegion], device_id: int) -> np.ndarray:
    """NIXL's compressed (address, len, device, stride, count) rows: one per region."""
    return np.array(
        [(r.addr, r.page_bytes, device_id, r.block_stride, r.num_blocks) for r in regions],
        dtype=np.int64,
    ).reshape(-1, 5)


def check_matching(local: Sequence[LayerRegion], remote: Sequence[LayerRegion], sizes: bool = True) -> None:
    """Both sides must list the same layers, in the same groups, with equal page sizes
    (``sizes=False``: sizes are reconciled by ``reconcile_regions``)."""
    if len(local) != len(remote):
        raise DescriptorError(f"layer count differs: local {len(local)}, remote {len(remote)}")
    for a, b in zip(local, remote):
        if a.token_layout != b.token_layout:
            raise DescriptorError(
                f"{a.name}: tokens laid out as {a.token_layout!r} here, {b.token_layout!r} on the peer "
                "(another attention backend or CPU ISA)"
            )
        if (a.name, a.group) != (b.name, b.group) or (sizes and a.page_bytes != b.page_bytes):
            raise DescriptorError(
                f"layer mismatch: local ({a.name}, group {a.group}, {a.page_bytes} B/page) vs "
                f"remote ({b.name}, group {b.group}, {b.page_bytes} B/page)"
            )


def reconcile_regions(
    local: Sequence[LayerRegion], remote: Sequence[LayerRegion]
) -> tuple[tuple[LayerRegion, ...], tuple[LayerRegion, ...]]:
    """The page maps both sides copy with: equal regions as they are; a recurrent state whose
    size differs only by speculative scratch rows trimmed, on both sides, to the rows that hold
    the state.

    vLLM widens Mamba/GDN/short-conv conv states by ``num_spec`` trailing rows (SD orientation:
    ``(conv_kernel - 1 + num_spec, dim)``) used only while verifying drafts; the state after a
    prefill is in the leading rows. A P and a D with different speculative token counts
    therefore agree on ``rows - scratch_rows`` rows of equal size, and only those are copied.
    Any other difference (DS orientation, other dims, a state without scratch rows) raises.
    """
    check_matching(local, remote, sizes=False)
    out_local, out_remote = [], []
    for a, b in zip(local, remote):
        if a.page_bytes != b.page_bytes:
            keep = _common_state_bytes(a, b)
            if keep is None:
                raise DescriptorError(
                    f"state {a.name}: local {a.page_bytes} B ({a.rows} rows, {a.scratch_rows} "
                    f"speculative), remote {b.page_bytes} B ({b.rows} rows, {b.scratch_rows} "
                    "speculative): the recurrent-state layouts differ beyond speculative rows"
                )
            rows = a.rows - a.scratch_rows
            a = msgspec.structs.replace(a, page_bytes=keep, rows=rows, scratch_rows=0)
            b = msgspec.structs.replace(b, page_bytes=keep, rows=rows, scratch_rows=0)
        out_local.append(a)
        out_remote.append(b)
    return tuple(out_local), tuple(out_remote)


def state_rows_only(region: LayerRegion) -> LayerRegion:
    """``region`` without its speculative scratch rows (itself when it has none)."""
    if region.scratch_rows <= 0 or region.rows <= region.scratch_rows or region.page_bytes % region.rows:
        return region
    rows = region.rows - region.scratch_rows
    return msgspec.structs.replace(
        region, page_bytes=rows * (region.page_bytes // region.rows), rows=rows, scratch_rows=0
    )


def _common_state_bytes(a: LayerRegion, b: LayerRegion) -> int | None:
    if min(a.rows, b.rows) <= 0 or a.page_bytes % a.rows or b.page_bytes % b.rows:
        return None
    row = a.page_bytes // a.rows
    kept = a.rows - a.scratch_rows
    if row != b.page_bytes // b.rows or kept != b.rows - b.scratch_rows or kept <= 0:
        return None
    return kept * row


def group_regions(regions: Sequence) -> dict[int, np.ndarray]:
    """Region (or row) indices per KV-cache group."""
    by_group: dict[int, list[int]] = {}
    for i, r in enumerate(regions):
        by_group.setdefault(r.group, []).append(i)
    return {g: np.array(ix, dtype=np.int64) for g, ix in by_group.items()}


# --- packing ----------------------------------------------------------------------------------


def packed_layer_order(regions: Sequence[LayerRegion]) -> dict[int, tuple[str, ...]]:
    """Groups of more than one layer whose pages are packed inside each block: sorted by
    address, each layer's page starts where the previous one ends, with the same block stride
    and block count. Value: the layer names in address order (the order inside the span, which
    must be the same on both sides for a span-to-span copy to land each page on its layer)."""
    out = {}
    for group, ix in group_regions(regions).items():
        regs = sorted((regions[i] for i in ix.tolist()), key=lambda r: r.addr)
        if len(regs) < 2:
            continue
        if all(
            b.addr == a.addr + a.page_bytes
            and (a.block_stride, a.num_blocks, a.page_bytes) == (b.block_stride, b.num_blocks, b.page_bytes)
            for a, b in zip(regs, regs[1:])
        ):
            out[group] = tuple(r.name for r in regs)
    return out


def common_packing(local: Sequence[LayerRegion], remote: Sequence[LayerRegion]) -> frozenset[int]:
    """Groups both sides can move as packed spans (same layers in the same order in a span)."""
    a, b = packed_layer_order(local), packed_layer_order(remote)
    return frozenset(g for g, names in a.items() if b.get(g) == names)


@dataclass(frozen=True)
class Row:
    """One strided row of a prepared list: ``num_blocks`` spans of ``span_bytes`` at
    ``addr + b * block_stride``; ``layers`` it covers (1 unless the group is packed)."""

    group: int
    addr: int
    span_bytes: int
    block_stride: int
    num_blocks: int
    layers: int


@dataclass(frozen=True)
class DescriptorRows:
    """A side's prepared list: its rows plus the arrays planning needs, built once per peer."""

    rows: tuple[Row, ...]
    offsets: np.ndarray  # index of each row's block-0 descriptor
    num_blocks: np.ndarray  # per row
    span_bytes: np.ndarray  # per row
    dense: np.ndarray  # per row: stride == span, so consecutive blocks are adjacent bytes
    rows_of_group: dict[int, np.ndarray]

    def strided(self, device_id: int) -> np.ndarray:
        """The (address, len, device, stride, count) array ``prep_xfer_dlist`` takes."""
        return np.array(
            [(r.addr, r.span_bytes, device_id, r.block_stride, r.num_blocks) for r in self.rows],
            dtype=np.int64,
        ).reshape(-1, 5)

    def row_of(self, idx: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.offsets, idx, side="right") - 1

    def nbytes_of(self, idx: np.ndarray) -> np.ndarray:
        """Bytes each descriptor index moves."""
        return self.span_bytes[self.row_of(idx)] if idx.size else np.zeros(0, dtype=np.int64)


def descriptor_rows(regions: Sequence[LayerRegion], packed: Collection[int] = ()) -> DescriptorRows:
    """Rows in region order; a packed group becomes one row at the place of its first region.
    With the same ``packed`` set on two sides whose regions match (``check_matching``), row i
    of one side corresponds to row i of the other."""
    rows: list[Row] = []
    done: set[int] = set()
    order = packed_layer_order(regions)
    for r in regions:
        if r.group in packed:
            if r.group in done:
                continue
            if r.group not in order:
                raise DescriptorError(f"group {r.group} is not packed in this page map")
            done.add(r.group)
            regs = [x for x in regions if x.group == r.group]
            first = min(regs, key=lambda x: x.addr)
            rows.append(Row(r.group, first.addr, first.page_bytes * len(regs), first.block_stride, first.num_blocks, len(regs)))
        else:
            rows.append(Row(r.group, r.addr, r.page_bytes, r.block_stride, r.num_blocks, 1))
    span = np.array([r.span_bytes for r in rows], dtype=np.int64)
    return DescriptorRows(
        rows=tuple(rows),
        offsets=region_offsets(rows),
        num_blocks=np.array([r.num_blocks for r in rows], dtype=np.int64),
        span_bytes=span,
        dense=np.array([r.block_stride == r.span_bytes for r in rows], dtype=bool),
        rows_of_group=group_regions(rows),
    )


# --- per request ------------------------------------------------------------------------------


def descriptor_indices(
    pairs: Sequence[Sequence[tuple[int, int]]],
    regions_of_group: dict[int, np.ndarray],
    local_offsets: np.ndarray,
    remote_offsets: np.ndarray,
    local_blocks: np.ndarray,
    remote_blocks: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """(local indices, remote indices) for all groups' pairs, row-major within a group.

    Rows (layers, or packed groups) are matched by position on both sides. Ordering row-major
    keeps consecutive blocks of one row adjacent in both lists, which is what lets NIXL merge
    them into one contiguous descriptor. Block ids are bounds-checked against each side's
    ``num_blocks`` (a tampered or stale id must not address other memory).
    """
    local_parts, remote_parts = [], []
    for group, group_pairs in enumerate(pairs):
        if len(group_pairs) == 0:  # lists, BlockPairs or (n, 2) arrays (block_phases.route_pairs)
            continue
        regions = regions_of_group.get(group)
        if regions is None:
            raise DescriptorError(f"group {group} has blocks to move but no registered layers")
        try:
            pr = np.array(group_pairs, dtype=np.int64).reshape(-1, 2)
        except (OverflowError, ValueError, TypeError) as exc:
            raise DescriptorError(f"group {group}: unusable block pairs ({exc})") from None
        src, dst = pr[:, 0], pr[:, 1]
        if (src < 0).any() or (src[None, :] >= remote_blocks[regions][:, None]).any():
            raise DescriptorError(f"group {group}: remote block id out of range in {src.tolist()}")
        if (dst < 0).any() or (dst[None, :] >= local_blocks[regions][:, None]).any():
            raise DescriptorError(f"group {group}: local block id out of range in {dst.tolist()}")
        local_parts.append((local_offsets[regions][:, None] + dst[None, :]).ravel())
        remote_parts.append((remote_offsets[regions][:, None] + src[None, :]).ravel())
    if not local_parts:
        empty = np.zeros(0, dtype=np.int32)
        return empty, empty
    return (
        np.concatenate(local_parts).astype(np.int32),
        np.concatenate(remote_parts).astype(np.int32),
    )


def plan_indices(
    pairs: Sequence[Sequence[tuple[int, int]]], local: DescriptorRows, remote: DescriptorRows
) -> tuple[np.ndarray, np.ndarray]:
    """``descriptor_indices`` over two sides' rows (built with the same packing)."""
    return descriptor_indices(
        pairs, local.rows_of_group, local.offsets, remote.offsets, local.num_blocks, remote.num_blocks
    )


def merge_breaks(idx: np.ndarray, rows: DescriptorRows) -> np.ndarray:
    """For each neighbour pair of ``idx``: True where NIXL cannot merge them on this side (not
    the next descriptor of the same dense row)."""
    if idx.size < 2:
        return np.zeros(0, dtype=bool)
    row = rows.row_of(idx)
    return (np.diff(idx) != 1) | (row[1:] != row[:-1]) | ~rows.dense[row[:-1]]


def run_starts(local_idx: np.ndarray, remote_idx: np.ndarray, local: DescriptorRows, remote: DescriptorRows) -> np.ndarray:
    """Positions in the index lists where a run NIXL merges begins (mergeable on both sides);
    empty for an empty READ."""
    if local_idx.size == 0:
        return np.zeros(0, dtype=np.int64)
    breaks = merge_breaks(local_idx, local) | merge_breaks(remote_idx, remote)
    return np.flatnonzero(np.concatenate(([True], breaks)))


def count_runs(local_idx: np.ndarray, remote_idx: np.ndarray, local: DescriptorRows, remote: DescriptorRows) -> int:
    """Descriptors NIXL moves after merging: runs mergeable on both sides."""
    return int(run_starts(local_idx, remote_idx, local, remote).size)


def merged_ranges(
    local_idx: np.ndarray, remote_idx: np.ndarray, local: DescriptorRows, remote: DescriptorRows
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(local address, remote address, bytes) of each run ``count_runs`` counts: the byte ranges
    NIXL moves after its merge. Not on the request path (the transfer benchmark copies exactly
    these ranges with the kernel's own call to show what is left above it)."""
    if local_idx.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    starts = run_starts(local_idx, remote_idx, local, remote)

    def addresses(idx: np.ndarray, rows: DescriptorRows) -> np.ndarray:
        row = rows.row_of(idx)
        base = np.array([r.addr for r in rows.rows], dtype=np.int64)[row]
        stride = np.array([r.block_stride for r in rows.rows], dtype=np.int64)[row]
        return base + (idx - rows.offsets[row]) * stride

    nbytes = np.add.reduceat(local.nbytes_of(local_idx).astype(np.int64), starts)
    return addresses(local_idx[starts], local), addresses(remote_idx[starts], remote), nbytes
