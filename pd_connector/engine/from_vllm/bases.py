"""The vLLM base classes of the connector's in-process types, or plain stand-ins where vLLM is
not installed at all.

Why: the real-NIXL tests (the production LeaseServer and Receiver with their tasks and stats) also
run on a GPU host that has torch and NIXL but no vLLM (``scripts/gpu_check.sh``,
docs/testing.md "GPU check"). Only vLLM loads the connector itself, so a stand-in never meets
vLLM; an installed vLLM that fails to import still fails here, loudly.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None

if VLLM_INSTALLED:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
else:

    class KVConnectorMetadata:  # type: ignore[no-redef]
        """vllm.distributed.kv_transfer.kv_connector.v1.base.KVConnectorMetadata: no members."""

    @dataclass
    class KVConnectorStats:  # type: ignore[no-redef]
        """vllm.distributed.kv_transfer.kv_connector.v1.metrics.KVConnectorStats: the payload."""

        data: dict[str, Any] = field(default_factory=dict)

    class KVConnectorPromMetrics:  # type: ignore[no-redef]
        def __init__(self, *args, **kwargs):
            raise RuntimeError("Prometheus metrics need vLLM, which is not installed")


__all__ = ["VLLM_INSTALLED", "KVConnectorMetadata", "KVConnectorPromMetrics", "KVConnectorStats"]
