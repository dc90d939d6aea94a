"""One D transport peered with one P of the same TP size and block sizes, as tests and
benchmarks pair them: planned (``read_plan.plan_peer``), added to the transport, and the
``Planner`` handed back (what ``PrefillPeers`` keeps per P rank in the connector)."""

from __future__ import annotations

from collections.abc import Sequence

from pd_connector.core import read_plan
from pd_connector.core.protocol import LayerRegion
from pd_connector.transport.nixl import NixlTransport


def add_peer(
    transport: NixlTransport, key: str, agent_metadata: bytes, regions: Sequence[LayerRegion], device_id: int = 0,
    agent_name: str = "", *, packed: bool = True,
) -> read_plan.Planner:
    """Peer ``transport`` (D, registered) with the P whose page map is ``regions`` as ``key``;
    the planner of its READs. ``packed=False``: one descriptor per layer page, as before
    packed spans (``read_plan.plan_engine``)."""
    plan = read_plan.plan_peer(
        transport.regions, regions, threads=transport.threads, copies_in_post=transport.copies_in_post, packed=packed
    )
    transport.add_peer(key, agent_metadata, plan, device_id, agent_name)
    return plan.planner
