"""``python -m benchmarks NAME [options]``: run one benchmark from the checkout's root."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

BENCHMARKS = {
    "transfer": "KV transfer: the connector's READ path vs raw NIXL vs memcpy (needs NIXL)",
    "transfer_blocks": "KV transfer across attention block sizes: descriptors and time per P:D block ratio vs raw NIXL (needs NIXL)",
    "transfer_tp": "KV transfer across tensor-parallel sizes: per D rank, descriptors and bytes per P rank vs raw NIXL (needs NIXL)",
    "scheduler": "µs per request in pd_connector's scheduler hooks vs vLLM's own (in process)",
    "e2e": "pd_connector vs vLLM's NixlConnector, each behind the proxy, on real vLLM servers (starts servers)",
    "nixl_progress": "NIXL progress-thread poll delay: idle CPU per agent and a loopback READ (needs NIXL)",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run one of pd_connector's benchmarks. Measurements, not tests: each prints a "
        "table and\nwrites JSON (and, for most, a PNG plot), its baselines measured in the same run.\n"
        "The figures measured for pd_connector, and how: docs/benchmarks.md.\n\n"
        + "\n".join(f"  {name:<15} {text}" for name, text in BENCHMARKS.items()),
        epilog="Everything after the benchmark's name goes to the benchmark itself, e.g.\n"
        "  python -m benchmarks transfer --help\n"
        "  python -m benchmarks scheduler --quick",
    )
    parser.add_argument("benchmark", choices=list(BENCHMARKS), metavar="{" + ",".join(BENCHMARKS) + "}",
                        help="which benchmark to run")
    # REMAINDER keeps the benchmark's own options (--help included) away from this parser.
    parser.add_argument("args", nargs=argparse.REMAINDER, metavar="...",
                        help="the benchmark's own options (python -m benchmarks NAME --help)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Imported only now: each pulls in torch, vLLM or NIXL.
    module = importlib.import_module(f"benchmarks.{args.benchmark}")
    # The benchmark's argparse names itself after sys.argv[0]: make its usage line read as the
    # command the user typed.
    saved = sys.argv[0]
    sys.argv[0] = f"python -m benchmarks {args.benchmark}"
    try:
        result = module.main(list(args.args))
    finally:
        sys.argv[0] = saved
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
