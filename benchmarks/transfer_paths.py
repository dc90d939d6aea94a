"""The ways the transfer benchmark moves one request's bytes, plus first-request cost.

  connector  exactly what ``pd_connector/engine/decode/receiver.py`` does per request: ``read_plan.Planner.plan``
             -> ``read_slices`` -> ``ChunkedRead`` (prepared lists; slices of
             ``nixl_read_chunk_mib`` where the post copies, else one post through the worker
             threads; notification on the last) polled to DONE.
  raw        the same agents and registrations, the same number of bytes as ONE descriptor
             (prepared once, like the connector's lists): make_prepped_xfer + transfer + poll.
  raw_threads  the same, as one descriptor per worker thread.
  memcpy     ``torch`` ``copy_`` of the same number of bytes between the same two buffers
             (CPU: one torch thread, like UCX's single-copy cma; CUDA: device copy).
  cma_runs   DRAM only, Linux: the kernel call UCX's cma transport makes for each descriptor
             (``process_vm_readv``) on exactly the connector's merged runs, up to ``IOV_MAX``
             runs per call, and nothing else: no NIXL, no UCX, no request per descriptor. The
             most any transfer over cma can reach on those ranges.
  cma_one    the same call on the same bytes as ONE range: raw NIXL's counterpart.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time

import numpy as np
import torch

from pd_connector.core.settings import ConnectorSettings
from pd_connector.core.idle_wait import idle_step_wait
from pd_connector.core.read_plan import Planner
from pd_connector.transport.nixl import DONE, FAILED, ChunkedRead, NixlTransport
from rig import nixl_peers

KEY = "bench-p"
POLL_S = 0.0002
# The connector path waits between polls as an idle engine step does (idle_wait.idle_step_wait);
# 0 (``--idle-step-wait-ms 0``) polls every POLL_S, as D did before that wait covered READs.
IDLE_WAIT_S = ConnectorSettings().idle_step_wait_ms / 1000
MISSING_NOTIFS: list[int] = []


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wait_handle(state_of, handle, timeout_s: float = 60.0) -> None:
    """Poll until DONE, sleeping POLL_S between polls as an engine loop polls once per step (a
    tight spin would steal a core from NIXL's own threads)."""
    deadline = time.perf_counter() + timeout_s
    while True:
        state = state_of(handle)
        if state == DONE:
            return
        if state == FAILED:
            raise RuntimeError("NIXL transfer failed")
        if time.perf_counter() > deadline:
            raise RuntimeError("NIXL transfer timed out")
        time.sleep(POLL_S)


def drain(p_t: NixlTransport, want: int = 1, timeout_s: float = 10.0) -> int:
    """Wait (untimed) for P's completion notification(s) so none pile up across reps."""
    got, deadline = 0, time.monotonic() + timeout_s
    while got < want and time.monotonic() < deadline:
        got += len(p_t.take_notifications())
        if got < want:
            time.sleep(0.0005)
    if got < want:
        MISSING_NOTIFS.append(want - got)
    return got


def connector_once(
    d_t: NixlTransport, planner: Planner, pairs, notif: bytes, chunk_bytes: int, key: str = KEY
) -> dict:
    """receiver.py's per-request path from peer ``key`` (its ``planner``), back to back (an idle
    engine: a step per slice, each POLL_S plus the idle step's wait, ``IDLE_WAIT_S``), timed end
    to end; ``post`` = the longest single call into NIXL, i.e. the longest stall of D's engine
    thread."""
    t0 = time.perf_counter()
    xfer = ChunkedRead(d_t, key, planner.plan(pairs, chunk_bytes), notif)
    t1 = time.perf_counter()
    longest, deadline = 0.0, t1 + 60.0
    while True:
        tc = time.perf_counter()
        posted = xfer.next
        state = xfer.advance()
        longest = max(longest, time.perf_counter() - tc)
        if state == DONE:
            break
        if state == FAILED:
            raise RuntimeError(xfer.error)
        if xfer.next == posted:  # nothing posted: the slice in flight is still running
            if time.perf_counter() > deadline:
                raise RuntimeError("connector READ timed out")
            time.sleep(POLL_S + idle_step_wait(True, IDLE_WAIT_S, 0, True, [xfer.in_nixl_for(time.monotonic())]))
    t2 = time.perf_counter()
    return {"total": t2 - t0, "plan": t1 - t0, "post": longest, "slices": xfer.slices}


def prepped_read(agent, local, remote, idx: np.ndarray, notif: bytes = b"") -> dict:
    """One READ of descriptors ``idx`` of two prepared lists, posted and polled to DONE (seconds:
    ``total``, and ``post`` for the call that posts it)."""
    t0 = time.perf_counter()
    handle = agent.make_prepped_xfer("READ", local, idx, remote, idx, notif_msg=notif)
    if agent.transfer(handle) == FAILED:
        raise RuntimeError("NIXL refused the READ")
    t1 = time.perf_counter()
    wait_handle(agent.check_xfer_state, handle)
    agent.release_xfer_handle(handle)
    return {"total": time.perf_counter() - t0, "post": t1 - t0}


class RawNixl:
    """The same bytes as ONE prepared descriptor, on the connector's own agents; with ``parts``
    > 1, as that many equal descriptors (one per worker thread: NIXL's thread pool splits a
    READ by descriptors, never inside one), listed last part first so NIXL cannot merge them
    back into one."""

    def __init__(self, d_t: NixlTransport, p_base: int, d_base: int, nbytes: int, dev: int, parts: int = 1):
        self.agent = d_t._agent  # the benchmark reaches into the transport on purpose
        peer = d_t._peers[KEY].agent_name
        bounds = [nbytes * i // parts for i in range(parts + 1)][::-1]
        spans = [(lo, hi - lo) for hi, lo in zip(bounds, bounds[1:])]
        self.local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(d_base + o, n, dev) for o, n in spans], d_t.mem_type)
        self.remote = self.agent.prep_xfer_dlist(peer, [(p_base + o, n, dev) for o, n in spans], d_t.mem_type)
        self.idx = np.arange(parts, dtype=np.int32)

    def once(self, notif: bytes) -> dict:
        return prepped_read(self.agent, self.local, self.remote, self.idx, notif)

    def close(self) -> None:
        self.agent.release_dlist_handle(self.local)
        self.agent.release_dlist_handle(self.remote)


