"""Synthetic tensor-parallel ranks of a tiny hybrid, for in-process tests and the benchmark.

Each rank's pages are laid out as vLLM shards them (segments from ``core/shards.py``) in one
allocation (on ``PD_TEST_DEVICE``: ``devices.py``) registered with its own NIXL agent, and can be
filled with bytes that are a function of the *global* unit (KV head, conv channel of a row, SSM
head) and the source block, so any rank's expected bytes after a handoff are known without a
reference implementation.
"""

from __future__ import annotations

import zlib

import numpy as np

from pd_connector.core import shards
from pd_connector.core.protocol import EngineCompat, GroupDesc, LayerRegion
from pd_connector.dev.rig import devices

ATTN_LAYERS = ("attn.0", "attn.1")


class Model:
    """A tiny hybrid: two attention layers of ``kv_heads`` heads and one Mamba2 layer with
    ``n_groups`` groups, or one GDN layer (``kind``)."""

    def __init__(self, kind: str, kv_heads: int, n_groups: int = 1, head_bytes: int = 32, scale: int = 1):
        self.kind, self.kv_heads, self.n_groups, self.head_bytes = kind, kv_heads, n_groups, head_bytes
        self.scale = scale  # multiplies every state dimension (benchmark-sized pages)

    def recurrent_shapes(self, tp: int):
        k = self.scale
        if self.kind == shards.MAMBA2:
            h, hd, s, kernel = 8, 4 * k, 4 * k, 4
            gp = self.n_groups if self.n_groups % tp == 0 else tp
            return ((kernel - 1, (h * hd + 2 * gp * s) // tp), (h // tp, hd, s))
        hk, hv, dk, dv, kernel = 4, 8, 4 * k, 2 * k, 4
        return ((kernel - 1, (2 * hk * dk + hv * dv) // tp), (hv // tp, dv, dk))

    def rank(self, tp: int, r: int, seed: int | None, num_blocks: int = 12) -> "Rank":
        return Rank(self, tp, r, seed, num_blocks)


class Rank:
    """One TP rank's allocation and page map; P ranks are filled with the global pattern."""

    def __init__(self, model: Model, tp: int, r: int, seed: int | None, num_blocks: int = 12):
        per_rank_heads = max(1, model.kv_heads // tp)
        attn_page = per_rank_heads * model.head_bytes
        conv, state = model.recurrent_shapes(tp)
        conv_bytes, state_bytes = int(np.prod(conv)) * 2, int(np.prod(state)) * 2  # bf16-sized
        mamba_page = conv_bytes + state_bytes + 16  # padding at the page tail
        self.size = 2 * num_blocks * attn_page + num_blocks * mamba_page
        self.buf = devices.zeros(self.size) if seed is None else devices.random_bytes(self.size, seed)
        base = self.buf.data_ptr()
        attn = shards.attention_segments(model.kv_heads, tp, r, model.head_bytes)
        regions = [
            LayerRegion(name, 0, base + i * num_blocks * attn_page, attn_page, attn_page, num_blocks, segments=attn)
            for i, name in enumerate(ATTN_LAYERS)
        ]
        m_base = base + 2 * num_blocks * attn_page
        for i, (addr, nbytes, rows) in enumerate(((m_base, conv_bytes, conv[0]), (m_base + conv_bytes, state_bytes, 0))):
            segs = shards.recurrent_segments(model.kind, i, conv, state, (2, 2), False, 0, tp, r, model.n_groups % tp != 0)
            regions.append(LayerRegion(f"m#{i}", 1, addr, mamba_page, nbytes, num_blocks, rows=rows, segments=segs))
        self.regions = regions
        self.transport = devices.transport()
        self.transport.register([(base, self.size, 0)], regions)

    def mem(self) -> np.ndarray:
        return devices.host(self.buf)

    def expected(self, pairs: dict[int, list[tuple[int, int]]], before: np.ndarray | None = None) -> np.ndarray:
        """This rank's allocation with P block ``src``'s global pattern written into block
        ``dst``'s segments for each (src, dst) of ``pairs[group]`` (``before`` elsewhere)."""
        out = (before if before is not None else self.mem()).copy()
        base = self.buf.data_ptr()
        for region in self.regions:
            for src, dst in pairs.get(region.group, ()):
                page = region.addr - base + dst * region.block_stride
                for seg in region.segments:
                    out[page + seg.offset : page + seg.offset + seg.count * seg.unit_bytes] = pattern(seg, src)
        return out

    def fill(self, blocks: dict[int, list[int]]) -> None:
        devices.write(self.buf, self.expected({g: [(b, b) for b in ids] for g, ids in blocks.items()}))

    def close(self) -> None:
        self.transport.close()


def pattern(seg, block: int) -> np.ndarray:
    """The bytes of global units ``seg.first ..`` of axis ``seg.unit`` in ``block``."""
    salt = zlib.crc32(seg.unit.encode())
    units = np.arange(seg.first, seg.first + seg.count, dtype=np.int64)[:, None]
    byte = np.arange(seg.unit_bytes, dtype=np.int64)[None, :]
    return ((salt + units * 131 + byte * 7 + block * 31) % 251).astype(np.uint8).ravel()


def compat(tp: int) -> EngineCompat:
    return EngineCompat("m", "bfloat16", "auto", [GroupDesc("attention", 16, 0, []), GroupDesc("mamba", 16, 0, [])], "", tp, "cpu")


