"""D's worker half of ``CORRUPT_STATE`` (rig/faults.py): the task marked by its type, and the
receiver that flips every byte of each recurrent-state page such a task's READ wrote.

Apart from rig/fault_connector.py because it needs no vLLM: tests/nixl (which runs where only
NIXL and torch are installed, scripts/gpu_check.py) drives it through the production Receiver.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from pd_connector.engine.decode.receiver import Receiver, read_pairs
from pd_connector.engine.metadata import RecvTask

# D's blocks per group -> uint8 views of their recurrent-state pages (StateDigester.pages).
StatePages = Callable[[list[list[int]]], Iterable[Any]]


class CorruptStateTask(RecvTask):
    """A ``RecvTask`` whose received recurrent state D's worker flips: marked by its type, so the
    product's task carries no field for it (vLLM pickles it to the worker, which imports this
    module as the connector's)."""


def corrupted(task: RecvTask) -> CorruptStateTask:
    return CorruptStateTask(**msgspec.structs.asdict(task))


def flip_pages(pages: StatePages, blocks: list[list[int]]) -> None:
    """Flip every byte of each recurrent-state page of ``blocks``. Whole pages: the
    prefix-caching negative control needs the tiny model's greedy output to change, which 64
    flipped bytes per page did not do."""
    for page in pages(blocks):
        page.bitwise_xor_(0xFF)


class StateCorruptingReceiver(Receiver):
    """The production Receiver, but a ``CorruptStateTask``'s READ has its recurrent state flipped
    as it lands (before the digest check, as a corrupted transfer would be). ``state_pages``:
    this rank's page views, None on a model without recurrent state (nothing flipped)."""

    state_pages: StatePages | None = None

    def read_ended(self, task: RecvTask) -> None:
        if self.state_pages is not None and isinstance(task, CorruptStateTask):
            flip_pages(self.state_pages, [[d for _, d in g] for g in read_pairs(task)])
