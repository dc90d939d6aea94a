"""Test-only fault injection, in one place: inert unless the decode instance runs with
``PD_CONNECTOR_FAULT_INJECTION=1``. The e2e negative controls use it to show that the output
comparison catches a one-token desync, a corrupted recurrent state or another prompt's state;
never enable it in production. The product holds no fault field: D's scheduler asks
``injector()`` once (None when off) and the receiver recognises a marked task by its type."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import msgspec

from pd_connector.core import handoff
from pd_connector.engine.metadata import RecvTask

ENV = "PD_CONNECTOR_FAULT_INJECTION"
# kv_transfer_params keys a test adds on D's request:
# resume this many tokens away from P's offset while still claiming P's real lease (the silent
# desync of vLLM's implicit rule);
RESUME_SHIFT = "_pd_fault_resume_shift"
# flip every byte of each recurrent-state page D received, as a corrupted transfer would;
CORRUPT_STATE = "_pd_fault_corrupt_state"
# skip D's prompt fingerprint check and claim with P's fingerprint (a handoff of another
# prompt then loads, as it did before the check existed).
SKIP_PROMPT_CHECK = "_pd_fault_skip_prompt_check"


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(ENV) == "1"


class Faults:
    """What a request asks to have broken (only built when enabled: ``injector``)."""

    def __init__(self) -> None:
        self._corrupt: set[str] = set()

    def skips_prompt_check(self, params: Mapping[str, Any]) -> bool:
        return params.get(SKIP_PROMPT_CHECK) is True

    def shifted(self, decision: handoff.Accepted, params: Mapping[str, Any], num_prompt_tokens: int) -> handoff.Accepted:
        """``decision`` resumed ``RESUME_SHIFT`` tokens off P's offset (still inside the prompt)."""
        shift = params.get(RESUME_SHIFT)
        if not isinstance(shift, int) or isinstance(shift, bool) or not 0 < decision.offset + shift < num_prompt_tokens:
            return decision
        return handoff.Accepted(offset=decision.offset + shift, params=decision.params)

    def note_admitted(self, request_id: str, params: Mapping[str, Any] | None) -> None:
        if isinstance(params, Mapping) and params.get(CORRUPT_STATE) is True:
            self._corrupt.add(request_id)

    def recv_task(self, request_id: str, task: RecvTask) -> RecvTask:
        """The worker's task for a request admitted with ``CORRUPT_STATE``: marked by its type."""
        if request_id in self._corrupt:
            self._corrupt.discard(request_id)
            return corrupted(task)
        return task


def injector(environ: Mapping[str, str] = os.environ) -> Faults | None:
    return Faults() if enabled(environ) else None


class CorruptStateTask(RecvTask):
    """A ``RecvTask`` whose received recurrent state D's worker flips (``CORRUPT_STATE``)."""


def corrupted(task: RecvTask) -> CorruptStateTask:
    return CorruptStateTask(**msgspec.structs.asdict(task))


def corrupts(task: RecvTask) -> bool:
    return isinstance(task, CorruptStateTask)


StateCorrupter = Callable[[list[list[int]]], None]


def state_corrupter(pages: Callable[[list[list[int]]], Iterable[Any]]) -> StateCorrupter | None:
    """D's worker hook for ``CORRUPT_STATE`` (None unless enabled): flip every byte of each
    recurrent-state page of the blocks D received (``pages(blocks)``: uint8 views,
    ``state_digest.StateDigester.pages``). Whole pages: the prefix-caching negative control
    needs the tiny model's greedy output to change, which 64 flipped bytes per page did not do."""
    if not enabled():
        return None

    def corrupt(blocks: list[list[int]]) -> None:
        for page in pages(blocks):
            page.bitwise_xor_(0xFF)

    return corrupt
