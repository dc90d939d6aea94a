"""D's proof that P held a lease for the whole of a READ (pure).

P frees a lease at its deadline even under a granted READ, so its hold stays bounded whatever
the link or D does (``leases.LeaseTable.expire``). Whether a READ can be trusted is therefore
D's decision, from P's own answers: a ``Granted`` or an ``Extended`` naming the request says P
keeps it at least ``seconds`` from when P received the message, which is after D sent it. So in
D's clock P holds the blocks until at least ``sent + seconds``; a READ D sees complete before
that read blocks P still held, a READ completing later may have read freed (reused) blocks and
D fails the load, which vLLM recomputes.
"""

from __future__ import annotations

# Two hosts' monotonic clocks run at rates within NTP's 500 ppm slew limit; 1 % covers that with
# room and costs a READ at most 1 % of the hold.
CLOCK_RATE_MARGIN = 0.01


def held_until(sent: float, seconds: float) -> float:
    """D's clock time until which P holds a lease it confirmed for ``seconds`` in answer to a
    message D sent at ``sent``."""
    return sent + max(0.0, seconds) * (1.0 - CLOCK_RATE_MARGIN)


def extended_hold(current: float, sent: float, seconds: float) -> float:
    """The hold after one more confirmation (answers can arrive out of order: never shorten)."""
    return max(current, held_until(sent, seconds))


def read_was_held(hold: float, completed_at: float) -> bool:
    """Whether every byte of a READ that D saw complete at ``completed_at`` (D's clock) was read
    while P held the blocks: the data landed before D observed the completion."""
    return completed_at <= hold
