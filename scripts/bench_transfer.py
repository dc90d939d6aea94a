#!/usr/bin/env python
"""Transfer benchmark: the connector's worker path vs raw NIXL (one descriptor) vs memcpy.

What is measured, per case, all three in the same run and interleaved rep by rep (so load on
the box hits every path alike), best of ``--reps`` after ``--warmup`` untimed runs:

  connector  exactly what ``pd_connector/receiver.py`` does per request with prepared
             descriptor lists: ``NixlTransport.plan`` -> ``read`` (make_prepped_xfer +
             transfer, with a notification) -> poll ``state`` until DONE -> ``release``.
  raw-NIXL   the same agents and registrations, the same number of bytes as ONE descriptor
             (prepared once, like the connector's lists): make_prepped_xfer + transfer + poll.
  memcpy     ``torch`` ``copy_`` of the same number of bytes between the same two buffers
             (CPU: one torch thread, like UCX's single-copy cma; CUDA: device copy).

Memory is laid out the way vLLM 0.32 does it (``get_kv_cache_config_from_groups``): one
allocation per engine shared by every KV-cache group, layer l's page of block b at
``offset + l * layer_stride + b * block_stride``; hybrids group layers in equal-sized groups
(attention + Mamba/GDN groups aliasing the same bytes) and pad the Mamba page to the attention
page after raising the attention block size until attention page >= Mamba page
(``Platform._align_hybrid_block_size``). The page map is derived by the production
``vllm_compat.regions_from_kv_caches``. ``--check-vllm`` cross-checks the placement against vLLM's own
function in a subprocess (all 18 model x block x layout combinations match).

Block ids are drawn like a running server's: ``scattered`` (random free-list order after
churn, on P and on D independently) and ``contiguous`` (one ascending run per side).

Sections (``--sections``):
  main    models x prompt lengths x block sizes x {scattered, contiguous}, vLLM's default
          layer-outer layout (LBHNC on CPU, LBNHC on CUDA: the same byte placement).
  layout  block-outer layout (BLHNC): the connector as is vs two prototypes of a fix.
  knobs   NIXL/UCX settings, each in a subprocess (UCX reads UCX_* at agent creation).

Examples:
  .venv/bin/python scripts/bench_transfer.py --quick
  .venv/bin/python scripts/bench_transfer.py --out .artifacts/bench --reps 5
  python scripts/bench_transfer.py --device cuda --budget-mib 4096
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace

os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")  # as pd_connector.transport does

import numpy as np
import torch

from pd_connector import layout
from pd_connector.protocol import LayerRegion
from pd_connector.transport import DONE, FAILED, NixlTransport
from pd_connector.vllm_compat import regions_from_kv_caches

KEY = "bench-p"
GUARD = 4096
MiB = 1 << 20
BF16 = 2

# --- model shapes ---------------------------------------------------------------------------
#
# Per-layer page sizes are the real models' (bf16 KV and bf16 recurrent state, TP=1); only the
# number of layers is reduced when a case would not fit ``--budget-mib`` (see ``geometry``).


@dataclass(frozen=True)
class ModelShape:
    key: str
    label: str
    num_layers: int  # real model
    attn_ids: tuple[int, ...]  # real layer indices of the attention layers
    kv_heads: int
    head_dim: int
    mamba_ids: tuple[int, ...] = ()
    mamba_kind: str = ""
    mamba_shapes: tuple[tuple[int, ...], ...] = ()  # vLLM's state shapes (conv, temporal)

    @property
    def attn_bytes_per_token(self) -> int:  # K and V of one layer, one token
        return 2 * self.kv_heads * self.head_dim * BF16

    @property
    def mamba_state_bytes(self) -> int:
        return sum(math.prod(s) * BF16 for s in self.mamba_shapes)


def _nemotron_h_8b() -> ModelShape:
    # nvidia/Nemotron-H-8B-Base-8K: 52 layers, hybrid_override_pattern below ("M" Mamba2,
    # "*" attention, "-" MLP). Attention 32 q / 8 kv heads x 128. Mamba2: 128 heads x 64,
    # d_state 128, n_groups 8, conv kernel 4, expand 2 (intermediate 8192).
    # vLLM MambaStateShapeCalculator.mamba2_state_shape: conv (8192 + 2*8*128, 3),
    # temporal (128, 64, 128) -> 2,158,592 B per layer.
    pattern = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
    return ModelShape(
        key="nemotron-h",
        label="Nemotron-H-8B-like (attn + Mamba2)",
        num_layers=len(pattern),
        attn_ids=tuple(i for i, c in enumerate(pattern) if c == "*"),
        kv_heads=8,
        head_dim=128,
        mamba_ids=tuple(i for i, c in enumerate(pattern) if c == "M"),
        mamba_kind="mamba2",
        mamba_shapes=((3, 8192 + 2 * 8 * 128), (128, 64, 128)),
    )


def _qwen3_next() -> ModelShape:
    # Qwen/Qwen3-Next-80B-A3B: 48 layers, full attention every 4th (12), Gated DeltaNet
    # otherwise (36). Attention 16 q / 2 kv heads x 256. GDN: 16 k heads, 32 v heads, 128 dims,
    # conv kernel 4. vLLM gated_delta_net_state_shape: conv (3, 128*16*2 + 128*32),
    # temporal (32, 128, 128) -> 1,097,728 B per layer.
    return ModelShape(
        key="qwen3-next",
        label="Qwen3-Next-80B-like (attn + GDN)",
        num_layers=48,
        attn_ids=tuple(i for i in range(48) if (i + 1) % 4 == 0),
        kv_heads=2,
        head_dim=256,
        mamba_ids=tuple(i for i in range(48) if (i + 1) % 4 != 0),
        mamba_kind="gdn",
        mamba_shapes=((3, 128 * 16 * 2 + 128 * 32), (32, 128, 128)),
    )


MODELS = {
    "llama-8b": ModelShape(
        key="llama-8b",
        label="Llama-3.1-8B-like (attention only)",
        num_layers=32,
        attn_ids=tuple(range(32)),
        kv_heads=8,
        head_dim=128,
    ),
    "nemotron-h": _nemotron_h_8b(),
    "qwen3-next": _qwen3_next(),
}

# --- vLLM placement ---------------------------------------------------------------------------


@dataclass
class Geometry:
    """One model at one block size, possibly with fewer layers (same per-layer pages)."""

    model: str
    user_block: int
    block_size: int  # attention block size vLLM ends up with
    page_bytes: int  # uniform page (Mamba pages padded to the attention page, as vLLM does)
    mamba_real_bytes: int
    groups: list[tuple[str, list[str]]]  # (kind, layer names in placement order)
    layers_real: int
    attn_layers: int
    mamba_layers: int

    @property
    def group_size(self) -> int:
        return len(self.groups[0][1])


def hybrid_block_size(m: ModelShape, user_block: int, kernel_min: int = 16) -> int:
    """``Platform._align_hybrid_block_size``: the smallest multiple of the kernel alignment
    (max(backend min kernel block, user block)) whose attention page holds the Mamba state."""
    if not m.mamba_ids:
        return user_block
    align = max(kernel_min, user_block)
    return align * math.ceil(m.mamba_state_bytes / (align * m.attn_bytes_per_token))


def vllm_group_size(n_attn: int, n_mamba: int) -> int:
    """``_get_kv_cache_groups_uniform_page_size``: min layer count per type, or the max when
    max < 1.5 * min."""
    counts = [c for c in (n_attn, n_mamba) if c]
    lo, hi = min(counts), max(counts)
    return hi if hi < 1.5 * lo else lo


def geometry(m: ModelShape, user_block: int, tokens: int, budget: int) -> Geometry:
    bs = hybrid_block_size(m, user_block)
    page = bs * m.attn_bytes_per_token
    nblk = math.ceil(tokens / bs)
    gs_real = vllm_group_size(len(m.attn_ids), len(m.mamba_ids))
    n_attn_groups = math.ceil(len(m.attn_ids) / gs_real)
    n_mamba_groups = math.ceil(len(m.mamba_ids) / gs_real) if m.mamba_ids else 0
    # Bytes one request moves per layer-per-group: attention blocks + one Mamba slot per group.
    per_gs = page * (nblk * n_attn_groups + n_mamba_groups)
    gs = max(1, min(gs_real, budget // per_gs))
    # vLLM: group i of a type gets layers[i::num_groups]; we keep the first gs of each group.
    def split(ids, n_groups):
        return [list(ids[i::n_groups])[:gs] for i in range(n_groups)]

    groups = []
    for ids in split(m.attn_ids, n_attn_groups):
        groups.append(("attention", [f"model.layers.{i}.self_attn.attn" for i in ids]))
    if m.mamba_ids:
        for ids in split(m.mamba_ids, n_mamba_groups):
            groups.append(("mamba", [f"model.layers.{i}.mixer" for i in ids]))
    return Geometry(
        model=m.key,
        user_block=user_block,
        block_size=bs,
        page_bytes=page,
        mamba_real_bytes=m.mamba_state_bytes,
        groups=groups,
        layers_real=len(m.attn_ids) + len(m.mamba_ids),
        attn_layers=gs * n_attn_groups,
        mamba_layers=gs * n_mamba_groups,
    )


@dataclass(frozen=True)
class KVTensor:
    """vllm.v1.kv_cache_interface.KVCacheTensor (the fields the connector reads)."""

    size: int
    layers: list[str]
    layer_stride: int
    block_stride: int
    offset: int = 0


def placement(geom: Geometry, num_blocks: int, block_outer: bool) -> tuple[int, list[KVTensor]]:
    """``get_kv_cache_config_from_groups`` for uniform pages (no alignment padding: the page
    sizes here are multiples of every kernel block's page)."""
    page, gs = geom.page_bytes, geom.group_size
    bytes_per_block = gs * page
    size = bytes_per_block * num_blocks
    tensors = []
    for _, names in geom.groups:
        if block_outer:  # [B, L, ...]: a block holds every layer's page of its group
            tensors.append(KVTensor(size, list(names), page, bytes_per_block, 0))
        else:  # [L, B, ...]: each layer owns a contiguous run of num_blocks pages
            tensors.append(KVTensor(size, list(names), page * num_blocks, page, 0))
    return size, tensors


# --- one engine's memory and transport --------------------------------------------------------


@dataclass
class Side:
    buf: torch.Tensor
    regions: list[LayerRegion]
    allocations: list[tuple[int, int, int]]

    @property
    def base(self) -> int:
        return self.buf.data_ptr()


def fill_pattern(buf: torch.Tensor, seed: int) -> None:
    """Distinct int64s everywhere (cheap; a misplaced page shows up as a mismatch)."""
    words = buf.numel() // 8
    view = buf[: words * 8].view(torch.int64)
    step = 16 * MiB
    for start in range(0, words, step):
        stop = min(words, start + step)
        view[start:stop].copy_(torch.arange(start, stop, dtype=torch.int64, device=buf.device))
    view.add_(seed << 40)


def build_side(geom: Geometry, num_blocks: int, block_outer: bool, device: torch.device, seed):
    size, tensors = placement(geom, num_blocks, block_outer)
    buf = torch.empty(size + GUARD, dtype=torch.uint8, device=device)
    if seed is None:
        buf.zero_()  # also faults every page in before timing
    else:
        fill_pattern(buf, seed)
    groups = [
        SimpleNamespace(layer_names=list(names), kv_cache_spec=SimpleNamespace(page_size_bytes=geom.page_bytes))
        for _, names in geom.groups
    ]
    config = SimpleNamespace(kv_cache_groups=groups, kv_cache_tensors=tensors, num_blocks=num_blocks)
    # What the model runner hands the connector: one view per layer starting at its block 0.
    kv_caches = {
        name: buf[t.offset + i * t.layer_stride :] for t in tensors for i, name in enumerate(t.layers)
    }
    allocations, regions = regions_from_kv_caches(config, kv_caches, tuple(range(len(groups))))
    return Side(buf, regions, allocations)


def choose_blocks(rng, num_blocks: int, counts: list[int], scattered: bool, start: int) -> list[np.ndarray]:
    """Block ids per group (disjoint across groups: a block belongs to one group at a time).
    Scattered: a random order over the pool (free list after churn); contiguous: one run."""
    total = sum(counts)
    if scattered:
        ids = rng.choice(np.arange(1, num_blocks), size=total, replace=False)
    else:
        ids = np.arange(start, start + total)
    out, pos = [], 0
    for c in counts:
        out.append(ids[pos : pos + c])
        pos += c
    return out


# --- the three paths --------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


POLL_S = 0.0002


def wait_handle(transport_state, handle, timeout_s: float = 60.0) -> None:
    """Poll until DONE. Sleeps POLL_S between polls, as an engine loop polls once per step:
    a tight spin would steal a core from NIXL's own threads (num_threads > 0 copies there)."""
    deadline = time.perf_counter() + timeout_s
    while True:
        state = transport_state(handle)
        if state == DONE:
            return
        if state == FAILED:
            raise RuntimeError("NIXL transfer failed")
        if time.perf_counter() > deadline:
            raise RuntimeError("NIXL transfer timed out")
        time.sleep(POLL_S)


def drain(p_t: NixlTransport, want: int = 1, timeout_s: float = 10.0) -> int:
    """Wait for P's completion notification(s) (not timed) so none pile up across reps;
    returns how many arrived."""
    got, deadline = 0, time.monotonic() + timeout_s
    while got < want and time.monotonic() < deadline:
        got += len(p_t.take_notifications())
        if got < want:
            time.sleep(0.0005)
    if got < want:
        MISSING_NOTIFS.append(want - got)
    return got


MISSING_NOTIFS: list[int] = []


def connector_once(d_t: NixlTransport, pairs, notif: bytes) -> dict:
    """receiver.py's per-request path, timed end to end and by stage."""
    t0 = time.perf_counter()
    local_idx, remote_idx = d_t.plan(KEY, pairs)
    t1 = time.perf_counter()
    handle = d_t.read(KEY, local_idx, remote_idx, notif)
    t2 = time.perf_counter()
    wait_handle(d_t.state, handle)
    d_t.release(handle)
    t3 = time.perf_counter()
    return {"total": t3 - t0, "plan": t1 - t0, "post": t2 - t1, "wait": t3 - t2}


class RawNixl:
    """The same bytes as ONE prepared descriptor, on the connector's own agents."""

    def __init__(self, d_t: NixlTransport, p_side: Side, d_side: Side, nbytes: int, dev: int):
        self.agent = d_t._agent  # the benchmark reaches into the transport on purpose
        peer = d_t._peers[KEY].agent_name
        mem = d_t.mem_type
        self.local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(d_side.base, nbytes, dev)], mem)
        self.remote = self.agent.prep_xfer_dlist(peer, [(p_side.base, nbytes, dev)], mem)
        self.idx = np.zeros(1, dtype=np.int32)

    def once(self, notif: bytes) -> float:
        t0 = time.perf_counter()
        h = self.agent.make_prepped_xfer("READ", self.local, self.idx, self.remote, self.idx, notif_msg=notif)
        if self.agent.transfer(h) == FAILED:
            raise RuntimeError("raw READ refused")
        wait_handle(self.agent.check_xfer_state, h)
        self.agent.release_xfer_handle(h)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.agent.release_dlist_handle(self.local)
        self.agent.release_dlist_handle(self.remote)


