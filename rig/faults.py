"""The negative controls' faults: what a test adds to D's ``kv_transfer_params`` to break one
handoff on purpose, so that the output comparison (or the digest, or the prefix-cache hit) is
seen to catch it. Only a D that loads the rig's connector honours them (``FAULT_CONNECTOR``,
rig/fault_connector.py); the product ignores these keys. Pure: importable without vLLM (unit
tests reach it through ``rig.stack``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pd_connector.core import handoff

# kv_transfer_config fields of a D that honours the keys below (PYTHONPATH must hold the
# checkout: rig.servers.source_checkout_env).
FAULT_CONNECTOR = {"kv_connector": "FaultInjectingConnector", "kv_connector_module_path": "rig.fault_connector"}

# kv_transfer_params keys a test adds on D's request:
# resume this many tokens away from P's offset while still claiming P's real lease (the silent
# desync of vLLM's implicit rule);
RESUME_SHIFT = "_pd_fault_resume_shift"
# flip every byte of each recurrent-state page D received, as a corrupted transfer would;
CORRUPT_STATE = "_pd_fault_corrupt_state"
# skip D's prompt fingerprint check and claim with P's fingerprint (a handoff of another
# prompt then loads, as it did before the check existed);
SKIP_PROMPT_CHECK = "_pd_fault_skip_prompt_check"
# place none of P's prompt checkpoints below the offset (as a D that cannot), loading the rest.
WITHHOLD_CHECKPOINTS = "_pd_fault_withhold_checkpoints"


def asks(params: Any, key: str) -> bool:
    """Whether D's ``params`` ask for the fault ``key`` (only ``True`` does)."""
    return isinstance(params, Mapping) and params.get(key) is True


def shifted(decision: handoff.Accepted, params: Mapping[str, Any], num_prompt_tokens: int) -> handoff.Accepted:
    """``decision`` resumed ``RESUME_SHIFT`` tokens off P's offset (still inside the prompt); the
    same object when the key is absent or would leave the prompt."""
    shift = params.get(RESUME_SHIFT)
    if not isinstance(shift, int) or isinstance(shift, bool) or not 0 < decision.replay_offset + shift < num_prompt_tokens:
        return decision
    return handoff.Accepted(replay_offset=decision.replay_offset + shift, params=decision.params)
