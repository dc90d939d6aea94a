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
from rig import devices

ATTN_LAYERS = ("attn.0", "attn.1")


# The recurrent layer kinds besides core's MAMBA2 and GDN (vLLM's rules: engine/from_vllm/
# recurrent_layouts.py): Jamba's Mamba1, LFM2's short convolution, Kimi Linear's KDA.
MAMBA1, SHORT_CONV, KDA = "mamba1", "short_conv", "kda"
KINDS = (shards.MAMBA2, shards.GDN, MAMBA1, SHORT_CONV, KDA)


class Model:
    """A tiny hybrid: two attention layers of ``kv_heads`` heads and one recurrent layer of
    ``kind`` (a Mamba2 one with ``n_groups`` groups). ``mla``: the attention layers are MLA's
    (Kimi Linear): one latent of ``head_bytes`` per block, every rank holding it whole."""

    def __init__(
        self, kind: str, kv_heads: int, n_groups: int = 1, head_bytes: int = 32, scale: int = 1, mla: bool = False
    ):
        if kind not in KINDS:
            raise ValueError(f"unknown layer kind {kind!r}; expected one of {KINDS}")
        self.kind, self.kv_heads, self.n_groups, self.head_bytes = kind, kv_heads, n_groups, head_bytes
        self.scale = scale  # multiplies every state dimension (benchmark-sized pages)
        self.mla = mla

    def layout(self, tp: int) -> tuple[shards.StateLayout, int, list[tuple[int, ...]]]:
        """(the layer's layout, its conv rows, the per-unit shape of each later state)."""
        k, part = self.scale, shards.ConvPart
        if self.kind == shards.MAMBA2:
            h, hd, s = 8, 4 * k, 4 * k
            group = part("B", s, True) if self.n_groups % tp else part("B", self.n_groups * s)
            return shards.StateLayout((part("x", h * hd), group, group._replace(axis="C")), "ssm_head", h), 3, [(hd, s)]
        if self.kind == shards.GDN:
            hk, hv, dk, dv = 4, 8, 4 * k, 2 * k
            qkv = (part("q", hk * dk), part("k", hk * dk), part("v", hv * dv))
            return shards.StateLayout(qkv, "value_head", hv), 3, [(dv, dk)]
        if self.kind == MAMBA1:
            return shards.StateLayout((part("x", 16 * k),), "ssm_channel", 16 * k), 3, [(4 * k,)]
        if self.kind == SHORT_CONV:
            return shards.StateLayout((part("channel", 16 * k),), "channel", 16 * k), 2, []
        heads, dim = 4, 4 * k  # KDA
        return shards.StateLayout(tuple(part(a, heads * dim) for a in "qkv"), "head", heads), 3, [(dim, dim)]

    def recurrent_shapes(self, tp: int) -> list[tuple[int, ...]]:
        """Every state's per-rank shape: the conv state (rows, channels) in vLLM's SD layout."""
        layout, rows, tails = self.layout(tp)
        channels = sum(p.total if p.replicated else p.total // tp for p in layout.conv)
        return [(rows, channels)] + [(layout.units // tp, *tail) for tail in tails]

    def rank(self, tp: int, r: int, seed: int | None, num_blocks: int = 12) -> "Rank":
        return Rank(self, tp, r, seed, num_blocks)


class Rank:
    """One TP rank's allocation and page map; P ranks are filled with the global pattern."""

    def __init__(self, model: Model, tp: int, r: int, seed: int | None, num_blocks: int = 12):
        if model.mla:
            attn_page = model.head_bytes
            attn = shards.replicated_segments(attn_page)
        else:
            attn_page = max(1, model.kv_heads // tp) * model.head_bytes
            attn = shards.attention_segments(model.kv_heads, tp, r, model.head_bytes)
        layout = model.layout(tp)[0]
        shapes = model.recurrent_shapes(tp)
        sizes = [int(np.prod(shape)) * 2 for shape in shapes]  # bf16-sized
        mamba_page = sum(sizes) + 16  # padding at the page tail
        self.size = 2 * num_blocks * attn_page + num_blocks * mamba_page
        self.buf = devices.zeros(self.size) if seed is None else devices.random_bytes(self.size, seed)
        base = self.buf.data_ptr()
        regions = [
            LayerRegion(name, 0, base + i * num_blocks * attn_page, attn_page, attn_page, num_blocks, segments=attn)
            for i, name in enumerate(ATTN_LAYERS)
        ]
        addr = base + 2 * num_blocks * attn_page
        for i, (shape, nbytes) in enumerate(zip(shapes, sizes)):
            segs = shards.state_segments(layout, i, shape, 2, False, 0, tp, r)
            rows = shape[0] if i == 0 else 0
            regions.append(LayerRegion(f"m#{i}", 1, addr, mamba_page, nbytes, num_blocks, rows=rows, segments=segs))
            addr += nbytes
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


