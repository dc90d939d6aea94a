"""Transfer benchmark: the connector's READ path vs raw NIXL (one descriptor) vs memcpy, and
over DRAM the kernel's own copy (``process_vm_readv``) of the connector's runs vs of one range.
With worker threads (``--num-threads``, default the connector's ``nixl_num_threads``) also raw
NIXL as one descriptor per thread (``raw_threads``): NIXL splits a READ by descriptors, so one
descriptor is copied by one thread, the connector's thousands by all of them.

Per case, all paths run in the same process, interleaved rep by rep (load on the box hits every
path alike): ``--warmup`` untimed reps, then ``--reps`` timed ones; figures are medians, and the
ratios are medians of per-rep time ratios (robust to drift). Every path moves the same number
of bytes between the same two registered buffers; the connector's pages are checked against
P's after an untimed first READ. One case: ``transfer_bench``; paths: ``transfer_paths``;
shapes: ``transfer_shapes``.

Sections (``--sections``):
  main    models x prompt lengths x block sizes x {scattered, contiguous} block ids,
          vLLM's default layer-outer layout (LBHNC on CPU, LBNHC on CUDA: same placement);
          block sizes as vLLM builds them on the device (attention: multiples of its smallest
          kernel block, CPU 32, CUDA 16; hybrids raised and aligned as vLLM does).
  layout  block-outer layout (BLHNC): packed spans (what the connector does) vs per-layer rows.
  ckpt    hybrids at 4k tokens with 0, 1 and 2 prompt checkpoint states below the offset read
          in the same READ (core/checkpoints.py): the extra bytes per handoff and their cost.
  stall   the longest time one call into NIXL holds D's engine thread: without worker threads
          sliced vs one READ (the post copies), and with them (the post returns at once).
  knobs   NIXL/UCX settings (worker threads, progress delay, UCX_TLS), each on a fresh agent pair.
  first   first-request cost: agent creation, registration, add_peer, connect, first READ.
  perdesc DRAM: what NIXL + UCX add per descriptor above the kernel's own copy (4096
          descriptors of 64 B, 4 KiB, 64 KiB, one READ, vs process_vm_readv of the same ranges).
  tcp     DRAM, root: P and D as two processes on two "hosts" (network namespaces joined by a
          veth link, boot ids of their own), where UCX picks tcp by itself: the connector's READ
          vs raw NIXL vs D's local memcpy, and the transport UCX's tables name
          (``transfer_tcp``). Skipped with the reason where namespaces cannot be made.

  python -m benchmarks transfer --quick
  python -m benchmarks transfer --device cuda      (GPU machines: registers VRAM)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict

os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")  # as pd_connector.transport.nixl does

import torch

from benchmarks import report
from benchmarks import transfer_paths as paths
from benchmarks.transfer_bench import Bench, progress_delay, run_section
from benchmarks.transfer_report import Result, fmt_tokens, print_results, summary_table
from benchmarks.transfer_shapes import KERNEL_BLOCK, MODELS, MiB, check_vllm_placement
from pd_connector.core.settings import UCX_ERROR_HANDLING_MODES, ConnectorSettings


def small_block_cases(args, tokens: int) -> list[tuple[str, int, int, bool]]:
    """Llama-like scattered and contiguous, Nemotron-H-like scattered, at the smallest block vLLM
    builds for attention on this device (most descriptors per byte)."""
    b = KERNEL_BLOCK[args.device]
    return [("llama-8b", tokens, b, True), ("llama-8b", tokens, b, False), ("nemotron-h", tokens, b, True)]


def knob_settings(quick: bool) -> list[tuple[str, int, dict, int | None]]:
    """(name, NixlTransport num_threads, UCX environment at agent creation, progress delay µs;
    None: the connector's default)."""
    default = ConnectorSettings().nixl_num_threads
    out = [(f"num_threads={n}" + (" (default)" if n == default else ""), n, {}, None) for n in (0, 1, 2, 4)]
    out += [("progress_delay_us=0", default, {}, 0), ("UCX_TLS=tcp", default, {"UCX_TLS": "tcp"}, None),
            ("UCX_TLS=posix,tcp", default, {"UCX_TLS": "posix,tcp"}, None)]
    by_threads = {n: name for name, n, env, delay in out if not env and delay is None}
    quick_set = (by_threads[0], by_threads[2], "UCX_TLS=tcp")
    return [k for k in out if k[0] in quick_set] if quick else out


def section_knobs(args) -> list[dict]:
    rows = []
    for name, threads, env, delay_us in knob_settings(args.quick):
        try:
            res = run_section(args, "knobs", small_block_cases(args, 4096), ("connector", "raw"), num_threads=threads, env=env,
                              delay_us=delay_us)
        except Exception as exc:  # a setting this machine's UCX cannot do
            rows.append({"setting": name, "error": f"{type(exc).__name__}: {exc}"[:160]})
            continue
        row = {"setting": name}
        for r in res:
            label = f"{fmt_tokens(r.tokens)} {r.model} {r.blocks[:4]}"
            row[label + " conn"] = r.gbps("connector")
            row[label + " raw"] = r.gbps("raw")
            row["ok"] = "y" if all(x.verified for x in res) else "NO"
        rows.append(row)
    return rows


def section_first(args) -> dict:
    """First-request cost on a case of the matrix (4k tokens, Nemotron-H-like, smallest block)."""
    bench = Bench(args)
    try:
        geom, p_side, d_side, pairs, nbytes = bench.sides("nemotron-h", 4096, bench.kernel_block, True, False,
                                                          args.budget_mib * MiB)
    finally:
        bench.close()
    out = paths.first_request(p_side, d_side, pairs, bench.mem_type, bench.dev, bench.chunk, args.num_threads,
                              bench.delay_us)
    out["nbytes"] = nbytes
    return out


def section_tcp(args, results: dict) -> dict:
    """The connector vs raw NIXL over a TCP link between two namespaced hosts."""
    from benchmarks import transfer_tcp

    out = transfer_tcp.run(args, small_block_cases(args, 4096))
    if "skipped" in out:
        print(f"\n== tcp: skipped ({out['skipped']}) ==", flush=True)
        return out
    picked = ", ".join(out["read_configs"]) or "no UCX_PROTO_INFO table found"
    where = "inter-node" if out["inter_node"] else "INTRA-NODE"
    print(f"\n== tcp: P and D on two hosts (network namespaces, veth link); UCX's READ went over {picked} "
          f"({where}); GB/s medians, c/raw = connector relative to raw NIXL, memcpy = D's local copy ==", flush=True)
    results["tcp"] = [Result(**r) for r in out["results"]]
    out["table"] = print_results(results["tcp"], ("connector", "raw", "memcpy"), "")
    return {k: v for k, v in out.items() if k != "results"}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks transfer", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=report.DEFAULT_OUT, help="directory for JSON and PNG")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--quick", action="store_true", help="a few minutes on a 2-core box")
    ap.add_argument("--models", nargs="+", choices=sorted(MODELS))
    ap.add_argument("--tokens", nargs="+", type=int, help="prompt lengths (default 1k 4k 16k 32k)")
    ap.add_argument("--blocks", nargs="+", type=int, help="user block sizes (default: the smallest vLLM builds for attention on the device "
                    "(CPU 32, CUDA 16), 64, 128; quick: smallest, 128)")
    ap.add_argument("--reps", type=int, help="timed repetitions, median kept (default 5; quick 3)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--budget-mib", type=float, help="max bytes one request moves; layers are dropped "
                    "(pages kept) above it, down to one layer per group (default 256; quick 96; a fraction "
                    "such as 0.01 leaves one layer: a case's smallest payload)")
    ap.add_argument("--pool-factor", type=float, default=1.5, help="pool blocks / request blocks")
    ap.add_argument("--num-threads", type=int, default=ConnectorSettings().nixl_num_threads,
                    help="nixl_num_threads for every section but knobs and stall (default: the connector's)")
    ap.add_argument("--ucx-error-handling", choices=UCX_ERROR_HANDLING_MODES,
                    default=ConnectorSettings().nixl_ucx_error_handling,
                    help="nixl_ucx_error_handling for the connector and raw NIXL agents (default: the connector's)")
    ap.add_argument("--progress-delay-us", type=int, help="nixl_progress_delay_us for every agent "
                    "(default: the connector's, 100 over DRAM, 0 over VRAM)")
    ap.add_argument("--idle-step-wait-ms", type=float, default=ConnectorSettings().idle_step_wait_ms,
                    help="idle_step_wait_ms: the connector path's wait between polls of a READ in flight "
                         "(idle_wait.idle_step_wait; 0 = poll every step, as before that wait covered READs)")
    ap.add_argument("--chunk-mib", type=int, default=32, help="nixl_read_chunk_mib (DRAM without worker threads only; 0 = one post)")
    sections = ["main", "layout", "ckpt", "stall", "knobs", "first", "perdesc", "tcp"]
    ap.add_argument("--sections", nargs="+", choices=sections,
                    help="default: all; --quick leaves out knobs (a fresh agent pair per setting)")
    ap.add_argument("--check-vllm", action="store_true",
                    help="cross-check the placement against vLLM's get_kv_cache_config_from_groups (imports vLLM)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.sections = args.sections or [s for s in sections if not (args.quick and s == "knobs")]
    args.models = args.models or list(MODELS)
    args.tokens = args.tokens or ([1024, 4096] if args.quick else [1024, 4096, 16384, 32768])
    small = KERNEL_BLOCK[args.device]
    args.blocks = args.blocks or ([small, 128] if args.quick else [small, 64, 128])
    args.reps = args.reps or (3 if args.quick else 5)
    args.budget_mib = args.budget_mib or (96 if args.quick else 256)
    return args


def main(argv=None) -> int:
    from benchmarks.transfer_plot import plot

    args = parse_args(argv)
    paths.IDLE_WAIT_S = args.idle_step_wait_ms / 1000
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: torch sees no CUDA device", file=sys.stderr)
        return 2
    started = time.monotonic()
    env = {**report.environment(), "device": args.device, "torch": torch.__version__,
           "UCX_TLS": os.environ.get("UCX_TLS", "(unset)")}
    print(f"bench transfer: {args.device}, {env['cpus']} CPUs, load {env['loadavg'][0]:.1f}, "
          f"budget {args.budget_mib} MiB/request, median of {args.reps} after {args.warmup} warm-up", flush=True)
    data: dict = {"environment": env, "args": vars(args), "tables": {}}
    if args.check_vllm:
        data["vllm_placement_check"] = check = check_vllm_placement()
        print(f"placement vs vLLM get_kv_cache_config_from_groups: {'match' if check['ok'] else check}")
    results: dict[str, list[Result]] = {}
    base = ("connector", "raw", "memcpy")
    odd = [b for b in args.blocks if b % KERNEL_BLOCK[args.device]]
    if odd:
        print(f"note: vLLM 0.32 refuses attention at block sizes {odd} on {args.device} (kernel blocks are multiples "
              f"of {KERNEL_BLOCK[args.device]}); measured anyway, hybrids are raised and aligned as vLLM does", flush=True)
    if "main" in args.sections:
        print("\n== main: layer-outer layout (vLLM's default); GB/s medians; desc = descriptors planned, "
              "runs = after NIXL's merge; c/raw, c/memcpy = connector throughput relative (median of "
              "per-rep ratios); stall = longest single call into NIXL (D's engine thread) ==", flush=True)
        cases = [(m, t, b, s) for m in args.models for b in args.blocks for t in args.tokens for s in (True, False)]
        variants = base + (("raw_threads",) if args.num_threads > 1 else ()) + (
            ("cma_runs", "cma_one") if paths.cma_available(torch.device(args.device)) else ())
        results["main"] = run_section(args, "main", cases, variants)
        data["tables"]["main"] = print_results(results["main"], variants, "")
        data["tables"]["summary"] = summary_table(results["main"])
        print("\n== summary: connector / raw NIXL (median of per-rep ratios) ==\n" + data["tables"]["summary"], flush=True)
    if "layout" in args.sections:
        print("\n== layout: block-outer (BLHNC); connector = packed spans, unpacked = one row per layer ==", flush=True)
        cases = [(m, 4096 if args.quick else t, KERNEL_BLOCK[args.device], s, True) for m in args.models for t in (4096, 16384)[: 1 if args.quick else 2] for s in (True, False)]
        variants = ("connector", "unpacked", "raw", "memcpy")
        results["layout"] = run_section(args, "layout", cases, variants)
        data["tables"]["layout"] = print_results(results["layout"], variants, "",
                                                 extra=["unpacked_desc", "unpacked_runs", ("unpacked/c", "unpacked/c", ".2f")])
    if "ckpt" in args.sections:
        print("\n== ckpt: prompt checkpoints below the offset (one Mamba page per layer each) read with the "
              "handoff; extra MiB = their bytes ==", flush=True)
        hybrids = [m for m in args.models if MODELS[m].mamba_ids]
        cases = [(m, 4096, KERNEL_BLOCK[args.device], True, False, k) for m in hybrids for k in (0, 1, 2)]
        results["ckpt"] = run_section(args, "ckpt", cases, base)
        data["tables"]["ckpt"] = print_results(
            results["ckpt"], base, "", extra=[("checkpoints", "ckpts", "d"), ("checkpoint_mib", "extra MiB", ".2f")]
        )
    if "stall" in args.sections:
        threads = args.num_threads or 2
        print(f"\n== stall: the longest call into NIXL on D's engine thread; without worker threads the connector "
              f"slices ({args.chunk_mib} MiB) vs one post per request, then with {threads} ==", flush=True)
        variants = ("connector", "one_read", "raw")
        stall_cases = small_block_cases(args, 16384)[: 2 if args.quick else 3]
        results["stall"] = run_section(args, "stall", stall_cases, variants, num_threads=0)
        results["stall"] += run_section(args, "stall", stall_cases, ("connector", "raw"), num_threads=threads)
        data["tables"]["stall"] = print_results(results["stall"], variants, "",
                                                extra=[("num_threads", "threads", "d"), ("1read_stall", "1-read stall ms", ".1f")])
    knob_rows: list[dict] = []
    if "knobs" in args.sections:
        print("\n== knobs: NIXL worker threads and UCX transports (GB/s, medians) ==", flush=True)
        knob_rows = section_knobs(args)
        cols = list(dict.fromkeys(k for r in knob_rows for k in r))
        data["tables"]["knobs"] = report.print_table(knob_rows, [(c, c, ".2f") for c in cols])
    if "first" in args.sections:
        print("\n== first request: cold set-up vs warm READ (ms) ==", flush=True)
        first = section_first(args)
        data["first_request"] = first
        data["tables"]["first"] = report.print_table(
            [{"step": k, "ms": v * 1e3} for k, v in first.items() if k not in ("nbytes", "metadata_bytes")],
            ["step", ("ms", "ms", ".2f")])
    if "perdesc" in args.sections and paths.cma_available(torch.device(args.device)):
        print("\n== per descriptor: one NIXL READ of 4096 unmergeable descriptors vs the kernel's copy of the same "
              "ranges (µs per descriptor, medians) ==", flush=True)
        data["per_descriptor"] = rows = paths.per_descriptor_cost((64, 4096, 65536), 4096, args.reps, progress_delay(args, "DRAM"))
        data["tables"]["perdesc"] = report.print_table(
            rows, ["bytes", "descriptors", ("nixl_us", "NIXL µs", ".2f"), ("kernel_us", "kernel µs", ".2f"),
                   ("nixl_minus_kernel_us", "NIXL - kernel µs", ".2f")])
    if "tcp" in args.sections and args.device == "cpu":
        data["tcp_link"] = section_tcp(args, results)
    data.update({k: [asdict(r) for r in v] for k, v in results.items()})
    data["knobs"] = knob_rows
    data["missing_notifications"] = sum(paths.MISSING_NOTIFS)
    data["environment"]["wall_s"] = time.monotonic() - started
    json_path = report.write_json("bench_transfer", data, args.out)
    png = report.write_plot("bench_transfer", lambda plt: plot(plt, results, knob_rows), args.out)
    print(f"\nwrote {json_path}" + (f" and {png}" if png else "") + f" ({time.monotonic() - started:.0f} s)")
    if paths.MISSING_NOTIFS:
        print(f"WARNING: {sum(paths.MISSING_NOTIFS)} completion notification(s) never reached P")
    bad = [r for rs in results.values() for r in rs if not r.verified]
    if bad:
        print(f"{len(bad)} case(s) moved wrong bytes", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
