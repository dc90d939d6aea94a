"""Pure tests of pd_connector.core.leases: P's lease table for handed-off blocks."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from pd_connector.core.leases import (
    ENDED,
    EXPIRED,
    GRANTED,
    MEMORY_TTL,
    MISMATCH,
    PROMPT_MISMATCH,
    UNKNOWN,
    LeaseTable,
)

# --- unit semantics ---------------------------------------------------------------------------


def test_grant_then_complete_finishes_once():
    t = LeaseTable()
    t.grant("a", deadline=100.0)
    assert t.holds("a") and len(t) == 1
    assert t.complete("a", now=5.0) is True
    assert not t.holds("a") and len(t) == 0
    assert t.take_to_free() == {"a"}
    assert t.take_to_free() == set()
    assert t.expire(1000.0) == []
    assert t.take_to_free() == set()


def test_grant_then_expire_finishes_once():
    t = LeaseTable()
    t.grant("a", deadline=100.0)
    assert t.expire(99.9) == []
    assert t.expire(100.0) == ["a"]  # deadline is inclusive
    assert t.expired_total == 1
    assert t.take_to_free() == {"a"}
    assert t.complete("a", now=101.0) is False  # a late notification finishes nothing
    assert t.expire(200.0) == []
    assert t.take_to_free() == set()


def test_early_completion_settles_grant_on_arrival():
    t = LeaseTable()
    assert t.complete("a", now=1.0) is False  # D read before P's worker saw the grant
    assert t.take_to_free() == set()
    t.grant("a", deadline=500.0)
    assert not t.holds("a")
    assert t.take_to_free() == {"a"}
    assert t.expire(10_000.0) == []
    assert t.expired_total == 0


def test_early_completion_forgotten_after_ttl():
    t = LeaseTable()
    t.complete("a", now=0.0)
    t.expire(MEMORY_TTL)  # exactly the TTL: still remembered
    t.grant("a", deadline=10_000.0)
    assert t.take_to_free() == {"a"}
    t.complete("b", now=0.0)
    t.expire(MEMORY_TTL + 0.001)  # past the TTL: forgotten
    t.grant("b", deadline=10_000.0)
    assert t.holds("b") and t.take_to_free() == set()
    assert t.expire(10_000.0) == ["b"]


def test_expiry_scans_all_entries_regardless_of_grant_order():
    """vllm#58222: deadlines are not in grant order once leases differ."""
    t = LeaseTable()
    t.grant("long", deadline=1000.0)
    t.grant("short", deadline=10.0)
    t.grant("mid", deadline=500.0)
    assert t.expire(50.0) == ["short"]
    assert sorted(t.expire(600.0)) == ["mid"]
    assert t.holds("long")
    assert t.take_to_free() == {"short", "mid"}


def test_completion_after_expiry_is_not_remembered_as_early():
    t = LeaseTable()
    t.grant("a", deadline=10.0)
    assert t.expire(10.0) == ["a"]
    assert t.complete("a", now=11.0) is False
    t.take_to_free()
    # Had the late completion been remembered as "early", a later grant under the same id
    # would be settled at once instead of leasing its blocks.
    t.grant("a", deadline=50.0)
    assert t.holds("a") and t.take_to_free() == set()


def test_duplicate_completion_finishes_once():
    t = LeaseTable()
    t.grant("a", deadline=100.0)
    assert t.complete("a", 1.0) is True
    assert t.complete("a", 2.0) is False  # NIXL notification and side-channel release both
    assert t.take_to_free() == {"a"}
    assert t.expire(1000.0) == []
    assert t.take_to_free() == set()


# --- claims -----------------------------------------------------------------------------------

BLOCKS = [[3, 4, 5], [9]]


def granted_table(deadline=100.0, offset=40, blocks=BLOCKS):
    t = LeaseTable()
    t.grant("a", deadline=deadline, replay_offset=offset, block_ids=blocks)
    return t


