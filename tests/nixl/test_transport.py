"""NixlTransport with two (or three) real NIXL agents in one process, UCX over DRAM
(VRAM with ``PD_TEST_DEVICE=cuda``: ``rig/devices.py``).

The KV caches are CPU uint8 tensors placed the way vLLM's hybrid allocator places them
(``KVCacheTensor``: layer ``layers[l]``'s page for block b at
``offset + l * layer_stride + b * block_stride``), with attention and Mamba tensors aliasing one
allocation by block id. The page map is derived with the production code
(``engine/compat.regions_from_kv_caches``); the expected bytes are computed independently from the
placement, so a wrong region, a wrong descriptor index or a stray NIXL write all show up as a
byte mismatch somewhere in D's allocation.
"""

from __future__ import annotations

import collections
import random
import re
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pd_connector.transport import side_channel
from pd_connector.core.descriptors import DescriptorError
from pd_connector.core.read_plan import Planner
from pd_connector.core.protocol import EngineCompat, GroupDesc, Hello, LayerRegion, Reject, Welcome
from pd_connector.transport.nixl import DONE, PENDING, NixlTransport
from pd_connector.engine.from_vllm.regions import regions_from_kv_caches
from rig import devices, nixl_peers

pytestmark = pytest.mark.nixl

ATTN, MAMBA = 0, 1  # transfer-group indices
ATTN_LAYERS = ("attn.0", "attn.1")
MAMBA_LAYERS = ("mamba.0", "mamba.1")
GUARD = 1024  # bytes after the last KVCacheTensor byte, inside the registered allocation
TIMEOUT_S = 10.0

# --- vLLM-like placement --------------------------------------------------------------------


@dataclass(frozen=True)
class KVTensor:
    """Mirror of vllm.v1.kv_cache_interface.KVCacheTensor (the fields regions_from_kv_caches
    reads)."""

    size: int
    layers: list[str]
    layer_stride: int
    block_stride: int
    offset: int = 0


@dataclass(frozen=True)
class Placement:
    kind: str
    num_blocks: int
    page: dict[int, int]  # group -> page bytes
    tensors: tuple[KVTensor, ...]
    nbytes: int  # whole allocation (tensors + guard)

    def group_of(self, name: str) -> int:
        return ATTN if name in ATTN_LAYERS else MAMBA

    def page_offset(self, name: str, block: int) -> int:
        for t in self.tensors:
            if name in t.layers:
                return t.offset + t.layers.index(name) * t.layer_stride + block * t.block_stride
        raise KeyError(name)


def placement(kind: str, num_blocks: int) -> Placement:
    if kind == "block_major_padded":
        # Each block is one packed slot of both layers' pages plus 512 B of padding; the
        # Mamba group (3 KiB pages) overlays the attention group (4 KiB pages) slot by slot,
        # so a Mamba page leaves 1 KiB of its layer slot untouched as well.
        attn_page, mamba_page = 4096, 3072
        slot = 2 * attn_page + 512
        tensors = (
            KVTensor(num_blocks * slot, list(ATTN_LAYERS), attn_page, slot),
            KVTensor(num_blocks * slot, list(MAMBA_LAYERS), attn_page, slot),
        )
        size = num_blocks * slot
    elif kind == "layer_major_dense":
        # Each layer owns a contiguous run of num_blocks pages (block_stride == page); Mamba
        # pages are padded to the attention page size (as vLLM's hybrid allocator does) and
        # alias the attention layers' regions.
        attn_page = mamba_page = 4096
        region = num_blocks * attn_page
        tensors = (
            KVTensor(2 * region, list(ATTN_LAYERS), region, attn_page),
            KVTensor(2 * region, list(MAMBA_LAYERS), region, mamba_page),
        )
        size = 2 * region
    else:  # pragma: no cover
        raise ValueError(kind)
    return Placement(kind, num_blocks, {ATTN: attn_page, MAMBA: mamba_page}, tensors, size + GUARD)


