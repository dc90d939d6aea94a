"""What each NIXL backend is created with (``transport.backend_params``): pure, no NIXL."""

from __future__ import annotations

import pytest

from pd_connector.transport import backend_params


def test_no_worker_threads_keeps_every_backends_defaults():
    assert backend_params("UCX", 0) == {}
    assert backend_params("LIBFABRIC", 0) == {}


def test_ucx_worker_threads_split_every_read_evenly():
    """Without split_batch_size 1, NIXL's thread-pool engine leaves a READ of fewer than ~1k
    descriptors to the caller, which over DRAM copies inside the post on D's engine thread."""
    assert backend_params("UCX", 2) == {"num_threads": "2", "split_batch_size": "1"}


@pytest.mark.parametrize("backend", ["LIBFABRIC", "OBJ"])
def test_other_threaded_backends_get_the_count_as_nixl_agent_passes_it(backend):
    assert backend_params(backend, 4) == {"num_threads": "4"}


def test_backends_without_threads_get_nothing():
    assert backend_params("POSIX", 4) == {}