def test_exact_claim_is_granted_and_extends_the_lease():
    t = granted_table(deadline=100.0)
    assert t.claim("a", 40, [[3, 4, 5], [9]], now=50.0, extend_to=170.0) == (GRANTED, "")
    assert t.expire(150.0) == []  # the old deadline no longer applies
    assert t.expire(170.0) == ["a"]


def test_claim_never_shortens_the_lease():
    t = granted_table(deadline=100.0)
    assert t.claim("a", 40, BLOCKS, now=1.0, extend_to=20.0)[0] == GRANTED
    assert t.expire(50.0) == []
    assert t.expire(100.0) == ["a"]


def test_claim_accepts_tuples_and_lists_alike():
    t = granted_table(blocks=((3, 4, 5), (9,)))
    assert t.claim("a", 40, [[3, 4, 5], [9]], now=0.0, extend_to=0.0)[0] == GRANTED
    t = granted_table(blocks=[[3, 4, 5], [9]])
    assert t.claim("a", 40, ((3, 4, 5), (9,)), now=0.0, extend_to=0.0)[0] == GRANTED


@pytest.mark.parametrize(
    "offset, blocks",
    [
        (39, BLOCKS),  # offset shifted by one: the silent desync
        (41, BLOCKS),
        (0, BLOCKS),
        (40, [[3, 4, 6], [9]]),  # a block rewritten
        (40, [[3, 4], [9]]),  # a block dropped
        (40, [[3, 4, 5, 6], [9]]),
        (40, [[4, 3, 5], [9]]),  # reordered
        (40, [[9], [3, 4, 5]]),  # groups swapped
        (40, [[3, 4, 5]]),  # a group dropped
        (40, [[3, 4, 5], [9], []]),
        (40, []),
    ],
)
def test_altered_claim_is_a_mismatch_and_changes_nothing(offset, blocks):
    t = granted_table(deadline=100.0)
    outcome, why = t.claim("a", offset, blocks, now=0.0, extend_to=500.0)
    assert outcome == MISMATCH
    assert "40" in why and str(offset) in why
    assert t.holds("a")
    assert t.expire(100.0) == ["a"]  # not extended


def test_claim_for_unknown_request():
    t = granted_table()
    outcome, why = t.claim("zzz", 40, BLOCKS, now=0.0, extend_to=10.0)
    assert outcome == UNKNOWN and "zzz" in why


def test_claim_past_deadline_is_expired_even_before_the_sweep():
    t = granted_table(deadline=100.0)
    assert t.claim("a", 40, BLOCKS, now=100.0, extend_to=300.0)[0] == EXPIRED
    assert t.expire(100.0) == ["a"]  # the claim did not revive it


def test_claim_after_expiry_is_expired_then_forgotten():
    t = granted_table(deadline=100.0)
    t.expire(100.0)
    assert t.claim("a", 40, BLOCKS, now=101.0, extend_to=300.0)[0] == EXPIRED
    t.expire(100.0 + MEMORY_TTL + 1)
    assert t.claim("a", 40, BLOCKS, now=100.0 + MEMORY_TTL + 2, extend_to=0.0)[0] == UNKNOWN


def test_extend_keeps_a_live_lease_and_never_shortens_it():
    t = granted_table(deadline=100.0)
    assert t.extend("a", now=50.0, extend_to=200.0) is True
    assert t.expire(150.0) == []
    assert t.extend("a", now=60.0, extend_to=70.0) is True  # no shortening
    assert t.expire(199.0) == []
    assert t.expire(200.0) == ["a"]


def test_extend_does_not_revive_or_create_leases():
    t = granted_table(deadline=100.0)
    assert t.extend("a", now=100.0, extend_to=500.0) is False  # past deadline, not yet swept
    assert t.expire(100.0) == ["a"]
    assert t.extend("a", now=101.0, extend_to=500.0) is False  # expired
    assert t.extend("zzz", now=0.0, extend_to=500.0) is False  # unknown
    assert not t.holds("zzz") and len(t) == 0