@dataclass
class Engine:
    """One side: its allocation, page map and NIXL transport; as D, the planner of each peer."""

    placement: Placement
    buf: torch.Tensor  # the allocation vLLM would make (registered with NIXL)
    transport: NixlTransport
    regions: list[LayerRegion]
    planners: dict[str, Planner] = field(default_factory=dict)

    def add_peer(self, key: str, agent_metadata: bytes, regions) -> None:
        """Peer this D with a P as ``key`` (``rig.nixl_peers.add_peer``), keeping its planner."""
        self.planners[key] = nixl_peers.add_peer(self.transport, key, agent_metadata, regions)

    @property
    def mem(self) -> np.ndarray:
        """The same bytes as numpy (a view on CPU, a host copy on CUDA): byte checks stay
        single-threaded (torch's intra-op pool makes many small ops crawl on a loaded 2-core box)."""
        return devices.host(self.buf)

    def page(self, name: str, block: int) -> np.ndarray:
        off = self.placement.page_offset(name, block)
        return self.mem[off : off + self.placement.page[self.placement.group_of(name)]]


def make_engine(kind: str, num_blocks: int, seed: int | None, **transport_kw) -> Engine:
    pl = placement(kind, num_blocks)
    buf = devices.zeros(pl.nbytes) if seed is None else devices.random_bytes(pl.nbytes, seed)
    groups = [
        SimpleNamespace(
            layer_names=list(names), kv_cache_spec=SimpleNamespace(page_size_bytes=page)
        )
        for names, page in ((ATTN_LAYERS, pl.page[ATTN]), (MAMBA_LAYERS, pl.page[MAMBA]))
    ]
    config = SimpleNamespace(
        kv_cache_groups=groups, kv_cache_tensors=list(pl.tensors), num_blocks=num_blocks
    )
    # What the model runner hands the connector: one view per layer, starting at its block 0.
    kv_caches = {name: buf[pl.page_offset(name, 0) :] for t in pl.tensors for name in t.layers}
    allocations, regions = regions_from_kv_caches(config, kv_caches, (ATTN, MAMBA))
    assert [r.name for r in regions] == [*ATTN_LAYERS, *MAMBA_LAYERS]
    assert allocations == [(buf.data_ptr(), pl.nbytes, 0)]
    transport = devices.transport(**transport_kw)
    try:
        transport.register(allocations, regions)
    except Exception:
        transport.close()
        raise
    return Engine(pl, buf, transport, regions)


def expected_after(d: Engine, p: Engine, pairs) -> tuple[np.ndarray, np.ndarray]:
    """D's allocation after the READ, computed from the placements (not from LayerRegion),
    and a mask of the bytes the READ may write."""
    want = d.mem.copy()
    mask = np.zeros(d.mem.shape, dtype=bool)
    for group, group_pairs in enumerate(pairs):
        names = ATTN_LAYERS if group == ATTN else MAMBA_LAYERS
        for p_block, d_block in group_pairs:
            for name in names:
                off = d.placement.page_offset(name, d_block)
                n = d.placement.page[group]
                assert not mask[off : off + n].any(), "test bug: D pages of one READ overlap"
                want[off : off + n] = p.page(name, p_block)
                mask[off : off + n] = True
    return want, mask


def describe_mismatch(d: Engine, got: np.ndarray, want: np.ndarray) -> str:
    bad = np.flatnonzero(got != want)
    first = int(bad[0])
    where = "padding/guard"
    for t in d.placement.tensors:
        for name in t.layers:
            page = d.placement.page[d.placement.group_of(name)]
            for b in range(d.placement.num_blocks):
                off = d.placement.page_offset(name, b)
                if off <= first < off + page:
                    where = f"{name} block {b} (+{first - off})"
    return f"{bad.size} byte(s) differ; first at offset {first} in {where}"


def assert_bytes(d: Engine, want: np.ndarray) -> None:
    if not np.array_equal(d.mem, want):
        pytest.fail(describe_mismatch(d, d.mem, want))


