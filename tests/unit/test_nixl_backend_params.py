"""What each NIXL backend is created with (``transport.backend_params``): pure, no NIXL."""

from __future__ import annotations

import pytest

from pd_connector.transport.backends import backend_params


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


def test_peer_error_handling_is_nixls_default_and_left_implicit():
    assert backend_params("UCX", 0, "peer") == {}
    assert backend_params("UCX", 2, "peer") == {"num_threads": "2", "split_batch_size": "1"}


def test_no_peer_error_handling_is_passed_to_ucx_with_or_without_threads():
    assert backend_params("UCX", 0, "none") == {"ucx_error_handling_mode": "none"}
    assert backend_params("UCX", 2, "none") == {
        "num_threads": "2",
        "split_batch_size": "1",
        "ucx_error_handling_mode": "none",
    }


@pytest.mark.parametrize("backend", ["LIBFABRIC", "POSIX"])
def test_the_ucx_error_handling_mode_reaches_only_ucx(backend):
    assert "ucx_error_handling_mode" not in backend_params(backend, 2, "none")
