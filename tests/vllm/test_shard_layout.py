"""The shard layouts of engine/shard_layout.py on pages vLLM builds itself: vLLM's spec objects,
its KVCacheTensor placement and its page views (rig/vllm_pages.py). Every byte D's plan
copies must land on the unit (slot kind, KV head, token) vLLM's view says it belongs to, and
anything the code cannot place must be refused by name. Each layout has a negative control.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest
import torch

from pd_connector.core import shards
from rig.vllm_pages import LAYERS, Layers, copy_planned, plain_attention

vllm_kv = pytest.importorskip("vllm.v1.kv_cache_interface")
FullAttentionSpec, MLAAttentionSpec, MambaSpec = vllm_kv.FullAttentionSpec, vllm_kv.MLAAttentionSpec, vllm_kv.MambaSpec

PAIRS = [(1, 2), (2, 1), (1, 4), (4, 1), (2, 4), (4, 2), (4, 8), (8, 2)]
BLOCKS = {0: [(1, 3), (2, 4), (7, 9)], 1: [(5, 6)]}  # (P block, D block) per group
HEAD, BLOCK = 8, 4  # head size, tokens per page
HEAD_KV_BYTES = 2 * HEAD * 2 * BLOCK  # one head's K and V in a page (bf16)


def plain(pad_per_head: int = 0, **kw):
    return plain_attention(HEAD, BLOCK, pad_per_head, **kw)


def check_pair(model: Layers, p: int, d: int, tamper=None) -> None:
    """Every D rank after copying its plan holds, through vLLM's view, exactly what vLLM's view
    of the P rank holding each unit says, and its padding is untouched."""
    p_ranks = {r: model.rank(p, r, seed=100 + r) for r in range(p)}
    for rank in p_ranks.values():
        rank.fill({g: [s for s, _ in pairs] for g, pairs in BLOCKS.items()})
    for j in range(d):
        mine = model.rank(d, j, seed=7 + j)
        before = mine.mem().copy()
        ranks = shards.peer_ranks(p, d, j)
        copy_planned(mine, {r: p_ranks[r] for r in ranks}, BLOCKS, tamper)
        want = mine.expected(BLOCKS, before)
        bad = np.flatnonzero(mine.mem() != want)
        assert bad.size == 0, f"D rank {j} of {d} (P TP {p}): {bad.size} bytes differ, first at {bad[0]}"


# --- plain per-head KV ---------------------------------------------------------------------------


@pytest.mark.parametrize("p, d", PAIRS)
@pytest.mark.parametrize("kv_heads", [1, 2, 8])
@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
def test_plain_kv_heads_land_on_their_head_through_vllms_view(kv_heads, layout, p, d):
    check_pair(Layers(kv_heads, plain(), layout=layout), p, d)


@pytest.mark.parametrize("p, d", [(1, 2), (2, 1), (1, 4), (4, 2)])
@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
def test_padded_page_p_tp1_d_tp2_gives_each_d_rank_its_own_heads(layout, p, d):
    """Regression (issue #25, 1): a head's bytes were taken as page_size_bytes // heads, so with
    a padded page D rank 1 received half of head 1 and P's padding, and no size check failed."""
    check_pair(Layers(4, plain(pad_per_head=32), layout=layout), p, d)


def test_a_padded_page_read_one_head_off_is_caught():
    """Negative control for the padded-page oracle: the same plan read one head further into
    P's page fails the byte check."""

    def one_head_off(plans):
        return {rank: (local, tuple(_shift(r, HEAD_KV_BYTES) for r in remote)) for rank, (local, remote) in plans.items()}

    with pytest.raises(AssertionError, match="bytes differ"):
        check_pair(Layers(4, plain(pad_per_head=32)), 1, 2, one_head_off)


def _shift(region, by):
    return msgspec.structs.replace(region, addr=region.addr + by)


def test_padded_page_segments_hold_the_heads_own_bytes_not_a_share_of_the_page():
    rank = Layers(2, plain(pad_per_head=32)).rank(1, 0, seed=None)
    (seg,) = rank.regions[0].segments
    assert (seg.unit, seg.first, seg.count, seg.offset, seg.unit_bytes) == ("kv_head", 0, 2, 0, HEAD_KV_BYTES)
    assert rank.regions[0].page_bytes == 2 * (HEAD_KV_BYTES + 32)


def test_kernel_blocks_are_described_per_kernel_block():
    """vLLM splits a page into kernel blocks ([blocks x r, H, N/r, C]) when the backend cannot run
    the block size: each head is then r runs, one per kernel block."""
    model = Layers(4, plain(), kernel_block_size=2)
    segs = model.rank(2, 1, seed=None).regions[0].segments
    assert [(s.unit, s.first, s.count) for s in segs] == [("kv_head@0", 2, 2), ("kv_head@1", 2, 2)]
    for p, d in ((1, 2), (2, 1), (4, 1)):
        check_pair(model, p, d)


def test_a_kernel_block_read_as_a_whole_head_is_caught():
    """Negative control: describing a kernel-split page as one run per head (the rule before)
    puts other heads' tokens on D's heads."""
    model = Layers(4, plain(), kernel_block_size=2)
    p_ranks = {0: model.rank(1, 0, seed=1)}
    p_ranks[0].fill({g: [s for s, _ in pairs] for g, pairs in BLOCKS.items()})
    mine = model.rank(2, 1, seed=2)
    before = mine.mem().copy()
    per_head = p_ranks[0].regions[0].page_bytes // 4
    for rank in (*p_ranks.values(), mine):
        heads = 4 if rank is p_ranks[0] else 2
        rank.regions = [
            _with_segments(r, shards.attention_segments(4, rank.tp, rank.r, per_head)) for r in rank.regions
        ]
        assert heads * per_head == rank.regions[0].page_bytes
    copy_planned(mine, p_ranks, BLOCKS)
    assert np.flatnonzero(mine.mem() != mine.expected(BLOCKS, before)).size


def _with_segments(region, segments):
    return msgspec.structs.replace(region, segments=segments, reason="")


# --- pages whose slots are not heads, packed content, unknown layouts: refused -----------------


def flashinfer_nvfp4(spec):
    """FlashInferBackend.customize_spec for NVFP4 (vllm/v1/attention/backends/flashinfer.py):
    2H slots, all heads' K then all heads' V, each slot hs bytes per token (the backend itself
    needs flashinfer, absent on CPU)."""
    return dataclasses.replace(spec, num_head_slots=2 * spec.num_kv_heads, state_content_bytes=spec.head_size * 2)


def nvfp4_slots(tp, heads):
    return flashinfer_nvfp4(plain()(tp, heads))


def test_k_then_v_head_slots_are_refused_at_unequal_tp_not_read_as_heads():
    """Regression (issue #25, 2): FlashInfer's NVFP4 page (2H slots: all K, then all V) was
    sharded as if each 1/H of the page were one head's K and V, so at P TP 1 -> D TP 2 D's V
    slots received P's K. Now: no segments, and the pair is refused naming the layer and why."""
    model = Layers(2, nvfp4_slots, k_then_v_slots=True)
    try:
        check_pair(model, 1, 2)
    except shards.ShardError as exc:
        assert LAYERS[0] in str(exc) and "num_head_slots 2 for 1 KV heads" in str(exc)  # D rank's page
    else:
        pytest.fail("a K-then-V page was sharded across TP sizes (and passed the byte check)")


def test_k_then_v_slots_oracle_catches_a_page_read_as_per_head():
    """Negative control for that oracle: segments that take 1/H of the page as one head (the
    rule before) put P's V slots on D's K slots."""
    model = Layers(2, nvfp4_slots, k_then_v_slots=True)
    p0 = model.rank(1, 0, seed=1)
    p0.fill({g: [s for s, _ in pairs] for g, pairs in BLOCKS.items()})
    mine = model.rank(2, 1, seed=2)
    before = mine.mem().copy()
    for rank in (p0, mine):
        per_head = rank.regions[0].page_bytes // max(1, 2 // rank.tp)
        rank.regions = [_with_segments(r, shards.attention_segments(2, rank.tp, rank.r, per_head)) for r in rank.regions]
    copy_planned(mine, {0: p0}, BLOCKS)
    assert np.flatnonzero(mine.mem() != mine.expected(BLOCKS, before)).size


def attention(**kw):
    return lambda tp, heads: FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=HEAD, dtype=torch.bfloat16, **kw)