def test_claim_after_completion_is_refused_at_once_not_left_pending():
    """A late claim on a lease its readers ended (an n > 1 sibling the router did not announce)
    gets a definite answer: UNKNOWN would make D poll for claim_wait_seconds."""
    t = granted_table()
    t.complete("a", now=1.0)
    outcome, why = t.claim("a", 40, BLOCKS, now=2.0, extend_to=300.0, reader="d#0/x")
    assert outcome == ENDED and "already ended" in why
    assert t.take_to_free() == {"a"}
    t.expire(1.0 + MEMORY_TTL + 1)  # forgotten after the memory's time
    assert t.claim("a", 40, BLOCKS, now=2.0 + MEMORY_TTL, extend_to=0.0)[0] == UNKNOWN


# --- readers: TP ranks and n > 1 requests ---------------------------------------------------------


def test_claim_with_another_prompt_fingerprint_is_refused_and_changes_nothing():
    t = LeaseTable()
    t.grant("a", deadline=100.0, replay_offset=40, block_ids=BLOCKS, fingerprint="1:aa")
    outcome, why = t.claim("a", 40, BLOCKS, now=0.0, extend_to=500.0, reader="r", fingerprint="1:bb")
    assert outcome == PROMPT_MISMATCH and "1:aa" in why and "1:bb" in why
    assert t.claim("a", 40, BLOCKS, now=0.0, extend_to=500.0, reader="r", fingerprint="")[0] == PROMPT_MISMATCH
    assert t.expire(100.0) == ["a"]  # not extended, and no reader was registered


def test_lease_for_n_requests_ends_after_a_reader_of_each():
    t = LeaseTable()
    t.grant("a", deadline=100.0, replay_offset=40, block_ids=BLOCKS, requests=2)
    for reader in ("d#0/0_x", "d#0/1_x"):
        assert t.claim("a", 40, BLOCKS, now=1.0, extend_to=600.0, reader=reader)[0] == GRANTED
    assert t.complete("a", 2.0, reader="d#0/0_x") is False
    assert t.holds("a") and t.take_to_free() == set()
    assert t.complete("a", 3.0, reader="d#0/1_x") is True
    assert t.take_to_free() == {"a"}


def test_blocks_are_never_freed_under_a_granted_read():
    """One announced request, two readers granted (n = 2 behind a router that did not say so):
    the first completion must not free the blocks the second is still reading."""
    t = LeaseTable(claim_seconds=5.0)
    t.grant("a", deadline=100.0, replay_offset=40, block_ids=BLOCKS)
    assert t.claim("a", 40, BLOCKS, now=1.0, extend_to=600.0, reader="A")[0] == GRANTED
    assert t.claim("a", 40, BLOCKS, now=1.0, extend_to=600.0, reader="B")[0] == GRANTED
    assert t.complete("a", 2.0, reader="A") is False
    assert t.expire(300.0) == []  # B's claim extended it, and B is still reading
    assert t.complete("a", 301.0, reader="B") is True
    assert t.take_to_free() == {"a"}


def test_whole_release_waits_for_granted_readers_and_refuses_new_claims():
    t = LeaseTable()
    t.grant("a", deadline=100.0, replay_offset=40, block_ids=BLOCKS, requests=3)
    assert t.claim("a", 40, BLOCKS, now=1.0, extend_to=600.0, reader="A")[0] == GRANTED
    assert t.complete("a", 2.0) is False  # D's scheduler released it: A still reads
    assert t.claim("a", 40, BLOCKS, now=2.0, extend_to=600.0, reader="B")[0] == ENDED
    assert t.complete("a", 3.0, reader="A") is True
    assert t.take_to_free() == {"a"}


