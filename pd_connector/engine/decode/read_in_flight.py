"""One leg's READ on D while it is in flight: its slices, how long P confirmed it holds the
lease (``core/read_hold.py``), and the reports of a READ or a NIXL call that takes too long."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pd_connector.core import read_hold
from pd_connector.core.params import LeaseRef
from pd_connector.engine.metrics import Recorder
from pd_connector.transport.nixl import ChunkedRead

logger = logging.getLogger("vllm.pd_connector")


@dataclass
class ReadInFlight:
    xfer: ChunkedRead
    lease: LeaseRef
    rank: int  # the P rank read from
    read_started: float
    descriptors: int
    digest: bytes
    nbytes: int
    hold: float  # D's clock time until which P confirmed it holds the lease
    warned: bool = False  # read_slow reported

    def confirm_hold(self, host: str, port: int, rank: int, sent: float, held: dict[str, float]) -> None:
        """Apply P rank ``rank``'s answer to an extension D sent at ``sent`` (``Extended.held``)."""
        seconds = held.get(self.lease.request_id)
        if seconds is not None and rank == self.rank and (self.lease.host, self.lease.port) == (host, port):
            self.hold = read_hold.extended_hold(self.hold, sent, seconds)

    def report_slow_call(self, request_id: str, seconds: float, recorder: Recorder, threads: int) -> None:
        # The engine thread itself was held: every request on this instance waited.
        recorder.count("nixl_call_slow")
        logger.warning(
            "pd_connector: a NIXL call for %s (READ from rank %d of %s, slice %d of %d) held the "
            "engine thread for %.2f s (nixl_num_threads=%d; see docs/operations.md, \"Slow READs\")",
            request_id, self.rank, self.lease.engine_id, self.xfer.next, self.xfer.slices, seconds, threads,
        )

    def report_slow_read(self, request_id: str, seconds: float, recorder: Recorder, threads: int) -> None:
        recorder.count("read_slow")
        logger.warning(
            "pd_connector: READ for %s from rank %d of %s still in flight after %.1f s (%d "
            "descriptors, %d of %d slices posted, nixl_num_threads=%d); still waiting, a posted "
            "READ cannot be cancelled safely (see docs/operations.md, \"Slow READs\")",
            request_id, self.rank, self.lease.engine_id, seconds, self.descriptors, self.xfer.next,
            self.xfer.slices, threads,
        )
