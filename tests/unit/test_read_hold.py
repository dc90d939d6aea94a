"""Pure tests of pd_connector.core.read_hold: D trusts a READ only inside the hold P confirmed."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pd_connector.core import read_hold

# P's clock against D's: an offset and a rate within NTP's slew limit (500 ppm).
offsets = st.floats(-1e6, 1e6)
rates = st.floats(1 - 5e-4, 1 + 5e-4)
confirmations = st.lists(
    st.tuples(st.floats(0, 1e4), st.floats(0, 10), st.floats(0, 600)),  # (D sent, transit, P's seconds)
    min_size=1,
    max_size=8,
)


@given(offsets, rates, confirmations, st.floats(0, 2e4))
def test_a_read_d_trusts_completed_before_p_could_free_its_blocks(offset, rate, answers, completed):
    """Whatever the transit times, the order of answers and the clocks' drift: a READ that
    read_was_held accepts completed (in P's clock) before P's deadline, the latest of its
    receipts plus the seconds it confirmed."""
    hold = float("-inf")
    p_deadline = float("-inf")
    for sent, transit, seconds in answers:
        hold = read_hold.extended_hold(hold, sent, seconds)
        received_on_p = offset + rate * (sent + transit)
        p_deadline = max(p_deadline, received_on_p + seconds)
    if read_hold.read_was_held(hold, completed):
        assert offset + rate * completed <= p_deadline + 1e-6


def test_a_hold_is_never_shortened_by_a_late_answer():
    hold = read_hold.held_until(10.0, 30.0)
    assert read_hold.extended_hold(hold, 5.0, 30.0) == hold
    assert read_hold.extended_hold(hold, 20.0, 30.0) > hold


def test_a_read_completing_after_the_hold_is_not_trusted():
    hold = read_hold.held_until(0.0, 1.0)
    assert read_hold.read_was_held(hold, 0.5)
    assert not read_hold.read_was_held(hold, 1.0)  # the clock margin: 1 s is past 0.99 s
    assert not read_hold.read_was_held(read_hold.held_until(0.0, 0.0), 0.001)  # P held nothing
