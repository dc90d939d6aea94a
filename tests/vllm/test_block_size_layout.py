"""Attention blocks of different sizes on P and D, through vLLM's own pages: vLLM builds each
rank's spec, placement and page views (rig/vllm_pages.py) at P's and D's block size,
the connector describes them (``describe_shards``, with the token layout of vLLM's CPU attention
backend and ISA) and plans the re-cut (``block_phases.peer_regions``, ``route_pairs``); the
copy is done as a READ would, piece by piece. The oracle is vLLM's own CPU kernel: it writes
the prompt's K and V into P's blocks, and into a fresh D rank's blocks for the tokens D loads;
D's memory after the copy must equal that, byte for byte. A plan one phase off, and a page
planned as if K and V of a token sat together, are caught. Both layouts vLLM CPU writes are
checked: the "vec" kernels' (forced, as on a host without AMX) and, on a host with AMX tiles,
the "amx" kernels' VNNI tiles (bf16 and fp8 pages), each also planned as the other (caught).
"""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np
import pytest
import torch

from pd_connector.core import block_phases, pairing, shards
from pd_connector.core.pairing import ATTENTION, GroupLayout
from rig.vllm_pages import Layers, plain_attention

pytest.importorskip("vllm.v1.kv_cache_interface")
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend  # noqa: E402

def _cpu_kernels() -> bool:
    import vllm._custom_ops  # noqa: F401  (loads vLLM's compiled ops)

    return hasattr(torch.ops._C, "cpu_attn_reshape_and_cache")


# vLLM 0.33's CUDA wheel (the in-process step of CI) ships no CPU attention kernels.
needs_cpu_kernels = pytest.mark.skipif(not _cpu_kernels(), reason="this vLLM build has no CPU attention kernels")

HEAD_SIZE = 32  # vLLM CPU's vec kernels want a multiple of 32 (16 picks vec16)
TOTAL_HEADS = 4
MAX_TOKENS = 1024
# Read before any fixture patches it: whether vLLM's AMX kernels can run here.
HOST_HAS_AMX = torch.cpu._is_amx_tile_supported()
needs_amx = pytest.mark.skipif(not HOST_HAS_AMX, reason="this host has no AMX tiles (torch.cpu._is_amx_tile_supported)")
CACHE_DTYPE = {"auto": torch.bfloat16, "fp8": torch.uint8}  # vLLM's fp8 KV cache pages are uint8
AMX = block_phases.token_layout_name(block_phases.AMX_VNNI, HEAD_SIZE)
VEC = block_phases.token_layout_name(block_phases.K_COLUMNS_V_ROWS, HEAD_SIZE)


@pytest.fixture(autouse=True)
def vec_host(monkeypatch):
    """Tests check the vec kernels' layout unless they ask for ``amx_host``: vLLM picks AMX for a
    bf16 model on a host with AMX tiles (``_get_attn_isa`` asks ``torch.cpu._is_amx_tile_supported``),
    so run as on one without."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)


@pytest.fixture
def amx_host(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)


def model(kv_heads: int, block: int, cache: str = "auto") -> Layers:
    spec_of = plain_attention(head_size=HEAD_SIZE, block_size=block, dtype=CACHE_DTYPE[cache])
    return Layers(kv_heads, spec_of, backend=CPUAttentionBackend)


def write_kv(
    rank, name: str, heads: list[int], blocks: list[int], block: int, tokens: int, cache_dtype: str = "auto"
) -> None:
    """The prompt's K and V of ``tokens`` tokens for global ``heads`` into ``blocks`` (token t
    in ``blocks[t // block]``), written by vLLM's own CPU kernel (``cpu_attn_reshape_and_cache``
    with the ISA the backend picks), as the model's forward pass writes them."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    gen = torch.Generator().manual_seed(sum(name.encode()))
    # Generated for the longest prompt, then cut: every rank sees the same token's K and V.
    key, value = (torch.randn(MAX_TOKENS, TOTAL_HEADS, HEAD_SIZE, generator=gen).to(torch.bfloat16)[:tokens] for _ in range(2))
    cache = rank.views[name]
    n_blocks, n_heads, n_tokens, _ = cache.shape
    key_cache, value_cache = cache.view(n_blocks, n_heads, 2 * n_tokens, -1).chunk(2, dim=2)
    t = torch.arange(tokens)
    slots = torch.tensor(blocks, dtype=torch.int64)[t // block] * block + t % block
    isa = _get_attn_isa(torch.bfloat16, block, HEAD_SIZE, cache_dtype)
    k, v = key[:, heads].contiguous(), value[:, heads].contiguous()
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa, 1.0, 1.0, cache_dtype)


