"""One tensor-parallel rank's pages built by vLLM itself and described by the connector, for
tests of the shard layouts (tests/vllm/test_shard_layout.py, tests/nixl/test_tp_transfer.py).

vLLM builds the pages: the rank's spec (``FullAttentionSpec`` and friends, per-rank heads), its
``KVCacheTensor`` placement from ``compute_layout_strides`` and the page views from
``allocate_kv_cache``, as the GPU and CPU model runners do. The connector describes them
(``regions_from_kv_caches``, ``describe_shards``). The oracle writes and reads every page only
through vLLM's views, labelling each byte with the *global* unit it holds (slot kind, KV head,
token, byte; or the block for replicated pages), so a D rank's expected bytes are known without
the segments under test.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
import torch

from pd_connector.core import shards
from pd_connector.core.protocol import LayerRegion

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


def vllm_head(total: int, tp: int, rank: int, slot: int) -> int:
    """Global KV head of ``rank``'s head ``slot`` (QKVParallelLinear: an even split, or one head
    replicated over ``tp // total`` consecutive ranks when TP exceeds the head count)."""
    return rank * (total // tp) + slot if total >= tp else rank * total // tp


@dataclass
class Layers:
    """Attention layers of ``kv_heads`` heads (``heads_of`` per layer where they differ); ``spec_of(tp, heads_on_rank)``
    builds the rank's vLLM spec, ``labels`` says what slot s of a rank holds."""

    kv_heads: int
    spec_of: Callable[[int, int], Any]
    layers: tuple[str, ...] = LAYERS
    heads_of: dict[str, int] = field(default_factory=dict)
    layout: str = "LBHNC"
    kernel_block_size: int | None = None
    replicated: bool = False  # every rank holds the same page (MLA)
    k_then_v_slots: bool = False  # 2H slots: all heads' K, then all heads' V (FlashInfer NVFP4)
    arch: Any = None  # a real ModelArchitectureConfig for heterogeneous checkpoints
    nixl: bool = False  # register each rank with its own NIXL agent (``Rank.transport``)
    backend: Any = None  # every layer's vLLM attention backend class (its token layout)
    model_dtype: Any = torch.bfloat16  # the model's dtype (vLLM CPU picks its ISA by it)
    vllm_config: Any = None  # a real VllmConfig to describe the pages with, instead of ``model_stub``

    def total(self, layer: str) -> int:
        return self.heads_of.get(layer, self.kv_heads)

    def slot_label(self, layer: str, tp: int, rank: int, slot: int, slots: int) -> int:
        total = self.total(layer)
        if self.replicated:
            return 0
        if self.k_then_v_slots:
            per = slots // 2
            return 2 * vllm_head(total, tp, rank, slot % per) + slot // per
        return vllm_head(total, tp, rank, slot)

    def rank(self, tp: int, r: int, seed: int | None, num_blocks: int = 12) -> "Rank":
        return Rank(self, tp, r, seed, num_blocks, self.nixl)


def plain_attention(
    head_size: int = 8, block_size: int = 4, pad_per_head: int = 0, dtype: Any = torch.bfloat16, **kw
) -> Callable[[int, int], Any]:
    """``spec_of`` for vLLM's plain attention (``FullAttentionSpec``, bf16 unless ``dtype``: uint8 is
    vLLM's fp8 KV cache); ``pad_per_head``
    pads the page (``page_size_padded``) by that much per head on the rank, so P's and D's pages
    pad alike per head, the case no size check tells from an unpadded page."""

    def spec_of(tp: int, heads: int) -> Any:
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        padded = heads * (2 * head_size * dtype.itemsize * block_size + pad_per_head) if pad_per_head else None
        return FullAttentionSpec(
            block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=dtype,
            page_size_padded=padded, **kw,
        )

    return spec_of


def model_stub(layers: Layers) -> Any:
    """The little of VllmConfig ``describe_shards`` reads for attention layers."""
    model = SimpleNamespace(
        get_total_num_kv_heads=lambda: layers.kv_heads, model_arch_config=layers.arch, use_mla=layers.replicated,
        dtype=layers.model_dtype,
    )
    context = {name: SimpleNamespace(attn_backend=layers.backend) for name in layers.layers} if layers.backend else None
    compilation = SimpleNamespace(static_forward_context=context) if context else None
    return SimpleNamespace(model_config=model, speculative_config=None, compilation_config=compilation)


class Rank:
    """One TP rank: vLLM's allocation and views, the connector's page map."""

    def __init__(self, model: Layers, tp: int, r: int, seed: int | None, num_blocks: int, transport: bool):
        from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, compute_layout_strides
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.worker.utils import allocate_kv_cache

        from pd_connector.engine.from_vllm.regions import regions_from_kv_caches
        from pd_connector.engine.from_vllm.shard_layout import describe_shards

        self.model, self.tp, self.r, self.num_blocks = model, tp, r, num_blocks
        layout = KVCacheLayout[model.layout]
        by_heads: dict[int, list[str]] = {}
        for name in model.layers:
            by_heads.setdefault(max(1, model.total(name) // tp), []).append(name)
        groups, tensors, offset, specs = [], [], 0, []
        for heads, names in by_heads.items():
            spec = model.spec_of(tp, heads)
            specs.append(spec)
            layer_stride, block_stride, *_ = compute_layout_strides(spec, num_blocks, len(names), layout)
            groups.append(KVCacheGroupSpec(names, spec))
            tensors.append(KVCacheTensor(0, names, layer_stride, block_stride, offset))
            offset += len(names) * layer_stride if layout.is_layer_compact else block_stride * num_blocks
        tensors = [KVCacheTensor(offset, t.layers, t.layer_stride, t.block_stride, t.offset) for t in tensors]
        self.kv_cache_config = KVCacheConfig(num_blocks, tensors, groups, kv_cache_layout=model.layout)
        kernel = [model.kernel_block_size] * len(groups) if model.kernel_block_size else None
        self.views = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"), layout, kernel)
        self.flat = torch.empty(0, dtype=torch.uint8).set_(next(iter(self.views.values())).untyped_storage())
        if seed is not None:
            self.flat.numpy()[:] = np.random.default_rng(seed).integers(0, 256, self.flat.numel(), dtype=np.uint8)
        group_ids = tuple(range(len(groups)))
        _, regions = regions_from_kv_caches(self.kv_cache_config, self.views, group_ids)
        self.regions: list[LayerRegion] = describe_shards(
            model.vllm_config or model_stub(model), self.kv_cache_config, group_ids, regions, r, tp, self.views
        )
        self.base = self.flat.data_ptr()
        self.transport = None
        if transport:
            from pd_connector.transport.nixl import NixlTransport

            self.transport = NixlTransport()
            self.transport.register([(self.base, self.flat.numel(), 0)], self.regions)

    def mem(self) -> np.ndarray:
        return self.flat.numpy()

    def _write(self, name: str, src: int, dst: int) -> None:
        """Block ``dst``'s K/V bytes, through vLLM's view, as global block ``src`` holds them."""
        view = self.views[name].view(torch.uint8)  # [blocks x kernel blocks, slots, tokens, bytes]
        ratio = view.shape[0] // self.num_blocks
        slots, tokens, nbytes = view.shape[1:]
        salt = zlib.crc32(name.encode()) % 251
        label = np.array([self.model.slot_label(name, self.tp, self.r, s, slots) for s in range(slots)])
        k, s, t, c = np.ix_(np.arange(ratio), np.arange(slots), np.arange(tokens), np.arange(nbytes))
        token = k * tokens + t
        block = src * 31 if not self.model.replicated else src * 29
        values = (salt + label[s] * 131 + token * 17 + c * 7 + block) % 251
        view[dst * ratio : (dst + 1) * ratio] = torch.from_numpy(values.astype(np.uint8))

    def expected(self, pairs: dict[int, list[tuple[int, int]]], before: np.ndarray | None = None) -> np.ndarray:
        """This rank's allocation with P block ``src``'s content written into block ``dst`` of
        every layer for each (src, dst) of ``pairs[group]`` (``before`` elsewhere)."""
        saved = self.mem().copy()
        if before is not None:
            self.mem()[:] = before
        for region in self.regions:
            for src, dst in pairs.get(region.group, ()):
                self._write(region.name, src, dst)
        out = self.mem().copy()
        self.mem()[:] = saved
        return out

    def fill(self, blocks: dict[int, list[int]]) -> None:
        self.mem()[:] = self.expected({g: [(b, b) for b in ids] for g, ids in blocks.items()})

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def copy_planned(d: Rank, p_ranks: dict[int, Rank], pairs: dict[int, list[tuple[int, int]]], tamper=None) -> dict:
    """Plan D rank ``d`` against its P ranks (``shards.shard_regions``) and copy each planned
    piece of each (src, dst) block pair as a READ would; returns the plans."""
    order = list(p_ranks)
    plans = shards.shard_regions(d.regions, {r: p.regions for r, p in p_ranks.items()}, order)
    if tamper is not None:
        plans = tamper(plans)
    for rank, (local, remote) in plans.items():
        p = p_ranks[rank]
        for lo, re_ in zip(local, remote):
            for src, dst in pairs.get(lo.group, ()):
                at, frm = lo.addr - d.base + dst * lo.block_stride, re_.addr - p.base + src * re_.block_stride
                d.mem()[at : at + lo.page_bytes] = p.mem()[frm : frm + re_.page_bytes]
    return plans
