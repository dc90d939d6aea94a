"""One transfer-benchmark case, every path on the same bytes (``transfer.py`` runs the
sections): a fresh P/D agent pair, both sides' registered buffers, the connector's untimed
first READ checked page by page, then the paths interleaved rep by rep."""

from __future__ import annotations

import math
import os

os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")  # as pd_connector.transport.nixl does

import numpy as np
import torch

from pd_connector.core import descriptors
from benchmarks import transfer_paths as paths
from benchmarks.transfer_report import Result, progress
from benchmarks.transfer_shapes import KERNEL_BLOCK, MODELS, MiB, build_side, choose_blocks, geometry
from pd_connector.core.read_plan import Planner
from pd_connector.core.settings import ConnectorSettings
from pd_connector.transport.nixl import NixlTransport
from rig import nixl_peers

KEY, UNPACKED = paths.KEY, "bench-p-unpacked"


def verify(p_side, d_side, pairs, page: int) -> bool:
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
                if not torch.equal(p_side.buf[po : po + page], d_side.buf[do : do + page]):
                    return False
    return True


class Bench:
    def __init__(self, args, num_threads: int | None = None, env: dict | None = None, delay_us: int | None = None):
        self.args = args
        self.device = torch.device(args.device)
        self.dev = (self.device.index or 0) if self.device.type == "cuda" else 0
        self.mem_type = "VRAM" if self.device.type == "cuda" else "DRAM"
        self.num_threads = args.num_threads if num_threads is None else num_threads
        self.delay_us = progress_delay(args, self.mem_type) if delay_us is None else delay_us
        self.kernel_block = KERNEL_BLOCK[self.device.type]
        self.rng = np.random.default_rng(args.seed)
        self.cma: dict[str, paths.CmaRead] = {}
        self.planners: dict[str, Planner] = {}  # D's peers of the case running
        self._n = 0
        with _Env(env or {}):
            self.p_t, self.d_t = (
                NixlTransport(self.mem_type, num_threads=self.num_threads, name=f"bench-{role}-{id(self)}",
                              progress_delay_us=self.delay_us, ucx_error_handling=args.ucx_error_handling)
                for role in "PD"
            )
        self.chunk = args.chunk_mib * MiB if self.d_t.copies_in_post else 0  # as receiver.py

    def close(self):
        self.d_t.close()
        self.p_t.close()

    def notif(self) -> bytes:
        self._n += 1
        return f"bench-{self._n}".encode()

    def sides(self, model, tokens, user_block, scattered, block_outer, budget, checkpoints=0):
        geom, counts, num_blocks = case_geometry(model, tokens, user_block, budget, self.kernel_block,
                                                 self.args.pool_factor, checkpoints)
        p_side = build_side(geom, num_blocks, block_outer, self.device, seed=1)
        d_side = build_side(geom, num_blocks, block_outer, self.device, seed=None)
        paths.sync(self.device)  # the fills are queued on a CUDA stream: done before any READ
        p_ids = choose_blocks(self.rng, num_blocks, counts, scattered, start=1)
        d_ids = choose_blocks(self.rng, num_blocks, counts, scattered, start=num_blocks - sum(counts))
        pairs = [list(zip(p.tolist(), d.tolist())) for p, d in zip(p_ids, d_ids)]
        nbytes = sum(len(gp) * len(names) * geom.page_bytes for gp, (_, names) in zip(pairs, geom.groups))
        return geom, p_side, d_side, pairs, nbytes

    def run_case(self, section, model, tokens, user_block, scattered, block_outer=False, checkpoints=0,
                 variants=("connector", "raw", "memcpy"), budget=None) -> Result:
        args = self.args
        geom, p_side, d_side, pairs, nbytes = self.sides(
            model, tokens, user_block, scattered, block_outer, (budget or args.budget_mib) * MiB, checkpoints
        )
        self.p_t.register(p_side.allocations, p_side.regions, self.dev)
        self.d_t.register(d_side.allocations, d_side.regions, self.dev)
        self.planners = {KEY: nixl_peers.add_peer(self.d_t, KEY, self.p_t.agent_metadata, p_side.regions, self.dev)}
        raws: dict[str, paths.RawNixl] = {}
        try:
            if "unpacked" in variants:  # the pre-packing connector: one row per layer
                self.planners[UNPACKED] = nixl_peers.add_peer(
                    self.d_t, UNPACKED, self.p_t.agent_metadata, p_side.regions, self.dev, packed=False
                )
            li, ri = self.planners[KEY].indices(pairs)
            res = Result(
                section, model, tokens, user_block, geom.block_size,
                "block-outer" if block_outer else "layer-outer", "scattered" if scattered else "contiguous",
                f"{geom.attn_layers + geom.mamba_layers}/{geom.layers_real}", nbytes, int(li.size),
                self.planners[KEY].count_runs(li, ri),
                knobs={"num_threads": self.num_threads, "chunk_mib": self.chunk // MiB, "checkpoints": checkpoints,
                       "checkpoint_bytes": checkpoints * sum(len(names) * geom.page_bytes
                                                             for kind, names in geom.groups if kind == "mamba")},
                load=os.getloadavg()[0], contig=self.contiguous_runs(pairs),
            )
            if "unpacked" in variants:
                unpacked = self.planners[UNPACKED]
                uli, uri = unpacked.indices(pairs)
                res.knobs["unpacked_desc"], res.knobs["unpacked_runs"] = int(uli.size), unpacked.count_runs(uli, uri)
            self.once("connector", pairs, p_side, d_side, nbytes, {})  # untimed, then checked
            res.verified = verify(p_side, d_side, pairs, geom.page_bytes)
            raws["raw"] = paths.RawNixl(self.d_t, p_side.base, d_side.base, nbytes, self.dev)
            if "raw_threads" in variants:
                raws["raw_threads"] = paths.RawNixl(self.d_t, p_side.base, d_side.base, nbytes, self.dev, self.num_threads)
            if "cma_runs" in variants:
                self.cma = {
                    "cma_runs": paths.CmaRead(*self.planners[KEY].merged_ranges(li, ri)),
                    "cma_one": paths.CmaRead(np.array([d_side.base]), np.array([p_side.base]), np.array([nbytes])),
                }
            stages: dict[str, list[dict]] = {v: [] for v in variants}
            for rep in range(args.warmup + args.reps):
                for v in variants:
                    st = self.once(v, pairs, p_side, d_side, nbytes, raws)
                    if rep >= args.warmup:
                        res.samples.setdefault(v, []).append(st["total"])
                        stages[v].append(st)
            res.stages_ms = {
                v: {k: float(np.median([s[k] for s in sts])) * (1 if k == "slices" else 1e3) for k in sts[0] if k != "total"}
                for v, sts in stages.items() if sts
            }
            return res
        finally:
            self.cma = {}
            for raw in raws.values():
                raw.close()
            self.d_t.close()
            self.p_t.close()

    def contiguous_runs(self, pairs) -> int:
        """Runs NIXL would merge the plan into before ``read_plan.cut_long_runs`` cuts them for the
        worker threads (the benchmark reaches into the planner's rows on purpose)."""
        planner = self.planners[KEY]
        li, ri = descriptors.plan_indices(pairs, planner.local, planner.remote)
        return planner.count_runs(li, ri)

    def once(self, variant, pairs, p_side, d_side, nbytes, raws) -> dict:
        if variant == "memcpy":
            return paths.memcpy_once(p_side.buf, d_side.buf, nbytes, self.device)
        if variant in self.cma:
            return self.cma[variant].once()
        if variant in raws:
            st = raws[variant].once(self.notif())
        elif variant == "connector":
            st = paths.connector_once(self.d_t, self.planners[KEY], pairs, self.notif(), self.chunk)
        elif variant == "one_read":  # no slicing: one post per request
            st = paths.connector_once(self.d_t, self.planners[KEY], pairs, self.notif(), 0)
        elif variant == "unpacked":
            st = paths.connector_once(self.d_t, self.planners[UNPACKED], pairs, self.notif(), self.chunk, key=UNPACKED)
        else:
            raise ValueError(variant)
        paths.drain(self.p_t)
        return st


