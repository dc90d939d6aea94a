"""Thin NIXL wrapper: register memory, prepare a peer's two descriptor lists, READ, poll.

What to read from a peer, and how each READ is cut, is decided in ``core/read_plan.py``
(``plan_engine``: a ``PeerPlan`` per P rank, with its ``Planner``); the caller keeps the
planners and hands ``add_peer`` the plan, whose rows this module prepares as they are. It
states the facts the planner needs about posting (``threads``, ``copies_in_post``) and
otherwise only talks to NIXL. One agent per worker process. NIXL is not guaranteed thread-safe,
so callers serialise access (the worker owns the agent; the side-channel thread never touches
it).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import uuid
from collections.abc import Sequence

import numpy as np

from pd_connector.core import read_plan
from pd_connector.core.protocol import LayerRegion
from pd_connector.transport.backends import backend_params, import_nixl

logger = logging.getLogger("vllm.pd_connector")

DONE, PENDING, FAILED = "DONE", "PROC", "ERR"
# A peer set-up, teardown, release or notification call that holds the engine thread this long
# is logged: NIXL 1.5.1's binding releases the GIL in only some of its calls, and one that keeps
# it stops every thread of the process, the side channel's included (docs/operations.md,
# "Unanswered first calls"). D's READ posts and polls are timed by the receiver (nixl_call_slow).
SLOW_CALL_S = 1.0


_AGENT_CREATION = threading.Lock()


def _timed(what: str, call, *args):
    """``call(*args)``, logged when it held this thread SLOW_CALL_S or more."""
    started = time.monotonic()
    try:
        return call(*args)
    finally:
        took = time.monotonic() - started
        if took >= SLOW_CALL_S:
            logger.warning("pd_connector: NIXL %s held this process's engine thread %.1f s", what, took)


class _DelayedProgressBind:
    """Stands in for NIXL's ``nixlBind`` module while ``nixl_agent.__init__`` runs, setting the
    progress thread's poll delay that the Python API hard-codes to 0 (``agent_config.pthrDelay
    = 0`` in nixl/_api.py, NIXL 1.5.1). With 0 the thread spins (sched_yield): a whole core per
    connected agent on a CPU host (docs/benchmarks.md, "NIXL progress thread")."""

    def __init__(self, bind, delay_us: int):
        self._bind, self._delay_us = bind, delay_us

    def __getattr__(self, name):
        return getattr(self._bind, name)

    def nixlAgent(self, name, config):  # noqa: N802 - NIXL's name
        config.pthrDelay = self._delay_us
        return self._bind.nixlAgent(name, config)


def create_agent(nixl_agent, name: str, config, progress_delay_us: int = 0):
    """``nixl_agent(name, config)``, with the progress thread polling every
    ``progress_delay_us`` (0: NIXL's own behaviour, no pause)."""
    api = sys.modules.get(nixl_agent.__module__)
    if progress_delay_us <= 0 or api is None or not hasattr(api, "nixlBind"):
        if progress_delay_us > 0:
            logger.warning("pd_connector: this NIXL has no nixlBind to set the progress delay on; using NIXL's")
        return nixl_agent(name, config)
    with _AGENT_CREATION:  # the swap is module-global: one agent creation at a time
        bind = api.nixlBind
        api.nixlBind = _DelayedProgressBind(bind, progress_delay_us)
        try:
            return nixl_agent(name, config)
        finally:
            api.nixlBind = bind




class _Peer:
    __slots__ = ("agent_name", "dlist", "local_dlist")

    def __init__(self, agent_name, dlist, local_dlist):
        self.agent_name = agent_name
        self.dlist = dlist
        self.local_dlist = local_dlist


class NixlTransport:
    """One NIXL agent with its registered KV pages and the peers it reads from."""

    def __init__(
        self,
        mem_type: str = "DRAM",
        backends: Sequence[str] = ("UCX",),
        num_threads: int = 0,
        name: str | None = None,
        capture_telemetry: bool = False,
        progress_thread: bool = True,
        progress_delay_us: int = 0,
        ucx_error_handling: str = "peer",
    ):
        nixl_agent, nixl_agent_config = import_nixl()
        self.name = name or f"pd-{uuid.uuid4().hex[:12]}"
        self.mem_type = mem_type
        # UCX's worker threads post and copy; without them a DRAM READ copies inside the post.
        threaded = num_threads > 0 and "UCX" in backends
        self._copies_in_post = mem_type == "DRAM" and not threaded
        self._threads = num_threads if threaded else 1
        # Backends are created here, not by nixl_agent, which passes UCX nothing but num_threads.
        config = nixl_agent_config(
            enable_prog_thread=progress_thread, backends=[], capture_telemetry=capture_telemetry
        )
        try:
            self._agent = create_agent(nixl_agent, self.name, config, progress_delay_us)
            for backend in backends:
                self._agent.create_backend(backend, backend_params(backend, num_threads, ucx_error_handling))
        except Exception as exc:
            raise RuntimeError(
                f"could not create a NIXL agent with backends {list(backends)}: {exc}. "
                "Check that the backend plugin is installed (NIXL_PLUGIN_DIR) and, for UCX, "
                "that UCX_TLS (if set) keeps 'tcp' for active messages."
            ) from exc
        self._regions: tuple[LayerRegion, ...] = ()
        self._device_id = 0
        # Local prepared lists by ``PeerPlan.local_key``: peers with the same packing and local
        # page map (the same speculative token count, the same shard) share one.
        self._local_lists: dict[tuple, object] = {}
        self._peers: dict[str, _Peer] = {}
        self._reg_descs = None

    # -- local memory ---------------------------------------------------------------------

    def register(
        self,
        allocations: Sequence[tuple[int, int, int]],
        regions: Sequence[LayerRegion],
        device_id: int = 0,
    ) -> None:
        """Register whole allocations ``(addr, nbytes, device)`` once, then prepare the local
        descriptor list a peer of this very layout reads into, before any handshake needs it."""
        reg = [(addr, size, dev, "") for addr, size, dev in allocations]
        self._reg_descs = self._agent.register_memory(reg, self.mem_type)
        self._regions = tuple(regions)
        self._device_id = device_id
        self._local_list(
            read_plan.plan_peer(self._regions, self._regions, threads=self.threads, copies_in_post=self.copies_in_post)
        )

    def _local_list(self, plan: read_plan.PeerPlan):
        """``plan``'s local list, prepared once per ``plan.local_key``."""
        if plan.local_key not in self._local_lists:
            self._local_lists[plan.local_key] = self._agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", plan.local_rows.strided(self._device_id), self.mem_type
            )
        return self._local_lists[plan.local_key]

    @property
    def regions(self) -> tuple[LayerRegion, ...]:
        return self._regions

    @property
    def threads(self) -> int:
        """UCX worker threads each READ is spread over (1: none)."""
        return self._threads

    @property
    def copies_in_post(self) -> bool:
        """Whether posting a READ copies its bytes before returning: DRAM without UCX worker
        threads."""
        return self._copies_in_post

    @property
    def agent_metadata(self) -> bytes:
        return self._agent.get_agent_metadata()

    # -- peers ----------------------------------------------------------------------------

    def has_peer(self, key: str) -> bool:
        return key in self._peers

    def add_peer(
        self, key: str, agent_metadata: bytes, plan: read_plan.PeerPlan, device_id: int = 0, agent_name: str = ""
    ) -> None:
        """Load a remote agent and prepare the two descriptor lists of ``plan`` (the remote one
        on the peer's ``device_id``; the local one shared by peers of the same
        ``plan.local_key``)."""
        # A kv_both instance may hand a request to itself (a router that lists one instance in
        # both pools). NIXL reads loopback under the agent's own name and refuses to load its own
        # metadata ("remote agent name same as local agent", NIXL_ERR_INVALID_PARAM).
        if agent_name != self.name:
            loaded = _timed("add_remote_agent", self._agent.add_remote_agent, agent_metadata)
            agent_name = loaded.decode() if isinstance(loaded, bytes) else loaded
        local_dlist = self._local_list(plan)
        strided = plan.remote_rows.strided(device_id)
        dlist = _timed("prep_xfer_dlist", self._agent.prep_xfer_dlist, agent_name, strided, self.mem_type)
        self._peers[key] = _Peer(agent_name, dlist, local_dlist)

    def connect(self, key: str) -> None:
        """Set up the transport connection to a peer now (UCX endpoints, remote keys), so the
        first READ does not pay for it; best effort (the first READ connects otherwise)."""
        peer = self._peers[key]
        if peer.agent_name == self.name:
            return
        try:
            _timed("make_connection", self._agent.make_connection, peer.agent_name)
        except Exception as exc:  # pragma: no cover - depends on the backend
            logger.info("pd_connector: pre-connecting to NIXL peer %s failed: %s", key, exc)

    def remove_peer(self, key: str) -> None:
        peer = self._peers.pop(key, None)
        if peer is None:
            return
        try:
            _timed("release_dlist_handle", self._agent.release_dlist_handle, peer.dlist)
            if peer.agent_name != self.name:
                _timed("remove_remote_agent", self._agent.remove_remote_agent, peer.agent_name)
        except Exception as exc:  # pragma: no cover - best effort during teardown
            logger.warning("pd_connector: removing NIXL peer %s failed: %s", key, exc)

    # -- transfers ------------------------------------------------------------------------

    def read(self, key: str, local_idx: np.ndarray, remote_idx: np.ndarray, notif: bytes):
        """Post one READ (remote -> local) with a completion notification to the remote
        (none when ``notif`` is empty)."""
        peer = self._peers[key]
        handle = self._agent.make_prepped_xfer(
            "READ", peer.local_dlist, local_idx, peer.dlist, remote_idx, notif_msg=notif
        )
        state = self._agent.transfer(handle)
        if state == FAILED:
            self.discard(handle)
            raise RuntimeError("NIXL refused to post the READ")
        return handle

    def merged_descriptors(self, handle) -> int:
        """NIXL's own count of descriptors a posted READ moved (``capture_telemetry`` agents)."""
        return int(self._agent.get_xfer_telemetry(handle).descCount)

    def state(self, handle) -> str:
        """DONE, PROC or ERR; an exception from NIXL counts as ERR."""
        try:
            return self._agent.check_xfer_state(handle)
        except Exception as exc:
            logger.warning("pd_connector: NIXL transfer state check failed: %s", exc)
            return FAILED

    def discard(self, handle) -> None:
        try:
            _timed("release_xfer_handle", self._agent.release_xfer_handle, handle)
        except Exception as exc:  # pragma: no cover
            logger.warning("pd_connector: releasing a NIXL handle failed: %s", exc)

    def notify(self, key: str, message: bytes) -> None:
        _timed("send_notif", self._agent.send_notif, self._peers[key].agent_name, message)

    def take_notifications(self) -> list[bytes]:
        """Notifications received since the last call, from every peer."""
        notifs = _timed("get_new_notifs", self._agent.get_new_notifs)
        return [m for msgs in notifs.values() for m in msgs]

    def close(self) -> None:
        for key in list(self._peers):
            self.remove_peer(key)
        try:
            for dlist in self._local_lists.values():
                self._agent.release_dlist_handle(dlist)
            if self._reg_descs is not None:
                self._agent.deregister_memory(self._reg_descs)
        except Exception as exc:  # pragma: no cover
            logger.warning("pd_connector: NIXL teardown failed: %s", exc)
        self._local_lists = {}
        self._reg_descs = None


