"""The transfer benchmark's ``tcp`` section: the connector's READ against raw NIXL between two
processes on two "hosts" (``rig/netns.py``: two network namespaces with boot ids of
their own, joined by a veth link), where UCX finds only ``tcp`` reachable and picks it itself.

P (``serve``) and D (``read``) run as subprocesses, one on each host, and meet through files in
a directory both see: per case P registers its side (the same seeded pages as the in-process
sections) and writes its agent metadata, regions and base address; D builds its side and a
local copy of P's pages, checks the connector's first READ page by page against that copy, then
times the paths rep by rep, interleaved: ``connector`` (the receiver's path), ``raw`` (the same
bytes as one descriptor) and ``memcpy`` (D's local copy of those bytes, the ceiling no network
reaches). D also records which transport UCX's protocol tables (``UCX_PROTO_INFO=y``) name for
the READ. No timed assertions: figures and ratios are printed and written to the JSON.

  python -m benchmarks.transfer_tcp serve|read DIR   (run by section_tcp)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import msgspec

KEY = "bench-p"
_WAIT_S = 300.0


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _wait_for(path: Path, timeout: float = _WAIT_S, idle=lambda: None) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout:.0f} s")
        idle()
        time.sleep(0.01)


def _transport(role: str, settings: dict):
    from pd_connector.transport.nixl import NixlTransport

    return NixlTransport("DRAM", num_threads=settings["num_threads"], name=f"bench-tcp-{role}-{os.getpid()}",
                         progress_delay_us=settings["delay_us"], ucx_error_handling=settings["ucx_error_handling"])


def serve(workdir: Path) -> int:
    """P: register each case's pages, publish them, wait until D is done with them."""
    import torch

    from benchmarks.transfer_bench import case_geometry
    from benchmarks.transfer_shapes import KERNEL_BLOCK, MiB, build_side

    spec = json.loads((workdir / "spec.json").read_text())
    p_t = _transport("p", spec["settings"])
    try:
        for i, (model, tokens, user_block, _scattered) in enumerate(spec["cases"]):
            geom, _, num_blocks = case_geometry(model, tokens, user_block, spec["budget_mib"] * MiB,
                                                KERNEL_BLOCK["cpu"], spec["pool_factor"])
            side = build_side(geom, num_blocks, False, torch.device("cpu"), seed=1)
            p_t.register(side.allocations, side.regions, 0)
            offer = {"meta": p_t.agent_metadata, "base": side.base,
                     "regions": msgspec.to_builtins(list(side.regions))}
            _write_atomic(workdir / f"case{i}.p", msgspec.msgpack.encode(offer))
            _wait_for(workdir / f"case{i}.done", idle=p_t.take_notifications)
            p_t.close()
            del side
    finally:
        p_t.close()
    return 0


def read(workdir: Path) -> int:
    """D: per case, the connector's READ and raw NIXL from P over the link, and a local memcpy."""
    import numpy as np
    import torch

    from pd_connector.core.protocol import LayerRegion
    from benchmarks import transfer_paths as paths
    from benchmarks.transfer_bench import case_geometry, verify
    from benchmarks.transfer_report import Result, progress
    from benchmarks.transfer_shapes import KERNEL_BLOCK, MiB, build_side, choose_blocks
    from rig import nixl_peers

    spec = json.loads((workdir / "spec.json").read_text())
    settings = spec["settings"]
    d_t = _transport("d", settings)
    chunk = spec["chunk_mib"] * MiB if d_t.copies_in_post else 0
    rng = np.random.default_rng(spec["seed"])
    device = torch.device("cpu")
    results = []
    notif = iter(range(1, 1 << 30))
    try:
        for i, (model, tokens, user_block, scattered) in enumerate(spec["cases"]):
            geom, counts, num_blocks = case_geometry(model, tokens, user_block, spec["budget_mib"] * MiB,
                                                     KERNEL_BLOCK["cpu"], spec["pool_factor"])
            mirror = build_side(geom, num_blocks, False, device, seed=1)  # P's pages, to check against
            d_side = build_side(geom, num_blocks, False, device, seed=None)
            p_ids = choose_blocks(rng, num_blocks, counts, scattered, start=1)
            d_ids = choose_blocks(rng, num_blocks, counts, scattered, start=num_blocks - sum(counts))
            pairs = [list(zip(p.tolist(), d.tolist())) for p, d in zip(p_ids, d_ids)]
            nbytes = sum(len(gp) * len(names) * geom.page_bytes for gp, (_, names) in zip(pairs, geom.groups))
            _wait_for(workdir / f"case{i}.p")
            offer = msgspec.msgpack.decode((workdir / f"case{i}.p").read_bytes())
            d_t.register(d_side.allocations, d_side.regions, 0)
            regions = msgspec.convert(offer["regions"], list[LayerRegion])
            planner = nixl_peers.add_peer(d_t, KEY, offer["meta"], regions, 0)
            d_t.connect(KEY)
            raw = None
            try:
                li, ri = planner.indices(pairs)
                res = Result("tcp", model, tokens, user_block, geom.block_size, "layer-outer",
                             "scattered" if scattered else "contiguous",
                             f"{geom.attn_layers + geom.mamba_layers}/{geom.layers_real}", nbytes, int(li.size),
                             planner.count_runs(li, ri), knobs={"num_threads": settings["num_threads"]},
                             load=os.getloadavg()[0])
                paths.connector_once(d_t, planner, pairs, f"tcp-{next(notif)}".encode(), chunk)  # untimed, checked
                res.verified = verify(mirror, d_side, pairs, geom.page_bytes)
                raw = paths.RawNixl(d_t, offer["base"], d_side.base, nbytes, 0)
                posts: list[float] = []  # the connector's longest call into NIXL per rep
                for rep in range(spec["warmup"] + spec["reps"]):
                    for variant in ("connector", "raw", "memcpy"):
                        if variant == "connector":
                            st = paths.connector_once(d_t, planner, pairs, f"tcp-{next(notif)}".encode(), chunk)
                        elif variant == "raw":
                            st = raw.once(f"tcp-{next(notif)}".encode())
                        else:
                            st = paths.memcpy_once(mirror.buf, d_side.buf, nbytes, device)
                        if rep >= spec["warmup"]:
                            res.samples.setdefault(variant, []).append(st["total"])
                            if variant == "connector":
                                posts.append(st["post"])
                res.stages_ms = {"connector": {"post": float(np.median(posts)) * 1e3}}
                results.append(asdict(res))
                progress(res)
            finally:
                if raw is not None:
                    raw.close()
                d_t.close()
                (workdir / f"case{i}.done").write_text("1")
    finally:
        d_t.close()
        _write_atomic(workdir / "results.json", json.dumps(results).encode())
    return 0


