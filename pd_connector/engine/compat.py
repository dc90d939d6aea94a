"""Translate vLLM configuration objects (0.32 and 0.33) into the pure core's plain values.

Everything that knows vLLM's class names lives here, so a vLLM upgrade touches one module.
"""

from __future__ import annotations

import math
import os
from typing import Any

import msgspec

from pd_connector.core.config import UnsupportedConfig
from pd_connector.core.handoff import RecomputeProfile
from pd_connector.core.pairing import ATTENTION, MAMBA, SLIDING_WINDOW, GroupLayout
from pd_connector.core.protocol import EngineCompat, GroupDesc, LayerRegion
from pd_connector.engine.identity import model_identity


def _spec_kind(spec: Any) -> tuple[str, int]:
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    if isinstance(spec, MambaSpec):
        return MAMBA, 0
    if isinstance(spec, SlidingWindowSpec):
        return SLIDING_WINDOW, spec.sliding_window
    if isinstance(spec, ChunkedLocalAttentionSpec):
        # Its blocks are freed per chunk, not per window: the sliding-window pairing would ship
        # blocks vLLM already nulled. Refuse rather than fail every handoff at run time.
        raise UnsupportedConfig(
            "pd_connector does not support chunked local attention (e.g. Llama 4) yet"
        )
    if isinstance(spec, FullAttentionSpec):
        return ATTENTION, 0
    if isinstance(spec, UniformTypeKVCacheSpecs):
        kinds = {_spec_kind(s) for s in spec.kv_cache_specs.values()}
        if len(kinds) == 1:
            return kinds.pop()
    raise UnsupportedConfig(
        f"pd_connector does not support KV-cache spec {type(spec).__name__} yet "
        "(supported: full attention, sliding window, Mamba/SSM/GDN)"
    )


def layouts_from_kv_cache_config(kv_cache_config: Any, group_ids: tuple[int, ...]) -> tuple[GroupLayout, ...]:
    layouts = []
    for g in group_ids:
        spec = kv_cache_config.kv_cache_groups[g].kv_cache_spec
        kind, window = _spec_kind(spec)
        layouts.append(
            GroupLayout(
                kind=kind,
                block_size=spec.block_size,
                sliding_window=window,
                num_speculative_blocks=getattr(spec, "num_speculative_blocks", 0) or 0,
                mamba_cache_mode=getattr(spec, "mamba_cache_mode", "none") or "none",
            )
        )
    return tuple(layouts)


def profile_from_vllm(vllm_config: Any, kv_cache_config: Any) -> RecomputeProfile:
    specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
    kinds = [_spec_kind(s)[0] for s in specs]
    has_mamba = MAMBA in kinds
    grid = 0
    if has_mamba and vllm_config.cache_config.enable_prefix_caching:
        # Align mode keeps Mamba state only where the cache manager looks it up.
        grid = _cache_hit_alignment(vllm_config, kv_cache_config)
    # A P/D load restores a bounded-replay window, so such groups need one recomputed token,
    # not the window (vLLM's _prefill_backoff); see RecomputeProfile.bounded_replay.
    bounded_replay = any((getattr(s, "prefix_replay_tokens", 0) or 0) > 0 for s in specs)
    return RecomputeProfile(
        has_recurrent_state=has_mamba,
        prefill_lookahead=int(getattr(vllm_config, "num_prefill_lookahead_tokens", 0) or 0),
        bounded_replay=bounded_replay,
        replay_grid=grid,
        eagle_drop=bool(grid and eagle_block_drop(vllm_config)),
    )