class ChunkedRead:
    """One request's READ, posted as consecutive slices of the planned descriptors, at most one
    slice per ``advance()`` call, the completion notification on the last slice only (P must
    not free its blocks before every slice landed).

    Why: over DRAM without UCX worker threads, UCX copies inside ``transfer()`` (shared-memory
    cma), so one big READ holds the calling thread -- D's engine thread -- for the whole copy.
    A slice bounds that (docs/benchmarks.md, "Transfer path"). With worker threads
    (``nixl_num_threads``) or over VRAM the post is asynchronous and the plan is one slice
    (``NixlTransport.copies_in_post``). NIXL 1.5.1 agents are not thread-safe in their default
    sync mode, and its RW mode serialises other calls behind a running ``transfer()``, so posting from a helper thread of ours would not help: every NIXL call stays
    on the engine thread, and NIXL's own worker threads do the copying.
    """

    def __init__(self, transport: NixlTransport, key: str, plan: read_plan.ReadPlan, notif: bytes):
        self.transport, self.key, self.notif = transport, key, notif
        self.local_idx, self.remote_idx = plan.local_idx, plan.remote_idx
        self.bounds = list(plan.bounds) or [(0, int(plan.local_idx.size))]
        self.next = 0  # index of the next slice to post
        self.handle = None
        self.posted_at = 0.0  # time.monotonic() when the slice in flight was posted
        self.error = ""
        self.error_kind = ""  # "post" (NIXL refused a slice) or "nixl" (a slice failed)

    @property
    def slices(self) -> int:
        return len(self.bounds)

    def advance(self, may_post: bool = True) -> str:
        """Poll the slice in flight; post the next one (when ``may_post``) once it is DONE.
        Returns DONE when every slice is done, FAILED (see ``error``) or PENDING."""
        if self.handle is not None:
            state = self.transport.state(self.handle)
            if state not in (DONE, FAILED):
                return PENDING
            self.transport.discard(self.handle)
            self.handle = None
            if state == FAILED:
                self.error, self.error_kind = "NIXL reported the READ failed", "nixl"
                return FAILED
        if self.next == len(self.bounds):
            return DONE
        if not may_post:
            return PENDING
        a, b = self.bounds[self.next]
        last = self.next == len(self.bounds) - 1
        try:
            self.handle = self.transport.read(
                self.key, self.local_idx[a:b], self.remote_idx[a:b], self.notif if last else b""
            )
        except Exception as exc:
            self.error, self.error_kind = f"posting the READ failed: {exc}", "post"
            return FAILED
        self.posted_at = time.monotonic()
        self.next += 1
        return PENDING

    def in_nixl_for(self, now: float) -> float | None:
        """How long the slice in flight has been in NIXL's hands (its copy is NIXL's progress
        and worker threads' to make), or None when the next slice is due to be posted here."""
        return None if self.handle is None else max(0.0, now - self.posted_at)

    def close(self) -> None:
        if self.handle is not None:
            self.transport.discard(self.handle)
            self.handle = None
