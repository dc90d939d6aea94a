"""An idle engine step with D's READ in NIXL's hands waits instead of polling it in a busy loop
(``WorkerSide._wait_if_idle``, ``idle_wait.idle_step_wait``), and the READ still completes as
soon as it can. Real NIXL, UCX over DRAM, in process.

P's agent runs without its progress thread here, so D's READ stays in flight until P's own
thread progresses its UCX worker: the situation of a P that gets no CPU while D polls, the
starvation loop this wait breaks (docs/operations.md, "CPU hosts")."""

from __future__ import annotations

import threading
import time

import pytest

from pd_connector.core.settings import ConnectorSettings
from pd_connector.core.params import LeaseRef
from pd_connector.engine.decode.receiver import Receiver
from pd_connector.engine.metadata import RecvTask
from pd_connector.engine.worker_side import WorkerSide
from rig import devices

from test_chunked_read import COMPAT, granting_side_channel
from test_transport import P_BLOCKS, TIMEOUT_S, assert_bytes, expected_after, make_engine

pytestmark = [
    pytest.mark.nixl,
    pytest.mark.skipif(devices.on_cuda(), reason="P's agent without a progress thread: a DRAM-over-UCX situation"),
]

KIND = "layer_major_dense"
PAIRS = [[(1, 3), (2, 4), (7, 9)], [(3, 11)]]
WAIT_S = 0.002  # idle_step_wait_ms's default
STALLED_S = 1.0


def idle_worker(receiver: Receiver, wake: threading.Event) -> WorkerSide:
    """The worker side of D in an engine step that scheduled nothing: only what
    ``_wait_if_idle`` reads (a WorkerSide needs a vLLM config to be built whole)."""
    worker = WorkerSide.__new__(WorkerSide)
    worker.receiver, worker.lease_server, worker._wake = receiver, None, wake
    worker._idle_step, worker._idle_wait_s = True, WAIT_S
    return worker


def step(worker: WorkerSide) -> None:
    """One empty engine step's hooks, in vLLM's order: start_load_kv, then get_finished."""
    worker.receiver.advance()
    worker._wait_if_idle()
    worker.receiver.advance()


def test_an_idle_step_waits_on_a_read_in_nixls_hands_instead_of_spinning_and_it_still_completes(free_port):
    p = make_engine(KIND, P_BLOCKS, seed=23, progress_thread=False)
    d = make_engine(KIND, 56, seed=None)
    server = granting_side_channel(p, free_port)
    wake = threading.Event()
    receiver = Receiver(d.transport, ConnectorSettings(), "d", COMPAT, None, wake=wake)
    worker = idle_worker(receiver, wake)
    try:
        receiver.add("r1", RecvTask(LeaseRef("p", "127.0.0.1", free_port, "P-r1"), PAIRS, 16, 15, [[1]]))
        deadline = time.monotonic() + TIMEOUT_S
        while not receiver.reads():  # handshake and claim (side-channel threads)
            step(worker)
            assert not receiver.take_results()[1] and time.monotonic() < deadline
        # P makes no progress: the READ stays in NIXL's hands. Count D's polls meanwhile.
        polls, started = 0, time.monotonic()
        state = d.transport.state

        def counted(handle):
            nonlocal polls
            polls += 1
            return state(handle)

        d.transport.state = counted
        while time.monotonic() - started < STALLED_S:
            step(worker)
        assert receiver.reads(), "the READ completed without P: nothing was tested"
        # Busy-polled, this was ~70,000 polls a second; waiting 1/8 of the time in flight, at
        # most WAIT_S, it is ~60 polls to reach the bound, then 1 per WAIT_S per hook.
        print(f"{polls} polls while the READ was stalled {STALLED_S} s")
        assert polls < 2 * (STALLED_S / WAIT_S + 100), f"{polls} polls in {STALLED_S} s: D spins on the READ"
        # P progresses (as its progress thread would): D notices within a few idle steps.
        resumed, finished = time.monotonic(), set()
        while not finished:
            p.transport.take_notifications()
            step(worker)
            finished, failed = receiver.take_results()
            assert not failed and time.monotonic() - resumed < TIMEOUT_S
        assert time.monotonic() - resumed < 0.5, "the READ completed, but D noticed it late"
        want, _ = expected_after(d, p, PAIRS)
        assert_bytes(d, want)
    finally:
        receiver.close()
        server.close()
        d.transport.close()
        p.transport.close()


def test_a_read_whose_next_slice_is_due_is_never_waited_for(free_port):
    """D's engine thread posts the slices over DRAM without worker threads: an idle step with a
    slice to post returns at once (the copy is this thread's work, a wait would only delay it)."""
    p = make_engine(KIND, P_BLOCKS, seed=29)
    d = make_engine(KIND, 56, seed=None)
    server = granting_side_channel(p, free_port)
    wake = threading.Event()
    receiver = Receiver(d.transport, ConnectorSettings(nixl_read_chunk_mib=0), "d", COMPAT, None, wake=wake)
    receiver._chunk_bytes = 4096  # a slice per descriptor
    worker = idle_worker(receiver, wake)
    waited = []
    wait = wake.wait
    wake.wait = lambda timeout=None: waited.append(timeout) or wait(timeout)
    # Two requests: one slice is posted per advance(), so the other's next slice waits its turn.
    reqs = {"r1": PAIRS, "r2": [[(10, 20), (11, 21)], [(12, 22)]]}
    try:
        for rid, pairs in reqs.items():
            receiver.add(rid, RecvTask(LeaseRef("p", "127.0.0.1", free_port, f"P-{rid}"), pairs, 16, 15, [[1]]))
        deadline, finished, due_steps = time.monotonic() + TIMEOUT_S, set(), 0
        while len(finished) < len(reqs):
            receiver.advance()
            due = bool(receiver.reads()) and None in receiver.reads_in_nixl()
            before = len(waited)
            worker._wait_if_idle()
            if due:
                due_steps += 1
                assert len(waited) == before, "an idle step waited with a slice to post"
            receiver.advance()
            done, failed = receiver.take_results()
            finished |= done
            assert not failed and time.monotonic() < deadline
        assert due_steps, "no step had a slice due: nothing was tested"
        union = [[pr for pairs in reqs.values() for pr in pairs[g]] for g in range(2)]
        want, _ = expected_after(d, p, union)
        assert_bytes(d, want)
    finally:
        receiver.close()
        server.close()
        d.transport.close()
        p.transport.close()