def rank_heads(layers: Layers, tp: int, r: int) -> list[int]:
    slots = max(1, layers.kv_heads // tp)
    return [layers.slot_label(layers.layers[0], tp, r, s, slots) for s in range(slots)]


def run(
    p: int, d: int, bp: int, bd: int, offset: int, kv_heads: int = TOTAL_HEADS, tamper=None, declared: str = "",
    cache: str = "auto", expect: str = "",
) -> None:
    """Hand the first ``offset`` prompt tokens from P (TP ``p``, blocks of ``bp``) to every D
    rank (TP ``d``, blocks of ``bd``); each D rank's memory must then equal a fresh rank into
    which vLLM's kernel wrote the tokens D loaded (every sub-block up to ``offset``) itself.
    ``declared``: plan with this token layout instead of the one described (negative control);
    ``expect``: the token layout both sides must have been described with; ``cache``: vLLM's
    KV cache dtype ("auto": the bf16 model's, or "fp8")."""

    def regions(rank):
        if not declared:
            return rank.regions
        return [msgspec.structs.replace(r, token_layout=declared) for r in rank.regions]

    p_model, d_model = model(kv_heads, bp, cache), model(kv_heads, bd, cache)
    p_ranks = {r: p_model.rank(p, r, seed=None, num_blocks=16) for r in range(p)}
    p_table = list(range(3, 3 + pairing.cdiv(offset, bp)))
    for r, rank in p_ranks.items():
        if expect:
            assert {x.token_layout for x in rank.regions} == {expect}
        for name in p_model.layers:
            write_kv(rank, name, rank_heads(p_model, p, r), p_table, bp, len(p_table) * bp, cache)
    plan = block_phases.PhasePlan.of([bp], [bd], [ATTENTION])
    small = min(bp, bd)
    for j in range(d):
        mine = d_model.rank(d, j, seed=None, num_blocks=16)
        reference = d_model.rank(d, j, seed=None, num_blocks=16)
        if expect:
            assert {x.token_layout for x in mine.regions} == {expect}
        d_table = list(range(2, 2 + pairing.cdiv(offset, bd)))
        for name in d_model.layers:
            write_kv(reference, name, rank_heads(d_model, d, j), d_table, bd, pairing.cdiv(offset, small) * small, cache)
        pairs = pairing.pair_block_lists((GroupLayout(ATTENTION, bd),), [p_table], (d_table,), offset, 0, remote_block_sizes=[bp])
        order = shards.peer_ranks(p, d, j)
        plans = block_phases.peer_regions(regions(mine), {r: regions(p_ranks[r]) for r in order}, order, p == d, plan, [bd], [bp])
        if tamper is not None:
            pairs = tamper(pairs)
        routed = block_phases.route_pairs(pairs, plan)
        for r, (local, remote) in plans.items():
            src_rank = p_ranks[r]
            for lo, re_ in zip(local, remote):
                for src, dst in routed[lo.group]:
                    at, frm = lo.addr - mine.base + dst * lo.block_stride, re_.addr - src_rank.base + src * re_.block_stride
                    mine.mem()[at : at + lo.page_bytes] = src_rank.mem()[frm : frm + re_.page_bytes]
        bad = np.flatnonzero(mine.mem() != reference.mem())
        assert bad.size == 0, f"D rank {j}: {bad.size} bytes differ from vLLM's own write, first at {bad[:4].tolist()}"
        mine.close()
        reference.close()


@needs_cpu_kernels
@pytest.mark.parametrize("bp, bd", [(32, 64), (64, 32), (32, 128), (96, 32)])
@pytest.mark.parametrize("p, d", [(1, 1), (1, 2), (2, 1)])
def test_d_holds_ps_k_and_v_of_every_token_it_loaded_through_vllms_cpu_view(p, d, bp, bd):
    run(p, d, bp, bd, offset=150)


def test_cpu_attention_pages_get_the_vec_kernels_token_layout():
    rank = model(4, 32).rank(1, 0, seed=None)
    want = block_phases.token_layout_name(block_phases.K_COLUMNS_V_ROWS, HEAD_SIZE)
    assert {r.token_layout for r in rank.regions} == {want}


def fp8_cache_model(model_dir: str, model_dtype: str, isa_on_layers: bool = True) -> Layers:
    """The tiny Llama (2 KV heads of 32) as ``model_dtype`` with an fp8 KV cache (uint8 pages),
    its attention layers built by vLLM (backend chosen by the platform) and, as the model runner
    does before register_kv_caches, vLLM's metadata builder run on them (it sets each layer's ISA)."""
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.attention.attention import Attention

    block = 32
    config = VllmConfig(
        model_config=ModelConfig(model=model_dir, dtype=model_dtype, seed=0, max_model_len=256),
        cache_config=CacheConfig(block_size=block, cache_dtype="fp8"),
        device_config=DeviceConfig("cpu"),
    )
    layers = Layers(2, plain_attention(head_size=HEAD_SIZE, block_size=block, dtype=torch.uint8), vllm_config=config)
    with set_current_vllm_config(config):
        for name in layers.layers:
            Attention(4, HEAD_SIZE, HEAD_SIZE**-0.5, 2, cache_config=config.cache_config, prefix=name)
        if isa_on_layers:
            spec = layers.spec_of(1, 2)
            CPUAttentionBackend.get_builder_cls()(spec, list(layers.layers), config, torch.device("cpu"))
    return layers


@pytest.mark.parametrize("isa_on_layers", [True, False], ids=["layer_isa", "model_dtype_rule"])
def test_fp8_cache_of_a_bf16_model_on_an_amx_host_gets_the_amx_layout_not_vec(model_dir, amx_host, isa_on_layers):
    """vLLM CPU picks the ISA by the model's dtype (bf16: AMX), not the fp8 cache's uint8: labelled
    vec, P's AMX pages would be cut as vec pages. Read off the layer, or by vLLM's rule without it."""
    rank = fp8_cache_model(model_dir, "bfloat16", isa_on_layers).rank(1, 0, seed=None)
    assert {r.token_layout for r in rank.regions} == {AMX}


def test_the_isa_vllm_set_on_the_layer_is_read_not_derived_again(model_dir, amx_host, monkeypatch):
    """The layer's own choice wins: here the host "changes" after vLLM chose, and the rule,
    applied again, would now say vec."""
    layers = fp8_cache_model(model_dir, "bfloat16")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert {r.token_layout for r in layers.rank(1, 0, seed=None).regions} == {AMX}


def test_negative_control_the_kv_cache_dtype_would_have_picked_vec(model_dir, amx_host):
    """The old rule (the spec's uint8 through vLLM's _get_attn_isa) gives vec on the same host, and
    an fp16 model's fp8 pages are vec: the layout above follows the model dtype, not a constant."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    spec = plain_attention(head_size=HEAD_SIZE, block_size=32, dtype=torch.uint8)(1, 2)
    assert _get_attn_isa(spec.dtype, spec.block_size, spec.head_size, "fp8") == "vec"
    rank = fp8_cache_model(model_dir, "float16").rank(1, 0, seed=None)
    assert {r.token_layout for r in rank.regions} == {block_phases.token_layout_name(block_phases.K_COLUMNS_V_ROWS, HEAD_SIZE)}


def test_a_backend_whose_token_layout_is_unknown_is_refused_by_name():
    """A page of another backend (here: no backend known) is not re-cut: the refusal names it."""
    p = dataclasses.replace(model(4, 64), backend=None).rank(1, 0, seed=None)
    d = model(4, 32).rank(1, 0, seed=None)
    plan = block_phases.PhasePlan.of([64], [32], [ATTENTION])
    with pytest.raises(block_phases.BlockSizeError, match="token layout"):
        block_phases.peer_regions(d.regions, {0: p.regions}, [0], True, plan, [32], [64])


@needs_cpu_kernels
def test_negative_control_pairs_one_phase_off_are_caught():
    def one_phase_off(pairs):
        g = pairs[0]
        return [pairing.BlockPairs(g.remote, g.local, [(x + 1) % 2 for x in g.phases])]

    with pytest.raises(AssertionError, match="differ"):
        run(1, 1, 64, 32, offset=150, tamper=one_phase_off)


@needs_cpu_kernels
def test_negative_control_cpu_pages_planned_as_interleaved_are_caught():
    """The same pages planned as if a token's K and V sat together (FlashAttention's layout)."""
    with pytest.raises(AssertionError, match="differ"):
        run(1, 1, 64, 32, offset=150, declared=block_phases.INTERLEAVED)



@needs_cpu_kernels
@needs_amx
@pytest.mark.parametrize("bp, bd", [(32, 64), (64, 32), (32, 128), (96, 32)])
@pytest.mark.parametrize("p, d", [(1, 1), (1, 2), (2, 1)])
def test_amx_pages_d_holds_ps_k_and_v_of_every_token_it_loaded(amx_host, p, d, bp, bd):
    """vLLM's AMX kernels (a bf16 model, blocks of multiples of 32, on this AMX host) pack K and
    V in VNNI tiles of 16 tokens: cut at whole tiles, D's pages are what the kernel writes there."""
    run(p, d, bp, bd, offset=150, expect=AMX)