@pytest.mark.parametrize(
    "spec_of, reason",
    [
        (attention(state_content_bytes=2 * HEAD * 2 + 8), "state_content_bytes 40"),  # e.g. inline scales
        (attention(tokens_per_state=2), "tokens_per_state 2"),
        (
            lambda tp, h: vllm_kv.RSWASpec(block_size=BLOCK, num_kv_heads=h, head_size=HEAD, dtype=torch.bfloat16, rswa_window=8),
            "RSWASpec",
        ),
    ],
    ids=["packed_content", "tokens_per_state", "unknown_spec_class"],
)
def test_pages_the_code_cannot_place_get_no_segments_and_a_reason(spec_of, reason):
    rank = Layers(2, spec_of).rank(2, 0, seed=None)
    assert all(not r.segments and reason in r.reason for r in rank.regions)
    with pytest.raises(shards.ShardError, match=f"{LAYERS[0]}: .*not described per TP shard: .*{reason}"):
        shards.shard_regions(rank.regions, {0: rank.regions}, (0,))


def test_a_token_major_layout_is_refused():
    """LBNHC: a head's tokens are H x C apart, not one run."""
    rank = Layers(2, plain(), layout="LBNHC").rank(1, 0, seed=None)
    assert not rank.regions[0].segments and "a head is not one run" in rank.regions[0].reason
    # Control: the same spec on LBHNC is described.
    assert Layers(2, plain()).rank(1, 0, seed=None).regions[0].segments


