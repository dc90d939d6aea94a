"""The recurrent-state shard layouts of engine/from_vllm/recurrent_layouts.py on states vLLM builds
itself: vLLM's layer classes at each TP size and rank, their MambaSpec, placement, page views and
state tensors (rig/vllm_states.py). Every byte of every D page must hold what the P rank
holding the same global channel or head held, the owner read off the layer's own loaded weights,
in both conv-state orientations (SD, DS); a plan one channel or one head off must fail; a layer
the code cannot place must be refused by name and reason.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import msgspec
import pytest
import torch

from pd_connector.core import shards
from rig.vllm_states import FAMILIES, LAYERS, Family, check_pair

mamba_utils = pytest.importorskip("vllm.model_executor.layers.mamba.mamba_utils")

PAIRS = [(1, 2), (2, 1), (1, 4), (4, 1), (2, 4), (4, 2)]
BLOCKS = {0: [(1, 3), (2, 4), (5, 6)]}  # (P block, D block)


@pytest.fixture(params=["SD", "DS"])
def conv_layout(request, monkeypatch):
    """vLLM's conv-state orientation (VLLM_SSM_CONV_STATE_LAYOUT), for the layers' shapes, the
    connector's regions and segments, and the oracle alike."""
    monkeypatch.setattr(mamba_utils, "get_conv_state_layout", lambda: request.param)
    return request.param


@pytest.mark.parametrize("p, d", PAIRS)
@pytest.mark.parametrize("family", ["mamba1", "short_conv", "kda"])
def test_new_state_layouts_land_every_byte_on_its_channel_and_head(family, p, d, conv_layout):
    """Regression (issue #29, 2): Mamba1 (Jamba), short convolutions (LFM2) and KDA (Kimi Linear)
    had no segments, so every unequal-TP pair of those models recomputed."""
    check_pair(FAMILIES[family], p, d, BLOCKS)


@pytest.mark.parametrize("p, d", PAIRS)
@pytest.mark.parametrize("family", ["mamba2_g1", "mamba2_g4", "gdn", "minimax_linear"])
def test_mamba2_gdn_and_linear_attention_from_vllms_own_layers(family, p, d, conv_layout):
    """Mamba2 with one group (replicated over the TP ranks) and with four, Qwen3-Next's GDN (two
    key heads, four value heads) and MiniMax's linear attention, placed by the layer's class and
    checked on vLLM's own layers."""
    check_pair(FAMILIES[family], p, d, BLOCKS)


def _shift(state: str, by):
    """A tamper: every piece of state ``state`` read ``by(region)`` bytes further into P's page."""

    def tamper(plans):
        return {
            rank: (local, tuple(
                msgspec.structs.replace(r, addr=r.addr + by(r)) if f"#{state}@" in r.name else r for r in remote
            ))
            for rank, (local, remote) in plans.items()
        }  # fmt: skip

    return tamper


def _elem(family: str, state: int) -> int:
    spec = FAMILIES[family].rank(1, 0, seed=None).spec
    return torch.empty((), dtype=spec.dtypes[state]).element_size()


@pytest.mark.parametrize("family", ["mamba1", "short_conv", "kda", "gdn", "mamba2_g1"])
def test_a_conv_state_read_one_channel_off_is_caught(family, conv_layout):
    """Negative control: the same plan with P's conv state read one channel further (one element
    in SD, one channel's rows in DS) fails the byte check."""
    rank = FAMILIES[family].rank(1, 0, seed=None)
    rows = rank.spec.shapes[0][1 if conv_layout == "DS" else 0]
    step = _elem(family, 0) * (rows if conv_layout == "DS" else 1)
    with pytest.raises(AssertionError, match="bytes differ"):
        check_pair(FAMILIES[family], 1, 2, BLOCKS, _shift("0", lambda r: step))


@pytest.mark.parametrize("family, state", [("mamba1", 1), ("kda", 1), ("gdn", 1), ("mamba2_g4", 1), ("minimax_linear", 0)])
def test_a_state_read_one_head_off_is_caught(family, state):
    """Negative control: the SSM / recurrent state read one head (Mamba1: one channel) further."""
    spec = FAMILIES[family].rank(2, 0, seed=None).spec
    shape = spec.shapes[state]
    head = torch.empty((), dtype=spec.dtypes[state]).element_size() * int(torch.tensor(shape[1:]).prod())
    with pytest.raises(AssertionError, match="bytes differ"):
        check_pair(FAMILIES[family], 2, 1, BLOCKS, _shift(str(state), lambda r: head))


# --- what the code cannot place: refused by name and reason -------------------------------------


def _refusal(rank) -> str:
    assert all(not r.segments and r.reason for r in rank.regions), [(r.name, r.reason) for r in rank.regions]
    with pytest.raises(shards.ShardError, match=f"{LAYERS[0]}#0: this layer's layout is not described per TP shard"):
        shards.shard_regions(rank.regions, {0: rank.regions}, (0,))
    return rank.regions[0].reason