# Linux UIO_MAXIOV: the most ranges one process_vm_readv call takes on either side.
IOV_MAX = 1024


def cma_available(device: torch.device) -> bool:
    return device.type == "cpu" and sys.platform.startswith("linux")


class CmaRead:
    """``process_vm_readv`` of byte ranges (local address, remote address, bytes) from process
    ``pid`` (default: this one, where the benchmark keeps both sides, as UCX then reads itself).

    Over DRAM, UCX 1.x's cma transport pins and copies each descriptor with a call of its own
    (one remote range per call). The kernel pins a remote range's pages separately for every
    range (``process_vm_rw_core`` -> ``process_vm_rw_single_vec``, at most 1024 pages per pin), so
    ranges of a few dozen pages pay a fixed cost each even when one call carries 1024 of them:
    comparing this path on the connector's runs with the same bytes as one range measures what
    no descriptor list, NIXL setting or UCX setting can remove."""

    def __init__(self, local_addr: np.ndarray, remote_addr: np.ndarray, nbytes: np.ndarray, pid: int | None = None):
        libc = ctypes.CDLL(None, use_errno=True)
        self._call = libc.process_vm_readv
        self._call.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                               ctypes.c_ulong]
        self._call.restype = ctypes.c_ssize_t
        self.pid = os.getpid() if pid is None else pid
        # struct iovec {void *iov_base; size_t iov_len;}: two 64-bit words per range.
        self._local = np.stack([local_addr, nbytes], axis=1).astype(np.uint64)
        self._remote = np.stack([remote_addr, nbytes], axis=1).astype(np.uint64)
        self.nbytes = int(np.sum(nbytes))
        self._calls = [
            (self._local[s:].ctypes.data, self._remote[s:].ctypes.data, min(IOV_MAX, len(nbytes) - s),
             int(np.sum(nbytes[s : s + IOV_MAX])))
            for s in range(0, len(nbytes), IOV_MAX)
        ]

    def once(self) -> dict:
        t0 = time.perf_counter()
        for local, remote, count, want in self._calls:
            got = self._call(self.pid, local, count, remote, count, 0)
            if got != want:
                err = ctypes.get_errno()
                raise OSError(err, f"process_vm_readv moved {got} of {want} bytes: {os.strerror(err)}")
        return {"total": time.perf_counter() - t0, "calls": len(self._calls)}


def memcpy_once(src: torch.Tensor, dst: torch.Tensor, nbytes: int, device: torch.device) -> dict:
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        sync(device)
        t0 = time.perf_counter()
        dst[:nbytes].copy_(src[:nbytes])
        sync(device)
        return {"total": time.perf_counter() - t0}
    finally:
        torch.set_num_threads(threads)