def wait_done(transport: NixlTransport, handles) -> None:
    """Poll every handle to DONE (fail on ERR or timeout), then release them all."""
    pending = dict(enumerate(handles))
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while pending:
            for i, h in list(pending.items()):
                state = transport.state(h)
                if state == DONE:
                    transport.discard(h)
                    del pending[i]
                else:
                    assert state == PENDING, f"READ #{i} ended in state {state}"
            assert time.monotonic() < deadline, f"{len(pending)} READ(s) still pending"
            time.sleep(0.0005)
    finally:
        for h in pending.values():
            transport.discard(h)


def collect_notifications(transport: NixlTransport, expected: int, settle_s: float = 0.05):
    """Every notification until ``expected`` arrived, plus whatever else comes in ``settle_s``
    (so a duplicate would be seen)."""
    got: list[bytes] = []
    deadline = time.monotonic() + TIMEOUT_S
    while len(got) < expected and time.monotonic() < deadline:
        got += transport.take_notifications()
        time.sleep(0.001)
    settle = time.monotonic() + settle_s
    while time.monotonic() < settle:
        got += transport.take_notifications()
        time.sleep(0.005)
    return collections.Counter(got)


class _Pool:
    """Agents are shared per module (creating and tearing down UCX agents costs far more than
    the transfers): one P/D pair per layout kind, plus a second P. Every test gets them reset:
    D zeroed, notifications drained, D peered with P under ``PEER``."""

    def __init__(self):
        self.pairs: dict[str, tuple[Engine, Engine]] = {}
        self.extra_p: dict[str, Engine] = {}

    def get(self, kind: str) -> tuple[Engine, Engine]:
        if kind not in self.pairs:
            p = make_engine(kind, P_BLOCKS, seed=1234 + len(self.pairs))
            try:
                d = make_engine(kind, D_BLOCKS, seed=None)
            except Exception:
                p.transport.close()
                raise
            self.pairs[kind] = (p, d)
        p, d = self.pairs[kind]
        if not d.transport.has_peer(PEER):
            d.add_peer(PEER, p.transport.agent_metadata, p.regions)
        devices.zero(d.buf)
        for e in (p, d, *self.extra_p.values()):
            e.transport.take_notifications()
        return p, d

    def second_p(self, kind: str) -> Engine:
        if kind not in self.extra_p:
            self.extra_p[kind] = make_engine(kind, P_BLOCKS, seed=99)
        self.extra_p[kind].transport.take_notifications()
        return self.extra_p[kind]

    def close(self) -> None:
        # Initiators (D) first, so no agent talks to one already gone.
        for _, d in self.pairs.values():
            d.transport.close()
        for e in (*(p for p, _ in self.pairs.values()), *self.extra_p.values()):
            e.transport.close()
        self.pairs.clear()
        self.extra_p.clear()


@pytest.fixture(scope="module")
def pool():
    pool = _Pool()
    yield pool
    pool.close()


@pytest.fixture
def engines(pool):
    """engines(kind) -> (P, D): D zeroed and peered with P under ``PEER``."""
    return pool.get


PEER = "engine-p"
KINDS = ["block_major_padded", "layer_major_dense"]
P_BLOCKS, D_BLOCKS = 40, 56  # different pool sizes on P and D, as in practice

# (attention pairs, Mamba pairs) as (P block, D block); the D blocks of one READ never alias
# across groups (a block id belongs to one group at a time). Block 0 is vLLM's null block.
PAIR_CASES = {
    "scattered": ([(7, 2), (1, 9), (4, 5), (30, 44)], [(3, 11)]),
    "contiguous_runs": ([(1, 3), (2, 4), (3, 5), (4, 6), (8, 12), (9, 13)], [(11, 15)]),
    "mamba_slot_only": ([], [(5, 1)]),
    "attention_only": ([(11, 15), (1, 1)], []),
    "last_blocks_both_sides": ([(P_BLOCKS - 1, D_BLOCKS - 1)], [(P_BLOCKS - 2, D_BLOCKS - 2)]),
}