def test_readers_still_due_get_the_claim_deadline_not_the_extended_lease():
    """An announced request that never comes (a router that said n = 2 and sent one) holds the
    blocks for the time a claim needs after the last reader is done, not lease_seconds."""
    t = LeaseTable(claim_seconds=5.0)
    t.grant("a", deadline=10.0, replay_offset=40, block_ids=BLOCKS, requests=2)
    assert t.claim("a", 40, BLOCKS, now=1.0, extend_to=600.0, reader="A")[0] == GRANTED
    assert t.complete("a", 20.0, reader="A") is False
    assert t.expire(24.9) == []
    assert t.expire(25.0) == ["a"]


def test_a_reader_that_completed_cannot_claim_again():
    t = LeaseTable()
    t.grant("a", deadline=100.0, replay_offset=40, block_ids=BLOCKS, requests=2)
    t.complete("a", 1.0, reader="A")
    assert t.claim("a", 40, BLOCKS, now=2.0, extend_to=600.0, reader="A")[0] == ENDED
    assert t.claim("a", 40, BLOCKS, now=2.0, extend_to=600.0, reader="B")[0] == GRANTED


def test_a_new_handoff_starts_with_the_claim_deadline():
    from pd_connector.core.leases import initial_lease

    assert initial_lease(30.0, 120.0) == 30.0
    assert initial_lease(300.0, 120.0) == 120.0


@settings(max_examples=200, deadline=None)
@given(
    requests=st.integers(1, 3),
    ops=st.lists(
        st.tuples(st.sampled_from(["claim", "done", "release", "expire"]), st.sampled_from("ABCD"), st.floats(0, 50)),
        max_size=40,
    ),
)
def test_no_lease_ends_under_a_granted_reader_except_at_its_deadline(requests, ops):
    """Whatever the interleaving of claims, completions, whole releases and sweeps: a lease
    ends by completion only once every reader granted a claim has completed; each id finishes
    once."""
    t = LeaseTable(claim_seconds=7.0)
    t.grant("a", deadline=20.0, replay_offset=1, block_ids=[[1]], fingerprint="d", requests=requests)
    now, granted, done, finished = 0.0, set(), set(), 0
    for op, reader, dt in ops:
        now += dt / 5
        if op == "claim":
            if t.claim("a", 1, [[1]], now, now + dt, reader=reader, fingerprint="d")[0] == GRANTED:
                granted.add(reader)
        elif op == "done":
            ended = t.complete("a", now, reader=reader)
            done.add(reader)
            assert not ended or granted <= done
        elif op == "release":
            ended = t.complete("a", now)
            assert not ended or granted <= done
        else:
            t.expire(now)
        finished += len(t.take_to_free())
        assert finished <= 1
        if finished:
            break
    t.expire(float("inf"))
    assert finished + len(t.take_to_free()) == 1


# --- random interleavings: each granted id finishes exactly once -------------------------------

ids = st.sampled_from([f"r{i}" for i in range(8)])