@needs_cpu_kernels
@needs_amx
@pytest.mark.parametrize("bp, bd", [(32, 64), (128, 32)])
def test_amx_fp8_pages_are_cut_alike(amx_host, bp, bd):
    """A bf16 model's fp8 KV cache on an AMX host: the AMX kernels write the same layout in
    elements of one byte, so the same cut holds."""
    run(1, 1, bp, bd, offset=150, cache="fp8", expect=AMX)


@needs_cpu_kernels
@needs_amx
def test_negative_control_amx_pairs_one_phase_off_are_caught(amx_host):
    def one_phase_off(pairs):
        g = pairs[0]
        return [pairing.BlockPairs(g.remote, g.local, [(x + 1) % 2 for x in g.phases])]

    with pytest.raises(AssertionError, match="differ"):
        run(1, 1, 64, 32, offset=150, tamper=one_phase_off, expect=AMX)


@needs_cpu_kernels
@needs_amx
@pytest.mark.parametrize("bp, bd", [(64, 32), (32, 64)])
def test_negative_control_amx_pages_planned_as_vec_are_caught(amx_host, bp, bd):
    with pytest.raises(AssertionError, match="differ"):
        run(1, 1, bp, bd, offset=150, declared=VEC)


@needs_cpu_kernels
def test_negative_control_vec_pages_planned_as_amx_are_caught():
    with pytest.raises(AssertionError, match="differ"):
        run(1, 1, 64, 32, offset=150, declared=AMX, expect=VEC)


def test_cpu_attention_pages_get_the_amx_layout_on_an_amx_host(amx_host):
    assert {r.token_layout for r in model(4, 32).rank(1, 0, seed=None).regions} == {AMX}