def case_geometry(model: str, tokens: int, user_block: int, budget: int, kernel_block: int, pool_factor: float,
                  checkpoints: int = 0):
    """(geometry, blocks per group, pool blocks) of one case: the same on both sides of a pair,
    also when P and D are two processes (``transfer_tcp``). ``checkpoints``: prompt checkpoint
    states below the offset read with the handoff (core/checkpoints.py): one more page per Mamba
    group each."""
    geom = geometry(MODELS[model], user_block, tokens, int(budget), kernel_block)  # --budget-mib may be a fraction
    n_attn = math.ceil(tokens / geom.block_size)
    counts = [n_attn if kind == "attention" else 1 + checkpoints for kind, _ in geom.groups]
    num_blocks = int(sum(counts) * pool_factor) + 2  # + the null block and a spare
    return geom, counts, num_blocks


def progress_delay(args, mem_type: str) -> int:
    """The connector's progress-thread delay (``nixl_progress_delay_us``; unset: its default for
    this memory type), so the benchmark's agents poll exactly as a served instance's do."""
    return ConnectorSettings(nixl_progress_delay_us=args.progress_delay_us).progress_delay_for(mem_type)


class _Env:
    """Environment variables set while agents are created (UCX reads UCX_* then)."""

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


def run_section(args, name, cases, variants=("connector", "raw", "memcpy"), **bench_kw) -> list[Result]:
    bench = Bench(args, **bench_kw)
    out = []
    try:
        for case in cases:
            out.append(bench.run_case(name, *case, variants=variants))
            progress(out[-1])
    finally:
        bench.close()
    return out