class LeaseMachine(RuleBasedStateMachine):
    """Model: ids are granted at most once (one request_finished per request); completions
    (NIXL notifications, releases, duplicates, strays for never-granted ids) and expiries
    interleave arbitrarily with a non-decreasing clock."""

    @initialize()
    def setup(self):
        self.t = LeaseTable()
        self.now = 0.0
        self.granted: dict[str, float] = {}
        self.leased: dict[str, tuple[int, list[list[int]]]] = {}
        self.finished: Counter[str] = Counter()
        self.early: dict[str, float] = {}  # model of remembered early completions
        self.expired = 0

    def _take(self):
        got = self.t.take_to_free()
        for rid in got:
            self.finished[rid] += 1
            assert rid in self.granted, f"{rid} finished but never granted"
        return got

    @rule(dt=st.floats(0, 400))
    def tick(self, dt):
        self.now += dt

    @rule(rid=ids, lease=st.floats(0, 300), offset=st.integers(0, 3), blocks=st.lists(st.lists(st.integers(1, 5), max_size=2), max_size=2))
    def grant(self, rid, lease, offset, blocks):
        if rid in self.granted:
            return
        self.granted[rid] = self.now + lease
        self.leased[rid] = (offset, blocks)
        early = rid in self.early
        self.t.grant(rid, self.now + lease, offset, blocks)
        if early:
            del self.early[rid]
            assert not self.t.holds(rid)
            assert rid in self._take()
        else:
            assert self.t.holds(rid)

    @rule(rid=ids)
    def complete(self, rid):
        held = self.t.holds(rid)
        result = self.t.complete(rid, self.now)
        assert result is held
        if not held:
            self.early[rid] = self.now
        else:
            assert rid in self._take()

    @rule(
        rid=ids,
        exact=st.booleans(),
        offset=st.integers(0, 3),
        blocks=st.lists(st.lists(st.integers(1, 5), max_size=2), max_size=2),
        extend=st.floats(0, 300),
    )
    def claim(self, rid, exact, offset, blocks, extend):
        if exact and rid in self.leased:
            offset, blocks = self.leased[rid]
        held = self.t.holds(rid)
        outcome, _ = self.t.claim(rid, offset, blocks, self.now, self.now + extend)
        if not held:
            assert outcome in (UNKNOWN, EXPIRED, ENDED)
        elif self.granted[rid] <= self.now:
            assert outcome == EXPIRED
        elif (offset, blocks) == self.leased[rid]:
            assert outcome == GRANTED
            self.granted[rid] = max(self.granted[rid], self.now + extend)
        else:
            assert outcome == MISMATCH
        assert self.t.holds(rid) == held  # a claim never ends or creates a lease

    @rule(rid=ids, extend=st.floats(0, 300))
    def extend(self, rid, extend):
        held = self.t.holds(rid)
        live = held and self.granted[rid] > self.now
        assert self.t.extend(rid, self.now, self.now + extend) is live
        if live:
            self.granted[rid] = max(self.granted[rid], self.now + extend)
        assert self.t.holds(rid) == held

    @rule()
    def expire(self):
        held_before = {rid for rid in self.granted if self.t.holds(rid)}
        due = {rid for rid in held_before if self.granted[rid] <= self.now}
        expired = self.t.expire(self.now)
        assert len(expired) == len(set(expired))
        assert set(expired) == due
        self.expired += len(expired)
        self.early = {r: s for r, s in self.early.items() if self.now - s <= MEMORY_TTL}
        assert set(self._take()) == due

    @invariant()
    def each_id_finished_at_most_once(self):
        if not hasattr(self, "t"):
            return
        assert all(c == 1 for c in self.finished.values()), self.finished
        assert self.t.expired_total == self.expired
        assert len(self.t) == sum(1 for rid in self.granted if self.t.holds(rid))
        for rid in self.granted:
            # Granted ids are either held or finished, never both, never neither.
            assert self.t.holds(rid) != (self.finished[rid] == 1)

    def teardown(self):
        if not hasattr(self, "t"):
            return
        self.t.expire(float("inf"))
        self._take()
        assert set(self.finished) == set(self.granted)
        assert all(c == 1 for c in self.finished.values())
        assert len(self.t) == 0


LeaseMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None
)
TestLeaseInterleavings = LeaseMachine.TestCase


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["grant", "complete", "expire", "take"]), ids, st.floats(0, 500)),
        max_size=60,
    )
)
def test_random_operation_sequences_finish_each_granted_id_once(ops):
    """The same property without a model: only counts of finished ids are checked."""
    t = LeaseTable()
    now, granted, finished = 0.0, set(), Counter()
    for op, rid, x in ops:
        now += x / 10
        if op == "grant" and rid not in granted:
            granted.add(rid)
            t.grant(rid, now + x)
        elif op == "complete":
            t.complete(rid, now)
        elif op == "expire":
            t.expire(now)
        elif op == "take":
            finished.update(t.take_to_free())
    t.expire(float("inf"))
    finished.update(t.take_to_free())
    assert set(finished) == granted
    assert all(c == 1 for c in finished.values())


