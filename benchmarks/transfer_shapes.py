"""Model geometries and vLLM's KV-cache placement for the transfer benchmark.

Per-layer page sizes are the real models' (bf16 KV and bf16 recurrent state, TP=1); only the
number of layers is reduced when a case would not fit the byte budget (see ``geometry``).
Memory is laid out the way vLLM 0.32/0.33 do it (``get_kv_cache_config_from_groups``): one
allocation per engine shared by every KV-cache group, layer l's page of block b at
``offset + l * layer_stride + b * block_stride``; hybrids group layers in equal-sized groups
(attention + Mamba/GDN groups aliasing the same bytes) and pad the Mamba page to the attention
page after raising the attention block size until attention page >= Mamba page
(``Platform._align_hybrid_block_size``). ``check_vllm_placement`` cross-checks ``placement``
against vLLM's own function.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from pd_connector.core.protocol import LayerRegion
from pd_connector.engine.from_vllm.vllm_config import kv_cache_config_from_groups_fn
from pd_connector.engine.from_vllm.regions import regions_from_kv_caches

GUARD = 4096
MiB = 1 << 20
BF16 = 2



@dataclass(frozen=True)
class ModelShape:
    key: str
    label: str
    num_layers: int  # real model
    attn_ids: tuple[int, ...]  # real layer indices of the attention layers
    kv_heads: int
    head_dim: int
    mamba_ids: tuple[int, ...] = ()
    mamba_kind: str = ""
    mamba_shapes: tuple[tuple[int, ...], ...] = ()  # vLLM's state shapes (conv, temporal)

    @property
    def attn_bytes_per_token(self) -> int:  # K and V of one layer, one token
        return 2 * self.kv_heads * self.head_dim * BF16

    @property
    def mamba_state_bytes(self) -> int:
        return sum(math.prod(s) * BF16 for s in self.mamba_shapes)


def _nemotron_h_8b() -> ModelShape:
    # nvidia/Nemotron-H-8B-Base-8K: 52 layers, hybrid_override_pattern below ("M" Mamba2,
    # "*" attention, "-" MLP). Attention 32 q / 8 kv heads x 128. Mamba2: 128 heads x 64,
    # d_state 128, n_groups 8, conv kernel 4, expand 2 (intermediate 8192).
    # vLLM MambaStateShapeCalculator.mamba2_state_shape: conv (8192 + 2*8*128, 3),
    # temporal (128, 64, 128) -> 2,158,592 B per layer.
    pattern = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
    return ModelShape(
        key="nemotron-h",
        label="Nemotron-H-8B-like (attn + Mamba2)",
        num_layers=len(pattern),
        attn_ids=tuple(i for i, c in enumerate(pattern) if c == "*"),
        kv_heads=8,
        head_dim=128,
        mamba_ids=tuple(i for i, c in enumerate(pattern) if c == "M"),
        mamba_kind="mamba2",
        mamba_shapes=((3, 8192 + 2 * 8 * 128), (128, 64, 128)),
    )


def _qwen3_next() -> ModelShape:
    # Qwen/Qwen3-Next-80B-A3B: 48 layers, full attention every 4th (12), Gated DeltaNet
    # otherwise (36). Attention 16 q / 2 kv heads x 256. GDN: 16 k heads, 32 v heads, 128 dims,
    # conv kernel 4. vLLM gated_delta_net_state_shape: conv (3, 128*16*2 + 128*32),
    # temporal (32, 128, 128) -> 1,097,728 B per layer.
    return ModelShape(
        key="qwen3-next",
        label="Qwen3-Next-80B-like (attn + GDN)",
        num_layers=48,
        attn_ids=tuple(i for i in range(48) if (i + 1) % 4 == 0),
        kv_heads=2,
        head_dim=256,
        mamba_ids=tuple(i for i in range(48) if (i + 1) % 4 != 0),
        mamba_kind="gdn",
        mamba_shapes=((3, 128 * 16 * 2 + 128 * 32), (32, 128, 128)),
    )


MODELS = {
    "llama-8b": ModelShape(
        key="llama-8b",
        label="Llama-3.1-8B-like (attention only)",
        num_layers=32,
        attn_ids=tuple(range(32)),
        kv_heads=8,
        head_dim=128,
    ),
    "nemotron-h": _nemotron_h_8b(),
    "qwen3-next": _qwen3_next(),
}

# --- vLLM placement ---------------------------------------------------------------------------


@dataclass
class Geometry:
    """One model at one block size, possibly with fewer layers (same per-layer pages)."""

    model: str
    user_block: int
    block_size: int  # attention block size vLLM ends up with
    page_bytes: int  # uniform page (Mamba pages padded to the attention page, as vLLM does)
    mamba_real_bytes: int
    groups: list[tuple[str, list[str]]]  # (kind, layer names in placement order)
    layers_real: int
    attn_layers: int
    mamba_layers: int

    @property
    def group_size(self) -> int:
        return len(self.groups[0][1])


# The smallest kernel block of vLLM 0.32's attention backend per device (``MultipleOf`` in
# ``get_supported_kernel_block_sizes``): CPU_ATTN 32, FlashAttention 16. vLLM refuses an
# attention block size that is not a multiple of it ("No common block size for 16 (CPU_ATTN:
# [MultipleOf(32)])", ``select_common_block_size``), and aligns a hybrid's raised block to it.
KERNEL_BLOCK = {"cpu": 32, "cuda": 16}


def hybrid_block_size(m: ModelShape, user_block: int, kernel_min: int = 16) -> int:
    """``Platform._align_hybrid_block_size``: the smallest multiple of the kernel alignment
    (max(backend min kernel block, user block)) whose attention page holds the Mamba state."""
    if not m.mamba_ids:
        return user_block
    align = max(kernel_min, user_block)
    return align * math.ceil(m.mamba_state_bytes / (align * m.attn_bytes_per_token))


def vllm_group_size(n_attn: int, n_mamba: int) -> int:
    """``_get_kv_cache_groups_uniform_page_size``: min layer count per type, or the max when
    max < 1.5 * min."""
    counts = [c for c in (n_attn, n_mamba) if c]
    lo, hi = min(counts), max(counts)
    return hi if hi < 1.5 * lo else lo


def geometry(m: ModelShape, user_block: int, tokens: int, budget: int, kernel_min: int = 16) -> Geometry:
    bs = hybrid_block_size(m, user_block, kernel_min)
    page = bs * m.attn_bytes_per_token
    nblk = math.ceil(tokens / bs)
    gs_real = vllm_group_size(len(m.attn_ids), len(m.mamba_ids))
    n_attn_groups = math.ceil(len(m.attn_ids) / gs_real)
    n_mamba_groups = math.ceil(len(m.mamba_ids) / gs_real) if m.mamba_ids else 0
    # Bytes one request moves per layer-per-group: attention blocks + one Mamba slot per group.
    per_gs = page * (nblk * n_attn_groups + n_mamba_groups)
    gs = max(1, min(gs_real, budget // per_gs))
    # vLLM: group i of a type gets layers[i::num_groups]; we keep the first gs of each group.
    def split(ids, n_groups):
        return [list(ids[i::n_groups])[:gs] for i in range(n_groups)]

    groups = []
    for ids in split(m.attn_ids, n_attn_groups):
        groups.append(("attention", [f"model.layers.{i}.self_attn.attn" for i in ids]))
    if m.mamba_ids:
        for ids in split(m.mamba_ids, n_mamba_groups):
            groups.append(("mamba", [f"model.layers.{i}.mixer" for i in ids]))
    return Geometry(
        model=m.key,
        user_block=user_block,
        block_size=bs,
        page_bytes=page,
        mamba_real_bytes=m.mamba_state_bytes,
        groups=groups,
        layers_real=len(m.attn_ids) + len(m.mamba_ids),
        attn_layers=gs * n_attn_groups,
        mamba_layers=gs * n_mamba_groups,
    )


@dataclass(frozen=True)
class KVTensor:
    """vllm.v1.kv_cache_interface.KVCacheTensor (the fields the connector reads)."""

    size: int
    layers: list[str]
    layer_stride: int
    block_stride: int
    offset: int = 0


def placement(geom: Geometry, num_blocks: int, block_outer: bool) -> tuple[int, list[KVTensor]]:
    """``get_kv_cache_config_from_groups`` for uniform pages (no alignment padding: the page
    sizes here are multiples of every kernel block's page)."""
    page, gs = geom.page_bytes, geom.group_size
    bytes_per_block = gs * page
    size = bytes_per_block * num_blocks
    tensors = []
    for _, names in geom.groups:
        if block_outer:  # [B, L, ...]: a block holds every layer's page of its group
            tensors.append(KVTensor(size, list(names), page, bytes_per_block, 0))
        else:  # [L, B, ...]: each layer owns a contiguous run of num_blocks pages
            tensors.append(KVTensor(size, list(names), page * num_blocks, page, 0))
    return size, tensors


# --- one engine's memory and transport --------------------------------------------------------


@dataclass
class Side:
    buf: torch.Tensor
    regions: list[LayerRegion]
    allocations: list[tuple[int, int, int]]

    @property
    def base(self) -> int:
        return self.buf.data_ptr()


def fill_pattern(buf: torch.Tensor, seed: int) -> None:
    """Distinct int64s everywhere (cheap; a misplaced page shows up as a mismatch)."""
    words = buf.numel() // 8
    view = buf[: words * 8].view(torch.int64)
    step = 16 * MiB
    for start in range(0, words, step):
        stop = min(words, start + step)
        view[start:stop].copy_(torch.arange(start, stop, dtype=torch.int64, device=buf.device))
    view.add_(seed << 40)


def build_side(geom: Geometry, num_blocks: int, block_outer: bool, device: torch.device, seed):
    size, tensors = placement(geom, num_blocks, block_outer)
    buf = torch.empty(size + GUARD, dtype=torch.uint8, device=device)
    if seed is None:
        buf.zero_()  # also faults every page in before timing
    else:
        fill_pattern(buf, seed)
    groups = [
        SimpleNamespace(layer_names=list(names), kv_cache_spec=SimpleNamespace(page_size_bytes=geom.page_bytes))
        for _, names in geom.groups
    ]
    config = SimpleNamespace(kv_cache_groups=groups, kv_cache_tensors=tensors, num_blocks=num_blocks)
    # What the model runner hands the connector: one view per layer starting at its block 0.
    kv_caches = {
        name: buf[t.offset + i * t.layer_stride :] for t in tensors for i, name in enumerate(t.layers)
    }
    allocations, regions = regions_from_kv_caches(config, kv_caches, tuple(range(len(groups))))
    return Side(buf, regions, allocations)


def choose_blocks(rng, num_blocks: int, counts: list[int], scattered: bool, start: int) -> list[np.ndarray]:
    """Block ids per group (disjoint across groups: a block belongs to one group at a time).
    Scattered: a random order over the pool (free list after churn); contiguous: one run."""
    total = sum(counts)
    if scattered:
        ids = rng.choice(np.arange(1, num_blocks), size=total, replace=False)
    else:
        ids = np.arange(start, start + total)
    out, pos = [], 0
    for c in counts:
        out.append(ids[pos : pos + c])
        pos += c
    return out




def child_check_vllm() -> None:
    """Cross-check ``placement`` (and each spec's page size) against vLLM's own
    ``get_kv_cache_config_from_groups``. The hybrid block size itself (``hybrid_block_size``) is
    not compared with ``Platform._align_hybrid_block_size`` here: that needs a full VllmConfig."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec

    get_kv_cache_config_from_groups = kv_cache_config_from_groups_fn()

    report = []
    for mk, m in MODELS.items():
        for ub in (16, 64, 128):
            geom = geometry(m, ub, 4096, 1 << 40)
            groups = []
            for kind, names in geom.groups:
                if kind == "attention":
                    spec = FullAttentionSpec(
                        block_size=geom.block_size, num_kv_heads=m.kv_heads, head_size=m.head_dim, dtype=torch.bfloat16
                    )
                else:
                    spec = MambaSpec(
                        block_size=geom.block_size,
                        shapes=m.mamba_shapes,
                        dtypes=(torch.bfloat16,) * len(m.mamba_shapes),
                        page_size_padded=geom.page_bytes,
                    )
                assert spec.page_size_bytes == geom.page_bytes, (mk, kind, spec.page_size_bytes, geom.page_bytes)
                groups.append(KVCacheGroupSpec(list(names), spec))
            for layout_name, block_outer in (("LBHNC", False), ("BLHNC", True)):
                num_blocks = 37
                cache = SimpleNamespace(
                    get_resolved_kv_cache_layout=lambda n=layout_name: __import__(
                        "vllm.v1.kv_cache_layout", fromlist=["KVCacheLayout"]
                    ).KVCacheLayout[n],
                    num_gpu_blocks_override=num_blocks,
                    prefix_cache_retention_interval=None,
                )
                cfg = SimpleNamespace(cache_config=cache, attention_config=SimpleNamespace(hisparse_config=None))
                kvc = get_kv_cache_config_from_groups(cfg, groups, available_memory=1 << 40)
                size, mine = placement(geom, num_blocks, block_outer)
                theirs = [
                    (t.size, list(t.layers), t.layer_stride, t.block_stride, t.offset) for t in kvc.kv_cache_tensors
                ]
                ours = [(t.size, t.layers, t.layer_stride, t.block_stride, t.offset) for t in mine]
                report.append({"model": mk, "block": ub, "layout": layout_name, "match": ours == theirs})
                if ours != theirs:
                    report[-1]["vllm"] = theirs[:2]
                    report[-1]["ours"] = ours[:2]
    print("CHECK " + json.dumps(report))


def check_vllm_placement() -> dict:
    """Run ``child_check_vllm`` in a subprocess (importing vLLM takes 10-100 s on a small box)."""
    code = "from benchmarks.transfer_shapes import child_check_vllm; child_check_vllm()"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("CHECK ")]
    if not line:
        return {"ok": None, "error": proc.stderr[-1500:]}
    report = json.loads(line[-1][len("CHECK ") :])
    return {"ok": all(r["match"] for r in report), "cases": report}