def memcpy_once(p_side: Side, d_side: Side, nbytes: int, device: torch.device) -> float:
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        sync(device)
        t0 = time.perf_counter()
        d_side.buf[:nbytes].copy_(p_side.buf[:nbytes])
        sync(device)
        return time.perf_counter() - t0
    finally:
        torch.set_num_threads(threads)


# --- prototypes of a fix (block-outer layouts) ------------------------------------------------


class SpanTransfer:
    """Prototype: one descriptor per (group, block) when a group's layer pages are packed next
    to each other inside a block (block-outer layouts: layer_stride == page_bytes), instead of
    one per (layer, block). Descriptor lists are prepared once per peer, like the connector's;
    groups that are not packed on BOTH sides keep per-layer rows."""

    def __init__(self, d_t: NixlTransport, p_side: Side, d_side: Side, dev: int):
        self.agent = d_t._agent
        peer = d_t._peers[KEY].agent_name
        self.local_rows, self.local_off, self.local_layers = self._rows(d_side.regions, dev)
        self.remote_rows, self.remote_off, _ = self._rows(p_side.regions, dev)
        same_packing = [
            (a is None) == (b is None) for a, b in zip(self._packed(d_side.regions), self._packed(p_side.regions))
        ]
        assert all(same_packing), "prototype expects the same packing on both sides"
        self.local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", self.local_rows, d_t.mem_type)
        self.remote = self.agent.prep_xfer_dlist(peer, self.remote_rows, d_t.mem_type)

    @staticmethod
    def _packed(regions):
        out = []
        for g in sorted({r.group for r in regions}):
            regs = sorted((r for r in regions if r.group == g), key=lambda r: r.addr)
            ok = all(
                b.addr - a.addr == a.page_bytes and a.block_stride == b.block_stride and a.num_blocks == b.num_blocks
                for a, b in zip(regs, regs[1:])
            )
            out.append(regs if ok else None)
        return out

    def _rows(self, regions, dev):
        rows, offsets, layers = [], {}, {}
        pos = 0
        for g, regs in zip(sorted({r.group for r in regions}), self._packed(regions)):
            offsets[g] = pos
            if regs is not None:
                r0 = regs[0]
                rows.append((r0.addr, r0.page_bytes * len(regs), dev, r0.block_stride, r0.num_blocks))
                layers[g] = 1
                pos += r0.num_blocks
            else:
                # layer-major per-layer rows, exactly like layout.strided_descriptors
                mine = [r for r in regions if r.group == g]
                for r in mine:
                    rows.append((r.addr, r.page_bytes, dev, r.block_stride, r.num_blocks))
                layers[g] = len(mine)
                pos += mine[0].num_blocks * len(mine)
        return np.array(rows, dtype=np.int64).reshape(-1, 5), offsets, layers

    def plan(self, pairs):
        li, ri = [], []
        for g, gp in enumerate(pairs):
            if not len(gp):
                continue
            pr = np.asarray(gp, dtype=np.int64).reshape(-1, 2)
            src, dst = pr[:, 0], pr[:, 1]
            n_layers = self.local_layers[g]
            if n_layers == 1:
                li.append(self.local_off[g] + dst)
                ri.append(self.remote_off[g] + src)
            else:
                raise NotImplementedError("prototype only handles groups packed on both sides")
        return np.concatenate(li).astype(np.int32), np.concatenate(ri).astype(np.int32)

    def merged_count(self, li: np.ndarray, ri: np.ndarray) -> int:
        """Descriptors left after NIXL's merge (consecutive indices AND adjacent memory)."""

        def addrs(rows, idx):
            starts = np.concatenate(([0], np.cumsum(rows[:, 4])[:-1]))
            row = np.searchsorted(starts, idx, side="right") - 1
            return rows[row, 0] + (idx - starts[row]) * rows[row, 3], rows[row, 1]

        la, ln = addrs(self.local_rows, li)
        ra, _ = addrs(self.remote_rows, ri)
        ok = (np.diff(li) == 1) & (np.diff(ri) == 1) & (la[:-1] + ln[:-1] == la[1:]) & (ra[:-1] + ln[:-1] == ra[1:])
        return int((~ok).sum()) + 1

    def once(self, pairs, notif: bytes) -> dict:
        t0 = time.perf_counter()
        li, ri = self.plan(pairs)
        t1 = time.perf_counter()
        h = self.agent.make_prepped_xfer("READ", self.local, li, self.remote, ri, notif_msg=notif)
        if self.agent.transfer(h) == FAILED:
            raise RuntimeError("span READ refused")
        t2 = time.perf_counter()
        wait_handle(self.agent.check_xfer_state, h)
        self.agent.release_xfer_handle(h)
        t3 = time.perf_counter()
        return {"total": t3 - t0, "plan": t1 - t0, "post": t2 - t1, "wait": t3 - t2, "desc": int(li.size)}

    def close(self):
        self.agent.release_dlist_handle(self.local)
        self.agent.release_dlist_handle(self.remote)


