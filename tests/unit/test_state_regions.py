"""Recurrent-state regions of engines with different speculative token counts.

vLLM widens a conv state by ``num_spec`` scratch rows (SD orientation), which moves the SSM state
inside the page. Regression for the silent desync found on Qwen3-Next with MTP: P with 2
speculative tokens, D with 1, byte-for-byte page copies -> D's first token wrong on most prompts.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pd_connector.core.descriptors import DescriptorError, reconcile_regions, state_rows_only
from pd_connector.core.protocol import LayerRegion


def _mamba_layer(name: str, conv_kernel: int, dim: int, ssm_bytes: int, spec: int, addr: int, itemsize: int = 2):
    rows = conv_kernel - 1 + spec
    conv = LayerRegion(f"{name}#0", 1, addr, 1 << 20, rows * dim * itemsize, 8, rows=rows, scratch_rows=spec)
    ssm = LayerRegion(f"{name}#1", 1, addr + conv.page_bytes, 1 << 20, ssm_bytes, 8, rows=4, scratch_rows=spec)
    return [conv, ssm]


@given(
    conv_kernel=st.integers(2, 5),
    dim=st.integers(1, 64),
    ssm_rows=st.integers(1, 8),
    spec_p=st.integers(0, 4),
    spec_d=st.integers(0, 4),
)
def test_conv_states_that_differ_by_speculative_rows_copy_the_state_rows(conv_kernel, dim, ssm_rows, spec_p, spec_d):
    p = _mamba_layer("gdn.0", conv_kernel, dim, ssm_rows * 128, spec_p, addr=1000)
    d = _mamba_layer("gdn.0", conv_kernel, dim, ssm_rows * 128, spec_d, addr=5000)
    local, remote = reconcile_regions(d, p)
    state_conv = (conv_kernel - 1) * dim * 2
    if spec_p == spec_d:
        assert (local, remote) == (tuple(d), tuple(p))  # identical shapes: copied whole
    else:
        assert local[0].page_bytes == remote[0].page_bytes == state_conv
    # Each side's SSM state is read/written where that side keeps it, whole.
    assert (remote[1].addr, local[1].addr) == (p[1].addr, d[1].addr)
    assert remote[1].page_bytes == local[1].page_bytes == ssm_rows * 128
    assert remote[0].addr == 1000 and local[0].addr == 5000


def test_a_difference_not_explained_by_speculative_rows_is_refused():
    p = _mamba_layer("gdn.0", 4, 32, 512, 2, addr=0)
    d = _mamba_layer("gdn.0", 3, 32, 512, 2, addr=0)  # another conv kernel: 4 rows vs 5 rows
    with pytest.raises(DescriptorError, match=r"state gdn\.0#0: .*differ beyond speculative rows"):
        reconcile_regions(d, p)


def test_ds_orientation_with_other_speculative_counts_is_refused():
    """DS: (dim, state_len); the leading dim is the channel, so rows - scratch disagree."""
    rows_p, rows_d = 64, 64
    p = LayerRegion("gdn.0#0", 1, 0, 1 << 20, rows_p * (3 + 2) * 2, 8, rows=rows_p, scratch_rows=2)
    d = LayerRegion("gdn.0#0", 1, 0, 1 << 20, rows_d * (3 + 1) * 2, 8, rows=rows_d, scratch_rows=1)
    with pytest.raises(DescriptorError):
        reconcile_regions([d], [p])


def test_attention_pages_of_other_sizes_are_refused():
    p = LayerRegion("attn.0", 0, 0, 4096, 4096, 8)
    d = LayerRegion("attn.0", 0, 0, 2048, 2048, 8)
    with pytest.raises(DescriptorError, match="attn.0"):
        reconcile_regions([d], [p])


def test_digest_sees_only_state_rows():
    conv = _mamba_layer("gdn.0", 4, 16, 256, 3, addr=0)[0]
    assert state_rows_only(conv).page_bytes == 3 * 16 * 2
    attention = LayerRegion("attn.0", 0, 0, 4096, 4096, 8)
    assert state_rows_only(attention) is attention
