"""Optional SHA-256 of recurrent-state pages, so D can detect bytes corrupted in transfer.

Reads pages through torch views of the registered allocations, so it works for DRAM and VRAM
alike. Only Mamba groups are hashed: their state is one slot per request and a corrupted state
is unrecoverable silently, while attention KV is large and covered by NIXL's own checks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from pd_connector.core.descriptors import state_rows_only
from pd_connector.core.protocol import LayerRegion


class StateDigester:
    def __init__(self, kv_caches: dict, regions: Sequence[LayerRegion]):
        self._views = {}
        for region in regions:
            tensor = kv_caches[region.name.partition("#")[0]]  # a Mamba state region: "layer#i"
            storage = tensor.untyped_storage()
            self._views[region.name] = (storage, storage.data_ptr(), tensor.device)
        # Only the rows that hold the state: an engine with another speculative token count
        # has a wider conv state whose scratch rows P never sends (descriptors.reconcile_regions).
        self._regions = tuple(state_rows_only(r) for r in regions)

    def pages(self, group_blocks: Sequence[Sequence[int]], groups: Sequence[int]):
        """uint8 views of the pages of ``group_blocks[g]`` for every layer of each group in
        ``groups``, in region order."""
        for region in self._regions:
            if region.group not in groups:
                continue
            storage, base, device = self._views[region.name]
            for block in group_blocks[region.group]:
                page = torch.empty(0, dtype=torch.uint8, device=device)
                page.set_(storage, region.addr - base + block * region.block_stride, (region.page_bytes,))
                yield page

    def digest(self, group_blocks: Sequence[Sequence[int]], groups: Sequence[int]) -> bytes:
        """SHA-256 over the pages of ``group_blocks[g]`` for every layer of each group in
        ``groups``, in region order (identical on P and D, see descriptors.check_matching)."""
        h = hashlib.sha256()
        for page in self.pages(group_blocks, groups):
            h.update(page.cpu().numpy().tobytes())
        return h.digest()
