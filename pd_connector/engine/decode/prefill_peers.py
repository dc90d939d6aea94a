"""D's connections to prefill engines, on one TP rank: one background handshake per P engine
(all the P ranks this rank pairs with), what to read from each (``read_plan.plan_engine``: the
shard plan when the TP sizes differ, the phase plan when attention block sizes do), and per P
rank a transport peer (``engine_id#rank``) with the ``Planner`` of its READs. A failed
connection is remembered until no load waits for it, so a later request retries (P may have
restarted). An engine no load has used for ``prefill_engine_idle_seconds`` is forgotten: vLLM
gives every P start a fresh engine id (``engine_id`` defaults to a random UUID,
vllm/config/kv_transfer.py), so an engine that restarted or scaled away would otherwise hold
its NIXL agent, descriptor lists and sockets on every D rank for the life of D."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from concurrent.futures import Future
from dataclasses import dataclass, field

from pd_connector.core import block_phases, read_plan, shards
from pd_connector.core.params import LeaseRef
from pd_connector.engine.metrics import Recorder
from pd_connector.transport.nixl import NixlTransport
from pd_connector.transport.lease_client import PeerRefused, LeaseClient

logger = logging.getLogger("vllm.pd_connector")


@dataclass
class ConnectedEngine:
    """A connected P engine: the transport peer key per paired P rank (None: this rank reads
    nothing from it), each peer's READ planner, the P ranks' NIXL agent names (a restarted P
    has new ones), and when a load last asked for it."""

    sources: dict[int, str | None]
    planners: dict[str, read_plan.Planner]
    agents: dict[int, str]
    side_channels: tuple[tuple[str, int], ...] = ()
    block_sizes: tuple[int, ...] = ()  # P's per transfer group, from its handshake
    last_used: float = field(default_factory=time.monotonic)


class PrefillPeers:
    def __init__(
        self,
        transport: NixlTransport,
        calls: LeaseClient,
        submit: Callable[..., Future],
        tp_rank: int,
        tp_size: int,
        recorder: Recorder,
        idle_seconds: float = 600.0,
    ):
        self.transport = transport
        self._calls = calls
        self._submit = submit
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.recorder = recorder
        self.engines: dict[str, ConnectedEngine] = {}
        self.errors: dict[str, tuple[str, str]] = {}  # engine id -> (why, kind)
        self._connecting: dict[str, tuple[Future, LeaseRef]] = {}
        self.idle_seconds = idle_seconds
        # Idle engines are looked for a few times per idle period, not on every engine step.
        self._next_sweep = time.monotonic() + idle_seconds / 4

    def forget_errors(self) -> None:
        if not self._connecting:
            self.errors.clear()

    def connect(self, prefill: LeaseRef) -> None:
        """Start connecting to ``prefill``'s engine unless connected or connecting."""
        key = prefill.engine_id
        engine = self.engines.get(key)
        if engine is not None:
            engine.last_used = time.monotonic()
            return
        if key in self._connecting:
            return
        ranks = shards.peer_ranks(prefill.tp_size, self.tp_size, self.tp_rank)
        self._connecting[key] = (self._submit(self._handshakes, prefill, ranks), prefill)

    def _handshakes(self, prefill: LeaseRef, ranks: tuple[int, ...]):
        return [(rank, *self._calls.handshake(prefill, rank)) for rank in ranks]

    def finish_connects(self) -> None:
        for key, (future, prefill) in list(self._connecting.items()):
            if not future.done():
                continue
            del self._connecting[key]
            try:
                answers = future.result()
                started = time.monotonic()
                engine = self._add_engine(key, answers, prefill)
            except block_phases.BlockSizeError as exc:
                self.errors[key] = (f"attention block sizes cannot be paired: {exc}", "block_size")
                logger.warning("pd_connector: refusing prefill engine %s: %s", key, exc)
                continue
            except shards.ShardError as exc:
                self.errors[key] = (f"tensor-parallel layouts cannot be paired: {exc}", "tp_mismatch")
                logger.warning("pd_connector: refusing prefill engine %s: %s", key, exc)
                continue
            except PeerRefused as exc:
                self.errors[key] = (f"handshake failed: {exc}", exc.kind)
                logger.warning("pd_connector: refusing prefill engine %s: %s", key, exc)
                continue
            except Exception as exc:
                self.errors[key] = (f"handshake failed: {exc}", "handshake")
                logger.warning("pd_connector: handshake with prefill engine %s failed: %s", key, exc)
                continue
            self.engines[key] = engine
            self._report_connected()
            self.errors.pop(key, None)
            self.recorder.observe("handshake_seconds", max(s for _, _, s in answers) + time.monotonic() - started)
            logger.info(
                "pd_connector: TP rank %d/%d connected to prefill engine %s (TP %d, ranks %s)",
                self.tp_rank,
                self.tp_size,
                key,
                answers[0][1].tp_size,
                [rank for rank, _, _ in answers],
            )

    def _add_engine(self, key: str, answers, prefill: LeaseRef) -> ConnectedEngine:
        """Load the paired P ranks' agents and prepare what to read from each."""
        p = answers[0][1].tp_size
        welcome_of = {rank: welcome for rank, welcome, _ in answers}
        mine = self._calls.compat.groups
        block_sizes = tuple(g.block_size for g in answers[0][1].compat.groups)
        local_sizes = [g.block_size for g in mine]
        phases = block_phases.PhasePlan.of(block_sizes, local_sizes, [g.kind for g in mine])
        plans = read_plan.plan_engine(
            self.transport.regions,
            {rank: w.regions for rank, w in welcome_of.items()},
            [rank for rank, _, _ in answers],
            p == self.tp_size,
            phases,
            local_sizes,
            block_sizes,
            threads=self.transport.threads,
            copies_in_post=self.transport.copies_in_post,
        )
        sources: dict[int, str | None] = {}
        planners: dict[str, read_plan.Planner] = {}
        for rank, plan in plans.items():
            if plan is None:
                sources[rank] = None  # every unit this rank holds is read from another
                continue
            peer = f"{key}#{rank}"
            welcome = welcome_of[rank]
            self.transport.remove_peer(peer)
            self.transport.add_peer(peer, welcome.agent_metadata, plan, agent_name=welcome.agent_name)
            # Connect now, while the claim is in flight, not in the first READ.
            self.transport.connect(peer)
            sources[rank] = peer
            planners[peer] = plan.planner
        channels = tuple((prefill.host, prefill.rank_port(rank)) for rank in welcome_of)
        agents = {rank: w.agent_name for rank, w in welcome_of.items()}
        return ConnectedEngine(sources, planners, agents, channels, block_sizes)

    def forget_idle(self, in_use: Callable[[], Collection[str]], now: float | None = None) -> None:
        """Forget the engines no load has asked for in ``idle_seconds``, except those a load
        still uses (``in_use()``: engine ids of the loads in progress); cheap between sweeps."""
        now = time.monotonic() if now is None else now
        if now < self._next_sweep or not self.engines:
            return
        self._next_sweep = now + self.idle_seconds / 4
        busy = set(in_use())
        for key, engine in list(self.engines.items()):
            if key in busy:
                engine.last_used = now  # idle counts from the end of its last load
            elif now - engine.last_used >= self.idle_seconds:
                logger.info(
                    "pd_connector: TP rank %d/%d forgets prefill engine %s, unused for %.0f s",
                    self.tp_rank, self.tp_size, key, now - engine.last_used,
                )
                self.drop(key)

    def drop(self, key: str) -> None:
        """Free what D holds for an engine: its NIXL peers (descriptor lists, remote agents and
        with them the UCX endpoints) and their planners, and the idle sockets to side channels
        no other engine uses."""
        engine = self.engines.pop(key, None)
        if engine is None:
            return
        for peer in engine.sources.values():
            if peer is not None:
                self.transport.remove_peer(peer)
        shared = {ch for other in self.engines.values() for ch in other.side_channels}
        self._calls.forget([ch for ch in engine.side_channels if ch not in shared])
        self._report_connected()

    def _report_connected(self) -> None:
        self.recorder.set_gauge("prefill_engines_connected", self.tp_rank, len(self.engines))