@pytest.mark.parametrize("n", [1, 50, 1000])
def test_many_leases_with_shuffled_deadlines(n):
    t = LeaseTable()
    deadlines = {f"r{i}": float((i * 7919) % n) for i in range(n)}
    for rid, d in deadlines.items():
        t.grant(rid, d)
    got = []
    for now in range(n):
        got.extend(t.expire(float(now)))
        assert all(deadlines[r] <= now for r in got)
    assert sorted(got) == sorted(deadlines)
    assert t.take_to_free() == set(deadlines)


def test_d_extends_every_third_of_a_lease_but_never_faster_than_the_floor():
    from pd_connector.core.leases import MIN_EXTEND_INTERVAL_S, extension_interval

    assert extension_interval(120.0) == 40.0
    assert extension_interval(0.6) == pytest.approx(0.2)
    # A P granting a tiny lease must not make every engine step send an extension.
    assert extension_interval(0.003) == MIN_EXTEND_INTERVAL_S


# --- readers (tensor parallelism: several D ranks read one P rank's shard) -------------------


def test_a_lease_with_two_readers_ends_after_both_and_a_repeat_counts_once():
    t = LeaseTable()
    t.grant("r", deadline=100.0, replay_offset=3, block_ids=[[1]])
    assert t.claim("r", 3, [[1]], now=1.0, extend_to=50.0, readers=2)[0] == GRANTED
    assert not t.complete("r", 2.0, reader="d#0/x", readers=2)
    assert not t.complete("r", 2.1, reader="d#0/x", readers=2)  # the same reader again
    assert t.take_to_free() == set()
    assert t.complete("r", 2.2, reader="d#1/x", readers=2)
    assert t.take_to_free() == {"r"}


def test_readers_that_complete_before_the_grant_settle_it_on_arrival():
    t = LeaseTable()
    t.complete("r", 1.0, reader="a", readers=2)
    t.grant("r", deadline=100.0)
    assert t.take_to_free() == set() and t.holds("r")
    t.complete("r", 1.5, reader="b", readers=2)
    assert t.take_to_free() == {"r"}
    t.complete("s", 1.0, reader="a", readers=2)
    t.complete("s", 1.1, reader="b", readers=2)
    t.grant("s", deadline=100.0)
    assert t.take_to_free() == {"s"} and not t.holds("s")


def test_a_release_without_reader_ends_a_lease_other_readers_still_hold():
    t = LeaseTable()
    t.grant("r", deadline=100.0)
    t.complete("r", 1.0, reader="a", readers=3)
    assert t.complete("r", 1.1)  # D's scheduler: nobody will read
    assert t.take_to_free() == {"r"}


@given(st.integers(1, 4), st.lists(st.integers(0, 5), max_size=12), st.booleans())
def test_a_lease_ends_exactly_when_its_last_distinct_reader_completes(readers, order, early):
    """Whatever the order, repeats and timing against the grant: finished once, at the moment
    the number of distinct readers reaches the count announced."""
    t = LeaseTable()
    if not early:
        t.grant("r", deadline=1e9)
    seen: set[int] = set()
    finished_at = None
    for i, reader in enumerate(order):
        t.complete("r", float(i), reader=f"d#{reader}", readers=readers)
        seen.add(reader)
        if finished_at is None and len(seen) >= readers:
            finished_at = i
    if early:
        t.grant("r", deadline=1e9)
    assert (t.take_to_free() == {"r"}) == (finished_at is not None)
    assert t.holds("r") == (finished_at is None)


def test_a_repeated_early_release_is_remembered_from_the_latest_one():
    """Found by the state machine: D released a handoff twice before P's grant, 301 s apart; the
    memory of early completions counted from the first release and forgot it, so the late
    grant leased blocks nobody would read until expiry."""
    table = LeaseTable()
    table.complete("r0", 0.0)
    table.complete("r0", 301.0)
    table.expire(301.0)
    table.grant("r0", 301.0, 0, [])
    assert not table.holds("r0") and table.take_to_free() == {"r0"}


