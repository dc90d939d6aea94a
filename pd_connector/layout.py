"""Descriptor arithmetic: from (P block, D block) pairs to NIXL descriptor indices.

Pure (numpy only). Each side prepares ONE descriptor list per peer at handshake time: region r
(one layer) contributes ``num_blocks`` descriptors, one per block page, in region order. A pair
of blocks in group g then expands to one descriptor per layer of g, on both sides; the indices
are computed here, vectorised, so the per-request cost does not grow with Python loops over
layers x blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pd_connector.protocol import LayerRegion


class LayoutError(ValueError):
    """P's and D's page maps cannot be matched."""


def region_offsets(regions: Sequence[LayerRegion]) -> np.ndarray:
    """Index of each region's block-0 descriptor in the prepared list."""
    counts = np.fromiter((r.num_blocks for r in regions), dtype=np.int64, count=len(regions))
    return np.concatenate(([0], np.cumsum(counts)[:-1])) if len(regions) else counts


def strided_descriptors(regions: Sequence[LayerRegion], device_id: int) -> np.ndarray:
    """NIXL's compressed (address, len, device, stride, count) rows: one per region."""
    return np.array(
        [(r.addr, r.page_bytes, device_id, r.block_stride, r.num_blocks) for r in regions],
        dtype=np.int64,
    ).reshape(-1, 5)


def check_matching(local: Sequence[LayerRegion], remote: Sequence[LayerRegion]) -> None:
    """Both sides must list the same layers, in the same groups, with equal page sizes."""
    if len(local) != len(remote):
        raise LayoutError(f"layer count differs: local {len(local)}, remote {len(remote)}")
    for a, b in zip(local, remote):
        if (a.name, a.group, a.page_bytes) != (b.name, b.group, b.page_bytes):
            raise LayoutError(
                f"layer mismatch: local ({a.name}, group {a.group}, {a.page_bytes} B/page) vs "
                f"remote ({b.name}, group {b.group}, {b.page_bytes} B/page)"
            )


def group_regions(regions: Sequence[LayerRegion]) -> dict[int, np.ndarray]:
    """Region indices per KV-cache group."""
    by_group: dict[int, list[int]] = {}
    for i, r in enumerate(regions):
        by_group.setdefault(r.group, []).append(i)
    return {g: np.array(ix, dtype=np.int64) for g, ix in by_group.items()}


def descriptor_indices(
    pairs: Sequence[Sequence[tuple[int, int]]],
    regions_of_group: dict[int, np.ndarray],
    local_offsets: np.ndarray,
    remote_offsets: np.ndarray,
    local_blocks: np.ndarray,
    remote_blocks: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """(local indices, remote indices) for all groups' pairs, layer-major within a group.

    Ordering layer-major keeps consecutive blocks of one layer adjacent in both lists, which is
    what lets NIXL merge them into one contiguous descriptor. Block ids are bounds-checked
    against each side's ``num_blocks`` (a tampered or stale id must not address other memory).
    """
    local_parts, remote_parts = [], []
    for group, group_pairs in enumerate(pairs):
        if not group_pairs:
            continue
        regions = regions_of_group.get(group)
        if regions is None:
            raise LayoutError(f"group {group} has blocks to move but no registered layers")
        try:
            pr = np.array(group_pairs, dtype=np.int64).reshape(-1, 2)
        except (OverflowError, ValueError, TypeError) as exc:
            raise LayoutError(f"group {group}: unusable block pairs ({exc})") from None
        src, dst = pr[:, 0], pr[:, 1]
        if (src < 0).any() or (src[None, :] >= remote_blocks[regions][:, None]).any():
            raise LayoutError(f"group {group}: remote block id out of range in {src.tolist()}")
        if (dst < 0).any() or (dst[None, :] >= local_blocks[regions][:, None]).any():
            raise LayoutError(f"group {group}: local block id out of range in {dst.tolist()}")
        local_parts.append((local_offsets[regions][:, None] + dst[None, :]).ravel())
        remote_parts.append((remote_offsets[regions][:, None] + src[None, :]).ravel())
    if not local_parts:
        empty = np.zeros(0, dtype=np.int32)
        return empty, empty
    return (
        np.concatenate(local_parts).astype(np.int32),
        np.concatenate(remote_parts).astype(np.int32),
    )


def count_runs(local_idx: np.ndarray, remote_idx: np.ndarray) -> int:
    """Descriptors left after merging neighbours that are consecutive on both sides (what NIXL
    does when the underlying pages are adjacent)."""
    if local_idx.size == 0:
        return 0
    breaks = (np.diff(local_idx) != 1) | (np.diff(remote_idx) != 1)
    return int(breaks.sum()) + 1
