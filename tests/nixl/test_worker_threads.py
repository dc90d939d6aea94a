"""READs through NIXL's UCX worker threads (``nixl_num_threads`` > 0, opt-in): the thread-pool
engine splits each READ over the threads (``transport.backend_params`` sets ``split_batch_size``
1) and posts it asynchronously. The bytes must be exactly the paired pages, P must hear of a
READ only once every chunk has landed (it frees its blocks on that notification), and D's
Receiver must post each READ in one post (two at most, ``read_plan.thread_slices``) instead of
slicing it by size. Real NIXL, UCX over DRAM, loopback.
"""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

from pd_connector.core import descriptors
from pd_connector.core.settings import ConnectorSettings
from pd_connector.core.params import LeaseRef
from pd_connector.engine.metadata import RecvTask
from pd_connector.engine.decode.receiver import Receiver
from pd_connector.transport.nixl import DONE, PENDING, ChunkedRead
from rig import devices

from test_chunked_read import COMPAT, granting_side_channel, peered_pairs, read_done
from test_transport import (
    ATTN,
    KINDS,
    MAMBA,
    PAIR_CASES,
    TIMEOUT_S,
    assert_bytes,
    collect_notifications,
    expected_after,
    wait_done,
)

pytestmark = pytest.mark.nixl

THREADS = 2
BIG_BLOCKS = 2048  # 2 x 8 MiB of attention pages: thousands of descriptors per READ


@pytest.fixture(scope="module")
def threaded():
    """kind[, num_blocks] -> (P, D), both with worker threads; D zeroed and peered with P as "p"."""
    with peered_pairs(seed=4321, num_threads=THREADS) as get:
        yield get


def wait_states(transport, handle) -> None:
    """Poll one READ to DONE (fail on ERR or timeout); the caller releases it."""
    deadline = time.monotonic() + TIMEOUT_S
    while (state := transport.state(handle)) == PENDING:
        assert time.monotonic() < deadline
        time.sleep(0.0005)
    assert state == DONE


def test_worker_threads_do_not_copy_inside_the_post(threaded):
    _, d = threaded("layer_major_dense")
    assert not d.transport.copies_in_post


@pytest.mark.parametrize("case", list(PAIR_CASES))
@pytest.mark.parametrize("kind", KINDS)
def test_worker_threads_move_exactly_the_paired_pages(threaded, kind, case):
    p, d = threaded(kind)
    pairs = [list(PAIR_CASES[case][0]), list(PAIR_CASES[case][1])]
    p_before = p.mem.copy()
    want, mask = expected_after(d, p, pairs)
    notif = f"threads-{kind}-{case}".encode()
    wait_done(d.transport, [d.transport.read("p", *d.planners["p"].indices(pairs), notif)])
    assert_bytes(d, want)
    assert not d.mem[~mask].any(), "a byte outside the paired D pages changed"
    assert np.array_equal(p.mem, p_before), "a READ modified the prefill side"
    assert collect_notifications(p.transport, 1) == {notif: 1}


def test_worker_threads_notify_p_only_after_every_chunk_landed(threaded):
    """P frees its blocks when the notification arrives: by then every byte of every chunk the
    threads copied must be in D. Thousands of scattered descriptors, so the READ is split into
    chunks copied side by side; P's notifications are polled while the READ runs, and D's bytes
    are checked the moment P hears."""
    p, d = threaded("layer_major_dense", BIG_BLOCKS)
    rng = random.Random(3)
    p_ids = rng.sample(range(1, BIG_BLOCKS), 1500)
    d_ids = rng.sample(range(1, BIG_BLOCKS), 1501)
    pairs = [list(zip(p_ids, d_ids[:1500])), [(rng.randrange(1, BIG_BLOCKS), d_ids[1500])]]
    want, _ = expected_after(d, p, pairs)
    li, ri = d.planners["p"].indices(pairs)
    assert d.planners["p"].count_runs(li, ri) > 2 * THREADS
    for attempt in range(3):
        devices.zero(d.buf)
        notif = f"big-{attempt}".encode()
        handle = d.transport.read("p", li, ri, notif)
        deadline = time.monotonic() + TIMEOUT_S
        try:
            while not (heard := p.transport.take_notifications()):
                assert time.monotonic() < deadline, "P was never notified"
                d.transport.state(handle)  # D's engine polls, as the connector does
            assert heard == [notif]
            assert_bytes(d, want)  # at the moment P heard
            wait_states(d.transport, handle)
        finally:
            d.transport.discard(handle)


def test_long_runs_are_cut_for_the_threads_and_nixl_merges_exactly_as_counted(threaded):
    """Contiguous blocks make one run per layer; with worker threads the plan cuts them
    (``read_plan.cut_long_runs``) so each thread gets a share, and NIXL's own merged count is the
    count the connector reports: the reversed pieces are not merged back."""
    p, d = threaded("layer_major_dense", BIG_BLOCKS)
    pairs = [[(b, b + 7) for b in range(1, 1001)], [(1200, 1300)]]
    li, ri = d.planners["p"].indices(pairs)
    planner = d.planners["p"]
    uncut = planner.count_runs(*descriptors.plan_indices(pairs, planner.local, planner.remote))
    runs = d.planners["p"].count_runs(li, ri)
    assert uncut == 2 + 2 and runs > 2 * THREADS
    handle = d.transport.read("p", li, ri, b"cut")
    try:
        wait_states(d.transport, handle)
        assert d.transport.merged_descriptors(handle) == runs
    finally:
        d.transport.discard(handle)
    want, _ = expected_after(d, p, pairs)
    assert_bytes(d, want)
    assert collect_notifications(p.transport, 1) == {b"cut": 1}


