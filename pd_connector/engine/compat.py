"""Translate vLLM 0.32 configuration objects into the pure core's plain values.

Everything that knows vLLM's class names lives here, so a vLLM upgrade touches one module.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Any

import msgspec

from pd_connector.core.config import UnsupportedConfig
from pd_connector.core.handoff import RecomputeProfile
from pd_connector.core.pairing import ATTENTION, MAMBA, SLIDING_WINDOW, GroupLayout
from pd_connector.core.prompt_digest import TOKENS, blocks_form, extra_keys, prompt_digest
from pd_connector.core.protocol import EngineCompat, GroupDesc, LayerRegion


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
    cache_config = vllm_config.cache_config
    if has_mamba and cache_config.enable_prefix_caching:
        # Align mode stores Mamba state at block boundaries only; hand over on that grid so
        # D's cache manager registers the state where it will look for it later.
        grid = max(s.block_size for s, k in zip(specs, kinds) if k == MAMBA)
    # A P/D load restores a bounded-replay window, so such groups need one recomputed token,
    # not the window (vLLM's _prefill_backoff); see RecomputeProfile.bounded_replay.
    bounded_replay = any((getattr(s, "prefix_replay_tokens", 0) or 0) > 0 for s in specs)
    spec_config = vllm_config.speculative_config
    return RecomputeProfile(
        has_recurrent_state=has_mamba,
        prefill_lookahead=int(getattr(vllm_config, "num_prefill_lookahead_tokens", 0) or 0),
        bounded_replay=bounded_replay,
        replay_grid=grid,
        eagle_drop=bool(grid and spec_config is not None and spec_config.use_eagle()),
    )


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


def check_supported(vllm_config: Any) -> None:
    """Refuse, at start-up, what this version cannot transfer correctly."""
    check_hybrid_kv_cache_manager(vllm_config)
    parallel = vllm_config.parallel_config
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "decode_context_parallel_size"):
        size = getattr(parallel, name, 1) or 1
        if size != 1:
            raise UnsupportedConfig(
                f"pd_connector supports {name}=1 only (got {size}); run one instance per GPU "
                "or use vLLM's NixlConnector for tensor/pipeline parallel P/D"
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
                scratch_rows=scratch,
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
                block_size=layout.block_size,
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
        model_revision=identity["model_revision"],
        tokenizer=identity["tokenizer"],
        tokenizer_revision=identity["tokenizer_revision"],
        quantization=identity["quantization"],
        rope=identity["rope"],
        max_model_len=identity["max_model_len"],
    )


def _name(path_or_id: Any) -> str:
    """A Hugging Face repo id whole (``org/name``: ``org1/X`` is not ``org2/X``); a local
    directory by its last component, since P and D may mount the same weights at different
    paths."""
    text = str(path_or_id or "").rstrip("/")
    if not text:
        return ""
    if os.path.isabs(text) or text.startswith((".", "~")) or os.path.isdir(text):
        return os.path.basename(text)
    return text


def model_identity(model_config: Any) -> dict[str, Any]:
    """What names the weights and positions P's pages were computed with, from vLLM's
    ``ModelConfig`` (vllm/config/model.py): model and tokenizer with their revisions, the
    quantization method, the RoPE parameters of the resolved config (``--hf-overrides`` and
    rope scaling included: they move every position's rotation), and ``max_model_len`` only
    under a scaled RoPE, where the rotation can depend on it (longrope picks its factors by it,
    dynamic NTK scales with it); without scaling positions do not depend on it, and P and D may
    differ (a P serving shorter prompts)."""
    rope_parameters = getattr(getattr(model_config, "hf_text_config", None), "rope_parameters", None)
    rope = ""
    scaled = False
    if isinstance(rope_parameters, dict) and rope_parameters:
        rope = json.dumps(rope_parameters, sort_keys=True, default=str)
        kinds = [p.get("rope_type", "default") for p in iter_rope_dicts(rope_parameters)]
        scaled = any(kind != "default" for kind in kinds)
    return {
        "model": _name(model_config.model),
        "model_revision": str(getattr(model_config, "revision", None) or ""),
        "tokenizer": _name(getattr(model_config, "tokenizer", None) or model_config.model),
        "tokenizer_revision": str(getattr(model_config, "tokenizer_revision", None) or ""),
        "quantization": str(getattr(model_config, "quantization", None) or ""),
        "rope": rope,
        "max_model_len": int(getattr(model_config, "max_model_len", 0) or 0) if scaled else 0,
    }


def iter_rope_dicts(rope_parameters: dict) -> list[dict]:
    """One dict per layer type when nested (vLLM's iter_rope_parameters), else the dict."""
    nested = [v for v in rope_parameters.values() if isinstance(v, dict)]
    return nested if nested and len(nested) == len(rope_parameters) else [rope_parameters]


def sibling_group(request_id: str) -> str | None:
    """The parent of an ``n > 1`` child request: vLLM names child i ``f"{i}_{parent_id}"``
    (ParentRequest.get_child_info, vllm/v1/engine/parallel_sampling.py), and the parent id
    carries a random suffix (InputProcessor.assign_request_id). None for other ids."""
    index, sep, parent = request_id.partition("_")
    return parent if sep and parent and index.isdigit() else None


def prompt_extra_keys(request: Any, length: int) -> tuple | None:
    """What besides the first ``length`` prompt tokens decides the state there
    (core/prompt_digest.extra_keys), from vLLM's ``Request``; None when the prompt cannot be
    fingerprinted (prompt embeddings: the state depends on tensors, not tokens)."""
    if request.prompt_embeds is not None:
        return None
    lora, salt, features = request.lora_request, request.cache_salt, request.mm_features
    if not (lora or salt or features):
        return ()  # the common case, on every handoff: no attribute chase
    items = [(str(f.identifier), int(f.mm_position.offset), int(f.mm_position.length)) for f in features or ()]
    return extra_keys(items, getattr(lora, "lora_name", None), salt, length)


def tp_rank_and_size(vllm_config: Any) -> tuple[int, int]:
    """This worker's tensor-parallel rank and size (vLLM's TP group exists by the time the
    worker-side connector is built: Worker.init_device runs first)."""
    size = int(vllm_config.parallel_config.tensor_parallel_size or 1)
    if size == 1:
        return 0, 1
    from vllm.distributed import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank()), size


# vLLM seeds these block hashes randomly per process unless PYTHONHASHSEED is set
# (resolve_none_hash_seed in vllm/v1/core/kv_cache_utils.py): not comparable across engines.
_PER_PROCESS_SEEDED = ("xxhash", "xxhash_cbor")


def fingerprint_form(vllm_config: Any, kv_cache_config: Any) -> tuple[str, int]:
    """(form, hash block size) of this engine's prompt fingerprints (core/prompt_digest.py):
    vLLM's own block hashes when another engine can reproduce them (EngineCore hashes every
    request's blocks when a KV connector is loaded, at kv_cache_config.hash_block_size, with
    --prefix-caching-hash-algo and a seed from PYTHONHASHSEED or vLLM's fixed default), else
    every token folded."""
    algo = str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "") or "")
    block = int(getattr(kv_cache_config, "hash_block_size", 0) or 0)
    seed = os.environ.get("PYTHONHASHSEED")
    if not algo or block <= 0 or (seed is None and algo in _PER_PROCESS_SEEDED):
        return TOKENS, 0
    if seed is None:
        from vllm.v1.core.kv_cache_utils import DEFAULT_NONE_HASH_SEED

        seed = DEFAULT_NONE_HASH_SEED
    return blocks_form(algo, block, hashlib.blake2b(seed.encode(), digest_size=4).hexdigest()), block


def prompt_fingerprint(request: Any, length: int, form: str = TOKENS, block_size: int = 0) -> str | None:
    """The fingerprint of a vLLM ``Request``'s first ``length`` prompt tokens in ``form``, or
    None if it cannot have one (prompt embeddings, or no block hashes for the blocks form)."""
    extra = prompt_extra_keys(request, length)
    tokens = request.prompt_token_ids
    if extra is None or tokens is None or len(tokens) < length:
        return None
    if form == TOKENS:
        return prompt_digest(tokens, length, extra)
    full = length // block_size
    hashes = getattr(request, "block_hashes", None) or ()
    if len(hashes) < full:
        return None
    chain = hashes[full - 1] if full else b""
    return prompt_digest(tokens, length, extra, form=form, chain=chain, chain_tokens=full * block_size)