def _cache_hit_alignment(vllm_config: Any, kv_cache_config: Any) -> int:
    """The token granularity of the Mamba group's prefix-cache hits and prompt checkpoints, as
    the engine core derives it (``resolve_kv_cache_block_sizes`` then
    ``resolve_cache_hit_alignment_tokens`` in vllm/v1/core/kv_cache_utils.py, both versions;
    ``MambaManager`` checkpoints on it): the ``prefix_match_unit`` when it is finer than the
    Mamba block, else the scheduler block size."""
    from vllm.v1.core.kv_cache_utils import resolve_cache_hit_alignment_tokens, resolve_kv_cache_block_sizes

    scheduler_block, hash_block = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    return int(resolve_cache_hit_alignment_tokens(kv_cache_config, vllm_config, scheduler_block, hash_block))


def eagle_block_drop(vllm_config: Any) -> bool:
    """vLLM's own rule for checkpointing Mamba state one unit early under speculative decoding.

    ``SpeculativeConfig.use_eagle_block_drop()`` (vllm/config/speculative.py) in both versions:
    0.32 = any EAGLE-family method (eagle, eagle3, mtp, dflash, dspark), 0.33 = only those whose
    draft KV depends on the next token (``needs_eagle_block_drop``: not dflash/dspark); both
    honour ``disable_eagle_block_drop``. 0.33's Scheduler also drops nothing when block hashes
    cover lookahead tokens (``VllmConfig.num_hash_lookahead_tokens``), which vLLM keeps at 0
    whenever a KV connector is configured."""
    spec_config = vllm_config.speculative_config
    if spec_config is None or getattr(vllm_config, "num_hash_lookahead_tokens", 0):
        return False
    return bool(spec_config.use_eagle_block_drop())


def kv_cache_config_from_groups_fn() -> Any:
    """vLLM's ``get_kv_cache_config_from_groups(vllm_config, groups, available_memory)``:
    vllm/v1/core/kv_cache_utils.py in 0.32, moved to vllm/v1/core/kv_cache_planning.py in 0.33."""
    try:
        from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    except ImportError:
        from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    return get_kv_cache_config_from_groups


def check_hybrid_kv_cache_manager(vllm_config: Any) -> None:
    """A hybrid model needs vLLM's hybrid KV-cache manager (one KV-cache group per layer kind).

    With ``--disable-hybrid-kv-cache-manager`` vLLM 0.32 tries to merge the Mamba layers' specs
    into one attention-like spec and fails in ``get_kv_cache_configs`` with "Failed to promote
    local KV cache specs to one unified type" (vllm/v1/core/kv_cache_utils.py,
    _promote_local_kv_cache_specs), which names neither the model nor the flag."""
    model = getattr(vllm_config, "model_config", None)
    scheduler = getattr(vllm_config, "scheduler_config", None)
    if model is None or not getattr(scheduler, "disable_hybrid_kv_cache_manager", False):
        return
    if getattr(model, "is_hybrid", False):
        raise UnsupportedConfig(
            "pd_connector: this is a hybrid model (attention plus Mamba/SSM/linear-attention "
            "layers), which needs vLLM's hybrid KV-cache manager: remove "
            "--disable-hybrid-kv-cache-manager (scheduler_config.disable_hybrid_kv_cache_manager)"
            " on both the prefill and the decode instance"
        )


def check_sleep_mode(vllm_config: Any) -> None:
    """Sleep releases the KV cache's memory and wake maps new pages, but pd_connector does not
    re-register them with NIXL (it has no ``unregister_kv_caches``/``restore_kv_caches``): a
    peer's READ after a wake would copy stale pages. vLLM 0.33 refuses
    ``--enable-sleep-mode`` itself when ``PDConnector.supports_sleep_mode`` says False
    (``VllmConfig._verify_kv_transfer_compat``); 0.32 has no such hook, so we refuse here."""
    model = getattr(vllm_config, "model_config", None)
    if getattr(model, "enable_sleep_mode", False):
        raise UnsupportedConfig(
            "pd_connector does not support sleep mode: after a wake the KV cache lives in new "
            "memory that pd_connector has not registered with NIXL; remove --enable-sleep-mode "
            "(model_config.enable_sleep_mode) on both the prefill and the decode instance"
        )