def block_major_once(d_t: NixlTransport, pairs, notif: bytes) -> dict:
    """Prototype 2: the connector's own lists, indices ordered block-major within a group
    (all layers of one block pair, then the next pair) instead of layer-major."""
    t0 = time.perf_counter()
    li, ri = d_t.plan(KEY, pairs)
    # plan() returns layer-major per group: reshape each group's (layers, pairs) to (pairs, layers)
    parts_l, parts_r, pos = [], [], 0
    for g, gp in enumerate(pairs):
        n = len(gp)
        if not n:
            continue
        nl = len(d_t._regions_of_group[g])
        parts_l.append(li[pos : pos + nl * n].reshape(nl, n).T.ravel())
        parts_r.append(ri[pos : pos + nl * n].reshape(nl, n).T.ravel())
        pos += nl * n
    li, ri = np.concatenate(parts_l), np.concatenate(parts_r)
    t1 = time.perf_counter()
    handle = d_t.read(KEY, li, ri, notif)
    t2 = time.perf_counter()
    wait_handle(d_t.state, handle)
    d_t.release(handle)
    t3 = time.perf_counter()
    return {"total": t3 - t0, "plan": t1 - t0, "post": t2 - t1, "wait": t3 - t2}


def chunked_once(d_t: NixlTransport, pairs, notif: bytes, chunk_bytes: int) -> dict:
    """Prototype 3 (engine-thread stalls on DRAM): the same planned READ posted as consecutive
    chunks of at most ``chunk_bytes``, each posted only after the previous one is DONE, with
    the completion notification on the last chunk only (P must not free before the end).
    In the connector each chunk would be posted by a later ``Receiver.advance()`` call (one
    engine step each); here they follow back to back. ``blocked`` = the longest single post."""
    t0 = time.perf_counter()
    li, ri = d_t.plan(KEY, pairs)
    offsets = layout.region_offsets(d_t.regions)
    page = np.array([r.page_bytes for r in d_t.regions], dtype=np.int64)
    cum = np.cumsum(page[np.searchsorted(offsets, li, side="right") - 1])
    cuts = np.searchsorted(cum, np.arange(chunk_bytes, int(cum[-1]), chunk_bytes), side="right")
    bounds = sorted({0, *cuts.tolist(), int(li.size)})
    t1 = time.perf_counter()
    longest = 0.0
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        last = k == len(bounds) - 2
        tp = time.perf_counter()
        h = d_t.read(KEY, li[a:b], ri[a:b], notif if last else b"")
        longest = max(longest, time.perf_counter() - tp)
        wait_handle(d_t.state, h)
        d_t.release(h)
    t3 = time.perf_counter()
    return {"total": t3 - t0, "plan": t1 - t0, "post": longest, "chunks": len(bounds) - 1}


# --- descriptor accounting --------------------------------------------------------------------


def page_addresses(regions, idx: np.ndarray) -> np.ndarray:
    """Start address of each prepared-list descriptor index (layer-major prepared lists)."""
    offsets = layout.region_offsets(regions)
    addr = np.array([r.addr for r in regions], dtype=np.int64)
    stride = np.array([r.block_stride for r in regions], dtype=np.int64)
    region = np.searchsorted(offsets, idx, side="right") - 1
    return addr[region] + (idx - offsets[region]) * stride[region]


def nixl_merged_count(d_regions, p_regions, li, ri) -> int:
    """Descriptors left after NIXL's merge, which needs BOTH consecutive indices in the
    prepared lists AND adjacent memory, on both sides (measured: tests in the report)."""
    if li.size == 0:
        return 0
    page = np.array([r.page_bytes for r in d_regions], dtype=np.int64)
    offsets = layout.region_offsets(d_regions)
    ln = page[np.searchsorted(offsets, li, side="right") - 1]
    la, ra = page_addresses(d_regions, li), page_addresses(p_regions, ri)
    ok = (np.diff(li) == 1) & (np.diff(ri) == 1) & (la[:-1] + ln[:-1] == la[1:]) & (ra[:-1] + ln[:-1] == ra[1:])
    return int((~ok).sum()) + 1


# --- one case ---------------------------------------------------------------------------------


@dataclass
class Case:
    model: str
    tokens: int
    user_block: int
    scattered: bool
    block_outer: bool = False


@dataclass
class Result:
    section: str
    model: str
    label: str
    tokens: int
    user_block: int
    block_size: int
    layout: str
    blocks: str
    attn_layers: int
    mamba_layers: int
    layers_real: int
    page_kib: float
    mamba_state_kib: float
    nbytes: int
    num_blocks_pool: int
    desc: int
    runs_count_runs: int
    runs_nixl: int
    gbps: dict = field(default_factory=dict)
    best_s: dict = field(default_factory=dict)
    stages_us: dict = field(default_factory=dict)
    knobs: dict = field(default_factory=dict)
    load: float = 0.0
    verified: bool = False
    samples: dict = field(default_factory=dict)  # variant -> per-rep seconds (timed reps)

    def paired(self, num: str, den: str = "connector") -> float:
        """Median over reps of t(num) / t(den), each rep running all variants back to back:
        > 1 means ``den`` is faster. Robust to load drift, unlike a ratio of two bests."""
        a, b = self.samples.get(num), self.samples.get(den)
        if not a or not b:
            return 0.0
        return float(np.median(np.array(a) / np.array(b)))