# --- transfers ------------------------------------------------------------------------------


def read_and_wait(d: Engine, pairs, notif: bytes, peer: str = PEER) -> None:
    wait_done(d.transport, [d.transport.read(peer, *d.planners[peer].indices(pairs), notif)])


@pytest.mark.parametrize("case", list(PAIR_CASES))
@pytest.mark.parametrize("kind", KINDS)
def test_read_moves_exactly_the_paired_pages(engines, kind, case):
    p, d = engines(kind)
    pairs = [list(PAIR_CASES[case][0]), list(PAIR_CASES[case][1])]
    p_before = p.mem.copy()
    want, mask = expected_after(d, p, pairs)
    assert mask.any()

    local_idx, remote_idx = d.planners[PEER].indices(pairs)
    # block_major_padded packs the two attention layers of a block into one span.
    attn_rows = 1 if kind == "block_major_padded" else len(ATTN_LAYERS)
    n_desc = len(pairs[ATTN]) * attn_rows + len(pairs[MAMBA]) * len(MAMBA_LAYERS)
    assert local_idx.dtype == remote_idx.dtype == np.int32
    assert local_idx.size == remote_idx.size == n_desc

    notif = f"req-{kind}-{case}".encode()
    wait_done(d.transport, [d.transport.read(PEER, local_idx, remote_idx, notif)])

    assert_bytes(d, want)
    assert not d.mem[~mask].any(), "a byte outside the paired D pages changed (padding included)"
    assert np.array_equal(p.mem, p_before), "a READ modified the prefill side"
    assert collect_notifications(p.transport, 1) == {notif: 1}
    assert d.transport.take_notifications() == []


@pytest.mark.parametrize("kind", KINDS)
def test_many_concurrent_reads_each_notify_once(engines, kind):
    num_reads = 16
    p, d = engines(kind)
    rng = random.Random(7)
    d_free = rng.sample(range(1, D_BLOCKS), 3 * num_reads)  # disjoint D blocks across READs
    reads = []
    for k in range(num_reads):
        d1, d2, d3 = d_free[3 * k : 3 * k + 3]
        pairs = [
            [(rng.randrange(1, P_BLOCKS), d1), (rng.randrange(1, P_BLOCKS), d2)],
            [(rng.randrange(1, P_BLOCKS), d3)],
        ]
        reads.append((f"req-{k}".encode(), pairs))

    union = [[pr for _, pairs in reads for pr in pairs[g]] for g in (ATTN, MAMBA)]
    want, mask = expected_after(d, p, union)  # D blocks are disjoint across READs
    handles = []
    for notif, pairs in reads:  # all posted before any is polled
        handles.append(d.transport.read(PEER, *d.planners[PEER].indices(pairs), notif))
    wait_done(d.transport, handles)

    assert_bytes(d, want)
    assert not d.mem[~mask].any()
    assert collect_notifications(p.transport, num_reads) == {n: 1 for n, _ in reads}


def test_reads_from_two_prefill_engines_notify_only_their_source(pool, engines):
    kind = "block_major_padded"
    p1, d = engines(kind)
    p2 = pool.second_p(kind)
    d.add_peer("p2", p2.transport.agent_metadata, p2.regions)
    try:
        pairs1 = [[(2, 3), (3, 4)], [(5, 6)]]
        pairs2 = [[(2, 7), (9, 8)], [(5, 10)]]  # same P block ids, other engine, other D blocks
        want1, _ = expected_after(d, p1, pairs1)
        want2, m2 = expected_after(d, p2, pairs2)
        h1 = d.transport.read(PEER, *d.planners[PEER].indices(pairs1), b"from-p1")
        h2 = d.transport.read("p2", *d.planners["p2"].indices(pairs2), b"from-p2")
        wait_done(d.transport, [h1, h2])
        want1[m2] = want2[m2]
        assert_bytes(d, want1)
        assert collect_notifications(p1.transport, 1) == {b"from-p1": 1}
        assert collect_notifications(p2.transport, 1) == {b"from-p2": 1}
    finally:
        d.transport.remove_peer("p2")