def test_an_odd_run_count_is_posted_in_two_slices_notifying_once_after_the_last(threaded):
    """Three packed attention blocks are three runs of one descriptor: NIXL would cut them into
    chunks of one for two threads, the third queued behind the first thread's copy while the
    post waits. The third goes in a second slice; P hears once, after it."""
    p, d = threaded("block_major_padded")
    pairs = [[(7, 2), (1, 9), (4, 5)], []]
    plan = d.planners["p"].plan(pairs, 1 << 20)
    assert plan.runs == 3
    assert plan.bounds == [(0, 2), (2, 3)]
    xfer = ChunkedRead(d.transport, "p", plan, b"odd")
    deadline = time.monotonic() + TIMEOUT_S
    while (state := xfer.advance()) == PENDING:
        assert xfer.next == xfer.slices or not p.transport.take_notifications(), "P heard before the last slice"
        assert time.monotonic() < deadline
        time.sleep(0.0005)
    assert state == DONE
    want, _ = expected_after(d, p, pairs)
    assert_bytes(d, want)
    assert collect_notifications(p.transport, 1) == {b"odd": 1}


def test_worker_threads_many_concurrent_reads_each_notify_once(threaded):
    p, d = threaded("block_major_padded")
    rng = random.Random(11)
    d_free = rng.sample(range(1, 56), 36)
    reads = []
    for k in range(12):
        d1, d2, d3 = d_free[3 * k : 3 * k + 3]
        pairs = [[(rng.randrange(1, 40), d1), (rng.randrange(1, 40), d2)], [(rng.randrange(1, 40), d3)]]
        reads.append((f"t-{k}".encode(), pairs))
    union = [[pr for _, pairs in reads for pr in pairs[g]] for g in (ATTN, MAMBA)]
    want, mask = expected_after(d, p, union)
    handles = [d.transport.read("p", *d.planners["p"].indices(pairs), notif) for notif, pairs in reads]
    wait_done(d.transport, handles)
    assert_bytes(d, want)
    assert not d.mem[~mask].any()
    assert collect_notifications(p.transport, len(reads)) == {n: 1 for n, _ in reads}


def test_receiver_posts_a_threaded_read_whole_whatever_the_slice_size(threaded, free_port):
    """``nixl_read_chunk_mib`` bounds how long a post that copies holds D's engine thread; a
    post through worker threads copies nothing, so it is one post (two at most, see
    ``read_plan.thread_slices``), never MiB slices: 600 blocks x 2 layers of 4 KiB would be 5."""
    p, d = threaded("layer_major_dense", BIG_BLOCKS)
    server = granting_side_channel(p, free_port)
    d.transport.remove_peer("p")
    receiver = Receiver(d.transport, ConnectorSettings(nixl_read_chunk_mib=1), "d", COMPAT, None)
    try:
        rng = random.Random(5)
        pairs = [list(zip(rng.sample(range(1, BIG_BLOCKS), 600), rng.sample(range(1, BIG_BLOCKS), 600))), []]
        receiver.add("r", RecvTask(LeaseRef("p", "127.0.0.1", free_port, "P-r"), pairs, 600 * 16, 600 * 16 - 1, [[1]]))
        slices = set()
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            receiver.advance()
            slices |= {r.xfer.slices for r in receiver.reads()}
            done, failed = receiver.take_results()
            assert not failed
            if done:
                break
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert slices and max(slices) <= 2, f"a READ through worker threads was sliced: {slices}"
        want, _ = expected_after(d, p, pairs)
        assert_bytes(d, want)
        assert collect_notifications(p.transport, 1) == {read_done("r"): 1}
    finally:
        receiver.close()
        server.close()
        if not d.transport.has_peer("p"):
            d.add_peer("p", p.transport.agent_metadata, p.regions)


@pytest.mark.parametrize("kind", KINDS)
def test_without_peer_error_handling_threads_move_the_paired_pages_and_notify_once(kind):
    """``nixl_ucx_error_handling: none`` (shared memory instead of tcp for UCX's active messages
    and connection set-up, the setting that avoided the first-READ stalls with worker threads):
    the bytes and the one completion notification are what they are under ``peer``."""
    with peered_pairs(seed=99, num_threads=THREADS, ucx_error_handling="none") as get:
        p, d = get(kind)
        pairs = [list(PAIR_CASES["scattered"][0]), list(PAIR_CASES["scattered"][1])]
        want, mask = expected_after(d, p, pairs)
        wait_done(d.transport, [d.transport.read("p", *d.planners["p"].indices(pairs), b"no-peer")])
        assert_bytes(d, want)
        assert not d.mem[~mask].any()
        assert collect_notifications(p.transport, 1) == {b"no-peer": 1}
