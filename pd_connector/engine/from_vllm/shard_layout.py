"""vLLM's tensor-parallel sharding of each page region, as ``core.shards`` segments.

An allow-list: a layer is described only when its page is a layout proven here (vLLM 0.32/0.33):
- plain attention (``FullAttentionSpec``, ``SlidingWindowSpec``): KV heads split evenly or
  replicated when TP exceeds the head count (``QKVParallelLinear``). vLLM views a page as
  ``[H, N, C]`` per (kernel) block (``create_kv_cache_views`` in vllm/v1/kv_cache_interface.py),
  C a head's K and V for one token; on the block-contiguous layouts (LBHNC, BLHNC) head h is one
  run of ``N * C`` bytes at ``h * N * C``, and padding (``page_size_padded``) sits after the heads.
  The run is read off the page view vLLM hands the connector and checked against the spec's own
  fields (heads, block size, head sizes, dtype), never taken from the page size.
- pages every rank holds whole (``AttentionSpec.max_tp_shards == 1``: MLA's latent; a
  ``MambaSpec`` with ``tp_replicated``): one replicated unit, read from one P rank.
- recurrent layers (Mamba1, Mamba2, short convolutions, GDN, KDA, MiniMax linear attention): by
  the layer's class, conv channels and heads as that class shards them (``recurrent_layouts``).
Anything else (head slots that are not heads, packed content, other layouts, spec classes not
named here) gets no segments and a reason, so only a peer of the same TP size can read it.
Attention pages also get the token layout of their backend and CPU ISA (``_token_layout``),
which P and D must share, and which a peer of another block size needs to cut pages by token.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import msgspec

from pd_connector.core import block_phases, shards
from pd_connector.core.protocol import LayerRegion, Segment
from pd_connector.engine.from_vllm import recurrent_layouts

logger = logging.getLogger("vllm.pd_connector")


def describe_shards(
    vllm_config: Any,
    kv_cache_config: Any,
    group_ids: tuple[int, ...],
    regions: Sequence[LayerRegion],
    tp_rank: int,
    tp_size: int,
    kv_caches: dict[str, Any],
) -> list[LayerRegion]:
    """``regions`` with this rank's segments filled in where vLLM's sharding is proven, and a
    reason on every other (``kv_caches``: the page views vLLM registered)."""
    out = []
    refused: dict[str, str] = {}
    for region in regions:
        layer, _, state = region.name.partition("#")
        spec = _layer_spec(kv_cache_config, group_ids[region.group], layer)
        reason = ""
        try:
            segments = _segments(vllm_config, kv_cache_config, spec, layer, state, region, tp_rank, tp_size, kv_caches)
        except shards.ShardError as exc:
            segments, reason = (), str(exc)
            refused.setdefault(layer, f"{region.name}: {reason}")
        token_layout = _token_layout(vllm_config, spec, layer) if any(s.unit.startswith("kv_head") for s in segments) else ""
        out.append(msgspec.structs.replace(region, segments=segments, reason=reason, token_layout=token_layout))
    if refused:
        logger.info(
            "pd_connector: %d layer(s) not described per TP shard, so only a peer with TP %d can "
            "hand them over: %s",
            len(refused),
            tp_size,
            "; ".join(sorted(set(refused.values()))[:4]),
        )
    return out


def _token_layout(vllm_config: Any, spec: Any, layer: str) -> str:
    """Where a token sits in ``layer``'s KV-head runs, by its attention backend
    (``block_phases`` layouts): FlashAttention's interleaved K|V, vLLM CPU's "vec" kernels'
    column-major K and row-major V, its "amx" kernels' VNNI tiles; any other backend or CPU ISA
    by name only (pages of that layout are copied whole between equal block sizes, never cut).
    "" without a backend."""
    context = getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", None) or {}
    module = context.get(layer)
    backend = getattr(module, "attn_backend", None)
    if backend is None:
        return ""
    name = backend.get_name()
    if name == "FLASH_ATTN":
        return block_phases.INTERLEAVED
    if name != "CPU_ATTN":
        return name
    # The ISA decides how reshape_and_cache lays K and V out (csrc/cpu/cpu_attn_<isa>.hpp). vLLM
    # picks it from the *model* dtype, not the KV cache's (uint8 under fp8: a bf16 model's fp8
    # pages on an AMX host are AMX), and sets it on the layer (CPUAttentionMetadataBuilder.__init__,
    # vllm/v1/attention/backends/cpu_attn.py) before register_kv_caches: read it there first.
    isa = getattr(module, "isa", None)
    if not isinstance(isa, str):
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        cache_dtype = getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto")
        isa = _get_attn_isa(vllm_config.model_config.dtype, spec.block_size, spec.head_size, cache_dtype)
    if isa == "vec" and spec.head_size == spec.head_size_v:
        return block_phases.token_layout_name(block_phases.K_COLUMNS_V_ROWS, spec.head_size)
    # AMX: VNNI-packed K and V in groups of 16 tokens and dims (vLLM makes the block size a
    # multiple of 32 and the head size one of 32 for it); its bf16 and fp8 pages hold the same
    # layout in elements (checked against vLLM's kernel in tests/vllm/test_block_size_layout.py).
    if isa == "amx" and spec.head_size == spec.head_size_v and spec.head_size % block_phases.AMX_DIM_GROUP == 0:
        return block_phases.token_layout_name(block_phases.AMX_VNNI, spec.head_size)
    return f"CPU_ATTN:{isa}"


def _layer_spec(kv_cache_config: Any, group: int, layer: str) -> Any:
    spec = kv_cache_config.kv_cache_groups[group].kv_cache_spec
    inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
    return inner.get(layer, spec) if inner else spec


def _segments(vllm_config, kv_cache_config, spec, layer, state, region, rank, tp, kv_caches) -> tuple[Segment, ...]:
    from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec, MambaSpec, SlidingWindowSpec

    if isinstance(spec, MambaSpec):
        if spec.tp_replicated:
            return shards.replicated_segments(region.page_bytes)
        return _recurrent(vllm_config, spec, layer, state, region, rank, tp)
    if isinstance(spec, AttentionSpec) and spec.max_tp_shards == 1:
        # vLLM: TP ranks past max_tp_shards hold replicas (kv_cache_utils._layer_tp_replicas), so
        # every rank's page is the same bytes; DCP, which would shard tokens, is refused at start.
        return shards.replicated_segments(region.page_bytes)
    if type(spec) not in (FullAttentionSpec, SlidingWindowSpec):
        raise shards.ShardError(f"{type(spec).__name__}: no TP layout known for this spec class")
    if spec.num_head_slots is not None:
        raise shards.ShardError(
            f"num_head_slots {spec.num_head_slots} for {spec.num_kv_heads} KV heads: the page's slots "
            "are not one per head (e.g. all K, then all V)"
        )
    if spec.state_content_bytes is not None:
        raise shards.ShardError(f"state_content_bytes {spec.state_content_bytes}: packed content not placed per head")
    if spec.tokens_per_state != 1:
        raise shards.ShardError(f"tokens_per_state {spec.tokens_per_state}: a page slot is not one token")
    # The layout (LBHNC, LBNHC, kernel blocks) is read off the view: its strides are the proof.
    page = _attention_page(spec, region, kv_caches.get(layer), kv_cache_config.num_blocks)
    total = shards.layer_kv_heads(spec.num_kv_heads, tp, _kv_head_candidates(vllm_config, layer))
    return shards.attention_page_segments(page, total, tp, rank)


def _attention_page(spec: Any, region: LayerRegion, view: Any, num_blocks: int) -> shards.AttentionPage:
    """The page as vLLM's view of it lays it out: ``[blocks x kernel blocks, H, N, C]``."""
    if view is None or view.dim() != 4 or view.shape[0] % num_blocks:
        raise shards.ShardError(f"page view {None if view is None else tuple(view.shape)}: not [blocks, H, N, C]")
    if view.stride(3) != 1:
        raise shards.ShardError("a token's content is not contiguous")
    elem = view.element_size()
    kernel_blocks = view.shape[0] // num_blocks
    dtype_bytes = spec.dtype.itemsize
    return shards.AttentionPage(
        page_bytes=region.page_bytes,
        kernel_blocks=kernel_blocks,
        kernel_stride=view.stride(0) * elem,
        slots=view.shape[1],
        slot_stride=view.stride(1) * elem,
        tokens=view.shape[2],
        token_stride=view.stride(2) * elem,
        content_bytes=view.shape[3] * elem,
        kv_heads=spec.num_kv_heads,
        block_size=spec.block_size,
        kv_bytes=(spec.head_size + spec.head_size_v) * dtype_bytes,
    )


