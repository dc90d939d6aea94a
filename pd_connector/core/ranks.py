"""Where each rank of a prefill instance listens, under data parallelism x tensor parallelism.

One prefill instance of DP size ``d`` and TP size ``t`` runs ``d * t`` side channels on its host,
one per (DP rank, TP rank), on consecutive ports from ``side_channel_port``: DP rank ``k``, TP rank
``r`` listens on ``side_channel_port + k * t + r``. At TP 1 that is vLLM NixlConnector's
``VLLM_NIXL_SIDE_CHANNEL_PORT + data_parallel_index`` (nixl/base_scheduler.py). P's
``kv_transfer_params`` name the engine holding the blocks (vLLM's per-rank engine id, ``<id>_dp<k>``,
set in run_engine_core, vllm/v1/engine/core.py) and its TP rank 0's port; D reaches that engine's
TP rank ``r`` at ``remote_port + r``. Two instances on one host must use disjoint port ranges.
"""

from __future__ import annotations

MAX_PORT = 65535


def side_channel_port(base: int, dp_index: int, tp_rank: int, tp_size: int) -> int:
    """The port of DP rank ``dp_index``'s TP rank ``tp_rank`` (``tp_size`` ranks per DP rank)."""
    if tp_size < 1 or not 0 <= tp_rank < tp_size or dp_index < 0:
        raise ValueError(f"no side channel for DP rank {dp_index}, TP rank {tp_rank} of {tp_size}")
    return base + dp_index * tp_size + tp_rank


def engine_base_port(base: int, dp_index: int, tp_size: int) -> int:
    """The port P names in ``kv_transfer_params`` (``remote_port``): its TP rank 0's."""
    return side_channel_port(base, dp_index, 0, tp_size)


def instance_ports(base: int, dp_size: int, tp_size: int) -> range:
    """Every side-channel port of an instance: what it binds on its host (all DP ranks there
    are local: vLLM numbers DP ranks globally, so a host running ranks k.. binds from
    ``base + k * tp_size``)."""
    return range(base, base + dp_size * tp_size)


def port_scheme_problem(base: int, dp_index: int, tp_size: int) -> str | None:
    """Why DP rank ``dp_index``'s side channels cannot follow the scheme (its top port is past
    65535), or None. Checked at start-up, before binding."""
    top = side_channel_port(base, dp_index, tp_size - 1, tp_size)
    if top > MAX_PORT:
        return (
            f"side_channel_port {base}: DP rank {dp_index} at tensor parallel size {tp_size} would "
            f"listen up to port {top} (side_channel_port + dp_rank * tp_size + tp_rank), past "
            f"{MAX_PORT}: set side_channel_port to at most {MAX_PORT - (dp_index + 1) * tp_size + 1}"
        )
    return None


def describe_scheme(base: int, dp_index: int, tp_size: int) -> str:
    """The scheme in words for a bind failure: which setting moves this instance's ports."""
    return (
        f"DP rank {dp_index} listens on side_channel_port {base} + {dp_index} * tp_size {tp_size} "
        "+ tp_rank; an instance with DP size d and TP size t takes d * t consecutive ports from "
        "side_channel_port, so give each instance on this host a side_channel_port at least that "
        "far from another's"
    )
