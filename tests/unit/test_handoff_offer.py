"""P's finish-time rule and the router's requirement field (pure)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pd_connector.core.handoff import offered_offset, requested_min_recompute


@given(st.integers(0, 10_000), st.integers(0, 10_000))
def test_p_hands_over_only_the_state_it_computed(chosen, computed):
    got = offered_offset(chosen, computed)
    assert got == (chosen if chosen > 0 and computed == chosen else 0)


def test_p_offset_not_computed_hands_over_nothing():
    # e.g. preempted and recomputed differently: the Mamba slot is not the state at R
    assert offered_offset(39, 40) == 0
    assert offered_offset(39, 38) == 0
    assert offered_offset(39, 39) == 39


@pytest.mark.parametrize("raw, expected", [(None, 0), (0, 0), (3, 3), (-1, None), (True, None), ("3", None), (2.0, None), ([3], None)])
def test_requested_min_recompute(raw, expected):
    assert requested_min_recompute(raw) == expected
