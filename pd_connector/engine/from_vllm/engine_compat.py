"""This engine's ``EngineCompat``: what a peer must share for pages to be copied byte for byte
(model, dtypes, groups, conv layout, speculative drafter, TP size), from vLLM's config."""

from __future__ import annotations

import os
from typing import Any

from pd_connector.core.pairing import MAMBA, wire_block_sizes
from pd_connector.core.protocol import EngineCompat, GroupDesc
from pd_connector.engine.from_vllm.vllm_config import layouts_from_kv_cache_config
from pd_connector.engine.from_vllm.identity import model_identity


def _spec_dtypes(spec: Any) -> list[str]:
    inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
    if inner:
        return sorted({d for child in inner.values() for d in _spec_dtypes(child)})
    dtypes = getattr(spec, "dtypes", None) or (getattr(spec, "dtype", None),)  # Mamba: per state
    return [str(d).removeprefix("torch.") for d in dtypes if d is not None]


def cache_dtypes(vllm_config: Any, kv_cache_config: Any, group_ids: tuple[int, ...]) -> str:
    """The ``--kv-cache-dtype`` setting and what each transfer group's pages really hold.

    Pages are copied byte for byte, so any dtype works as long as P and D store the same one;
    ``cache_dtype`` alone would miss "auto" resolving differently (another ``--dtype``) and the
    Mamba state dtypes (``--mamba-ssm-cache-dtype``), which can differ at equal page size."""
    groups = " | ".join(
        "+".join(_spec_dtypes(kv_cache_config.kv_cache_groups[g].kv_cache_spec)) for g in group_ids
    )
    return f"{vllm_config.cache_config.cache_dtype} (pages: {groups})"


def engine_compat(vllm_config: Any, kv_cache_config: Any, group_ids: tuple[int, ...]) -> EngineCompat:
    layouts = layouts_from_kv_cache_config(kv_cache_config, group_ids)
    groups = []
    for layout, g in zip(layouts, group_ids):
        group = kv_cache_config.kv_cache_groups[g]
        groups.append(
            GroupDesc(
                kind=layout.kind,
                # A Mamba block holds one state whatever its size (max_model_len without prefix
                # caching, the align-mode block with it): the slot copy does not depend on it.
                block_size=wire_block_sizes([layout])[0],
                # Mamba pages are padded to the attention page and hold a conv state whose width
                # depends on the speculative token count; what must agree is per state, checked
                # by descriptors.reconcile_regions on the page map. Attention pages must be equal
                # unless their block sizes differ and are re-cut (core/block_phases.py).
                page_bytes=0 if layout.kind == MAMBA else group.kv_cache_spec.page_size_bytes,
                layer_names=sorted(group.layer_names),
            )
        )
    conv_layout = ""
    if any(layout.kind == MAMBA for layout in layouts):
        from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

        # Pages are copied byte for byte, so P and D must lay conv state out the same way.
        # vLLM's CPU platform picks DS only for connectors named Nixl* and SD otherwise on
        # AVX512-BF16 CPUs (vllm/platforms/cpu.py); we compare instead of assuming.
        conv_layout = str(get_conv_state_layout())
    model = vllm_config.model_config
    spec = vllm_config.speculative_config
    # Only drafters with their own KV (EAGLE/MTP/draft models) change what the pages mean: the
    # drafter's KV for the prefix is handed over too. ngram/suffix/medusa keep none, so a P
    # without speculation serves a D with ngram (and back) like any other pair.
    speculative = "none"
    if spec is not None and spec.uses_draft_kv_cache():
        draft = getattr(spec, "model", None) or ""
        speculative = f"{spec.method}:{os.path.basename(str(draft).rstrip('/'))}" if draft else str(spec.method)
    identity = model_identity(model)
    return EngineCompat(
        model=identity["model"],
        dtype=str(model.dtype),
        kv_cache_dtype=cache_dtypes(vllm_config, kv_cache_config, group_ids),
        groups=groups,
        conv_state_layout=conv_layout,
        tensor_parallel_size=vllm_config.parallel_config.tensor_parallel_size,
        device=str(vllm_config.kv_transfer_config.kv_buffer_device),
        speculative=speculative,
        model_files=identity["model_files"],
        model_revision=identity["model_revision"],
        tokenizer=identity["tokenizer"],
        tokenizer_revision=identity["tokenizer_revision"],
        quantization=identity["quantization"],
        rope=identity["rope"],
        max_model_len=identity["max_model_len"],
    )