def run(args, cases, timeout_s: float = 900.0, own_boot_ids: bool = True) -> dict:
    """Both agents on two namespaced hosts; returns the results, the READ's UCX transports and
    the logs' directory, or ``{"skipped": reason}`` where namespaces cannot be made.
    ``own_boot_ids=False``: the two namespaces stay one machine to UCX (``netns.TwoHosts``)."""
    from benchmarks.transfer_bench import progress_delay
    from rig import ucx_logs
    from rig.netns import TwoHosts, unavailable_reason
    from rig.process_groups import signal_group
    from rig.servers import source_checkout_env

    reason = unavailable_reason()
    if reason:
        return {"skipped": reason}
    workdir = Path(tempfile.mkdtemp(prefix="pd-bench-tcp-"))
    spec = {
        "cases": [list(c) for c in cases], "budget_mib": args.budget_mib, "pool_factor": args.pool_factor,
        "reps": args.reps, "warmup": args.warmup, "seed": args.seed, "chunk_mib": args.chunk_mib,
        "settings": {"num_threads": args.num_threads, "delay_us": progress_delay(args, "DRAM"),
                     "ucx_error_handling": args.ucx_error_handling},
    }
    (workdir / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, **source_checkout_env(), "UCX_PROTO_INFO": "y"}
    module = [sys.executable, "-m", "benchmarks.transfer_tcp"]
    procs: list[subprocess.Popen] = []
    with TwoHosts(own_boot_ids=own_boot_ids) as net:
        try:
            for host, role in ((net.a, "serve"), (net.b, "read")):
                with open(workdir / f"{role}.log", "wb") as log:
                    procs.append(subprocess.Popen(host.command([*module, role, str(workdir)]), env=env, stdout=log,
                                                  stderr=subprocess.STDOUT, start_new_session=True))
            deadline = time.monotonic() + timeout_s
            for proc in reversed(procs):  # D first: P exits once D is done with every case
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    signal_group(proc.pid, 9)
                    proc.wait()
    d_log = (workdir / "read.log").read_text(errors="replace")
    if procs[1].returncode != 0 or not (workdir / "results.json").exists():
        raise RuntimeError(f"the D agent failed (exit {procs[1].returncode}); log {workdir / 'read.log'}:\n"
                           + d_log[-3000:])
    tables = ucx_logs.read_tables(d_log)
    return {
        "results": json.loads((workdir / "results.json").read_text()),
        "read_transports": sorted(ucx_logs.transports(tables)),
        "inter_node": bool(tables) and all(t.inter_node for t in tables),
        "read_configs": sorted({c for t in tables for c in t.configs}),
        "logs": str(workdir),
    }


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] not in ("serve", "read"):
        print(__doc__, file=sys.stderr)
        return 2
    return (serve if argv[0] == "serve" else read)(Path(argv[1]))


if __name__ == "__main__":
    sys.exit(main())
