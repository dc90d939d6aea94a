"""Transfer across attention block sizes: what D moves when P's blocks are k times larger or
smaller than its own, against equal blocks and raw NIXL on the same bytes.

In one process, with real NIXL agents (UCX over DRAM): a P rank and a D rank of two attention
layers (``rig/attention_pages.py``), D's block size fixed, P's at each ratio, each token
layout ``core/block_phases`` cuts (``interleaved``: a token's K and V together, FlashAttention;
``cpu_vec``: vLLM CPU's vec kernels, K column-major, so one run per K column). One request of
``--tokens`` tokens on scattered blocks: descriptors (NIXL's merged runs), bytes, the connector's
READ (``Planner.plan`` + ``ChunkedRead``, polled to DONE) and raw NIXL moving the same bytes as
one descriptor, and their ratio. Figures, not assertions.

    python -m benchmarks transfer_blocks [--ratios 1,2,4,8,1/2,1/4,1/8] [--layouts interleaved cpu_vec]
        [--tokens N] [--block N] [--reps N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from pd_connector.core import block_phases, pairing, read_plan
from pd_connector.core.pairing import ATTENTION, GroupLayout
from benchmarks import report
from benchmarks.transfer_paths import POLL_S
from rig.attention_pages import AttentionRank
from benchmarks.transfer_tp import poll_to_done
from pd_connector.transport.nixl import DONE, ChunkedRead

DEFAULT_RATIOS = "1,2,4,8,1/2,1/4,1/8"


def layout_of(name: str, head_dim: int) -> str:
    if name == "interleaved":
        return block_phases.INTERLEAVED
    return block_phases.token_layout_name(block_phases.K_COLUMNS_V_ROWS, head_dim)


def _read(transport, key: str, plan) -> float:
    t0 = time.perf_counter()
    poll_to_done(transport, [ChunkedRead(transport, key, plan, b"")])
    return time.perf_counter() - t0


def _raw(agent, local, remote) -> float:
    t0 = time.perf_counter()
    handle = agent.make_prepped_xfer("READ", local, np.zeros(1, np.int32), remote, np.zeros(1, np.int32))
    agent.transfer(handle)
    while agent.check_xfer_state(handle) != DONE:
        time.sleep(POLL_S)
    agent.release_xfer_handle(handle)
    return time.perf_counter() - t0


def bench_ratio(ratio: Fraction, layout: str, args, rng: np.random.Generator) -> dict:
    bd = args.block
    bp = int(bd * ratio)
    kw = dict(total_heads=args.kv_heads, token_bytes=4 * args.head_dim, token_layout=layout_of(layout, args.head_dim))
    p_blocks, d_blocks = pairing.cdiv(args.tokens, bp), pairing.cdiv(args.tokens, bd)
    p = AttentionRank(1, 0, bp, seed=1, num_blocks=2 * p_blocks + 1, **kw)
    d = AttentionRank(1, 0, bd, num_blocks=2 * d_blocks + 1, **kw)
    try:
        p_table = rng.choice(np.arange(1, p.num_blocks), p_blocks, replace=False).tolist()
        d_table = rng.choice(np.arange(1, d.num_blocks), d_blocks, replace=False).tolist()
        pairs = pairing.pair_block_lists(
            (GroupLayout(ATTENTION, bd),), [p_table], (d_table,), args.tokens, 0, remote_block_sizes=[bp]
        )
        plan = block_phases.PhasePlan.of([bp], [bd], [ATTENTION])
        peer = read_plan.plan_engine(
            d.regions, {0: p.regions}, [0], True, plan, [bd], [bp],
            threads=d.transport.threads, copies_in_post=d.transport.copies_in_post,
        )[0]
        d.transport.add_peer("p", p.transport.agent_metadata, peer)
        read = peer.planner.plan(pairs, 0)
        agent = d.transport._agent  # the benchmark reaches into the transport on purpose
        peer = d.transport._peers["p"].agent_name
        raw_local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(d.buf.data_ptr(), read.nbytes, 0)], d.transport.mem_type)
        raw_remote = agent.prep_xfer_dlist(peer, [(p.buf.data_ptr(), read.nbytes, 0)], d.transport.mem_type)
        conn, raw = [], []
        for rep in range(args.reps + 1):  # the first pays UCX's connection set-up: not counted
            c, w = _read(d.transport, "p", read), _raw(agent, raw_local, raw_remote)
            if rep:
                conn.append(c)
                raw.append(w)
        agent.release_dlist_handle(raw_local)
        agent.release_dlist_handle(raw_remote)
        c, w = statistics.median(conn), statistics.median(raw)
        return {
            "layout": layout,
            "P:D block": f"{bp}:{bd}",
            "pairs": len(pairs[0]),
            "descriptors": read.runs,
            "KiB": round(read.nbytes / 1024, 1),
            "connector_ms": round(c * 1e3, 3),
            "connector_min_ms": round(min(conn) * 1e3, 3),
            "raw_ms": round(w * 1e3, 3),
            "c/raw": round(w / c, 2) if c else None,
        }
    finally:
        d.close()
        p.close()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks transfer_blocks", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ratios", default=DEFAULT_RATIOS, help="P's block size over D's, e.g. 1,2,1/2")
    ap.add_argument("--layouts", nargs="+", choices=("interleaved", "cpu_vec"), default=["interleaved", "cpu_vec"])
    ap.add_argument("--block", type=int, default=64, help="D's block size (tokens)")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per request")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128, help="bf16 elements of K (and of V) per head and token")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=report.DEFAULT_OUT)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    rows = [bench_ratio(Fraction(r), layout, args, rng) for layout in args.layouts for r in args.ratios.split(",")]
    title = f"{args.tokens} tokens, {args.kv_heads} KV heads x {args.head_dim} bf16, 2 layers, median of {args.reps}"
    report.print_table(rows, list(rows[0]) if rows else [], title=title)
    print("c/raw: raw NIXL time over the connector's (1.0 = as fast as one descriptor for the same bytes)")
    report.write(args.out, "transfer_blocks", {"args": vars(args), "rows": rows})
    return 0