# --- the bounded hold (no lease outlives max_hold after its grant) -----------------------------


def test_no_claim_or_extension_keeps_a_lease_past_max_hold():
    t = LeaseTable(max_hold=10.0)
    t.grant("a", deadline=3.0, replay_offset=4, block_ids=[[1]], now=0.0)
    assert t.claim("a", 4, [[1]], now=1.0, extend_to=8.0, reader="d#0")[0] == GRANTED
    assert t.held_seconds("a", 1.0) == 7.0
    for now in (5.0, 8.0, 9.5):
        assert t.extend("a", now, now + 5.0)
    assert t.held_seconds("a", 9.5) == 0.5  # capped at 0 + 10, not 14.5
    assert t.expire(10.0) == ["a"]
    assert t.expired_reading_total == 1  # freed under the granted, unfinished READ
    assert t.held_seconds("a", 10.0) == 0.0 and not t.extend("a", 10.0, 15.0)


def test_a_claim_past_the_hold_cap_is_refused_as_expired_not_granted_a_0s_hold():
    """Regression: with the cap (10 s) below the claim deadline (30 s), a claim 20 s after the
    grant found the lease live and was granted a hold capped at 0 s: D read, discarded the READ
    as lease_lost and recomputed. Now refused as expired, and nothing is granted."""
    t = LeaseTable(max_hold=10.0)
    t.grant("a", deadline=30.0, replay_offset=4, block_ids=[[1]], now=0.0)
    for now in (20.0, 10.0):  # past the cap, and at it (a 0 s hold either way)
        outcome, why = t.claim("a", 4, [[1]], now=now, extend_to=now + 120.0, reader="d#0")
        assert outcome == EXPIRED and "hold cap" in why and "max_hold_seconds" in why
    assert t.held_seconds("a", 20.0) == 10.0  # the refused claim moved nothing
    assert t.expire(30.0) == ["a"] and t.expired_reading_total == 0  # no READ was granted


def test_negative_control_a_claim_just_inside_the_hold_cap_is_still_granted_what_is_left():
    t = LeaseTable(max_hold=10.0)
    t.grant("a", deadline=30.0, replay_offset=4, block_ids=[[1]], now=0.0)
    assert t.claim("a", 4, [[1]], now=9.0, extend_to=129.0, reader="d#0")[0] == GRANTED
    assert t.held_seconds("a", 9.0) == 1.0


@settings(max_examples=200, deadline=None)
@given(
    st.floats(0.5, 100.0), st.floats(0.5, 100.0), st.floats(0.0, 150.0), st.floats(0.0, 200.0),
)  # fmt: skip
def test_every_granted_claim_confirms_a_positive_hold(max_hold, deadline, now, lease):
    """Whatever the cap, first deadline and claim time: a claim is granted iff the hold it would
    confirm is positive, else refused as expired."""
    t = LeaseTable(max_hold=max_hold)
    t.grant("a", deadline=deadline, replay_offset=0, block_ids=[[1]], now=0.0)
    outcome, _ = t.claim("a", 0, [[1]], now=now, extend_to=now + lease, reader="d#0")
    if now < min(deadline, max_hold):
        assert outcome == GRANTED and t.held_seconds("a", now) > 0
    else:
        assert outcome == EXPIRED


def test_an_expiry_after_every_reader_completed_is_not_counted_as_under_a_read():
    t = LeaseTable()
    t.grant("a", deadline=3.0, replay_offset=4, block_ids=[[1]], requests=2, now=0.0)
    t.claim("a", 4, [[1]], now=1.0, extend_to=2.0, reader="d#0")
    t.complete("a", 1.5, reader="d#0")
    assert t.expire(5.0) == ["a"] and t.expired_reading_total == 0
