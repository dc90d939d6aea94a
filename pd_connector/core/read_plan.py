"""How D plans and posts its READs (pure, numpy). Once per P engine, ``plan_engine`` decides
which P bytes feed which D bytes for every paired P rank (equal TP: the page maps reconciled;
unequal TP: the shard plan; unequal block sizes: the phase re-cut; ``block_phases.peer_regions``)
and gives each a ``PeerPlan``: the rows of the two descriptor lists the transport prepares, and
the ``Planner`` that plans every READ from that rank, with slices by size where the post itself
copies (``chunk_bounds``), and for NIXL's UCX worker threads the order and posts that give every
thread an equal share (``cut_long_runs``, ``thread_slices``). The descriptor indices, and NIXL's
merge rule these build on, live in ``core/descriptors.py``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pd_connector.core.block_phases import PhasePlan, peer_regions, route_pairs
from pd_connector.core.descriptors import (
    DescriptorRows,
    common_packing,
    count_runs,
    descriptor_rows,
    merged_ranges,
    plan_indices,
    reconcile_regions,
    run_starts,
)
from pd_connector.core.protocol import LayerRegion


def chunk_bounds(nbytes: np.ndarray, max_bytes: int) -> list[tuple[int, int]]:
    """Split descriptors (with these byte sizes, in order) into consecutive slices of at most
    ``max_bytes`` each (a single larger descriptor is a slice of its own); ``max_bytes <= 0``:
    one slice. Every descriptor is in exactly one slice, in order."""
    n = int(nbytes.size)
    if n == 0:
        return []
    if max_bytes <= 0:
        return [(0, n)]
    bounds, start = [], 0
    # A loop over chunks, not descriptors: searchsorted finds where each chunk ends.
    cum = np.cumsum(nbytes, dtype=np.int64)
    while start < n:
        base = int(cum[start - 1]) if start else 0
        stop = int(np.searchsorted(cum, base + max_bytes, side="right"))
        stop = max(stop, start + 1)
        bounds.append((start, stop))
        start = stop
    return bounds


def cut_long_runs(
    local_idx: np.ndarray, remote_idx: np.ndarray, local: DescriptorRows, remote: DescriptorRows,
    threads: int, pieces_per_thread: int = 8, min_bytes: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """The same descriptor pairs, reordered for a READ through ``threads`` of NIXL's UCX worker
    threads, so that the runs NIXL merges are about equally long and, where runs can be cut,
    their number is a multiple of ``threads``.

    A run longer than the READ's median run, or than ``1/(threads * pieces_per_thread)`` of its
    bytes, is cut at descriptor boundaries into pieces of about equal size (not below
    ``min_bytes``), listed last piece first: NIXL merges a descriptor only with the next one in
    the list when both sides are contiguous, so reversed pieces stay apart (``count_runs``
    counts them). Then runs with descriptors to spare are cut once more, most bytes per piece
    first, until the count is a multiple of ``threads`` (see ``thread_slices`` for why).

    Why: NIXL's UCX thread pool splits a READ among its threads by the number of descriptors
    after its merge, never inside one (nixlUcxThreadPoolEngine::prepXfer). A READ of a few long
    runs (contiguous block ids, packed layouts) would leave threads idle, and long attention
    runs listed before short state pages would give the first thread the bulk of the bytes;
    with runs of about one size, a split by count is a split by bytes. Runs stay in order, and
    a single descriptor longer than the cut stays whole."""
    n = int(local_idx.size)
    if n < 2 or threads <= 1:
        return local_idx, remote_idx
    nbytes = local.nbytes_of(local_idx).astype(np.int64)
    starts = run_starts(local_idx, remote_idx, local, remote)
    run_len = np.diff(np.append(starts, n))
    run_bytes = np.add.reduceat(nbytes, starts)
    share = -(-int(nbytes.sum()) // (threads * pieces_per_thread))
    max_bytes = max(min(share, int(np.median(run_bytes))), min_bytes, 1)
    # A run lies in one row, so its descriptors are equally long: k cuts (k <= its descriptors)
    # make k non-empty pieces.
    cuts = np.minimum(-(-run_bytes // max_bytes), run_len)
    short = -int(cuts.sum()) % threads
    spare = np.flatnonzero(cuts < run_len)
    if 0 < short <= spare.size:
        cuts[spare[np.argsort(-run_bytes[spare] / cuts[spare], kind="stable")[:short]]] += 1
    if (cuts == 1).all():
        return local_idx, remote_idx
    run = np.repeat(np.arange(starts.size), run_len)
    before = np.cumsum(nbytes) - nbytes
    within = before - before[starts][run]  # bytes ahead of each descriptor in its run
    piece = within * cuts[run] // run_bytes[run]
    order = np.lexsort((np.arange(n), -piece, run))
    return local_idx[order], remote_idx[order]


def thread_slices(
    local_idx: np.ndarray, remote_idx: np.ndarray, local: DescriptorRows, remote: DescriptorRows, threads: int
) -> list[tuple[int, int]]:
    """How to post a READ through ``threads`` UCX worker threads: one slice, unless its run
    count n (after NIXL's merge) exceeds ``threads`` without being a multiple of it; then the
    last ``n mod threads`` runs go in a second slice, posted once the first is done.

    Why: NIXL 1.5.1 cuts a READ into chunks of ``n // threads`` runs, so such an n makes one
    chunk more than there are threads; it lands in the first thread's queue behind that
    thread's whole first chunk, and ``transfer()`` returns only when every chunk is posted
    (nixlUcxThreadPoolEngine::sendXferRange), a whole copy's wait on the posting thread
    (docs/benchmarks.md, "Transfer path"). ``cut_long_runs`` avoids it wherever a run can be
    cut; this covers READs of single-descriptor runs."""
    n = int(local_idx.size)
    if n == 0:
        return []
    starts = run_starts(local_idx, remote_idx, local, remote)
    runs = int(starts.size)
    extra = runs % threads if threads > 1 else 0
    if runs <= threads or extra == 0:
        return [(0, n)]
    cut = int(starts[runs - extra])
    return [(0, cut), (cut, n)]


# With n worker threads, a READ's runs are cut into pieces of at most 1/(8n) of its bytes (or
# its median run), so that NIXL's split by descriptor count (``cut_long_runs``) leaves each
# thread within about 1/8 of an equal share; not below 256 KiB, where a descriptor's own cost
# would become a noticeable share of its copy (docs/benchmarks.md, per-descriptor cost).
RUN_PIECES_PER_THREAD = 8
MIN_RUN_PIECE_BYTES = 256 << 10


@dataclass(frozen=True)
class ReadPlan:
    """One READ from one peer, planned once: descriptor indices on both sides, the slices it
    is posted in (``bounds``: index ranges), the runs NIXL moves after its merge and the bytes."""

    local_idx: np.ndarray
    remote_idx: np.ndarray
    bounds: list[tuple[int, int]]
    runs: int
    nbytes: int

    @property
    def empty(self) -> bool:
        return self.local_idx.size == 0


class Planner:
    """Every READ from one peer is planned here: descriptor indices for per-group (remote block,
    local block) pairs, the slices it is posted in, its runs and bytes. ``plan_engine`` builds one
    per peer from the rows of the two descriptor lists the transport prepares; NIXL is never
    called here.

    ``shard``: a TP shard plan, where this peer may hold nothing of some groups (other P ranks
    send those). ``copies_in_post``: DRAM without UCX worker threads, where the post itself
    copies (slices by size); else ``threads`` worker threads share each READ. ``phases``: the
    attention groups whose block sizes differ from this peer's, moved per phase group
    (``block_phases.route_pairs``)."""

    __slots__ = ("local", "remote", "shard", "threads", "copies_in_post", "phases")

    def __init__(
        self, local: DescriptorRows, remote: DescriptorRows, *, shard: bool, threads: int, copies_in_post: bool,
        phases: PhasePlan | None = None,
    ):
        self.local, self.remote, self.shard = local, remote, shard
        self.threads, self.copies_in_post = threads, copies_in_post
        self.phases = phases

    def indices(self, pairs: Sequence[Sequence[tuple[int, int]]]) -> tuple[np.ndarray, np.ndarray]:
        """Descriptor indices (local, remote); with several worker threads, long runs cut so that
        each thread gets a share (``cut_long_runs``)."""
        if self.phases is not None:
            pairs = route_pairs(pairs, self.phases)
        if self.shard:
            pairs = [g if i in self.local.rows_of_group else () for i, g in enumerate(pairs)]
        local_idx, remote_idx = plan_indices(pairs, self.local, self.remote)
        return cut_long_runs(
            local_idx, remote_idx, self.local, self.remote, self.threads, RUN_PIECES_PER_THREAD, MIN_RUN_PIECE_BYTES
        )

    def slices(self, local_idx: np.ndarray, remote_idx: np.ndarray, chunk_bytes: int) -> list[tuple[int, int]]:
        """``ChunkedRead`` bounds: where the post copies, slices of at most ``chunk_bytes``;
        through worker threads one slice, or two (``thread_slices``)."""
        if self.copies_in_post:
            return chunk_bounds(self.local.nbytes_of(local_idx), chunk_bytes)
        return thread_slices(local_idx, remote_idx, self.local, self.remote, self.threads)

    def count_runs(self, local_idx: np.ndarray, remote_idx: np.ndarray) -> int:
        """Descriptors NIXL moves for these indices after its merge (contiguous runs)."""
        return count_runs(local_idx, remote_idx, self.local, self.remote)

    def merged_ranges(self, local_idx: np.ndarray, remote_idx: np.ndarray):
        """(local address, remote address, bytes) of those runs (``descriptors.merged_ranges``)."""
        return merged_ranges(local_idx, remote_idx, self.local, self.remote)

    def plan(self, pairs: Sequence[Sequence[tuple[int, int]]], chunk_bytes: int) -> ReadPlan:
        """Everything about one READ, computed once."""
        local_idx, remote_idx = self.indices(pairs)
        return ReadPlan(
            local_idx,
            remote_idx,
            self.slices(local_idx, remote_idx, chunk_bytes) if local_idx.size else [],
            self.count_runs(local_idx, remote_idx),
            int(self.local.nbytes_of(local_idx).sum()),
        )


@dataclass(frozen=True)
class PeerPlan:
    """What D reads from one P rank, decided once per peer: the ``Planner`` over the two
    descriptor lists' rows, and ``local_key``, equal for every peer whose local list is the
    same (same packing, same local page map), so that the transport prepares it once."""

    local_key: tuple[frozenset[int], tuple[LayerRegion, ...]]
    planner: Planner

    @property
    def local_rows(self) -> DescriptorRows:
        return self.planner.local

    @property
    def remote_rows(self) -> DescriptorRows:
        return self.planner.remote


def plan_engine(
    local: Sequence[LayerRegion],
    remote_by_rank: dict[int, Sequence[LayerRegion]],
    order: Sequence[int],
    same_tp: bool,
    phases: PhasePlan,
    local_sizes: Sequence[int],
    remote_sizes: Sequence[int],
    *,
    threads: int,
    copies_in_post: bool,
    packed: bool = True,
) -> dict[int, PeerPlan | None]:
    """Per P rank of one P engine (``order``: the ranks this D rank pairs with, preferred
    first): its ``PeerPlan``, or None where this D rank reads nothing from it (every unit that
    rank holds comes from another). ``local``: D's page map; ``remote_by_rank``: each P rank's,
    from its handshake; ``phases`` and the block sizes per group: the re-cut of unequal
    attention block sizes (``block_phases.PhasePlan``). ``threads`` and ``copies_in_post``: how
    the transport posts (``Planner``). ``packed=False`` describes every layer's page on its own
    even where both sides could move packed spans (a benchmark's comparison)."""
    plans: dict[int, PeerPlan | None] = {}
    for rank, (mine, theirs) in peer_regions(
        local, remote_by_rank, order, same_tp, phases, local_sizes, remote_sizes
    ).items():
        if mine is not None and not mine:
            plans[rank] = None
            continue
        # A matched pair of page maps (shard or phase plan) may leave groups to other P ranks;
        # otherwise (equal TP, equal block sizes) the two maps are reconciled whole.
        shard = mine is not None
        if mine is None:
            mine, theirs = reconcile_regions(local, theirs)
        mine, theirs = tuple(mine), tuple(theirs)
        packing = common_packing(mine, theirs) if packed else frozenset()
        planner = Planner(
            descriptor_rows(mine, packing), descriptor_rows(theirs, packing), shard=shard, threads=threads,
            copies_in_post=copies_in_post, phases=phases if phases.ratio else None,
        )
        plans[rank] = PeerPlan((packing, mine), planner)
    return plans


def plan_peer(
    local: Sequence[LayerRegion], remote: Sequence[LayerRegion], *, threads: int, copies_in_post: bool,
    packed: bool = True,
) -> PeerPlan:
    """``plan_engine`` for one P rank at D's TP size and block sizes, the two page maps
    reconciled: the one P, one D pairs of tests and benchmarks, and the local list the
    transport prepares at registration for a peer of its own layout."""
    no_recut = PhasePlan.of((), (), ())
    plans = plan_engine(
        local, {0: remote}, (0,), True, no_recut, (), (), threads=threads, copies_in_post=copies_in_post,
        packed=packed,
    )
    return plans[0]