def _kv_head_candidates(vllm_config: Any, layer: str) -> list[int]:
    """The KV-head counts the model config allows for ``layer``: the target model's count for
    the layer's index (per layer for heterogeneous checkpoints), else any of its layers', and
    every drafter layer's (a drafter's layers share the KV cache and need not be told apart by
    name)."""
    target = _per_layer_kv_heads(vllm_config.model_config)
    index = _layer_index(layer)
    out = [target[index]] if index is not None and index < len(target) else list(target)
    draft = getattr(vllm_config.speculative_config, "draft_model_config", None)
    if draft is not None:
        out.extend(_per_layer_kv_heads(draft))
    return out


def _per_layer_kv_heads(model_config: Any) -> list[int]:
    arch = getattr(model_config, "model_arch_config", None)
    if arch is None or getattr(arch, "per_layer_overrides", None) is None:
        return [model_config.get_total_num_kv_heads()]
    return [arch[i].total_num_kv_heads for i in range(len(arch.per_layer_overrides))]


def _layer_index(layer: str) -> int | None:
    numbers = [int(part) for part in layer.split(".") if part.isdigit()]
    return numbers[0] if len(numbers) == 1 else None


def _recurrent(vllm_config, spec, layer, state, region, rank, tp) -> tuple[Segment, ...]:
    import torch
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    context = getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", None) or {}
    layout = recurrent_layouts.state_layout(context.get(layer), spec, tp)
    index = int(state)
    return shards.state_segments(
        layout,
        index,
        spec.shapes[index],
        torch.empty((), dtype=spec.dtypes[index]).element_size(),
        dim_first=str(get_conv_state_layout()).upper().endswith("DS"),
        scratch_rows=region.scratch_rows,
        tp=tp,
        rank=rank,
    )
