"""Thin NIXL wrapper: register memory, prepare descriptor lists once per peer, READ, poll.

All descriptor arithmetic lives in ``layout.py``; this module only talks to NIXL. One agent per
worker process. NIXL is not guaranteed thread-safe, so callers serialise access (the worker owns
the agent; the side-channel thread never touches it).
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Sequence

import numpy as np

from pd_connector import layout
from pd_connector.protocol import LayerRegion

logger = logging.getLogger("vllm.pd_connector")

DONE, PENDING, FAILED = "DONE", "PROC", "ERR"


def _import_nixl():
    # vLLM sets this before importing nixl (vllm/distributed/nixl_utils.py): UCX's registration
    # cache otherwise grows without bound under many registrations.
    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise RuntimeError(
            "pd_connector needs NIXL: `pip install nixl==1.5.1` (CPU/CUDA 12/13 wheels). "
            f"Import failed: {exc}"
        ) from exc
    return nixl_agent, nixl_agent_config


class _Peer:
    __slots__ = ("agent_name", "dlist", "offsets", "num_blocks", "regions")

    def __init__(self, agent_name, dlist, regions: Sequence[LayerRegion]):
        self.agent_name = agent_name
        self.dlist = dlist
        self.regions = tuple(regions)
        self.offsets = layout.region_offsets(regions)
        self.num_blocks = np.array([r.num_blocks for r in regions], dtype=np.int64)


class NixlTransport:
    """One NIXL agent with its registered KV pages and the peers it reads from."""

    def __init__(
        self,
        mem_type: str = "DRAM",
        backends: Sequence[str] = ("UCX",),
        num_threads: int = 0,
        name: str | None = None,
    ):
        nixl_agent, nixl_agent_config = _import_nixl()
        self.name = name or f"pd-{uuid.uuid4().hex[:12]}"
        self.mem_type = mem_type
        config = nixl_agent_config(backends=list(backends), num_threads=num_threads)
        try:
            self._agent = nixl_agent(self.name, config)
        except Exception as exc:
            raise RuntimeError(
                f"could not create a NIXL agent with backends {list(backends)}: {exc}. "
                "Check that the backend plugin is installed (NIXL_PLUGIN_DIR) and, for UCX, "
                "that UCX_TLS (if set) keeps 'tcp' for active messages."
            ) from exc
        self._regions: tuple[LayerRegion, ...] = ()
        self._local_dlist = None
        self._local_offsets = np.zeros(0, dtype=np.int64)
        self._local_blocks = np.zeros(0, dtype=np.int64)
        self._regions_of_group: dict[int, np.ndarray] = {}
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
        descriptor list over every (layer, block) page."""
        reg = [(addr, size, dev, "") for addr, size, dev in allocations]
        self._reg_descs = self._agent.register_memory(reg, self.mem_type)
        self._regions = tuple(regions)
        self._local_offsets = layout.region_offsets(regions)
        self._local_blocks = np.array([r.num_blocks for r in regions], dtype=np.int64)
        self._regions_of_group = layout.group_regions(regions)
        self._local_dlist = self._agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT",
            layout.strided_descriptors(regions, device_id),
            self.mem_type,
        )

    @property
    def regions(self) -> tuple[LayerRegion, ...]:
        return self._regions

    @property
    def agent_metadata(self) -> bytes:
        return self._agent.get_agent_metadata()

    # -- peers ----------------------------------------------------------------------------

    def has_peer(self, key: str) -> bool:
        return key in self._peers

    def add_peer(
        self, key: str, agent_metadata: bytes, regions: Sequence[LayerRegion], device_id: int = 0
    ) -> None:
        """Load a remote agent and prepare its descriptor list (once per peer)."""
        layout.check_matching(self._regions, regions)
        agent_name = self._agent.add_remote_agent(agent_metadata)
        if isinstance(agent_name, bytes):
            agent_name = agent_name.decode()
        dlist = self._agent.prep_xfer_dlist(
            agent_name, layout.strided_descriptors(regions, device_id), self.mem_type
        )
        self._peers[key] = _Peer(agent_name, dlist, regions)

    def remove_peer(self, key: str) -> None:
        peer = self._peers.pop(key, None)
        if peer is None:
            return
        try:
            self._agent.release_dlist_handle(peer.dlist)
            self._agent.remove_remote_agent(peer.agent_name)
        except Exception as exc:  # pragma: no cover - best effort during teardown
            logger.warning("pd_connector: removing NIXL peer %s failed: %s", key, exc)

    # -- transfers ------------------------------------------------------------------------

    def plan(
        self, key: str, pairs: Sequence[Sequence[tuple[int, int]]]
    ) -> tuple[np.ndarray, np.ndarray]:
        """Descriptor indices (local, remote) for per-group (remote block, local block) pairs."""
        peer = self._peers[key]
        return layout.descriptor_indices(
            pairs,
            self._regions_of_group,
            self._local_offsets,
            peer.offsets,
            self._local_blocks,
            peer.num_blocks,
        )

    def read(self, key: str, local_idx: np.ndarray, remote_idx: np.ndarray, notif: bytes):
        """Post one READ (remote -> local) with a completion notification to the remote."""
        peer = self._peers[key]
        handle = self._agent.make_prepped_xfer(
            "READ", self._local_dlist, local_idx, peer.dlist, remote_idx, notif_msg=notif
        )
        state = self._agent.transfer(handle)
        if state == FAILED:
            self.release(handle)
            raise RuntimeError("NIXL refused to post the READ")
        return handle

    def state(self, handle) -> str:
        """DONE, PROC or ERR; an exception from NIXL counts as ERR."""
        try:
            return self._agent.check_xfer_state(handle)
        except Exception as exc:
            logger.warning("pd_connector: NIXL transfer state check failed: %s", exc)
            return FAILED

    def release(self, handle) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as exc:  # pragma: no cover
            logger.warning("pd_connector: releasing a NIXL handle failed: %s", exc)

    def notify(self, key: str, message: bytes) -> None:
        self._agent.send_notif(self._peers[key].agent_name, message)

    def take_notifications(self) -> list[bytes]:
        """Notifications received since the last call, from every peer."""
        notifs = self._agent.get_new_notifs()
        return [m for msgs in notifs.values() for m in msgs]

    def close(self) -> None:
        for key in list(self._peers):
            self.remove_peer(key)
        try:
            if self._local_dlist is not None:
                self._agent.release_dlist_handle(self._local_dlist)
            if self._reg_descs is not None:
                self._agent.deregister_memory(self._reg_descs)
        except Exception as exc:  # pragma: no cover
            logger.warning("pd_connector: NIXL teardown failed: %s", exc)
        self._local_dlist = None
        self._reg_descs = None
