"""Where vLLM CPU instances that run at the same time go: ``VLLM_CPU_OMP_THREADS_BIND`` per
instance. The one place that decides it for ``stack`` (baseline + P + D) and ``spec_matrix``
(kv_both instances per speculative config); see docs/operations.md, "CPU hosts"."""

from __future__ import annotations

import os


def cpu_binds(count: "int | list[int]", first_core: int = 0) -> list[tuple[str, dict[str, str]]]:
    """``VLLM_CPU_OMP_THREADS_BIND`` and extra environment for instances run at once: ``count``
    of them, or one per entry of a list of their tensor-parallel sizes (a TP-n instance has n
    worker processes, and vLLM wants one bind entry per rank, ``"0|1"``).

    Never two on one core: a vLLM CPU worker spins on ``sched_yield`` between steps (for a second
    after each, and without pause while a connector keeps the engine stepping), and on this
    kernel a spinning task pinned to a core starves another instance pinned to the same core
    for minutes (docs/operations.md, "CPU hosts"). Up to the core count: one core each, from ``first_core``. More: unpinned, one
    OpenMP thread each, so the kernel can move a waiting instance to the other core."""
    sizes = [1] * count if isinstance(count, int) else list(count)
    cores = os.cpu_count() or 1
    if sum(sizes) <= cores:
        out, core = [], first_core
        for size in sizes:
            out.append(("|".join(str((core + i) % cores) for i in range(size)), {}))
            core += size
        return [(bind, env) for bind, env in out]
    return [("nobind", {"OMP_NUM_THREADS": "1"}) for _ in sizes]
