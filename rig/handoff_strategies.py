"""Hypothesis strategies shared by the tests of pd_connector.core.handoff
(tests/unit/test_handoff_offset.py, tests/unit/test_handoff_decide.py): engine profiles
(core/recompute_profile.py) and prompt lengths."""

from __future__ import annotations

from hypothesis import strategies as st

from pd_connector.core.recompute_profile import RecomputeProfile

profiles = st.builds(
    RecomputeProfile,
    has_recurrent_state=st.booleans(),
    prefill_lookahead=st.integers(0, 6),
    bounded_replay=st.booleans(),
    checkpoint_unit=st.one_of(st.just(0), st.integers(1, 64), st.sampled_from([8, 16, 32, 64, 128])),
    eagle_drop=st.booleans(),
)
# The skew scenario of the brief: EAGLE-family lookahead 0..4, recurrent or not, no grid.
skew_profiles = st.builds(
    RecomputeProfile,
    has_recurrent_state=st.booleans(),
    prefill_lookahead=st.integers(0, 4),
)
prompt_lengths = st.integers(1, 5000)
