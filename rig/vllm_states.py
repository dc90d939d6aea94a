"""One tensor-parallel rank's recurrent-state pages built by vLLM itself, for the state shard
layouts (tests/vllm/test_state_shard_layout.py).

vLLM builds everything: the layer (``MambaMixer``, ``MambaMixer2``, ``ShortConv``, Qwen3-Next's
GDN, Kimi Linear's KDA, MiniMax's linear attention) at the rank's TP size and rank (a stand-in TP group, as
``get_tensor_model_parallel_world_size`` / ``_rank`` read it), its ``MambaSpec``
(``get_kv_cache_spec``, padded with ``mamba_page_size_padded``), the placement, the page views
(``allocate_kv_cache``) and the per-state tensors (``bind_kv_cache``). The connector describes
the pages (``regions_from_kv_caches``, ``describe_shards``).

The oracle never uses the segments under test: which global channel or head each row of a
rank's state holds is read off the layer's own parameters after loading a checkpoint whose rows
are numbered, through the layer's own weight loaders (the conv weight's rows are the conv
state's channels, ``D`` / ``A_log`` / the decay slopes the SSM heads'). Every byte of a state is
written through vLLM's state tensor as a function of (global unit, position in it, block).
"""

from __future__ import annotations

import contextlib
import zlib
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
import torch

from pd_connector.core.protocol import LayerRegion

LAYERS = ("model.layers.0.mixer", "model.layers.1.mixer")
_MODEL = SimpleNamespace(dtype=torch.bfloat16)  # conv states bf16; SSM states float32 (below)


@contextlib.contextmanager
def tensor_parallel(tp: int, rank: int):
    """vLLM's TP group as its layers read it at construction (size and rank only)."""
    from vllm.distributed import parallel_state

    saved = parallel_state._TP
    parallel_state._TP = SimpleNamespace(world_size=tp, rank_in_group=rank, rank=rank, local_rank=rank)
    try:
        yield
    finally:
        parallel_state._TP = saved


def vllm_config() -> Any:
    from vllm.config import DeviceConfig, VllmConfig

    config = VllmConfig(device_config=DeviceConfig("cpu"))
    config.cache_config.mamba_block_size = 16
    config.cache_config.mamba_ssm_cache_dtype = "float32"
    return config


def _numbered(rows: int, *tail: int) -> torch.Tensor:
    """A checkpoint tensor whose row i holds i + 1 everywhere."""
    return (torch.arange(rows, dtype=torch.float32) + 1).view(rows, *([1] * len(tail))).expand(rows, *tail).contiguous()


def _rows(param: torch.Tensor) -> np.ndarray:
    """The checkpoint row each of ``param``'s rows came from."""
    return param.detach().reshape(param.shape[0], -1)[:, 0].numpy().astype(np.int64) - 1


def _load(param: torch.Tensor, weight: torch.Tensor, *shard: int) -> None:
    param.weight_loader(param, weight, *shard)


# --- the layers -------------------------------------------------------------------------------
# Each family: build(config, prefix) -> module, and units(module) -> per state, the global unit of
# each channel (conv) or of each row of the outermost axis (other states).


def _mamba1(config, prefix):
    from vllm.model_executor.layers.mamba.mamba_mixer import MambaMixer

    return MambaMixer(
        hidden_size=64, ssm_state_size=16, conv_kernel_size=4, intermediate_size=128, time_step_rank=8,
        use_conv_bias=True, use_bias=False, use_rms_norm=True, model_config=_MODEL,
        cache_config=config.cache_config, prefix=prefix,
    )  # fmt: skip


def _mamba1_units(m):
    _load(m.conv1d.weight, _numbered(m.intermediate_size, 1, m.conv_kernel_size))
    _load(m.D, _numbered(m.intermediate_size))
    return [_rows(m.conv1d.weight), _rows(m.D)]


def _mamba2(groups: int):
    def build(config, prefix):
        from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2

        return MambaMixer2(
            hidden_size=64, ssm_state_size=16, conv_kernel_size=4, intermediate_size=128,
            use_conv_bias=True, use_bias=False, n_groups=groups, num_heads=8, head_dim=16,
            model_config=_MODEL, cache_config=config.cache_config, prefix=prefix,
        )  # fmt: skip

    return build


def _mamba2_units(m):
    groups = 1 if type(m.conv1d).__name__ != "MergedColumnParallelLinear" else m.n_groups
    _load(m.conv1d.weight, _numbered(m.intermediate_size + 2 * groups * m.ssm_state_size, 1, m.conv_kernel_size))
    _load(m.D, _numbered(m.num_heads))
    return [_rows(m.conv1d.weight), _rows(m.D)]