# --- replicated content: read whole from one P rank ---------------------------------------------


def mla(tp, heads):
    # As MLAAttention.get_kv_cache_spec builds it (one latent head, max_tp_shards=1).
    return MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=24, dtype=torch.bfloat16, max_tp_shards=1)


@pytest.mark.parametrize("p, d", PAIRS)
def test_mla_latent_is_read_whole_from_one_p_rank_at_any_tp_ratio(p, d):
    """Regression (issue #25, 7): MLA got no segments, so every unequal-TP pair recomputed
    although any one P rank holds everything D needs."""
    check_pair(Layers(1, mla, replicated=True), p, d)


def test_mla_d_reads_from_the_first_p_rank_only_and_releases_the_others():
    model = Layers(1, mla, replicated=True)
    p_ranks = {r: model.rank(4, r, seed=None) for r in range(4)}
    plans = shards.shard_regions(model.rank(1, 0, seed=None).regions, {r: p.regions for r, p in p_ranks.items()}, (0, 1, 2, 3))
    assert len(plans[0][0]) == len(LAYERS) and all(plans[r] == ((), ()) for r in (1, 2, 3))


def test_mla_oracle_catches_a_read_from_the_wrong_block():
    """Negative control: the latent read one block further into P's pages fails."""

    def next_block(plans):
        return {rank: (local, tuple(_shift(r, r.block_stride) for r in remote)) for rank, (local, remote) in plans.items()}

    with pytest.raises(AssertionError, match="bytes differ"):
        check_pair(Layers(1, mla, replicated=True), 2, 1, next_block)


