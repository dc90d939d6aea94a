"""Real NIXL (UCX over DRAM, loopback) and real ZMQ sockets, in process. No mocks.

Tests marked ``nixl`` (all of ``test_transport.py``) are skipped, with the import error as the
reason, when the ``nixl`` package cannot be imported. The side-channel tests only need pyzmq
and msgspec and run either way.

Buffers live on ``PD_TEST_DEVICE`` (cpu, the default, or cuda: ``rig/devices.py``);
asking for cuda where torch sees none is a usage error, not a skip.
"""

from __future__ import annotations

import os

import pytest

from rig import devices
from rig.ports import free_port as free_port_below_ephemeral

# Same default pd_connector.transport.nixl applies before it imports nixl (vLLM does it too).
os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")

try:
    from nixl._api import nixl_agent as _nixl_agent  # noqa: F401

    NIXL_MISSING: str | None = None
except Exception as exc:  # ImportError, or a broken wheel failing on load
    NIXL_MISSING = (
        f"nixl is not importable ({type(exc).__name__}: {exc}); "
        "install nixl==1.5.1 to run the real-NIXL transport tests"
    )


def pytest_configure(config):
    if (why := devices.unavailable()) is not None:
        raise pytest.UsageError(why)


def pytest_report_header(config):
    return f"real-NIXL buffers on {devices.name()} ({devices.mem_type()}; {devices.ENV})"


@pytest.fixture(autouse=True)
def _require_nixl(request):
    if NIXL_MISSING is not None and request.node.get_closest_marker("nixl") is not None:
        pytest.skip(NIXL_MISSING)


@pytest.fixture
def free_port() -> int:
    return free_port_below_ephemeral()


@pytest.fixture
def new_free_port():
    """Call it for as many free ports as a test needs."""
    return free_port_below_ephemeral
