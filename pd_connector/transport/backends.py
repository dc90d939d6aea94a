"""Which NIXL backends this installation provides, checked before the worker creates its agent.

NIXL 1.5.1's ``nixl_agent`` only *warns* about a requested backend whose plugin is missing
("Skipping backend registration X due to the missing plugin", nixl/_api.py nixl_agent.__init__)
and returns an agent without it; every later transfer would then fail far from the cause. We
refuse at start-up instead, listing what is available.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence

from pd_connector.core.settings import UnsupportedConfig


def import_nixl():
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


def missing_backends_message(requested: Sequence[str], available: Sequence[str]) -> str | None:
    """The start-up refusal for backends NIXL cannot create (None: all are available)."""
    missing = [b for b in requested if b not in available]
    if not missing:
        return None
    return (
        f"pd_connector: nixl_backends {list(requested)} names {', '.join(missing)}, which this "
        f"NIXL installation does not provide (available: {', '.join(sorted(available)) or 'none'}). "
        "Set kv_connector_extra_config nixl_backends (or PD_CONNECTOR_NIXL_BACKENDS) to available "
        'ones (default ["UCX"]), or install the plugin (NIXL_PLUGIN_DIR points NIXL at plugins)'
    )


def available_backends() -> list[str]:
    """Plugin names NIXL can load here, from a throwaway agent without backends (about a
    millisecond once nixl is imported; no UCX context is created)."""
    nixl_agent, nixl_agent_config = import_nixl()
    probe = nixl_agent(
        f"pd-probe-{uuid.uuid4().hex[:8]}",
        nixl_agent_config(enable_prog_thread=False, backends=[]),
    )
    return list(probe.get_plugin_list())


def check_backends(requested: Sequence[str]) -> None:
    """Raise ``UnsupportedConfig`` naming the missing backends and the available ones."""
    message = missing_backends_message(requested, available_backends())
    if message:
        raise UnsupportedConfig(message)


def backend_params(backend: str, num_threads: int, ucx_error_handling: str = "peer") -> dict[str, str]:
    """Init parameters for one NIXL backend with ``num_threads`` worker threads (0: none)
    and, for UCX, the endpoints' error-handling mode (NIXL's own default, ``peer``, is left
    implicit).

    UCX with threads runs ``nixlUcxThreadPoolEngine`` (NIXL plugins/ucx/ucx_backend.cpp): a
    transfer of at least ``split_batch_size`` descriptors goes out in chunks of
    ``max(descriptors / threads, split_batch_size)``, each posted and progressed by a worker
    thread with its own UCX worker; a smaller one is posted by the caller, which over DRAM
    copies inside the post (cma). With NIXL's default size, READs of up to ~1k descriptors
    stayed on D's engine thread and a 2-thread pool copied a 2k-descriptor READ on one thread.
    1 splits every READ evenly over the threads: the post returns in well under a millisecond
    and the copies run side by side (scattered 128 KiB pages on the 2-core box: 6-7 GB/s with 2
    threads, 4.5 with none, against 4.8-5.1 for one descriptor; docs/operations.md, "Worker
    threads")."""
    params: dict[str, str] = {}
    if backend == "UCX":
        if num_threads > 0:
            params.update(num_threads=str(num_threads), split_batch_size="1")
        if ucx_error_handling != "peer":
            params["ucx_error_handling_mode"] = ucx_error_handling
    elif backend in ("LIBFABRIC", "OBJ") and num_threads > 0:  # as nixl_agent.__init__ passes it
        params["num_threads"] = str(num_threads)
    return params