class Bench:
    def __init__(self, args, knobs: dict | None = None):
        self.args = args
        self.device = torch.device(args.device)
        self.dev_id = (self.device.index or 0) if self.device.type == "cuda" else 0
        self.mem_type = "VRAM" if self.device.type == "cuda" else "DRAM"
        self.knobs = dict(knobs or {})
        nt = self.knobs.get("num_threads", args.num_threads)
        self.knobs["num_threads"] = nt
        self.p_t = NixlTransport(mem_type=self.mem_type, num_threads=nt, name="bench-P")
        self.d_t = NixlTransport(mem_type=self.mem_type, num_threads=nt, name="bench-D")
        self.rng = np.random.default_rng(args.seed)
        self._notif = 0

    def close(self):
        self.d_t.close()
        self.p_t.close()

    def notif(self) -> bytes:
        self._notif += 1
        return f"bench-{self._notif}".encode()

    def run_case(self, case: Case, section: str, variants=("connector", "raw", "memcpy")) -> Result:
        args, m = self.args, MODELS[case.model]
        geom = geometry(m, case.user_block, case.tokens, args.budget_mib * MiB)
        n_attn = math.ceil(case.tokens / geom.block_size)
        counts = [n_attn if kind == "attention" else 1 for kind, _ in geom.groups]
        total = sum(counts)
        num_blocks = int(total * args.pool_factor) + 2  # + the null block and a spare
        p_side = build_side(geom, num_blocks, case.block_outer, self.device, seed=1)
        d_side = build_side(geom, num_blocks, case.block_outer, self.device, seed=None)
        p_ids = choose_blocks(self.rng, num_blocks, counts, case.scattered, start=1)
        d_ids = choose_blocks(self.rng, num_blocks, counts, case.scattered, start=num_blocks - total)
        pairs = [list(zip(p.tolist(), d.tolist())) for p, d in zip(p_ids, d_ids)]
        nbytes = sum(len(gp) * len(names) * geom.page_bytes for gp, (_, names) in zip(pairs, geom.groups))

        self.p_t.register(p_side.allocations, p_side.regions, self.dev_id)
        self.d_t.register(d_side.allocations, d_side.regions, self.dev_id)
        self.d_t.add_peer(KEY, self.p_t.agent_metadata, p_side.regions, self.dev_id)
        raw = span = None
        try:
            li, ri = self.d_t.plan(KEY, pairs)
            res = Result(
                section=section,
                model=m.key,
                label=m.label,
                tokens=case.tokens,
                user_block=case.user_block,
                block_size=geom.block_size,
                layout="block-outer" if case.block_outer else "layer-outer",
                blocks="scattered" if case.scattered else "contiguous",
                attn_layers=geom.attn_layers,
                mamba_layers=geom.mamba_layers,
                layers_real=geom.layers_real,
                page_kib=geom.page_bytes / 1024,
                mamba_state_kib=geom.mamba_real_bytes / 1024,
                nbytes=nbytes,
                num_blocks_pool=num_blocks,
                desc=int(li.size),
                runs_count_runs=layout.count_runs(li, ri),
                runs_nixl=nixl_merged_count(d_side.regions, p_side.regions, li, ri),
                knobs=dict(self.knobs),
                load=os.getloadavg()[0],
            )
            # Untimed first READ, then check a sample of pages landed where they belong.
            self._connector(pairs)
            res.verified = verify(p_side, d_side, pairs, geom)
            if "raw" in variants:
                raw = RawNixl(self.d_t, p_side, d_side, nbytes, self.dev_id)
            if "span" in variants:
                span = SpanTransfer(self.d_t, p_side, d_side, self.dev_id)
                d_side.buf.zero_()
                span.once(pairs, self.notif())
                drain(self.p_t)
                res.verified = res.verified and verify(p_side, d_side, pairs, geom)
                sli, sri = span.plan(pairs)
                res.knobs["span_desc"] = int(sli.size)
                res.knobs["span_runs"] = span.merged_count(sli, sri)
            if "chunked" in variants:
                d_side.buf.zero_()
                chunked_once(self.d_t, pairs, self.notif(), args.chunk_mib * MiB)
                drain(self.p_t)
                time.sleep(0.05)
                extra = len(self.p_t.take_notifications())
                res.knobs["chunked_extra_notifications"] = extra  # must be 0: one per READ
                res.verified = res.verified and verify(p_side, d_side, pairs, geom) and extra == 0
            if "blockmajor" in variants:
                d_side.buf.zero_()
                block_major_once(self.d_t, pairs, self.notif())
                drain(self.p_t)
                res.verified = res.verified and verify(p_side, d_side, pairs, geom)
            direct = {}
            if {"direct", "sort_d", "sort_p", "seq_nomerge"} & set(variants):
                agent, peer = self.d_t._agent, self.d_t._peers[KEY]
                direct["direct"] = (li, ri, False)
                o = np.argsort(li, kind="stable")
                direct["sort_d"] = (li[o].copy(), ri[o].copy(), False)
                o = np.argsort(ri, kind="stable")
                direct["sort_p"] = (li[o].copy(), ri[o].copy(), False)
                seq_ids = choose_blocks(self.rng, num_blocks, counts, False, start=1)
                seq_pairs = [list(zip(x.tolist(), x.tolist())) for x in seq_ids]
                sl, sr = self.d_t.plan(KEY, seq_pairs)
                direct["seq_nomerge"] = (sl, sr, True)

                def direct_once(v):
                    dl, dr, skip = direct[v]
                    t0 = time.perf_counter()
                    h = agent.make_prepped_xfer(
                        "READ", self.d_t._local_dlist, dl, peer.dlist, dr, notif_msg=self.notif(), skip_desc_merge=skip
                    )
                    agent.transfer(h)
                    t1 = time.perf_counter()
                    wait_handle(agent.check_xfer_state, h)
                    agent.release_xfer_handle(h)
                    drain(self.p_t)
                    return {"total": time.perf_counter() - t0, "post": t1 - t0}

            best: dict[str, float] = {}
            stages: dict[str, dict] = {}
            samples: dict[str, list] = {v: [] for v in variants}
            reps = args.why_reps if section in ("why", "layout") else args.reps
            for rep in range(args.warmup + reps):
                timed = rep >= args.warmup
                for v in variants:
                    if v == "connector":
                        st = self._connector(pairs)
                    elif v == "raw":
                        st = {"total": raw.once(self.notif())}
                        drain(self.p_t)
                    elif v == "memcpy":
                        st = {"total": memcpy_once(p_side, d_side, nbytes, self.device)}
                    elif v == "span":
                        st = span.once(pairs, self.notif())
                        drain(self.p_t)
                    elif v == "blockmajor":
                        st = block_major_once(self.d_t, pairs, self.notif())
                        drain(self.p_t)
                    elif v in direct:
                        st = direct_once(v)
                    elif v == "chunked":
                        st = chunked_once(self.d_t, pairs, self.notif(), args.chunk_mib * MiB)
                        drain(self.p_t)
                        res.knobs["chunks"] = st.pop("chunks")
                    else:
                        raise ValueError(v)
                    if timed:
                        samples[v].append(st["total"])
                    if timed and st["total"] < best.get(v, math.inf):
                        best[v] = st["total"]
                        stages[v] = {k: round(x * 1e6, 1) for k, x in st.items() if k != "total"}
            res.best_s = best
            res.samples = samples
            res.gbps = {v: nbytes / t / 1e9 for v, t in best.items()}
            res.stages_us = stages
            return res
        finally:
            if raw is not None:
                raw.close()
            if span is not None:
                span.close()
            self.d_t.close()
            self.p_t.close()
            del p_side, d_side

    def _connector(self, pairs) -> dict:
        st = connector_once(self.d_t, pairs, self.notif())
        drain(self.p_t)
        return st


def verify(p_side: Side, d_side: Side, pairs, geom: Geometry) -> bool:
    """First and last pair of every group, first and last layer: D's page equals P's."""
    for g, gp in enumerate(pairs):
        if not gp:
            continue
        p_regs = [r for r in p_side.regions if r.group == g]
        d_regs = [r for r in d_side.regions if r.group == g]
        for src, dst in {gp[0], gp[-1]}:
            for pr, dr in {(p_regs[0], d_regs[0]), (p_regs[-1], d_regs[-1])}:
                po = pr.addr - p_side.base + src * pr.block_stride
                do = dr.addr - d_side.base + dst * dr.block_stride
                n = geom.page_bytes
                if not torch.equal(p_side.buf[po : po + n], d_side.buf[do : do + n]):
                    return False
    return True


# --- output -----------------------------------------------------------------------------------


