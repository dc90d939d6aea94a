"""Synthetic attention ranks whose blocks hold a prompt's tokens, for in-process tests and the
benchmark of unequal block sizes (``bench transfer_blocks``, tests/nixl/test_block_size_transfer.py).

Each rank's attention pages are laid out as vLLM's head-major page view (``[kernel block, head,
token, content]``, heads sharded by TP) in one allocation registered with its own NIXL agent,
and the bytes of a token follow a ``block_phases`` token layout: a token's K and V together
(interleaved) or as vLLM CPU's vec kernels keep them (K column-major, then V row-major). Bytes
are a function of the layer, the *global* KV head and the *token position in the prompt*, so a
D rank's expected bytes after a handoff are known whatever the two block sizes.
"""

from __future__ import annotations

import numpy as np

from pd_connector.core import block_phases, shards
from pd_connector.core.protocol import LayerRegion
from rig import devices

LAYERS = ("attn.0", "attn.1")


class AttentionRank:
    """One TP rank of ``total_heads`` KV heads: ``block`` tokens per block in ``kernels`` kernel
    blocks (``pad`` bytes after each kernel block's heads), ``token_bytes`` of K and V per
    token and head, laid out as ``token_layout``."""

    def __init__(
        self, tp: int, rank: int, block: int, *, total_heads: int = 4, token_bytes: int = 8, kernels: int = 1,
        pad: int = 0, seed: int | None = None, num_blocks: int = 24, token_layout: str = block_phases.INTERLEAVED,
    ):
        self.block, self.kernels, self.token_bytes, self.num_blocks = block, kernels, token_bytes, num_blocks
        self.memory_layout = token_layout  # how the pattern is written (a negative control may lie)
        self.first, self.heads = shards.sharded(total_heads, tp, rank, "KV heads")
        self.per_kernel = block // kernels
        self.head_bytes = self.per_kernel * token_bytes
        self.kernel_stride = self.heads * self.head_bytes + pad
        self.page = kernels * self.kernel_stride
        size = len(LAYERS) * num_blocks * self.page
        self.buf = devices.zeros(size) if seed is None else devices.random_bytes(size, seed)
        base = self.buf.data_ptr()
        segments = shards.attention_segments(total_heads, tp, rank, self.head_bytes, kernels, self.kernel_stride)
        self.regions = [
            LayerRegion(
                name, 0, base + i * num_blocks * self.page, self.page, self.page, num_blocks, segments=segments,
                token_layout=token_layout,
            )
            for i, name in enumerate(LAYERS)
        ]
        self.transport = devices.transport()
        self.transport.register([(base, size, 0)], self.regions)

    def offsets(self) -> np.ndarray:
        """Byte offset in a page of (head, token, byte), shape (heads, block, token_bytes)."""
        h = np.arange(self.heads)[:, None, None]
        t = np.arange(self.block)[None, :, None]
        b = np.arange(self.token_bytes)[None, None, :]
        head = (t // self.per_kernel) * self.kernel_stride + h * self.head_bytes
        within = t % self.per_kernel
        parts = block_phases.token_parts(self.memory_layout, self.per_kernel, self.token_bytes)
        if parts is None:
            raise ValueError(f"token layout {self.memory_layout!r} cannot be written")
        # Byte b of a token sits in the part whose bytes (in order) hold it.
        starts = np.cumsum([0] + [size for _, size in parts])
        part = np.searchsorted(starts, b, side="right") - 1
        part_offset = np.array([offset for offset, _ in parts])[part]
        part_size = np.array([size for _, size in parts])[part]
        return head + part_offset + within * part_size + (b - starts[part])

    def write_tokens(self, mem: np.ndarray, layer: int, block_id: int, first_token: int, tokens: slice) -> None:
        """The pattern of prompt tokens ``first_token + t`` (t in ``tokens``) into a block."""
        page = layer * self.num_blocks * self.page + block_id * self.page
        offsets = self.offsets()[:, tokens]
        h = np.arange(self.first, self.first + self.heads)[:, None, None]
        t = first_token + np.arange(self.block)[tokens][None, :, None]
        b = np.arange(self.token_bytes)[None, None, :]
        mem[page + offsets] = ((layer * 97 + h * 131 + t * 7 + b * 3) % 251).astype(np.uint8)

    def fill(self, table: list[int]) -> None:
        """Block ``table[i]`` of every layer holds prompt tokens ``[i * block, (i + 1) * block)``."""
        mem = self.mem().copy()
        for i, block_id in enumerate(table):
            for layer in range(len(LAYERS)):
                self.write_tokens(mem, layer, block_id, i * self.block, slice(None))
        devices.write(self.buf, mem)

    def mem(self) -> np.ndarray:
        return devices.host(self.buf)

    def close(self) -> None:
        self.transport.close()
