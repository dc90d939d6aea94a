"""vLLM's configuration objects (0.32 and 0.33) as the pure core's plain values: the group
layouts, the recompute profile, the checkpoint rule, this engine's TP and DP placement."""

from __future__ import annotations

from typing import Any

from pd_connector.core.settings import UnsupportedConfig
from pd_connector.core.checkpoints import CheckpointRule
from pd_connector.core.pairing import ATTENTION, MAMBA, SLIDING_WINDOW, GroupLayout
from pd_connector.core.recompute_profile import RecomputeProfile


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
        checkpoint_unit=grid,
        eagle_drop=bool(grid and eagle_block_drop(vllm_config)),
    )


def checkpoint_rule_from_vllm(
    vllm_config: Any,
    kv_cache_config: Any,
    profile: RecomputeProfile,
    layouts: tuple[GroupLayout, ...],
    group_ids: tuple[int, ...],
) -> CheckpointRule:
    """The core's rule from this engine's config: the Mamba groups' block size (one for all in
    align mode, else no checkpoints), the unit and drop of ``profile``, whether every Mamba
    backend exports checkpoints inside a chunk (``Scheduler.mamba_has_prefill_checkpoint_blocks``)
    and the granularity the scheduler splits prefill chunks on (``cache_config.block_size``,
    read by ``Scheduler._mamba_block_aligned_split`` at every step; ``CheckpointPool.rule``
    reads it again per request)."""
    sizes = {layout.block_size for layout in layouts if layout.kind == MAMBA}
    if len(sizes) != 1 or not profile.checkpoint_unit:
        return CheckpointRule()
    specs = [kv_cache_config.kv_cache_groups[g].kv_cache_spec for g, layout in zip(group_ids, layouts) if layout.kind == MAMBA]
    exports = all((getattr(spec, "num_prefill_checkpoint_blocks", 0) or 0) > 0 for spec in specs)
    return CheckpointRule(
        block_size=sizes.pop(),
        profile=profile,
        exports=exports,
        split_block=int(getattr(vllm_config.cache_config, "block_size", 0) or 0),
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