def per_descriptor_cost(sizes: tuple[int, ...], count: int, reps: int, progress_delay_us: int) -> list[dict]:
    """DRAM: ``count`` descriptors of each size in ``sizes`` (every other slot of a buffer, so
    none merge), moved by ONE prepared NIXL READ and by ``CmaRead`` (the kernel call alone) on
    the same ranges; medians in µs per descriptor. The difference is what NIXL and UCX add per
    descriptor above the kernel, whatever its size: it bounds every list of small pages."""
    p_t, d_t = (NixlTransport("DRAM", name=f"perdesc-{role}-{os.getpid()}", progress_delay_us=progress_delay_us)
                for role in "PD")
    p_agent, d_agent = p_t._agent, d_t._agent  # the benchmark reaches into the transport on purpose
    out = []
    try:
        for size in sizes:
            src = torch.ones(2 * count * size, dtype=torch.uint8)
            dst = torch.zeros_like(src)
            regs = [agent.register_memory([(buf.data_ptr(), buf.numel(), 0, "")], "DRAM")
                    for agent, buf in ((p_agent, src), (d_agent, dst))]
            peer = d_agent.add_remote_agent(p_agent.get_agent_metadata())  # with P's new registration
            peer = peer.decode() if isinstance(peer, bytes) else peer
            offsets = np.arange(count, dtype=np.int64) * 2 * size
            local = d_agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(dst.data_ptr() + int(o), size, 0) for o in offsets], "DRAM")
            remote = d_agent.prep_xfer_dlist(peer, [(src.data_ptr() + int(o), size, 0) for o in offsets], "DRAM")
            idx = np.arange(count, dtype=np.int32)
            kernel = CmaRead(dst.data_ptr() + offsets, src.data_ptr() + offsets, np.full(count, size, dtype=np.int64))
            nixl_s, kernel_s = [], []
            for _ in range(reps + 1):  # the first pair warms UCX's endpoint and registration cache
                nixl_s.append(prepped_read(d_agent, local, remote, idx)["total"])
                kernel_s.append(kernel.once()["total"])
            nixl_us = float(np.median(nixl_s[1:])) / count * 1e6
            kernel_us = float(np.median(kernel_s[1:])) / count * 1e6
            out.append({"bytes": size, "descriptors": count, "nixl_us": nixl_us, "kernel_us": kernel_us,
                        "nixl_minus_kernel_us": nixl_us - kernel_us})
            d_agent.release_dlist_handle(local)
            d_agent.release_dlist_handle(remote)
            d_agent.remove_remote_agent(peer)
            p_agent.deregister_memory(regs[0])
            d_agent.deregister_memory(regs[1])
    finally:
        d_t.close()
        p_t.close()
    return out


def first_request(p_side, d_side, pairs, mem_type: str, dev: int, chunk_bytes: int, num_threads: int,
                  progress_delay_us: int) -> dict:
    """Cold-start cost of one P/D pair, step by step, then the same READ warm (seconds).

    D's connector does: agent creation + registration at start-up (``register_kv_caches``);
    on the first request from a P, the side-channel handshake (ZMQ, a background thread, not
    measured here: see ``vllm:pd_handshake_seconds``), then ``add_peer`` (plan the peer, load
    P's metadata, prepare P's list) and ``connect`` (UCX endpoints) on the engine thread, while
    the claim round trip is in flight; every later request reuses all of it."""
    out: dict[str, float] = {}
    t = time.perf_counter()
    p_t, d_t = (
        NixlTransport(mem_type=mem_type, num_threads=num_threads, name=f"first-{role}-{os.getpid()}",
                      progress_delay_us=progress_delay_us)
        for role in "PD"
    )
    out["create_agents_x2"] = time.perf_counter() - t
    try:
        t = time.perf_counter()
        p_t.register(p_side.allocations, p_side.regions, dev)
        d_t.register(d_side.allocations, d_side.regions, dev)
        out["register_x2"] = time.perf_counter() - t
        t = time.perf_counter()
        meta = p_t.agent_metadata
        out["get_metadata"] = time.perf_counter() - t
        out["metadata_bytes"] = len(meta)
        t = time.perf_counter()
        planner = nixl_peers.add_peer(d_t, KEY, meta, p_side.regions, dev)
        out["add_peer"] = time.perf_counter() - t
        t = time.perf_counter()
        d_t.connect(KEY)
        out["connect"] = time.perf_counter() - t
        for label in ("first_read", "second_read", "warm_read"):
            out[label] = connector_once(d_t, planner, pairs, label.encode(), chunk_bytes)["total"]
            drain(p_t)
    finally:
        d_t.close()
        p_t.close()
    return out