def test_read_again_after_peer_removed_and_re_added(engines):
    """The worker's retry path: remove_peer, then add_peer with the same metadata."""
    p, d = engines("layer_major_dense")
    pairs = [[(1, 2)], [(3, 4)]]
    want, _ = expected_after(d, p, pairs)
    read_and_wait(d, pairs, b"a")
    d.transport.remove_peer(PEER)
    assert not d.transport.has_peer(PEER)
    devices.zero(d.buf)
    d.add_peer(PEER, p.transport.agent_metadata, p.regions)
    read_and_wait(d, pairs, b"b")
    assert_bytes(d, want)
    assert collect_notifications(p.transport, 2) == {b"a": 1, b"b": 1}


def test_handshake_over_side_channel_then_read(engines, free_port):
    """D's real path: Hello -> Welcome over ZMQ, add_peer from the Welcome, READ."""
    p, d = engines("block_major_padded")
    d.transport.remove_peer(PEER)
    compat = EngineCompat(
        model="tiny",
        dtype="torch.bfloat16",
        kv_cache_dtype="auto",
        groups=[
            GroupDesc("attention", 16, 4096, list(ATTN_LAYERS)),
            GroupDesc("mamba", 64, 3072, list(MAMBA_LAYERS)),
        ],
        conv_state_layout="DS",
        tensor_parallel_size=1,
        device="cpu",
    )
    welcome = Welcome(
        engine_id=PEER,
        agent_name=p.transport.name,
        agent_metadata=p.transport.agent_metadata,
        regions=list(p.regions),
        compat=compat,
    )

    def serve(message):
        return welcome if isinstance(message, Hello) else Reject(reason="unexpected")

    server = side_channel.SideChannelServer("127.0.0.1", free_port, serve)
    try:
        reply = side_channel.call("127.0.0.1", free_port, Hello("engine-d", compat), 5.0)
    finally:
        server.close()
    assert isinstance(reply, Welcome)
    assert reply.regions == list(p.regions) and reply.agent_name == p.transport.name
    d.add_peer(PEER, reply.agent_metadata, reply.regions)
    pairs = [[(4, 9), (5, 10)], [(6, 2)]]
    want, _ = expected_after(d, p, pairs)
    read_and_wait(d, pairs, b"r1")
    assert_bytes(d, want)
    assert collect_notifications(p.transport, 1) == {b"r1": 1}


# --- planning: empty, merged, refused -------------------------------------------------------


def test_plan_with_no_pairs_returns_empty_arrays(engines):
    _, d = engines("block_major_padded")
    for pairs in ([], [[], []], [[]]):
        local_idx, remote_idx = d.planners[PEER].indices(pairs)
        assert local_idx.size == remote_idx.size == 0
        assert local_idx.dtype == remote_idx.dtype == np.int32
        assert d.planners[PEER].count_runs(local_idx, remote_idx) == 0


def test_nixl_refuses_a_read_with_zero_descriptors(engines):
    """Why a zero-pair READ must never be posted: NIXL 1.5.1 rejects it in makeXferReq
    (NIXL_ERR_INVALID_PARAM, logged as 'different number of indices for local (0), remote
    (0)'), so the notification P waits for is never sent."""
    p, d = engines("block_major_padded")
    empty = np.zeros(0, dtype=np.int32)
    with pytest.raises(Exception, match="NIXL_ERR_INVALID_PARAM"):
        d.transport.read(PEER, empty, empty, b"nothing")
    assert collect_notifications(p.transport, 0) == {}


