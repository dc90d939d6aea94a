"""When an idle engine step waits for side-channel news (pd_connector.core.idle_wait)."""

from hypothesis import given
from hypothesis import strategies as st

from pd_connector.core.idle_wait import idle_wait_seconds, should_wait_for_news

WAIT_S = 0.002  # the default idle_step_wait_ms


def test_idle_step_with_leases_held_waits():
    assert should_wait_for_news(True, WAIT_S, reading=False, leases_held=1, loads_pending=False)


def test_idle_step_with_loads_pending_waits():
    assert should_wait_for_news(True, WAIT_S, reading=False, leases_held=0, loads_pending=True)


def test_step_that_scheduled_work_never_waits():
    assert not should_wait_for_news(False, WAIT_S, reading=False, leases_held=3, loads_pending=True)


def test_wait_disabled_by_zero_idle_step_wait_ms():
    assert not should_wait_for_news(True, 0.0, reading=False, leases_held=3, loads_pending=True)


def test_nothing_to_wait_for_without_leases_or_loads():
    assert not should_wait_for_news(True, WAIT_S, reading=False, leases_held=0, loads_pending=False)


@given(
    idle_step=st.booleans(),
    wait_s=st.floats(min_value=0.0, max_value=1.0),
    leases_held=st.integers(min_value=0, max_value=10_000),
    loads_pending=st.booleans(),
)
def test_never_waits_while_a_read_is_in_flight(idle_step, wait_s, leases_held, loads_pending):
    """A READ's slices are posted and polled step by step: waiting would stall the transfer."""
    assert not should_wait_for_news(idle_step, wait_s, True, leases_held, loads_pending)


@given(
    idle_step=st.booleans(),
    wait_s=st.floats(min_value=0.0, max_value=1.0),
    reading=st.booleans(),
    leases_held=st.integers(min_value=0, max_value=10_000),
    loads_pending=st.booleans(),
)
def test_waits_exactly_when_every_condition_holds(idle_step, wait_s, reading, leases_held, loads_pending):
    expected = idle_step and wait_s > 0 and not reading and (leases_held > 0 or loads_pending)
    assert should_wait_for_news(idle_step, wait_s, reading, leases_held, loads_pending) == expected


def test_dp_ranks_in_lockstep_never_wait():
    """A MoE DP rank that waited in an idle step would hold up every other rank's forward
    pass (they all join the same collectives, dummy batches included)."""
    assert idle_wait_seconds(2.0, dp_lockstep=True) == 0.0
    assert idle_wait_seconds(2.0, dp_lockstep=False) == 0.002
