"""Test-only fault injection, in one place: inert unless the decode instance runs with
``PD_CONNECTOR_FAULT_INJECTION=1``. The e2e negative controls use it to show that the output
comparison catches a one-token desync, a corrupted recurrent state or another prompt's state;
never enable it in production."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

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
# place none of P's prompt checkpoints below the offset (as a D that cannot), loading the rest.
WITHHOLD_CHECKPOINTS = "_pd_fault_withhold_checkpoints"


class Faults:
    """What a request asks to have broken; every answer is "nothing" when disabled."""

    def __init__(self, environ: Mapping[str, str] = os.environ):
        self.enabled = environ.get(ENV) == "1"

    def resume_shift(self, params: Mapping[str, Any]) -> int:
        shift = params.get(RESUME_SHIFT) if self.enabled else None
        return shift if isinstance(shift, int) and not isinstance(shift, bool) else 0

    def corrupts_state(self, params: Mapping[str, Any]) -> bool:
        return self.enabled and params.get(CORRUPT_STATE) is True

    def skips_prompt_check(self, params: Mapping[str, Any]) -> bool:
        return self.enabled and params.get(SKIP_PROMPT_CHECK) is True

    def withholds_checkpoints(self, params: Mapping[str, Any]) -> bool:
        return self.enabled and params.get(WITHHOLD_CHECKPOINTS) is True


StateCorrupter = Callable[[list[list[int]]], None]


def state_corrupter(pages: Callable[[list[list[int]]], Iterable[Any]]) -> StateCorrupter | None:
    """D's worker hook for ``CORRUPT_STATE`` (None unless enabled): flip every byte of each
    recurrent-state page of the blocks D received (``pages(blocks)``: uint8 views,
    ``digest.PageDigester.pages``). Whole pages: the prefix-caching negative control needs the
    tiny model's greedy output to change, which 64 flipped bytes per page did not do."""
    if not Faults().enabled:
        return None

    def corrupt(blocks: list[list[int]]) -> None:
        for page in pages(blocks):
            page.bitwise_xor_(0xFF)

    return corrupt
