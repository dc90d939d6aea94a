"""The core's restatement of vLLM's prompt checkpoint, and the handoff plan built on it, against
vLLM's own function (``get_mamba_prefill_checkpoint_position``, vllm/v1/kv_cache_interface.py)
for block-sized and finer prefix match units, with and without the EAGLE drop."""

from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.v1.kv_cache_interface import get_mamba_prefill_checkpoint_position

from pd_connector.core.handoff import RecomputeProfile, mamba_checkpoint_position, plan_handoff

units = st.sampled_from([8, 16, 32, 64, 384, 640])


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 20_000), units, st.booleans())
def test_checkpoint_position_is_vllms(n, unit, drop):
    assert mamba_checkpoint_position(n, unit, drop) == get_mamba_prefill_checkpoint_position(n, unit, drop)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 20_000),
    units,
    st.sampled_from([1, 2, 4, 10]),
    st.sampled_from([0, 1, 3]),
    st.booleans(),
    st.integers(0, 2000),
)
def test_plan_lands_on_vllms_checkpoint_only_within_budget(n, unit, blocks_per_unit, lookahead, drop, budget):
    """The offset is vLLM's checkpoint when that costs D at most ``budget`` extra tokens, else
    N - tail; P pins vLLM's checkpoint for its next turn when it lies on a whole Mamba block it
    computes."""
    profile = RecomputeProfile(
        has_recurrent_state=True,
        prefill_lookahead=lookahead,
        replay_grid=unit,
        eagle_drop=drop,
        mamba_block_size=unit * blocks_per_unit,
    )
    tail = max(1, lookahead - 1)
    plan = plan_handoff(n, profile, 0, budget)
    checkpoint = get_mamba_prefill_checkpoint_position(n, unit, drop)
    assert plan.checkpoint == checkpoint
    if 0 < checkpoint and n - tail - budget <= checkpoint <= n - tail:
        assert plan.offset == checkpoint
    else:
        assert plan.offset == max(0, n - tail)
    pinnable = 0 < checkpoint <= plan.offset and checkpoint % profile.mamba_block_size == 0
    assert plan.retain == (checkpoint if pinnable else 0)
