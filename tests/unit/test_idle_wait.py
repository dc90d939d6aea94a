"""When an idle engine step waits for side-channel news (pd_connector.core.idle_wait)."""

from hypothesis import given
from hypothesis import strategies as st

from pd_connector.core.idle_wait import READ_WAIT_FRACTION, idle_step_wait, idle_wait_seconds, should_wait_for_news

WAIT_S = 0.002  # the default idle_step_wait_ms


def test_idle_step_with_leases_held_waits():
    assert should_wait_for_news(True, WAIT_S, leases_held=1, loads_pending=False)


def test_idle_step_with_loads_pending_waits():
    assert should_wait_for_news(True, WAIT_S, leases_held=0, loads_pending=True)


def test_step_that_scheduled_work_never_waits():
    assert not should_wait_for_news(False, WAIT_S, leases_held=3, loads_pending=True)


def test_wait_disabled_by_zero_idle_step_wait_ms():
    assert not should_wait_for_news(True, 0.0, leases_held=3, loads_pending=True)


def test_nothing_to_wait_for_without_leases_or_loads():
    assert not should_wait_for_news(True, WAIT_S, leases_held=0, loads_pending=False)


@given(
    idle_step=st.booleans(),
    wait_s=st.floats(min_value=0.0, max_value=1.0),
    leases_held=st.integers(min_value=0, max_value=10_000),
    loads_pending=st.booleans(),
)
def test_a_step_with_a_read_in_flight_never_waits_the_news_bound(idle_step, wait_s, leases_held, loads_pending):
    """With a READ in flight the wait follows the READ (idle_step_wait, below), not the bound:
    a slice in NIXL's hands for 1 ms allows an eighth of it, a slice due none."""
    assert idle_step_wait(idle_step, wait_s, leases_held, loads_pending, reads=(0.001,)) <= READ_WAIT_FRACTION * 0.001
    assert idle_step_wait(idle_step, wait_s, leases_held, loads_pending, reads=(None,)) == 0.0


@given(
    idle_step=st.booleans(),
    wait_s=st.floats(min_value=0.0, max_value=1.0),
    leases_held=st.integers(min_value=0, max_value=10_000),
    loads_pending=st.booleans(),
)
def test_waits_exactly_when_every_condition_holds(idle_step, wait_s, leases_held, loads_pending):
    expected = idle_step and wait_s > 0 and (leases_held > 0 or loads_pending)
    assert should_wait_for_news(idle_step, wait_s, leases_held, loads_pending) == expected


def test_dp_ranks_in_lockstep_never_wait():
    """A MoE DP rank that waited in an idle step would hold up every other rank's forward
    pass (they all join the same collectives, dummy batches included)."""
    assert idle_wait_seconds(2.0, dp_lockstep=True) == 0.0
    assert idle_wait_seconds(2.0, dp_lockstep=False) == 0.002


# -- idle_step_wait: how long, READs in flight included ------------------------------------------

waits = st.floats(min_value=0.0, max_value=1.0)
in_nixl = st.floats(min_value=0.0, max_value=3600.0)


def test_a_read_with_a_slice_to_post_is_not_waited_for():
    """D's engine thread posts the slices (ChunkedRead.advance): a wait would only delay the copy."""
    assert idle_step_wait(True, WAIT_S, 0, True, reads=[None]) == 0.0
    assert idle_step_wait(True, WAIT_S, 0, True, reads=[10.0, None]) == 0.0


def test_a_read_in_nixls_hands_for_long_is_polled_every_idle_step_wait_ms_not_in_a_busy_loop():
    """The spin this replaces: a READ lasting seconds was polled without pause, a whole core."""
    assert idle_step_wait(True, WAIT_S, 0, True, reads=[5.0]) == WAIT_S


def test_a_read_just_posted_is_polled_again_at_once():
    """Waiting a fraction of the time in flight: a READ that completes in microseconds is not
    slowed by a wait of milliseconds."""
    assert idle_step_wait(True, WAIT_S, 0, True, reads=[0.0]) == 0.0
    assert idle_step_wait(True, WAIT_S, 0, True, reads=[0.001]) == 0.001 * READ_WAIT_FRACTION


@given(idle_step=st.booleans(), wait_s=waits, leases_held=st.integers(0, 100), loads_pending=st.booleans(),
       reads=st.lists(st.one_of(st.none(), in_nixl), max_size=5))
def test_never_waits_past_the_bound_nor_in_a_step_that_scheduled_work(idle_step, wait_s, leases_held, loads_pending, reads):
    wait = idle_step_wait(idle_step, wait_s, leases_held, loads_pending, reads)
    assert 0.0 <= wait <= wait_s
    if not idle_step or wait_s == 0:
        assert wait == 0.0


@given(wait_s=waits, reads=st.lists(in_nixl, min_size=1, max_size=5))
def test_a_reads_completion_is_noticed_at_most_a_fraction_of_its_time_in_flight_late(wait_s, reads):
    """Whichever READ completes first, the step waits at most READ_WAIT_FRACTION of the time its
    slice has been in flight: a READ's time grows by at most that fraction (plus one step)."""
    assert idle_step_wait(True, wait_s, 0, True, reads) <= READ_WAIT_FRACTION * min(reads)


@given(wait_s=st.floats(min_value=1e-4, max_value=1.0), a=in_nixl, b=in_nixl)
def test_the_wait_backs_off_as_a_read_stays_in_flight(wait_s, a, b):
    early, late = sorted((a, b))
    assert idle_step_wait(True, wait_s, 0, True, [early]) <= idle_step_wait(True, wait_s, 0, True, [late])
    if late >= wait_s / READ_WAIT_FRACTION:
        assert idle_step_wait(True, wait_s, 0, True, [late]) == wait_s


@given(idle_step=st.booleans(), wait_s=waits, leases_held=st.integers(0, 100), loads_pending=st.booleans())
def test_without_reads_it_waits_the_whole_bound_exactly_when_news_is_waited_for(idle_step, wait_s, leases_held, loads_pending):
    expected = wait_s if should_wait_for_news(idle_step, wait_s, leases_held, loads_pending) else 0.0
    assert idle_step_wait(idle_step, wait_s, leases_held, loads_pending, ()) == expected
