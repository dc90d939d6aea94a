"""The replay offset lands where vLLM's own cache manager checkpoints Mamba state in align mode,
with and without EAGLE's last-unit drop (vllm#51295, #53945)."""

import pytest
from vllm.v1.kv_cache_interface import get_mamba_prefill_checkpoint_position

from pd_connector.core.handoff import RecomputeProfile, choose_replay_offset


@pytest.mark.parametrize("unit", [8, 16, 32, 384])
@pytest.mark.parametrize("eagle", [False, True])
def test_offset_on_vllm_mamba_checkpoint_grid(unit, eagle):
    profile = RecomputeProfile(has_recurrent_state=True, prefill_lookahead=int(eagle), replay_grid=unit, eagle_drop=eagle)
    for n in range(1, 4 * unit + 3):
        expected = get_mamba_prefill_checkpoint_position(n, unit, eagle)
        assert choose_replay_offset(n, profile) == max(0, expected), (n, unit, eagle)
