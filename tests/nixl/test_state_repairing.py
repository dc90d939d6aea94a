"""Real NIXL READs of recurrent state between engines with different speculative token counts.

vLLM packs a Mamba/GDN layer's states at the start of each page (conv, then SSM) and widens the
conv state by one row per speculative token, so the SSM state sits at another page offset on an
engine with another count. Regression: P with 2 speculative tokens, D with 1, pages copied byte
for byte -> D resumed on a shifted SSM state (wrong first token on Qwen3-Next + MTP, no error).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pd_connector.transport.nixl import DONE
from pd_connector.engine.from_vllm.regions import regions_from_kv_caches
from rig import devices, nixl_peers

CONV_KERNEL, CONV_DIM = 4, 96
SSM_SHAPE = (2, 16, 8)
PAGE = 8192  # padded page (vLLM pads Mamba pages to the attention page)
NUM_BLOCKS = 6
LAYERS = ("gdn.0", "gdn.1")


def _engine(num_spec: int, seed: int):
    conv_shape = (CONV_KERNEL - 1 + num_spec, CONV_DIM)  # SD orientation
    spec = SimpleNamespace(
        page_size_bytes=PAGE,
        shapes=(conv_shape, SSM_SHAPE),
        dtypes=(torch.bfloat16, torch.float32),
        num_speculative_blocks=num_spec,
        mamba_type=SimpleNamespace(name="GDN_ATTN"),
    )
    layer_bytes = NUM_BLOCKS * PAGE
    buf = devices.random_bytes(len(LAYERS) * layer_bytes, seed)
    tensor = SimpleNamespace(size=buf.numel(), layers=list(LAYERS), layer_stride=layer_bytes, block_stride=PAGE, offset=0)
    config = SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(layer_names=list(LAYERS), kv_cache_spec=spec)],
        kv_cache_tensors=[tensor],
        num_blocks=NUM_BLOCKS,
    )
    kv_caches = {name: buf[i * layer_bytes :] for i, name in enumerate(LAYERS)}
    allocations, regions = regions_from_kv_caches(config, kv_caches, (0,))
    transport = devices.transport()
    transport.register(allocations, regions)
    return SimpleNamespace(buf=buf, transport=transport, regions=regions, conv_shape=conv_shape)


def _states(engine, layer: int, block: int):
    page = devices.host(engine.buf)[layer * NUM_BLOCKS * PAGE + block * PAGE :][:PAGE]
    conv_bytes = int(np.prod(engine.conv_shape)) * 2
    ssm_bytes = int(np.prod(SSM_SHAPE)) * 4
    state_rows = (CONV_KERNEL - 1) * CONV_DIM * 2
    return page[:state_rows].copy(), page[conv_bytes : conv_bytes + ssm_bytes].copy()


@pytest.mark.parametrize(("p_spec", "d_spec"), [(2, 1), (1, 3), (0, 2), (3, 0), (2, 2)])
def test_state_of_another_speculative_width_lands_where_d_reads_it(p_spec, d_spec):
    p, d = _engine(p_spec, seed=1), _engine(d_spec, seed=2)
    try:
        assert [r.name for r in p.regions] == ["gdn.0#0", "gdn.0#1", "gdn.1#0", "gdn.1#1"]
        planner = nixl_peers.add_peer(
            d.transport, "p", p.transport.agent_metadata, p.regions, agent_name=p.transport.name
        )
        local_idx, remote_idx = planner.indices([[(4, 1)]])  # P's slot 4 -> D's slot 1
        untouched_before = devices.host(d.buf)[: NUM_BLOCKS * PAGE][2 * PAGE :].copy()
        handle = d.transport.read("p", local_idx, remote_idx, b"")
        deadline = time.monotonic() + 10
        while (state := d.transport.state(handle)) != DONE and time.monotonic() < deadline:
            time.sleep(0.01)
        assert state == DONE
        d.transport.discard(handle)
        for layer in range(len(LAYERS)):
            p_conv, p_ssm = _states(p, layer, 4)
            d_conv, d_ssm = _states(d, layer, 1)
            assert np.array_equal(d_conv, p_conv), f"layer {layer}: conv state rows differ"
            assert np.array_equal(d_ssm, p_ssm), f"layer {layer}: SSM state not where D reads it"
        assert np.array_equal(devices.host(d.buf)[: NUM_BLOCKS * PAGE][2 * PAGE :], untouched_before)
    finally:
        p.transport.close()
        d.transport.close()