def fmt_tokens(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def print_main_table(results: list[Result]) -> str:
    head = (
        f"{'model':<11} {'layers':>7} {'tok':>4} {'bs':>8} {'blocks':<10} {'MiB':>6} "
        f"{'desc':>6} {'runs':>5} {'conn':>6} {'raw':>6} {'memcpy':>6} {'c/raw~':>6} {'c/mcp~':>6} "
        f"{'plan_us':>7} {'blk_ms':>7} {'tot_ms':>7} {'load':>5} ok"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        layers = f"{r.attn_layers + r.mamba_layers}/{r.layers_real}"
        bs = str(r.block_size) if r.block_size == r.user_block else f"{r.user_block}>{r.block_size}"
        g = r.gbps
        c, raw, mc = g.get("connector", 0), g.get("raw", 0), g.get("memcpy", 0)
        st = r.stages_us.get("connector", {})  # of the best rep
        lines.append(
            f"{r.model:<11} {layers:>7} {fmt_tokens(r.tokens):>4} {bs:>8} {r.blocks:<10} "
            f"{r.nbytes / MiB:>6.0f} {r.desc:>6} {r.runs_nixl:>5} {c:>6.2f} {raw:>6.2f} {mc:>6.2f} "
            f"{r.paired('raw'):>6.2f} {r.paired('memcpy'):>6.2f} "
            f"{st.get('plan', 0):>7.0f} {st.get('post', 0) / 1e3:>7.1f} {r.best_s.get('connector', 0) * 1e3:>7.1f} "
            f"{r.load:>5.1f} {'y' if r.verified else 'NO'}"
        )
    text = "\n".join(lines)
    print(text)
    return text


def print_variant_table(results: list[Result], variants: list[str]) -> str:
    head = (
        f"{'model':<11} {'tok':>4} {'bs':>8} {'layout':<11} {'blocks':<10} {'MiB':>5} {'desc':>6} "
        f"{'nixl':>5} {'span':>9} " + " ".join(f"{v[:10]:>10}" for v in variants) + "  speedup~      ok"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        bs = str(r.block_size) if r.block_size == r.user_block else f"{r.user_block}>{r.block_size}"
        g = r.gbps
        gains = "/".join(f"{r.paired('connector', v):.2f}" for v in variants if v not in ("connector", "raw", "memcpy"))
        lines.append(
            f"{r.model:<11} {fmt_tokens(r.tokens):>4} {bs:>8} {r.layout:<11} {r.blocks:<10} "
            f"{r.nbytes / MiB:>5.0f} {r.desc:>6} {r.runs_nixl:>5} "
            f"{str(r.knobs.get('span_desc', '-')) + '>' + str(r.knobs.get('span_runs', '-')):>9} "
            + " ".join(f"{g.get(v, 0):>10.2f}" for v in variants)
            + f"  {gains:>11}  {'y' if r.verified else 'NO'}"
        )
    text = "\n".join(lines)
    print(text)
    return text


def plot(results: list[Result], layout_results, knob_rows, path: str, stall_results=()) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (.venv/bin/pip install matplotlib)")
        return
    models = list(dict.fromkeys(r.model for r in results))
    blocks = list(dict.fromkeys(r.user_block for r in results)) or [None, None, None]
    extra = 1 if (layout_results or knob_rows or stall_results) else 0
    if not models and not extra:
        return
    fig, axes = plt.subplots(
        len(models) + extra, len(blocks), figsize=(4.2 * len(blocks), 3.2 * (len(models) + extra)), squeeze=False
    )
    for i, mk in enumerate(models):
        for j, ub in enumerate(blocks):
            ax = axes[i][j]
            rs = [r for r in results if r.model == mk and r.user_block == ub]
            for mode, style in (("scattered", "-"), ("contiguous", "--")):
                sel = sorted((r for r in rs if r.blocks == mode), key=lambda r: r.tokens)
                if not sel:
                    continue
                x = [r.tokens for r in sel]
                ax.plot(x, [r.gbps.get("connector", 0) for r in sel], "o" + style, color="C0", label=f"connector {mode}")
                ax.plot(x, [r.gbps.get("raw", 0) for r in sel], "s" + style, color="C1", label=f"raw NIXL 1 desc ({mode} run)")
                ax.plot(x, [r.gbps.get("memcpy", 0) for r in sel], "^" + style, color="C2", label=f"memcpy ({mode} run)")
            bs = rs[0].block_size if rs else ub
            ax.set_title(f"{mk}  block {ub}" + (f"->{bs}" if bs != ub else ""), fontsize=9)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("prompt tokens", fontsize=8)
            ax.set_ylabel("GB/s", fontsize=8)
            ax.grid(alpha=0.3)
            if i == 0 and j == 0:
                ax.legend(fontsize=6)
    if extra:
        ax = axes[-1][0]
        if layout_results:
            names = [f"{r.model}\n{r.blocks[:4]}" for r in layout_results]
            xs = np.arange(len(layout_results))
            for k, v in enumerate(("connector", "blockmajor", "span", "raw")):
                ax.bar(xs + k * 0.2, [r.gbps.get(v, 0) for r in layout_results], 0.2, label=v)
            ax.set_xticks(xs + 0.3, names, fontsize=6, rotation=45, ha="right")
            ax.set_title("block-outer layout: connector vs prototypes", fontsize=9)
            ax.set_ylabel("GB/s", fontsize=8)
            ax.legend(fontsize=6)
        if knob_rows and len(axes[-1]) > 1:
            ax = axes[-1][1]
            labels = [k["name"] for k in knob_rows]
            cases = list(dict.fromkeys(c for k in knob_rows for c in k["gbps"]))
            xs = np.arange(len(labels))
            width = 0.8 / max(1, len(cases))
            for c_i, c in enumerate(cases):
                ax.bar(xs + c_i * width, [k["gbps"].get(c, 0) for k in knob_rows], width, label=c)
            ax.set_xticks(xs + 0.4 - width / 2, labels, fontsize=6, rotation=45, ha="right")
            ax.set_title("NIXL/UCX knobs (connector path)", fontsize=9)
            ax.set_ylabel("GB/s", fontsize=8)
            ax.legend(fontsize=5)
        if stall_results and len(axes[-1]) > 2:
            ax = axes[-1][2]
            names = [f"{r.model}\n{fmt_tokens(r.tokens)} {r.blocks[:4]}" for r in stall_results]
            xs = np.arange(len(stall_results))
            ax.bar(xs - 0.2, [r.stages_us.get("connector", {}).get("post", 0) / 1e3 for r in stall_results], 0.4,
                   label="connector: one READ")
            ax.bar(xs + 0.2, [r.stages_us.get("chunked", {}).get("post", 0) / 1e3 for r in stall_results], 0.4,
                   label="chunked prototype: longest post")
            ax.set_xticks(xs, names, fontsize=6, rotation=45, ha="right")
            ax.set_ylabel("ms inside read() (engine thread)", fontsize=8)
            ax.set_title("D engine-thread stall per READ", fontsize=9)
            ax.legend(fontsize=6)
        for k in range(3 if stall_results else 2, len(axes[-1])):
            axes[-1][k].axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- sections ---------------------------------------------------------------------------------


def progress(r: Result, k: int) -> None:
    g = " ".join(f"{v} {x:.2f}" for v, x in r.gbps.items())
    print(
        f"  [{k}] {r.model} {fmt_tokens(r.tokens)} b{r.user_block} {r.layout} {r.blocks}: {g} GB/s "
        f"(load {r.load:.1f})",
        flush=True,
    )


def section_main(args) -> list[Result]:
    bench = Bench(args)
    out = []
    try:
        for mk in args.models:
            for ub in args.blocks:
                for tok in args.tokens:
                    for scattered in (True, False):
                        r = bench.run_case(Case(mk, tok, ub, scattered), "main")
                        out.append(r)
                        progress(r, len(out))
    finally:
        bench.close()
    return out


def section_layout(args) -> list[Result]:
    bench = Bench(args)
    out = []
    variants = ("connector", "blockmajor", "span", "raw", "memcpy")
    try:
        for mk in args.models:
            for tok in args.layout_tokens:
                for scattered in (True, False):
                    case = Case(mk, tok, args.layout_block, scattered, block_outer=True)
                    out.append(bench.run_case(case, "layout", variants))
                    progress(out[-1], len(out))
    finally:
        bench.close()
    return out


WHY_CASES = [  # (model, tokens, user block, scattered): the cases furthest below raw NIXL
    ("llama-8b", 4096, 16, True),
    ("llama-8b", 16384, 16, True),
    ("llama-8b", 4096, 64, True),
]
WHY_VARIANTS = ("connector", "direct", "sort_d", "sort_p", "seq_nomerge", "raw")


def section_why(args) -> list[Result]:
    """Where the connector loses to one big descriptor, step by step, on the same pages:
    connector (plan + read) -> direct (the same indices, planned beforehand) -> seq_nomerge
    (the same number of equal-sized descriptors over sequential pages, merging off) -> raw
    (one descriptor). sort_d / sort_p: the scattered indices ordered by D / P address."""
    bench = Bench(args)
    out = []
    try:
        cases = WHY_CASES[:1] if args.quick else WHY_CASES
        for mk, tok, ub, scattered in cases:
            r = bench.run_case(Case(mk, tok, ub, scattered), "why", WHY_VARIANTS)
            out.append(r)
            progress(r, len(out))
    finally:
        bench.close()
    return out


def print_why_table(results: list[Result]) -> str:
    head = (
        f"{'model':<9} {'tok':>4} {'bs':>4} {'MiB':>4} {'desc':>5} {'page':>6} | "
        + " ".join(f"{v[:11]:>11}" for v in WHY_VARIANTS)
        + f" | {'plan+py':>7} {'scatter':>7} {'count':>7} {'us/desc':>7} {'sort_d':>7} {'sort_p':>7}"
    )
    lines = [
        "GB/s (best rep) per variant; then median per-rep time ratios: plan+py = connector/direct,",
        "scatter = direct/seq_nomerge, count = seq_nomerge/raw, us/desc = (seq_nomerge - raw) / desc;",
        "sort_d, sort_p = direct/sorted (> 1: sorting helps)",
        "",
        head,
        "-" * len(head),
    ]
    for r in results:
        med = {v: float(np.median(r.samples[v])) for v in WHY_VARIANTS if r.samples.get(v)}
        us_desc = (med["seq_nomerge"] - med["raw"]) / r.desc * 1e6 if r.desc else 0
        lines.append(
            f"{r.model:<9} {fmt_tokens(r.tokens):>4} {r.block_size:>4} {r.nbytes / MiB:>4.0f} {r.desc:>5} "
            f"{r.page_kib:>4.0f}Ki | "
            + " ".join(f"{r.gbps.get(v, 0):>11.2f}" for v in WHY_VARIANTS)
            + f" | {r.paired('connector', 'direct'):>7.2f} {r.paired('direct', 'seq_nomerge'):>7.2f} "
            f"{r.paired('seq_nomerge', 'raw'):>7.2f} {us_desc:>7.1f} {r.paired('direct', 'sort_d'):>7.2f} "
            f"{r.paired('direct', 'sort_p'):>7.2f}"
        )
    text = "\n".join(lines)
    print(text)
    return text


STALL_CASES = [  # (model, tokens, user block, scattered): the largest requests of the matrix
    ("llama-8b", 16384, 16, True),
    ("llama-8b", 16384, 16, False),
    ("nemotron-h", 16384, 16, True),
    ("qwen3-next", 16384, 16, True),
]


def section_stall(args) -> list[Result]:
    bench = Bench(args)
    out = []
    try:
        cases = STALL_CASES[:2] if args.quick else STALL_CASES
        for mk, tok, ub, scattered in cases:
            r = bench.run_case(Case(mk, tok, ub, scattered), "stall", ("connector", "chunked", "raw"))
            out.append(r)
            progress(r, len(out))
    finally:
        bench.close()
    return out


def print_stall_table(results: list[Result]) -> str:
    head = (
        f"{'model':<11} {'tok':>4} {'bs':>8} {'blocks':<10} {'MiB':>5} {'desc':>6} | "
        f"{'conn GB/s':>9} {'blocked ms':>10} | {'chunks':>6} {'chunked GB/s':>12} {'max blocked ms':>14} | "
        f"{'raw GB/s':>8}  ok"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        bs = str(r.block_size) if r.block_size == r.user_block else f"{r.user_block}>{r.block_size}"
        g, st = r.gbps, r.stages_us
        lines.append(
            f"{r.model:<11} {fmt_tokens(r.tokens):>4} {bs:>8} {r.blocks:<10} {r.nbytes / MiB:>5.0f} {r.desc:>6} | "
            f"{g.get('connector', 0):>9.2f} {st.get('connector', {}).get('post', 0) / 1e3:>10.1f} | "
            f"{r.knobs.get('chunks', 0):>6} {g.get('chunked', 0):>12.2f} {st.get('chunked', {}).get('post', 0) / 1e3:>14.1f} | "
            f"{g.get('raw', 0):>8.2f}  {'y' if r.verified else 'NO'}"
        )
    text = "\n".join(lines)
    print(text)
    return text


KNOB_CASES = [  # (model, tokens, user block, scattered)
    ("llama-8b", 4096, 16, True),  # 64 KiB pages, thousands of descriptors
    ("llama-8b", 4096, 16, False),  # the same, merged into one descriptor per layer
    ("nemotron-h", 4096, 16, True),  # 2 MiB pages, tens of descriptors
]


def knob_configs(quick: bool, only=None) -> list[dict]:
    """num_threads: NixlTransport(num_threads=...) -> UCX backend "num_threads" (NIXL's
    thread-pool engine). ucx_params: extra UCX backend parameters (NixlTransport cannot pass
    them today; agent creation is patched). env: set while the agents are created and around
    each of their transfers (UCX reads UCX_* when an agent's context is created: verified
    in-process, UCX_TLS=tcp on one pair and default on another give tcp and cma speeds)."""
    configs = [
        {"name": "default (nt=0)"},
        {"name": "num_threads=1", "num_threads": 1},
        {"name": "num_threads=2", "num_threads": 2},
        {"name": "num_threads=4", "num_threads": 4},
        {"name": "nt=1 split_batch=1", "num_threads": 1, "ucx_params": {"split_batch_size": "1"}},
        {"name": "nt=2 split_batch=1", "num_threads": 2, "ucx_params": {"split_batch_size": "1"}},
        {"name": "skip_desc_merge", "skip_merge": True},
        {"name": "UCX_TLS=cma,tcp", "env": {"UCX_TLS": "cma,tcp"}},
        {"name": "UCX_TLS=posix,tcp", "env": {"UCX_TLS": "posix,tcp"}},
        {"name": "UCX_TLS=tcp", "env": {"UCX_TLS": "tcp"}},
        {"name": "NIXL_UCX_SGL_ENABLE=1", "env": {"NIXL_UCX_SGL_ENABLE": "1"}},
        {"name": "no progress thread", "prog_thread": False},
    ]
    if only:
        configs = [c for c in configs if c["name"] in only]
    elif quick:
        keep = ("default (nt=0)", "num_threads=2", "nt=2 split_batch=1", "skip_desc_merge", "UCX_TLS=tcp")
        configs = [c for c in configs if c["name"] in keep]
    return configs


class _Env:
    def __init__(self, env: dict):
        self.env, self.saved = env, {}

    def __enter__(self):
        for k, v in self.env.items():
            self.saved[k] = os.environ.get(k)
            os.environ[k] = v

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def make_transport(cfg: dict, mem_type: str, name: str) -> NixlTransport:
    """A NixlTransport built with the knob's agent settings."""
    import pd_connector.transport as tr

    nt = int(cfg.get("num_threads", 0))
    params = {str(k): str(v) for k, v in (cfg.get("ucx_params") or {}).items()}
    prog = cfg.get("prog_thread", True)
    if not params and prog:
        with _Env(cfg.get("env", {})):
            return NixlTransport(mem_type=mem_type, num_threads=nt, name=name)
    real = tr._import_nixl

    def patched():
        agent_cls, config_cls = real()

        def make_config(backends, num_threads):
            if params:  # the UCX backend is created below, with the extra parameters
                return config_cls(backends=[], num_threads=0, enable_prog_thread=prog)
            return config_cls(backends=backends, num_threads=num_threads, enable_prog_thread=prog)

        def make_agent(agent_name, config):
            agent = agent_cls(agent_name, config)
            if params:
                agent.create_backend("UCX", {**params, **({"num_threads": str(nt)} if nt else {})})
            return agent

        return make_agent, make_config

    tr._import_nixl = patched
    try:
        with _Env(cfg.get("env", {})):
            return NixlTransport(mem_type=mem_type, num_threads=nt, name=name)
    finally:
        tr._import_nixl = real


def read_skip_merge(d_t: NixlTransport, key, local_idx, remote_idx, notif):
    """NixlTransport.read with skip_desc_merge=True (what the knob measures)."""
    peer = d_t._peers[key]
    h = d_t._agent.make_prepped_xfer(
        "READ", d_t._local_dlist, local_idx, peer.dlist, remote_idx, notif_msg=notif, skip_desc_merge=True
    )
    if d_t._agent.transfer(h) == FAILED:
        raise RuntimeError("READ refused")
    return h


def section_knobs(args) -> list[dict]:
    """One P/D agent pair per setting, alive one at a time (every agent runs its own progress
    threads, so keeping a dozen pairs alive would slow all of them). The memory of every knob
    case is built once and shared; the settings run round-robin in a rotating order,
    ``--warmup`` + ``--reps`` rounds, per case one untimed READ (a fresh pair connects on its
    first transfer), one timed connector READ and one raw READ, so load drift on the box
    spreads over all settings. Best round per setting and case is kept."""
    device = torch.device(args.device)
    mem_type = "VRAM" if device.type == "cuda" else "DRAM"
    dev_id = (device.index or 0) if device.type == "cuda" else 0
    rng = np.random.default_rng(args.seed + 7)
    configs = knob_configs(args.quick, args.knobs)
    rows = {
        c["name"]: {"name": c["name"], "config": c, "gbps": {}, "raw_gbps": {}, "post_ms": {}, "total_ms": {},
                    "verified": True, "missing_notifications": 0}
        for c in configs
    }
    cases = []
    for mk, tok, ub, scattered in KNOB_CASES:
        geom = geometry(MODELS[mk], ub, tok, args.knob_budget_mib * MiB)
        n_attn = math.ceil(tok / geom.block_size)
        counts = [n_attn if kind == "attention" else 1 for kind, _ in geom.groups]
        num_blocks = int(sum(counts) * args.pool_factor) + 2
        p_side = build_side(geom, num_blocks, False, device, seed=3)
        d_side = build_side(geom, num_blocks, False, device, seed=None)
        p_ids = choose_blocks(rng, num_blocks, counts, scattered, start=1)
        d_ids = choose_blocks(rng, num_blocks, counts, scattered, start=num_blocks - sum(counts))
        bpairs = [list(zip(p.tolist(), d.tolist())) for p, d in zip(p_ids, d_ids)]
        nbytes = sum(len(gp) * len(names) * geom.page_bytes for gp, (_, names) in zip(bpairs, geom.groups))
        cases.append((knob_case_name(mk, tok, ub, scattered), geom, p_side, d_side, bpairs, nbytes))
    best = {
        (c["name"], case[0]): {"connector": math.inf, "raw": math.inf, "post": 0.0, "fractions": []}
        for c in configs
        for case in cases
    }
    for rnd in range(args.warmup + args.reps):
        t_round = time.monotonic()
        # Rotate the order every round: no setting is always the one right after agent churn.
        for cfg in configs[rnd % len(configs) :] + configs[: rnd % len(configs)]:
            row = rows[cfg["name"]]
            if "error" in row:
                continue
            env = cfg.get("env", {})
            try:
                p_t = make_transport(cfg, mem_type, f"knob-P{rnd}")
                d_t = make_transport(cfg, mem_type, f"knob-D{rnd}")
            except Exception as exc:
                row["error"] = f"agent creation failed: {exc}"
                continue
            try:
                for name, geom, p_side, d_side, bpairs, nbytes in cases:
                    raw = None
                    try:
                        with _Env(env):
                            p_t.register(p_side.allocations, p_side.regions, dev_id)
                            d_t.register(d_side.allocations, d_side.regions, dev_id)
                            d_t.add_peer(KEY, p_t.agent_metadata, p_side.regions, dev_id)
                            raw = RawNixl(d_t, p_side, d_side, nbytes, dev_id)
                            if rnd == 0:  # zero once, so the first READ of each setting is verified
                                d_side.buf.zero_()
                            # Untimed READ first: a fresh agent pair connects its UCX endpoints
                            # and unpacks remote keys on its first transfer (tens of ms).
                            li, ri = d_t.plan(KEY, bpairs)
                            read = read_skip_merge if cfg.get("skip_merge") else NixlTransport.read
                            h = read(d_t, KEY, li, ri, f"w{rnd}".encode())
                            wait_handle(d_t.state, h, timeout_s=args.knob_timeout)
                            d_t.release(h)
                            row["missing_notifications"] += 1 - min(1, drain(p_t, 1, 5.0))
                            t0 = time.perf_counter()
                            li, ri = d_t.plan(KEY, bpairs)
                            read = read_skip_merge if cfg.get("skip_merge") else NixlTransport.read
                            h = read(d_t, KEY, li, ri, f"k{rnd}".encode())
                            t1 = time.perf_counter()
                            wait_handle(d_t.state, h, timeout_s=args.knob_timeout)
                            d_t.release(h)
                            total = time.perf_counter() - t0
                            row["missing_notifications"] += 1 - min(1, drain(p_t, 1, 5.0))
                            if rnd == 0:
                                row["verified"] &= verify(p_side, d_side, bpairs, geom)
                            raw_t = raw.once(f"r{rnd}".encode())
                            row["missing_notifications"] += 1 - min(1, drain(p_t, 1, 5.0))
                    except Exception as exc:
                        row["error"] = f"{name}: {type(exc).__name__}: {exc}"
                        break
                    finally:
                        if raw is not None:
                            raw.close()
                        d_t.close()
                        p_t.close()
                    if rnd >= args.warmup:
                        b = best[(cfg["name"], name)]
                        if total < b["connector"]:
                            b["connector"], b["post"] = total, t1 - t0
                        b["raw"] = min(b["raw"], raw_t)
                        b["fractions"].append((t1 - t0) / total)
            finally:
                del p_t, d_t
        print(f"  round {rnd + 1}/{args.warmup + args.reps} ({'warm-up' if rnd < args.warmup else 'timed'}, "
              f"{time.monotonic() - t_round:.0f} s, load {os.getloadavg()[0]:.1f})", flush=True)
    for (cfg_name, case_name), b in best.items():
        if math.isinf(b["connector"]):
            continue
        nbytes = next(c[5] for c in cases if c[0] == case_name)
        r = rows[cfg_name]
        r["gbps"][case_name] = nbytes / b["connector"] / 1e9
        r["raw_gbps"][case_name] = nbytes / b["raw"] / 1e9
        r["post_ms"][case_name] = b["post"] * 1e3
        r["total_ms"][case_name] = b["connector"] * 1e3
        r.setdefault("blocked_fraction_median", {})[case_name] = float(np.median(b["fractions"]))
    del cases
    return list(rows.values())


def knob_case_name(mk, tok, ub, scattered) -> str:
    return f"{mk} {fmt_tokens(tok)} b{ub} {'scat' if scattered else 'cont'}"


def child_check_vllm() -> None:
    """Cross-check ``placement`` and the hybrid block size against vLLM's own functions."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec

    report = []
    for mk, m in MODELS.items():
        for ub in (16, 64, 128):
            geom = geometry(m, ub, 4096, 1 << 40)
            groups = []
            for kind, names in geom.groups:
                if kind == "attention":
                    spec = FullAttentionSpec(
                        block_size=geom.block_size, num_kv_heads=m.kv_heads, head_size=m.head_dim, dtype=torch.bfloat16
                    )
                else:
                    spec = MambaSpec(
                        block_size=geom.block_size,
                        shapes=m.mamba_shapes,
                        dtypes=(torch.bfloat16,) * len(m.mamba_shapes),
                        page_size_padded=geom.page_bytes,
                    )
                assert spec.page_size_bytes == geom.page_bytes, (mk, kind, spec.page_size_bytes, geom.page_bytes)
                groups.append(KVCacheGroupSpec(list(names), spec))
            for layout_name, block_outer in (("LBHNC", False), ("BLHNC", True)):
                num_blocks = 37
                cache = SimpleNamespace(
                    get_resolved_kv_cache_layout=lambda n=layout_name: __import__(
                        "vllm.v1.kv_cache_layout", fromlist=["KVCacheLayout"]
                    ).KVCacheLayout[n],
                    num_gpu_blocks_override=num_blocks,
                    prefix_cache_retention_interval=None,
                )
                cfg = SimpleNamespace(cache_config=cache, attention_config=SimpleNamespace(hisparse_config=None))
                kvc = get_kv_cache_config_from_groups(cfg, groups, available_memory=1 << 40)
                size, mine = placement(geom, num_blocks, block_outer)
                theirs = [
                    (t.size, list(t.layers), t.layer_stride, t.block_stride, t.offset) for t in kvc.kv_cache_tensors
                ]
                ours = [(t.size, t.layers, t.layer_stride, t.block_stride, t.offset) for t in mine]
                report.append({"model": mk, "block": ub, "layout": layout_name, "match": ours == theirs})
                if ours != theirs:
                    report[-1]["vllm"] = theirs[:2]
                    report[-1]["ours"] = ours[:2]
    print("CHECK " + json.dumps(report))


def check_vllm_placement() -> dict:
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child-check-vllm"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("CHECK ")]
    if not line:
        return {"ok": None, "error": proc.stderr[-1500:]}
    report = json.loads(line[-1][len("CHECK ") :])
    return {"ok": all(r["match"] for r in report), "cases": report}


# --- main -------------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".artifacts/bench/", help="directory for JSON and PNG")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--quick", action="store_true", help="~1 minute smoke run")
    ap.add_argument("--models", nargs="+", choices=sorted(MODELS))
    ap.add_argument("--tokens", nargs="+", type=int, help="prompt lengths (default 1k 4k 16k 32k)")
    ap.add_argument("--blocks", nargs="+", type=int, help="user block sizes (default 16 64 128)")
    ap.add_argument("--reps", type=int, help="timed repetitions, best kept (default 3)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument(
        "--budget-mib",
        type=int,
        help="max bytes one request moves; layers are dropped (pages kept) above it (default 256)",
    )
    ap.add_argument("--pool-factor", type=float, default=1.5, help="pool blocks / request blocks")
    ap.add_argument("--num-threads", type=int, default=0, help="NixlTransport(num_threads=...) for main/layout")
    sections = ["main", "why", "layout", "stall", "knobs"]
    ap.add_argument("--sections", nargs="+", default=sections, choices=sections)
    ap.add_argument("--why-reps", type=int, help="timed reps of the 'why' section (default 8; quick 4)")
    ap.add_argument("--chunk-mib", type=int, default=32, help="chunk size of the chunked-READ prototype")
    ap.add_argument("--knobs", nargs="+", help="run only these knob settings (names as printed)")
    ap.add_argument("--knob-budget-mib", type=int, default=128, help="request size cap for the knob cases")
    ap.add_argument("--knob-timeout", type=float, default=20.0, help="seconds before a knob's READ counts as hung")
    ap.add_argument("--layout-tokens", nargs="+", type=int)
    ap.add_argument("--layout-block", type=int, default=16)
    ap.add_argument(
        "--check-vllm",
        action="store_true",
        help="cross-check the placement against vLLM's get_kv_cache_config_from_groups in a "
        "subprocess (imports vLLM: ~10-100 s on a 2-core box)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child-check-vllm", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.models = args.models or list(MODELS)
    if args.quick:
        args.tokens = args.tokens or [1024, 4096]
        args.blocks = args.blocks or [16, 128]
        args.reps = args.reps or 2
        args.budget_mib = args.budget_mib or 96
        args.layout_tokens = args.layout_tokens or [4096]
    args.tokens = args.tokens or [1024, 4096, 16384, 32768]
    args.blocks = args.blocks or [16, 64, 128]
    args.reps = args.reps or 3
    args.why_reps = args.why_reps or (4 if args.quick else 8)
    args.budget_mib = args.budget_mib or 256
    args.layout_tokens = args.layout_tokens or [4096, 16384]
    return args


def environment(args) -> dict:

    try:
        from importlib.metadata import version

        nixl_v = version("nixl")
    except Exception:  # pragma: no cover
        nixl_v = "?"
    return {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "device": args.device,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "nixl": nixl_v,
        "UCX_TLS": os.environ.get("UCX_TLS", "(unset)"),
        "loadavg_start": os.getloadavg(),
        "argv": sys.argv,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child_check_vllm:
        child_check_vllm()
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: torch sees no CUDA device", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    env = environment(args)
    t_start = time.monotonic()
    print(
        f"bench_transfer: {args.device}, {env['cpus']} CPUs, load {env['loadavg_start'][0]:.1f}, "
        f"budget {args.budget_mib} MiB/request, best of {args.reps} after {args.warmup} warm-up",
        flush=True,
    )
    report: dict = {"environment": env, "args": {k: v for k, v in vars(args).items() if not k.startswith("child")}}
    if args.check_vllm:
        check = check_vllm_placement()
        report["vllm_placement_check"] = check
        print(f"placement vs vLLM get_kv_cache_config_from_groups: {'match' if check['ok'] else check}", flush=True)
    tables = {}
    main_results = layout_results = []
    knob_rows: list[dict] = []
    if "main" in args.sections:
        print("\n== main: connector vs raw NIXL (1 descriptor) vs memcpy, layer-outer layout (vLLM default) ==")
        print("GB/s; desc = descriptors before merge (local_idx.size); runs = after NIXL's merge;")
        print("layers = used/real (pages real size); bs a>b = user block a, vLLM hybrid block b;")
        print("plan_us = NixlTransport.plan; blk_ms = time read() holds the calling (engine) thread;")
        print("tot_ms = connector total; load = 1-min load average at the start of the case\n", flush=True)
        main_results = section_main(args)
        tables["main"] = print_main_table(main_results)
    why_results: list[Result] = []
    if "why" in args.sections:
        print("\n== why: scattered small pages vs one descriptor, decomposed (layer-outer) ==\n", flush=True)
        why_results = section_why(args)
        tables["why"] = print_why_table(why_results)
    if "layout" in args.sections:
        print("\n== layout: block-outer (BLHNC) placement, connector vs prototypes ==")
        print("blockmajor = same lists, block-major index order; span = one descriptor per (group, block)\n", flush=True)
        layout_results = section_layout(args)
        tables["layout"] = print_variant_table(layout_results, ["connector", "blockmajor", "span", "raw", "memcpy"])
    stall_results: list[Result] = []
    if "stall" in args.sections:
        print(f"\n== stall: how long one READ holds D's engine thread; chunked prototype ({args.chunk_mib} MiB) ==")
        print("blocked ms = time inside NixlTransport.read (make_prepped_xfer + transfer) of the best rep\n", flush=True)
        stall_results = section_stall(args)
        tables["stall"] = print_stall_table(stall_results)
    if "knobs" in args.sections:
        print("\n== knobs: NIXL/UCX settings, one agent pair each, interleaved rep by rep ==", flush=True)
        knob_rows = section_knobs(args)
        tables["knobs"] = print_knob_table(knob_rows)
    report["main"] = [asdict(r) for r in main_results]
    report["layout"] = [asdict(r) for r in layout_results]
    report["stall"] = [asdict(r) for r in stall_results]
    report["why"] = [asdict(r) for r in why_results]
    report["knobs"] = knob_rows
    report["tables"] = tables
    report["missing_notifications"] = sum(MISSING_NOTIFS)
    if MISSING_NOTIFS:
        print(f"WARNING: {sum(MISSING_NOTIFS)} completion notification(s) never reached P")
    report["environment"]["loadavg_end"] = os.getloadavg()
    report["environment"]["wall_s"] = time.monotonic() - t_start
    json_path = os.path.join(args.out, "bench_transfer.json")
    png_path = os.path.join(args.out, "bench_transfer.png")
    with open(json_path, "w") as f:
        json.dump(report, f, indent=1, default=str)
    try:
        plot(main_results, layout_results, knob_rows, png_path, stall_results)
    except Exception as exc:  # a plot must not lose the measurements
        print(f"plot failed: {exc}")
    print(f"\nwrote {json_path} and {png_path} ({time.monotonic() - t_start:.0f} s)")
    bad = [r for r in (*main_results, *why_results, *layout_results, *stall_results) if not r.verified]
    if bad:
        print(f"{len(bad)} case(s) moved wrong bytes", file=sys.stderr)
        return 1
    return 0


def print_knob_table(rows: list[dict]) -> str:
    """Per case: connector GB/s and raw-NIXL GB/s (best round), the best connector time, and
    blk% = median share of the connector time spent inside read(), i.e. holding the calling
    (engine) thread."""
    cases = list(dict.fromkeys(c for r in rows for c in r.get("gbps", {})))
    w = 30
    head = f"{'setting':<22} " + " ".join(f"{c:>{w}}" for c in cases) + "  ok"
    sub = f"{'':<22} " + " ".join(f"{'conn   raw  tot_ms  blk%':>{w}}" for _ in cases)
    lines = [head, sub, "-" * len(head)]
    for r in rows:
        if "error" in r:
            tail = r["error"].strip().splitlines()[-1] if r["error"].strip() else "?"
            lines.append(f"{r['name']:<22} failed: {tail[:120]}")
            continue
        cells = []
        for c in cases:
            cg, rg = r["gbps"].get(c, 0), r.get("raw_gbps", {}).get(c, 0)
            total = r.get("total_ms", {}).get(c, 0)
            frac = r.get("blocked_fraction_median", {}).get(c, 0)
            cells.append(f"{cg:5.2f} {rg:5.2f} {total:7.1f} {frac * 100:5.0f}".rjust(w))
        ok = "y" if r.get("verified") and not r.get("missing_notifications") else "NO"
        lines.append(f"{r['name']:<22} " + " ".join(cells) + f"  {ok}")
    text = "\n".join(lines)
    print(text)
    return text


if __name__ == "__main__":
    sys.exit(main())