def test_an_mla_spec_without_vllms_replica_promise_is_refused():
    """Control on the rule: the replication is vLLM's ``max_tp_shards == 1``, not the class."""
    spec_of = lambda tp, h: MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=24, dtype=torch.bfloat16)  # noqa: E731
    rank = Layers(1, spec_of, replicated=True).rank(2, 0, seed=None)
    assert not rank.regions[0].segments and "MLAAttentionSpec" in rank.regions[0].reason


def test_tp_replicated_mamba_state_is_one_replicated_unit_per_state():
    from pd_connector.engine.from_vllm.shard_layout import describe_shards
    from pd_connector.core.protocol import LayerRegion

    spec = MambaSpec(block_size=16, shapes=((3, 8), (2, 4)), dtypes=(torch.bfloat16, torch.float32), tp_replicated=True)
    config = vllm_kv.KVCacheConfig(1, [], [vllm_kv.KVCacheGroupSpec(["m.0"], spec)])
    regions = [LayerRegion("m.0#0", 0, 0, 4096, 48, 4), LayerRegion("m.0#1", 0, 48, 4096, 32, 4)]
    out = describe_shards(None, config, (0,), regions, 1, 2, {})
    assert [r.segments for r in out] == [shards.replicated_segments(48), shards.replicated_segments(32)]
    plans = shards.shard_regions(out, {0: out, 1: out}, (0, 1))
    assert [x.page_bytes for x in plans[0][0]] == [48, 32] and plans[1] == ((), ())
    # Control: the same state without tp_replicated is not read whole.
    sharded = dataclasses.replace(spec, tp_replicated=False)
    config = vllm_kv.KVCacheConfig(1, [], [vllm_kv.KVCacheGroupSpec(["m.0"], sharded)])
    no_modules = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context={}))
    out = describe_shards(no_modules, config, (0,), regions, 1, 2, {})
    assert all(shards.REPLICATED not in {s.unit for s in r.segments} for r in out)


# --- layers with different KV-head counts --------------------------------------------------------


def heterogeneous_arch(heads: list[int]):
    """A real ModelArchitectureConfig of a checkpoint whose layers' KV-head counts differ."""
    from vllm.config.model_arch import ModelArchitectureConfig

    base = ModelArchitectureConfig(
        architectures=["LlamaForCausalLM"], model_type="llama", text_model_type=None, hidden_size=64,
        total_num_hidden_layers=len(heads), total_num_attention_heads=8, head_size=HEAD, vocab_size=128,
        total_num_kv_heads=heads[0], num_experts=0, num_experts_per_token=0, quantization_config=None,
        is_deepseek_mla=False, is_mm_prefix_lm=False, rswa_window=None, derived_max_model_len_and_key=(2048.0, None),
    )
    return ModelArchitectureConfig.from_layers([dataclasses.replace(base, total_num_kv_heads=h) for h in heads])


@pytest.mark.parametrize("p, d", [(1, 2), (2, 1), (1, 4), (4, 1), (2, 4)])
def test_layers_with_different_kv_head_counts_are_each_sharded_by_their_own_count(p, d):
    """Regression (issue #25, 7): the model's single KV-head count was taken for every layer, so
    a layer with another count got no segments and the pair was refused."""
    heads = [8, 2]
    model = Layers(8, plain(), heads_of=dict(zip(LAYERS, heads)), arch=heterogeneous_arch(heads))
    check_pair(model, p, d)


def test_a_head_count_the_config_cannot_decide_is_refused():
    """Both a layer of 8 heads and one of 2 leave one head per rank at TP 8: without the
    layer's index the count is ambiguous, so the layer is refused, not guessed."""
    with pytest.raises(shards.ShardError, match=r"fit several head counts of the model \(\[2, 8\]\)"):
        shards.layer_kv_heads(1, 8, [8, 2])
    assert shards.layer_kv_heads(4, 2, [8, 2]) == 8  # control: more than one head decides