def _short_conv(config, prefix):
    from vllm.model_executor.layers.mamba.short_conv import ShortConv

    hf = SimpleNamespace(conv_L_cache=3, conv_bias=False)
    return ShortConv(hf, dim=64, layer_idx=0, model_config=_MODEL, cache_config=config.cache_config, prefix=prefix)


def _short_conv_units(m):
    _load(m.conv.weight, _numbered(m.conv_dim, 1, m.L_cache))
    return [_rows(m.conv.weight)]


def _kda(config, prefix):
    from vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn import KimiGatedDeltaNetAttention

    hf = SimpleNamespace(
        hidden_size=64, hidden_act="silu", rms_norm_eps=1e-6,
        linear_attn_config={"head_dim": 32, "num_heads": 4, "short_conv_kernel_size": 4},
    )  # fmt: skip
    module = KimiGatedDeltaNetAttention(hf, config, prefix=prefix)
    module.model_config = _MODEL  # read by get_state_dtype (vLLM's ModelConfig needs a model)
    return module


def _kda_units(m):
    proj = m.num_heads * m.head_dim
    for part in range(3):  # the checkpoint's q_conv1d, k_conv1d, v_conv1d: rows numbered apart
        _load(m.conv1d.weight, _numbered(proj, 1, m.conv_size) + part * proj, part)
    _load(m.A_log, _numbered(m.num_heads))
    return [_rows(m.conv1d.weight), _rows(m.A_log)]


def _gdn(config, prefix):
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

    hf = SimpleNamespace(
        hidden_size=64, hidden_act="silu", rms_norm_eps=1e-6, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
    )  # fmt: skip
    config.model_config = SimpleNamespace(dtype=_MODEL.dtype, hf_text_config=hf, hf_config=hf)  # read at init
    return QwenGatedDeltaNetAttention(hf, config, prefix=prefix)


def _gdn_units(m):
    _load(m.conv1d.weight, _numbered(2 * m.num_k_heads * m.head_k_dim + m.num_v_heads * m.head_v_dim, 1, m.conv_kernel_size))
    _load(m.A_log, _numbered(m.num_v_heads))
    return [_rows(m.conv1d.weight), _rows(m.A_log)]


def _linear(config, prefix):
    from vllm.model_executor.layers.mamba.linear.minimax_linear_attn import MiniMaxText01LinearAttention

    hf = SimpleNamespace(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, head_dim=32)
    module = MiniMaxText01LinearAttention(hf, config, prefix=prefix)
    module.model_config = _MODEL
    return module


def _linear_units(m):
    # Each head has its own decay slope; the rank's slopes are its heads' (tp_slope).
    slopes = m.slope_rate.numpy()
    return [np.array([int(np.argmin(np.abs(slopes - s))) for s in m.tp_slope.numpy()])]


@dataclass
class Family:
    build: Callable[[Any, str], Any]
    units: Callable[[Any], list]
    layers: tuple[str, ...] = LAYERS
    padding: int = 48  # page_size_padded: bytes after the states, never read or written

    def rank(self, tp: int, r: int, seed: int | None, num_blocks: int = 8) -> "StateRank":
        return StateRank(self, tp, r, seed, num_blocks)


FAMILIES = {
    "mamba1": Family(_mamba1, _mamba1_units),
    "mamba2_g1": Family(_mamba2(1), _mamba2_units),
    "mamba2_g4": Family(_mamba2(4), _mamba2_units),
    "short_conv": Family(_short_conv, _short_conv_units),
    "kda": Family(_kda, _kda_units),
    "gdn": Family(_gdn, _gdn_units),
    "minimax_linear": Family(_linear, _linear_units),
}


