"""The transfer benchmark's kernel path (``transfer_paths.CmaRead``): ``process_vm_readv`` of
exactly the given ranges, more than one call's worth of them, and a loud error when the kernel
moves less than asked."""

from __future__ import annotations

import sys

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process_vm_readv is Linux-only")


def test_cma_read_copies_exactly_the_ranges_across_several_calls():
    from benchmarks.transfer_paths import IOV_MAX, CmaRead

    page, n = 64, IOV_MAX + 7  # two calls
    src = np.arange(page * 2 * n, dtype=np.uint8) % 251
    dst = np.zeros_like(src)
    rng = np.random.default_rng(0)
    src_pages = rng.permutation(2 * n)[:n]
    dst_pages = rng.permutation(2 * n)[:n]
    read = CmaRead(
        dst.ctypes.data + dst_pages * page, src.ctypes.data + src_pages * page, np.full(n, page, dtype=np.int64)
    )
    out = read.once()
    assert out["calls"] == 2 and read.nbytes == n * page
    want = np.zeros_like(src)
    for s, d in zip(src_pages, dst_pages):
        want[d * page : (d + 1) * page] = src[s * page : (s + 1) * page]
    assert np.array_equal(dst, want)


def test_cma_read_of_an_unmapped_range_raises_instead_of_timing_a_partial_copy():
    from benchmarks.transfer_paths import CmaRead

    dst = np.zeros(4096, dtype=np.uint8)
    read = CmaRead(np.array([dst.ctypes.data]), np.array([8]), np.array([4096]))  # remote address 8: unmapped
    with pytest.raises(OSError, match="process_vm_readv moved"):
        read.once()