def test_a_subclass_of_an_allowed_layer_is_refused():
    """The rule is the class's, not its base's: a subclass (or a plugin's out-of-tree replacement
    of the layer) may shard differently."""

    def build(config, prefix):
        from vllm.model_executor.layers.mamba.mamba_mixer import MambaMixer

        class PluginMixer(MambaMixer):
            pass

        return PluginMixer(
            hidden_size=64, ssm_state_size=16, conv_kernel_size=4, intermediate_size=128, time_step_rank=8,
            use_conv_bias=True, use_bias=False, use_rms_norm=True, model_config=SimpleNamespace(dtype=torch.bfloat16),
            cache_config=config.cache_config, prefix=prefix,
        )  # fmt: skip

    family = Family(build, FAMILIES["mamba1"].units)
    reason = _refusal(family.rank(2, 0, seed=None))
    assert "PluginMixer (MAMBA1): no TP layout known for this layer class" in reason
    # Control: MambaMixer itself is described.
    assert all(r.segments for r in FAMILIES["mamba1"].rank(2, 0, seed=None).regions)


def test_states_of_another_shape_than_the_layers_rule_are_refused(monkeypatch):
    """A spec whose states are not what vLLM's shape function gives for the layer's sizes (here
    MambaMixer2 with ReplaySSM's ring states appended, as ``use_replayssm`` builds them) is not
    read as the two-state layout."""
    from vllm.config.mamba import MambaBackendEnum
    from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2

    base = MambaMixer2.get_state_shape

    def with_rings(self):
        calc = mamba_utils.MambaStateShapeCalculator
        return calc.append_replayssm_ring(base(self), self.n_groups, self.tp_size, 4, MambaBackendEnum.TRITON)

    monkeypatch.setattr(MambaMixer2, "get_state_shape", with_rings)
    monkeypatch.setattr(MambaMixer2, "get_state_dtype", lambda self: (torch.bfloat16, torch.float32) + (torch.bfloat16,) * 3)
    reason = _refusal(FAMILIES["mamba2_g4"].rank(2, 0, seed=None))
    assert "MambaMixer2: spec states" in reason and "but the layer's sizes give" in reason


def test_a_state_without_its_layer_module_is_refused():
    """No module under the layer's name (the rule reads the layer's class and sizes): refused."""
    rank = FAMILIES["short_conv"].rank(2, 0, seed=None)
    from pd_connector.engine.from_vllm.shard_layout import describe_shards

    bare = [msgspec.structs.replace(r, segments=(), reason="") for r in rank.regions]
    no_modules = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context={}))
    rank.regions = describe_shards(no_modules, rank.kv_cache_config, (0,), bare, 0, 2, rank.views)
    assert "no vLLM layer registered under this name" in _refusal(rank)


# --- MLA: the latent every rank holds whole, from vLLM's own spec builders ----------------------


def _mla_spec(cls):
    """The spec ``cls.get_kv_cache_spec`` builds (the layer's own code; only the attributes it
    reads are given: a 48-wide latent, the default cache dtype)."""
    layer = SimpleNamespace(
        kv_cache_dtype="auto", head_size=48, sliding_window=None, indexer=None, non_causal_multi_token_decode=False,
        topk_buffer_width=None,  # read by 0.33 only
    )
    config = SimpleNamespace(cache_config=SimpleNamespace(block_size=4), model_config=SimpleNamespace(dtype=torch.bfloat16))
    return cls.get_kv_cache_spec(layer, config)


def _mla_classes():
    out = []
    for module, name in (
        ("vllm.model_executor.layers.attention.mla_attention", "MLAAttention"),  # DeepSeek-V2/V3
        ("vllm.models.kimi_k3.nvidia.mla", "MultiHeadLatentAttention"),  # Kimi Linear, Kimi-K3
    ):
        out.append(pytest.param(module, name, id=name))
    return out


@pytest.mark.parametrize("p, d", PAIRS)
@pytest.mark.parametrize("module, name", _mla_classes())
def test_mla_latent_from_vllms_spec_builders_is_read_whole_at_any_ratio(module, name, p, d):
    """Kimi Linear's MLA layers (and DeepSeek's) declare ``max_tp_shards=1``: every rank's page
    is the same latent, read whole from one P rank whatever the TP ratio."""
    from rig.vllm_pages import Layers

    cls = getattr(pytest.importorskip(module), name)
    spec = _mla_spec(cls)
    assert spec.max_tp_shards == 1 and spec.num_kv_heads == 1
    check_pair(Layers(1, lambda tp, heads: spec, replicated=True), p, d, {0: [(1, 3), (2, 4)]})