def check_supported(vllm_config: Any) -> None:
    """Refuse, at start-up, what this version cannot transfer correctly."""
    check_hybrid_kv_cache_manager(vllm_config)
    check_sleep_mode(vllm_config)
    parallel = vllm_config.parallel_config
    # Tensor parallelism is supported (core/shards.py); pipeline and decode-context parallelism
    # split the KV cache by layer or by token, which the page maps do not describe yet.
    for name in ("pipeline_parallel_size", "decode_context_parallel_size"):
        size = getattr(parallel, name, 1) or 1
        if size != 1:
            raise UnsupportedConfig(
                f"pd_connector supports {name}=1 only (got {size}); tensor parallelism is "
                "supported (any P and D sizes where one divides the other)"
            )
    device = vllm_config.kv_transfer_config.kv_buffer_device
    platform = vllm_config.device_config.device_type
    if device != platform:
        raise UnsupportedConfig(
            f"kv_buffer_device={device!r} but the KV cache lives on {platform!r}; pd_connector "
            f"transfers the KV cache in place: set \"kv_buffer_device\":\"{platform}\""
        )


def regions_from_kv_caches(
    kv_cache_config: Any, kv_caches: dict[str, Any], group_ids: tuple[int, ...]
) -> tuple[list[tuple[int, int, int]], list[LayerRegion]]:
    """(allocations to register, per-layer page map) from vLLM's ``KVCacheTensor`` placement:
    layer l's page for block b starts at ``offset + l * layer_stride + b * block_stride`` bytes
    into its backing allocation (vllm/v1/kv_cache_interface.py, KVCacheTensor)."""
    group_of_layer = {}
    page_of_group = {}
    spec_of_group = {}
    for index, g in enumerate(group_ids):
        group = kv_cache_config.kv_cache_groups[g]
        page_of_group[index] = group.kv_cache_spec.page_size_bytes
        spec_of_group[index] = group.kv_cache_spec
        for name in group.layer_names:
            group_of_layer[name] = index
    allocations: dict[int, tuple[int, int, int]] = {}
    regions = []
    for tensor in kv_cache_config.kv_cache_tensors:
        for i, name in enumerate(tensor.layers):
            if name not in group_of_layer or name not in kv_caches:
                continue
            view = kv_caches[name]
            storage = view.untyped_storage()
            base = storage.data_ptr()
            device_id = view.device.index or 0
            allocations[base] = (base, storage.nbytes(), device_id)
            addr = base + tensor.offset + i * tensor.layer_stride
            page = page_of_group[group_of_layer[name]]
            if view.data_ptr() != addr:
                raise UnsupportedConfig(
                    f"layer {name}: KV view starts at +{view.data_ptr() - base} bytes, vLLM's "
                    f"placement says +{addr - base}; unsupported KV-cache layout"
                )
            if addr + (kv_cache_config.num_blocks - 1) * tensor.block_stride + page > base + storage.nbytes():
                raise UnsupportedConfig(f"layer {name}: page map exceeds its allocation")
            region = LayerRegion(
                name=name,
                group=group_of_layer[name],
                addr=addr,
                block_stride=tensor.block_stride,
                page_bytes=page,
                num_blocks=kv_cache_config.num_blocks,
            )
            regions.extend(_state_regions(region, spec_of_group[group_of_layer[name]], name))
    missing = set(group_of_layer) - {r.name.partition("#")[0] for r in regions}
    if missing:
        raise UnsupportedConfig(f"no KV-cache placement for layers {sorted(missing)}")
    regions.sort(key=lambda r: (r.group, r.name))
    return list(allocations.values()), regions


