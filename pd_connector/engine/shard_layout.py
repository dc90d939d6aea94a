"""vLLM's tensor-parallel sharding of each page region, as ``core.shards`` segments.

What each rank holds (vLLM 0.32):
- attention (full, sliding window): KV heads, split evenly or replicated when TP exceeds the head
  count (``QKVParallelLinear``); a head's bytes are one run of the page in head-major layouts
  (``KVCacheLayout.is_block_contiguous``: LBHNC/BLHNC, the only CPU layout).
- Mamba2 conv state: channels ``[x | B | C]``, x split by heads, B and C by groups, or the one
  group replicated on every rank when TP does not divide ``n_groups`` (``MambaMixer2``);
  SSM state (H, P, S) by heads.
- GDN conv state: channels ``[Q | K | V]``, each split evenly; recurrent state (Hv, dv, dk) by
  value heads (``QwenGatedDeltaNetAttention``, ``gated_delta_net_state_shape``).
Anything else gets no segments, so only a peer of the same TP size can read it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import msgspec

from pd_connector.core import shards
from pd_connector.core.pairing import MAMBA
from pd_connector.core.protocol import LayerRegion, Segment
from pd_connector.engine.compat import _spec_kind

logger = logging.getLogger("vllm.pd_connector")


def describe_shards(
    vllm_config: Any,
    kv_cache_config: Any,
    group_ids: tuple[int, ...],
    regions: Sequence[LayerRegion],
    tp_rank: int,
    tp_size: int,
) -> list[LayerRegion]:
    """``regions`` with this rank's segments filled in where vLLM's sharding is known."""
    out = []
    undescribed = set()
    for region in regions:
        layer, _, state = region.name.partition("#")
        spec = _layer_spec(kv_cache_config, group_ids[region.group], layer)
        try:
            segments = _segments(vllm_config, kv_cache_config, spec, layer, state, region, tp_rank, tp_size)
        except shards.ShardError as exc:
            logger.info("pd_connector: %s cannot be read by a peer of another TP size: %s", region.name, exc)
            segments = ()
        if not segments:
            undescribed.add(layer)
        out.append(msgspec.structs.replace(region, segments=segments))
    if undescribed:
        logger.info(
            "pd_connector: %d layer(s) not described per TP shard (e.g. %s): only a peer with "
            "TP %d can hand them over",
            len(undescribed),
            sorted(undescribed)[0],
            tp_size,
        )
    return out


def _layer_spec(kv_cache_config: Any, group: int, layer: str) -> Any:
    spec = kv_cache_config.kv_cache_groups[group].kv_cache_spec
    inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
    return inner.get(layer, spec) if inner else spec


def _segments(vllm_config, kv_cache_config, spec, layer, state, region, rank, tp) -> tuple[Segment, ...]:
    kind, _ = _spec_kind(spec)
    if kind != MAMBA:
        return _attention(vllm_config, kv_cache_config, spec, region, rank, tp)
    mamba_type = getattr(getattr(spec, "mamba_type", None), "name", "")
    if getattr(spec, "tp_replicated", False) or mamba_type not in ("MAMBA2", "GDN_ATTN") or len(spec.shapes) != 2:
        return ()
    import torch
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    kind_of = {"MAMBA2": shards.MAMBA2, "GDN_ATTN": shards.GDN}[mamba_type]
    return shards.recurrent_segments(
        kind_of,
        int(state),
        spec.shapes[0],
        spec.shapes[1],
        [torch.empty((), dtype=d).element_size() for d in spec.dtypes],
        dim_first=str(get_conv_state_layout()).upper().endswith("DS"),
        scratch_rows=region.scratch_rows,
        tp=tp,
        rank=rank,
        groups_replicated=kind_of == shards.MAMBA2 and _mamba2_groups_replicated(vllm_config, layer, tp),
    )


def _attention(vllm_config, kv_cache_config, spec, region, rank, tp) -> tuple[Segment, ...]:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = getattr(kv_cache_config, "kv_cache_layout", None) or "LBHNC"
    if not KVCacheLayout[layout].is_block_contiguous or getattr(vllm_config.model_config, "use_mla", False):
        return ()
    per_rank = int(getattr(spec, "num_kv_heads", 0) or 0)
    if per_rank <= 0 or region.page_bytes % per_rank:
        return ()
    for total in _total_kv_heads(vllm_config):
        if max(1, total // tp) == per_rank:
            return shards.attention_segments(total, tp, rank, region.page_bytes // per_rank)
    return ()


def _total_kv_heads(vllm_config) -> list[int]:
    """The target model's KV-head count, then the drafter's (its layers share the KV cache)."""
    out = [vllm_config.model_config.get_total_num_kv_heads()]
    draft = getattr(vllm_config.speculative_config, "draft_model_config", None)
    if draft is not None:
        out.append(draft.get_total_num_kv_heads())
    return out


def _mamba2_groups_replicated(vllm_config, layer: str, tp: int) -> bool:
    """Whether every rank holds all of B and C: vLLM replicates the single group when TP does
    not divide ``n_groups`` (MambaMixer2 then builds conv1d as a plain ColumnParallelLinear
    instead of the MergedColumnParallelLinear that shards the groups)."""
    if tp == 1:
        return False
    module = vllm_config.compilation_config.static_forward_context.get(layer)
    conv = getattr(module, "conv1d", None)
    if conv is None:
        raise shards.ShardError(f"{layer}: no Mamba2 module to read its group sharding from")
    return type(conv).__name__ != "MergedColumnParallelLinear"
