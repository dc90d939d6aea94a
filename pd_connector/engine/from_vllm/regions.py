"""vLLM's KV-cache placement as the page map NIXL registers: one region per layer, and per
state of a Mamba layer."""

from __future__ import annotations

import math
from typing import Any

import msgspec

from pd_connector.core.settings import UnsupportedConfig
from pd_connector.core.protocol import LayerRegion


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