# The state that grows by the engine's speculative token count, per Mamba layer type: the conv
# state, (conv_kernel - 1 + num_spec) rows (MambaStateShapeCalculator, vllm/model_executor/layers/
# mamba/mamba_utils.py). Mamba1's conv state, every SSM/recurrent state and linear attention's
# have no speculative rows; another type's states are never trimmed (copied or refused whole).
# The conv state is these types' first state (``shapes[0]``).
_CONV_WITH_SPECULATIVE_ROWS = frozenset({"MAMBA2", "SHORT_CONV", "GDN_ATTN"})


def _conv_state_layout() -> str:
    """vLLM's conv-state orientation, "SD" (its default) where vLLM is absent (the GPU check's
    real-NIXL tests run without it)."""
    try:
        from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout
    except ImportError:
        return "SD"
    return "DS" if str(get_conv_state_layout()).upper().endswith("DS") else "SD"


def _state_regions(page: LayerRegion, spec: Any, layer: str) -> list[LayerRegion]:
    """A Mamba layer's page as one region per state, padding left out.

    vLLM packs a Mamba layer's states contiguously at the start of each block's page
    (``MambaBase.bind_kv_cache`` in vllm/model_executor/layers/mamba/abstract.py: conv state,
    then SSM state(s), then padding up to the group's page size). Other specs: the page as is.
    """
    inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
    if inner:
        spec = inner.get(layer, spec)
    shapes, dtypes = getattr(spec, "shapes", None), getattr(spec, "dtypes", None)
    if not shapes or not dtypes:
        return [page]
    import torch

    scratch = int(getattr(spec, "num_speculative_blocks", 0) or 0)
    if getattr(getattr(spec, "mamba_type", None), "name", "") not in _CONV_WITH_SPECULATIVE_ROWS:
        scratch = 0
    elif scratch and _conv_state_layout() == "DS":
        scratch = 0  # (channels, rows): the speculative rows are not leading rows
    out, offset = [], 0
    for i, (shape, dtype) in enumerate(zip(shapes, dtypes)):
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        out.append(
            msgspec.structs.replace(
                page,
                name=f"{layer}#{i}",
                addr=page.addr + offset,
                page_bytes=nbytes,
                rows=int(shape[0]) if shape else 0,
                scratch_rows=scratch if i == 0 else 0,
            )
        )
        offset += nbytes
    if offset > page.page_bytes:
        raise UnsupportedConfig(f"layer {layer}: states of {offset} B exceed the {page.page_bytes} B page")
    return out


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
                block_size=0 if layout.kind == MAMBA else layout.block_size,
                # Mamba pages are padded to the attention page and hold a conv state whose width
                # depends on the speculative token count; what must agree is per state, checked
                # by layout.reconcile_regions on the page map. Attention pages must be equal.
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


def tp_rank_and_size(vllm_config: Any) -> tuple[int, int]:
    """This worker's tensor-parallel rank and size (vLLM's TP group exists by the time the
    worker-side connector is built: Worker.init_device runs first)."""
    size = int(vllm_config.parallel_config.tensor_parallel_size or 1)
    if size == 1:
        return 0, 1
    from vllm.distributed import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank()), size


def dp_placement(vllm_config: Any) -> tuple[int, bool]:
    """This engine's data-parallel index and whether its DP ranks step in lockstep.

    ``data_parallel_index`` is the rank among the instance's DP engines in every mode (vLLM sets
    it per engine in run_engine_core, vllm/v1/engine/core.py, and keeps it when a dense model's
    ranks are made independent: ``reconfigure_for_independent_dp_rank`` resets
    ``data_parallel_rank`` and ``data_parallel_size`` to 0 and 1). A DP size still above 1 is a
    MoE model's DP group, whose ranks run every step together (``DPEngineCoreProc``)."""
    parallel = vllm_config.parallel_config
    index = getattr(parallel, "data_parallel_index", None)
    if index is None:
        index = getattr(parallel, "data_parallel_rank", 0)
    return int(index or 0), int(getattr(parallel, "data_parallel_size", 1) or 1) > 1