def test_descriptor_count_contiguous_runs_merge_scattered_do_not(engines):
    p, d = engines("layer_major_dense")
    layers = len(ATTN_LAYERS)
    cases = {
        "contiguous": [[(1, 5), (2, 6), (3, 7), (4, 8), (5, 9)], []],
        "scattered": [[(1, 9), (7, 2), (3, 12), (10, 5), (5, 14)], []],
        "contiguous_on_p_only": [[(1, 9), (2, 2), (3, 12), (4, 5), (5, 14)], []],
        "two_runs": [[(1, 5), (2, 6), (3, 7), (20, 30), (21, 31)], []],
    }
    runs = {}
    for name, pairs in cases.items():
        local_idx, remote_idx = d.planners[PEER].indices(pairs)
        assert local_idx.size == 5 * layers
        runs[name] = d.planners[PEER].count_runs(local_idx, remote_idx)
        devices.zero(d.buf)
        want, _ = expected_after(d, p, pairs)
        read_and_wait(d, pairs, name.encode())
        assert_bytes(d, want)
    assert runs == {
        "contiguous": layers,
        "scattered": 5 * layers,
        "contiguous_on_p_only": 5 * layers,
        "two_runs": 2 * layers,
    }
    # A Mamba slot is one page per Mamba layer.
    local_idx, remote_idx = d.planners[PEER].indices([[], [(3, 4)]])
    assert d.planners[PEER].count_runs(local_idx, remote_idx) == len(MAMBA_LAYERS)


@pytest.mark.parametrize(
    "pairs, side",
    [
        ([[(P_BLOCKS, 1)], []], "remote"),  # one past P's last block (D has more blocks)
        ([[(1, D_BLOCKS)], []], "local"),
        ([[], [(-1, 2)]], "remote"),
        ([[], [(2, -1)]], "local"),
        ([[(1, 2), (2, 3), (10**6, 4)], []], "remote"),  # one bad id among good ones
    ],
    ids=["remote_eq_num_blocks", "local_eq_num_blocks", "remote_negative", "local_negative",
         "remote_far_out"],
)
def test_plan_refuses_out_of_range_block_ids(engines, pairs, side):
    _, d = engines("block_major_padded")
    with pytest.raises(DescriptorError, match=f"{side} block id out of range"):
        d.planners[PEER].indices(pairs)


def test_plan_refuses_pairs_for_a_group_without_layers(engines):
    _, d = engines("block_major_padded")
    with pytest.raises(DescriptorError, match="group 2 has blocks to move but no registered layers"):
        d.planners[PEER].indices([[], [], [(1, 1)]])


def test_plan_block_id_beyond_int64_raises_layout_error_not_overflow(engines):
    _, d = engines("block_major_padded")
    with pytest.raises(DescriptorError):
        d.planners[PEER].indices([[(2**63, 1)], []])


# --- peer validation ------------------------------------------------------------------------


def _tamper(regions, index, **changes):
    out = list(regions)
    fields = {f: getattr(out[index], f) for f in LayerRegion.__struct_fields__}
    fields.update(changes)
    out[index] = LayerRegion(**fields)
    return out


@pytest.mark.parametrize(
    "index, changes, named",
    [
        (1, {"name": "attn.7"}, "attn.7"),
        (2, {"group": 0}, "mamba.0"),
        (3, {"page_bytes": 4096 + 2048}, "mamba.1"),
        (0, {"page_bytes": 2048}, "attn.0"),
    ],
    ids=["layer_name", "group", "page_size_mamba", "page_size_attention"],
)
def test_add_peer_refuses_mismatched_regions_naming_the_layer(engines, index, changes, named):
    p, d = engines("block_major_padded")
    tampered = _tamper(p.regions, index, **changes)
    with pytest.raises(DescriptorError, match=rf"(layer mismatch: .*|state ){re.escape(named)}\b"):
        d.add_peer("tampered", p.transport.agent_metadata, tampered)
    assert not d.transport.has_peer("tampered")
    with pytest.raises(DescriptorError, match="layer count differs: local 4, remote 3"):
        d.add_peer("tampered", p.transport.agent_metadata, p.regions[:3])
    assert not d.transport.has_peer("tampered")


