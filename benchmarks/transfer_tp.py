"""Transfer across tensor-parallel sizes: what each D rank moves from each P rank for one
request, and how long the connector's READs take against raw NIXL moving the same bytes.

In one process, with real NIXL agents (UCX over DRAM): P ranks and D ranks of a synthetic hybrid
(two attention layers, GQA heads or MLA's replicated latent, and one recurrent layer of each
kind vLLM shards: Mamba2, GDN, Mamba1, short convolution, KDA; laid out as vLLM shards them:
``rig/tp_layouts.py``). Per (P TP, D TP) and D rank: descriptors (NIXL's merged runs)
and bytes per source rank, the connector's READs (``NixlTransport.read_plan`` +
``ChunkedRead``, one per source rank, posted together and polled to DONE) and raw NIXL (one
descriptor per source rank carrying the same bytes), and their ratio. Figures, not assertions.

    python -m benchmarks transfer_tp [--pairs 1x2,2x1,...] [--kinds mamba2 gdn ...]
        [--attention gqa mla] [--blocks N] [--reps N] [--scale K]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import numpy as np

from pd_connector.core import block_phases, read_plan, shards
from benchmarks import report
from benchmarks.transfer_paths import POLL_S
from rig.tp_layouts import KINDS, Model
from pd_connector.transport.nixl import DONE, FAILED, ChunkedRead

DEFAULT_PAIRS = "1x2,2x1,2x2,1x4,4x1,2x4,4x2"


def parse_pairs(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        p, _, d = item.partition("x")
        out.append((int(p), int(d)))
        shards.check_tp_pair(*out[-1])
    return out


def poll_to_done(transport, xfers) -> None:
    """Advance every ``ChunkedRead`` until DONE (RuntimeError on a failure or after 60 s)."""
    deadline = time.perf_counter() + 60
    pending = list(xfers)
    while pending:
        for x in list(pending):
            state = x.advance()
            if state == DONE:
                pending.remove(x)
            elif state == FAILED:
                raise RuntimeError(x.error)
        if time.perf_counter() > deadline:
            raise RuntimeError("READ timed out")
        if pending:
            time.sleep(POLL_S)


def bench_pair(model: Model, p: int, d: int, blocks: int, reps: int, rng: np.random.Generator) -> list[dict]:
    num_blocks = 2 * blocks + 1
    p_ranks = [model.rank(p, r, seed=r, num_blocks=num_blocks) for r in range(p)]
    d_ranks = [model.rank(d, j, seed=None, num_blocks=num_blocks) for j in range(d)]
    rows = []
    try:
        src = rng.choice(np.arange(1, num_blocks), blocks, replace=False)
        dst = rng.choice(np.arange(1, num_blocks), blocks, replace=False)
        pairs = [list(zip(src.tolist(), dst.tolist()))] * 2
        for j, rank in enumerate(d_ranks):
            ranks = shards.peer_ranks(p, d, j)
            peers = read_plan.plan_engine(
                rank.regions, {r: p_ranks[r].regions for r in ranks}, ranks, p == d, block_phases.PhasePlan.of((), (), ()),
                (), (), threads=rank.transport.threads, copies_in_post=rank.transport.copies_in_post,
            )
            keys, raws = {}, []
            plans_of = {}
            for r, peer in peers.items():
                if peer is None:
                    continue
                key = f"p#{r}"
                rank.transport.add_peer(key, p_ranks[r].transport.agent_metadata, peer)
                keys[r] = key
                plans_of[r] = peer.planner.plan(pairs, 0)
            # Raw NIXL: each source rank's bytes as one descriptor between the same two agents.
            agent = rank.transport._agent  # the benchmark reaches into the transport on purpose
            for r, plan in plans_of.items():
                peer = rank.transport._peers[keys[r]].agent_name
                local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(rank.buf.data_ptr(), plan.nbytes, 0)], rank.transport.mem_type)
                remote = agent.prep_xfer_dlist(peer, [(p_ranks[r].buf.data_ptr(), plan.nbytes, 0)], rank.transport.mem_type)
                raws.append((local, remote))
            conn_s, raw_s = [], []
            for rep in range(reps + 1):  # the first pays UCX's connection set-up: not counted
                t0 = time.perf_counter()
                xfers = [ChunkedRead(rank.transport, keys[r], plan, b"") for r, plan in plans_of.items()]
                poll_to_done(rank.transport, xfers)
                connector = time.perf_counter() - t0
                t0 = time.perf_counter()
                handles = []
                for local, remote in raws:
                    h = agent.make_prepped_xfer("READ", local, np.zeros(1, np.int32), remote, np.zeros(1, np.int32))
                    agent.transfer(h)
                    handles.append(h)
                for h in handles:
                    while agent.check_xfer_state(h) != DONE:
                        time.sleep(POLL_S)
                    agent.release_xfer_handle(h)
                if rep:
                    conn_s.append(connector)
                    raw_s.append(time.perf_counter() - t0)
            for local, remote in raws:
                agent.release_dlist_handle(local)
                agent.release_dlist_handle(remote)
            for r in keys:
                p_ranks[r].transport.take_notifications()
            nbytes = sum(plan.nbytes for plan in plans_of.values())
            c, w = statistics.median(conn_s), statistics.median(raw_s)
            rows.append(
                {
                    "layers": f"{'mla' if model.mla else 'gqa'}+{model.kind}",
                    "pair": f"{p}x{d}",
                    "d_rank": j,
                    "sources": ",".join(str(r) for r in plans_of),
                    "descriptors": "/".join(str(plan.runs) for plan in plans_of.values()),
                    "bytes": "/".join(str(plan.nbytes) for plan in plans_of.values()),
                    "MiB": round(nbytes / 2**20, 2),
                    "connector_ms": round(c * 1e3, 2),
                    # The fastest rep too: on DRAM some posts pay a few ms inside UCX's copy
                    # (docs/benchmarks.md, "Across tensor-parallel sizes").
                    "connector_min_ms": round(min(conn_s) * 1e3, 2),
                    "raw_ms": round(w * 1e3, 2),
                    "c/raw": round(w / c, 2) if c else None,
                }
            )
    finally:
        for rank in p_ranks + d_ranks:
            rank.close()
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks transfer_tp", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", default=DEFAULT_PAIRS, help="P x D TP sizes, e.g. 1x2,2x1")
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="recurrent layer kinds")
    ap.add_argument("--attention", nargs="+", choices=("gqa", "mla"), default=["gqa", "mla"],
                    help="attention layers: KV heads sharded by TP, or MLA's latent on every rank")
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--n-groups", type=int, default=1)
    ap.add_argument("--head-bytes", type=int, default=16384, help="bytes of one KV head in one block")
    ap.add_argument("--scale", type=int, default=8, help="multiplies the recurrent state's dimensions")
    ap.add_argument("--blocks", type=int, default=128, help="blocks per request (scattered)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=report.DEFAULT_OUT)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    rows = []
    for attention in args.attention:
        for kind in args.kinds:
            model = Model(kind, args.kv_heads, args.n_groups, args.head_bytes, args.scale, mla=attention == "mla")
            for p, d in parse_pairs(args.pairs):
                rows += bench_pair(model, p, d, args.blocks, args.reps, rng)
    report.print_table(rows, list(rows[0]) if rows else [], title=f"{args.blocks} blocks, median of {args.reps}")
    print("c/raw: raw NIXL time over the connector's (1.0 = as fast as one descriptor per source rank)")
    report.write(args.out, "transfer_tp", {"args": vars(args), "rows": rows})
    return 0