class StateRank:
    """One TP rank: vLLM's layers, allocation and state tensors, the connector's page map."""

    def __init__(self, family: Family, tp: int, r: int, seed: int | None, num_blocks: int):
        from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, compute_layout_strides
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.worker.utils import allocate_kv_cache

        from pd_connector.engine.from_vllm.regions import regions_from_kv_caches
        from pd_connector.engine.from_vllm.shard_layout import describe_shards

        from vllm.config import set_current_vllm_config

        self.tp, self.r, self.num_blocks = tp, r, num_blocks
        self.config = config = vllm_config()
        with tensor_parallel(tp, r), set_current_vllm_config(config):
            self.modules = {name: family.build(config, name) for name in family.layers}
            self.units = {name: family.units(m) for name, m in self.modules.items()}
            first = next(iter(self.modules.values()))
            config.cache_config.mamba_page_size_padded = first.get_kv_cache_spec(config).page_size_bytes + family.padding
            self.spec = first.get_kv_cache_spec(config)
            layout = KVCacheLayout.LBHNC
            names = list(family.layers)
            layer_stride, block_stride, *_ = compute_layout_strides(self.spec, num_blocks, len(names), layout)
            size = len(names) * layer_stride if layout.is_layer_compact else block_stride * num_blocks
            tensors = [KVCacheTensor(size, names, layer_stride, block_stride, 0)]
            self.kv_cache_config = KVCacheConfig(num_blocks, tensors, [KVCacheGroupSpec(names, self.spec)])
            self.views = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"), layout)
            for name, module in self.modules.items():
                module.bind_kv_cache(self.views[name])
            self.flat = torch.empty(0, dtype=torch.uint8).set_(next(iter(self.views.values())).untyped_storage())
            if seed is not None:
                self.flat.numpy()[:] = np.random.default_rng(seed).integers(0, 256, self.flat.numel(), dtype=np.uint8)
            _, regions = regions_from_kv_caches(self.kv_cache_config, self.views, (0,))
            self.regions: list[LayerRegion] = describe_shards(config, self.kv_cache_config, (0,), regions, r, tp, self.views)
        self.base = self.flat.data_ptr()

    def mem(self) -> np.ndarray:
        return self.flat.numpy()

    def _write(self, name: str, src: int, dst: int) -> None:
        """Block ``dst``'s states, through vLLM's state tensors, as global block ``src`` holds them."""
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

        module = self.modules[name]
        has_conv = type(module).__name__ not in ("MiniMaxText01LinearAttention",)
        for i, state in enumerate(module.kv_cache):
            block = state[dst]  # this state's per-block shape, vLLM's orientation
            raw = block.view(torch.uint8).view(*block.shape, block.element_size())
            labels = self.units[name][i]
            if has_conv and i == 0:  # (rows, channels) in SD, (channels, rows) in DS
                dim_first = is_conv_state_dim_first()
                channels = raw.shape[0] if dim_first else raw.shape[1]
                assert len(labels) == channels, (name, len(labels), tuple(raw.shape))
                t, c = np.meshgrid(np.arange(raw.shape[1 if dim_first else 0]), labels, indexing="ij")
                unit, pos = (c.T, t.T) if dim_first else (c, t)
            else:  # outermost axis: the unit; the rest its content
                inner = int(np.prod(raw.shape[1:-1], dtype=np.int64))
                assert len(labels) == raw.shape[0], (name, len(labels), tuple(raw.shape))
                unit = np.repeat(labels, inner).reshape(raw.shape[:-1])
                pos = np.tile(np.arange(inner), len(labels)).reshape(raw.shape[:-1])
            salt = zlib.crc32(f"{name}#{i}".encode()) % 251
            byte = np.arange(raw.shape[-1])
            values = (salt + unit[..., None] * 131 + pos[..., None] * 17 + byte * 7 + src * 31) % 251
            raw.copy_(torch.from_numpy(values.astype(np.uint8)))

    def expected(self, pairs: dict[int, list[tuple[int, int]]], before: np.ndarray | None = None) -> np.ndarray:
        """This rank's allocation with P block ``src``'s states written into block ``dst`` of every
        layer for each (src, dst) of ``pairs[0]`` (``before`` elsewhere: padding, other blocks)."""
        saved = self.mem().copy()
        if before is not None:
            self.mem()[:] = before
        for name in self.modules:
            for src, dst in pairs.get(0, ()):
                self._write(name, src, dst)
        out = self.mem().copy()
        self.mem()[:] = saved
        return out

    def fill(self, blocks: dict[int, list[int]]) -> None:
        self.mem()[:] = self.expected({g: [(b, b) for b in ids] for g, ids in blocks.items()})


def check_pair(model: Any, p: int, d: int, blocks: dict[int, list[tuple[int, int]]], tamper=None) -> None:
    """Every D rank of TP ``d`` after copying its plan against P at TP ``p`` holds, through vLLM's
    views, exactly what the P rank holding each unit held, and nothing else changed (padding,
    other blocks). ``model``: anything with ``rank(tp, r, seed)`` (a ``Family``, vllm_pages'
    ``Layers``)."""
    from pd_connector.core import shards
    from rig.vllm_pages import copy_planned

    p_ranks = {r: model.rank(p, r, seed=100 + r) for r in range(p)}
    for rank in p_ranks.values():
        rank.fill({g: [s for s, _ in pairs] for g, pairs in blocks.items()})
    for j in range(d):
        mine = model.rank(d, j, seed=7 + j)
        before = mine.mem().copy()
        copy_planned(mine, {r: p_ranks[r] for r in shards.peer_ranks(p, d, j)}, blocks, tamper)
        bad = np.flatnonzero(mine.mem() != mine.expected(blocks, before))
        assert bad.size == 0, f"D rank {j} of {d} (P TP {p}): {bad.size} bytes differ, first at {bad[0]}"