def test_add_peer_regions_outside_peer_registration_refused_by_nixl_then_retry_works(engines):
    """A Welcome whose page map reaches past P's registered memory: NIXL's prep of the remote
    dlist fails (NIXL_ERR_NOT_FOUND; it checks descriptors against the peer's registration
    from its metadata), so a tampered page map cannot aim READs at other memory. No peer is
    kept, and add_peer with the true map then works (loading the same agent twice is fine)."""
    p, d = engines("block_major_padded")
    d.transport.remove_peer(PEER)
    too_many = _tamper(p.regions, 3, num_blocks=P_BLOCKS + 8)
    with pytest.raises(Exception, match="NIXL_ERR_NOT_FOUND"):
        d.add_peer(PEER, p.transport.agent_metadata, too_many)
    assert not d.transport.has_peer(PEER)
    d.add_peer(PEER, p.transport.agent_metadata, p.regions)
    pairs = [[(1, 2)], [(P_BLOCKS - 1, 3)]]
    want, _ = expected_after(d, p, pairs)
    read_and_wait(d, pairs, b"ok")
    assert_bytes(d, want)


def test_register_refuses_a_page_map_past_the_allocation():
    pl = placement("block_major_padded", 4)
    buf = devices.zeros(pl.nbytes)
    t = devices.transport()
    try:
        bad = [LayerRegion("attn.0", 0, buf.data_ptr(), pl.tensors[0].block_stride, 4096, 40)]
        with pytest.raises(Exception, match="NIXL_ERR_NOT_FOUND"):
            t.register([(buf.data_ptr(), pl.nbytes, 0)], bad)
    finally:
        t.close()


def test_an_agent_with_a_progress_delay_still_completes_reads_only_d_polls():
    """The default over DRAM (nixl_progress_delay_us=100, set through transport.create_agent's
    shim around NIXL's hard-coded pthrDelay=0): P's progress thread, now pausing between polls,
    must still serve a READ that only D polls, with the right bytes and P's notification."""
    p = make_engine("layer_major_dense", P_BLOCKS, seed=5)
    d = make_engine("layer_major_dense", 56, seed=None)
    for eng in (p, d):
        eng.transport.close()
        eng.transport = devices.transport(progress_delay_us=100)
        eng.transport.register([(eng.buf.data_ptr(), eng.placement.nbytes, 0)], eng.regions)
    try:
        d.add_peer("p", p.transport.agent_metadata, p.regions)
        pairs = [[(1, 3), (7, 9), (4, 5)], [(3, 11)]]
        li, ri = d.planners["p"].indices(pairs)
        handle = d.transport.read("p", li, ri, b"delayed")
        deadline = time.monotonic() + TIMEOUT_S
        while (state := d.transport.state(handle)) == PENDING:
            assert time.monotonic() < deadline
        assert state == DONE
        d.transport.discard(handle)
        want, _ = expected_after(d, p, pairs)
        assert_bytes(d, want)
        assert collect_notifications(p.transport, 1) == {b"delayed": 1}
    finally:
        d.transport.close()
        p.transport.close()


def test_a_nixl_call_that_holds_the_engine_thread_is_logged(monkeypatch, caplog):
    """A side-channel thread held 22.7 s on P in CI with nothing else in P's log: the NIXL calls
    outside D's READ path (notifications, peer set-up) now say when they held the thread."""
    from pd_connector.transport import nixl as nixl_transport

    monkeypatch.setattr(nixl_transport, "SLOW_CALL_S", 0.05)
    with caplog.at_level("WARNING", logger="vllm.pd_connector"):
        assert nixl_transport._timed("get_new_notifs", lambda: time.sleep(0.1) or {}) == {}
        assert nixl_transport._timed("make_connection", lambda name: name, "fast") == "fast"
    assert "NIXL get_new_notifs held this process's engine thread" in caplog.text
    assert "make_connection" not in caplog.text
