"""Prompt checkpoints below the offset over real NIXL, through the production LeaseServer and
Receiver: D claims the checkpoint states with the offset's blocks and one READ moves both
(the checkpoint pages land in D's blocks byte for byte, and the state digest, which covers
the offset's state only, still matches); a claim that names a checkpoint P did not lease is
refused before any byte moves (negative control).
"""

from __future__ import annotations

import threading
import time

import pytest

from pd_connector.core.settings import ConnectorSettings
from pd_connector.core.params import LeaseRef
from pd_connector.core.protocol import CheckpointBlocks, Welcome
from pd_connector.engine.metadata import RecvTask, SendLease
from pd_connector.engine.decode.receiver import Receiver
from pd_connector.engine.prefill.lease_server import LeaseServer

from test_chunked_read import COMPAT
from test_state_digest import blocks, digester, pair  # noqa: F401 (pair: fixture)
from test_transport import MAMBA, TIMEOUT_S, assert_bytes, expected_after

pytestmark = pytest.mark.nixl

MAIN = [[(1, 3), (7, 9)], [(3, 11)]]  # (P block, D block): KV of [0, R) and the state at R
CHECKPOINT = [[], [(5, 2)]]  # the state at a checkpoint below R
LEASED = [CheckpointBlocks(8, [[], [5]])]


def _load(p, d, port: int, claimed: list[CheckpointBlocks]) -> tuple[set[str], dict[str, str]]:
    p_dig, d_dig = digester(p), digester(d)
    settings = ConnectorSettings(side_channel_host="127.0.0.1", side_channel_port=port, verify_state_digest=True)
    welcome = Welcome("p", p.transport.name, p.transport.agent_metadata, list(p.regions), COMPAT)
    sender = LeaseServer(settings, "p", COMPAT, welcome, lambda b: p_dig.digest(b, [MAMBA]), threading.Event())
    receiver = Receiver(d.transport, settings, "d", COMPAT, lambda b: d_dig.digest(b, [MAMBA]))
    try:
        sender.grant({"P-r1": SendLease(time.monotonic() + 30, 15, blocks(MAIN, 0), checkpoints=LEASED)})
        task = RecvTask(
            LeaseRef("p", "127.0.0.1", port, "P-r1"), MAIN, 16, 15, blocks(MAIN, 0),
            checkpoints=claimed, checkpoint_pairs=CHECKPOINT,
        )
        receiver.add("r1", task)
        deadline = time.monotonic() + TIMEOUT_S
        finished: set[str] = set()
        failed: dict[str, str] = {}
        while not finished and not failed:
            receiver.advance()
            failed = dict(receiver.failed)
            finished = receiver.take_results()[0]
            sender.blocks_to_free(p.transport.take_notifications())
            assert time.monotonic() < deadline
            time.sleep(0.002)
        # Until P ended the lease (D's READ notification, or the release after a refused claim):
        # a release still in flight at close would reach a later test's side channel on this port.
        while sender.held():
            sender.blocks_to_free(p.transport.take_notifications())
            assert time.monotonic() < deadline
            time.sleep(0.002)
        return finished, failed
    finally:
        receiver.close()
        sender.close()


def test_one_read_moves_the_offsets_blocks_and_the_checkpoint_states(pair, free_port):  # noqa: F811
    p, d = pair
    d.transport.remove_peer("engine-p")
    finished, failed = _load(p, d, free_port, LEASED)
    assert finished == {"r1"} and not failed
    want, _ = expected_after(d, p, [m + c for m, c in zip(MAIN, CHECKPOINT)])
    assert_bytes(d, want)


def test_a_claim_for_a_checkpoint_p_did_not_lease_is_refused(pair, free_port):  # noqa: F811
    p, d = pair
    d.transport.remove_peer("engine-p")
    before = d.mem.copy()
    finished, failed = _load(p, d, free_port, [CheckpointBlocks(8, [[], [6]])])
    assert not finished and "did not lease" in failed["r1"]
    assert (d.mem == before).all(), "nothing may be read after a refused claim"
