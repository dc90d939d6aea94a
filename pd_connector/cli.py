"""``pd-connector`` command line: ``proxy`` (serve the P/D proxy) and ``demo``.

Heavy modules (aiohttp, the demo with its torch/vLLM imports) are imported only by the subcommand
that needs them, so ``--help`` works on a bare install.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence


def _nonneg_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pd-connector",
        description="Prefill/decode disaggregation tools for vLLM.",
    )
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging level (default: INFO)",
    )
    sub = parser.add_subparsers(dest="command", metavar="{proxy,demo}")

    proxy = sub.add_parser(
        "proxy",
        help="serve the P/D HTTP proxy",
        description="OpenAI-compatible proxy: prefill on a P instance (max_tokens=1), then decode "
        "on a D instance with P's kv_transfer_params. Several --prefill/--decode URLs are used "
        "round-robin.",
    )
    proxy.add_argument("--prefill", action="append", required=True, metavar="URL",
                       help="prefill (P) base URL, e.g. http://127.0.0.1:18100; repeatable")
    proxy.add_argument("--decode", action="append", required=True, metavar="URL",
                       help="decode (D) instance base URL, e.g. http://127.0.0.1:18200; repeatable")
    proxy.add_argument("--host", default="127.0.0.1", help="listen address (default: 127.0.0.1)")
    proxy.add_argument("--port", type=int, required=True, help="listen port")
    proxy.add_argument(
        "--decode-min-recompute", type=_nonneg_int, default=None, metavar="K",
        help="minimum number of prompt tokens D recomputes; sent to P as "
        "kv_transfer_params.pd_min_recompute_tokens (default: unset)",
    )
    proxy.add_argument("--timeout", type=float, default=None, metavar="S",
                       help="seconds for P's request, D's non-streamed request, and the gap "
                       "between D's streamed chunks (default: 600)")

    demo = sub.add_parser(
        "demo",
        help="run the end-to-end demo",
        description="Run the pd_connector end-to-end demo.",
    )
    demo.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                      help="device the demo's vLLM instances run on (default: cpu)")
    demo.add_argument("--keep-going", action="store_true",
                      help="continue with the remaining steps after a failed one")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.command == "proxy":
        from pd_connector.proxy import DEFAULT_TIMEOUT_S, run_proxy

        run_proxy(
            args.prefill, args.decode, host=args.host, port=args.port,
            decode_min_recompute=args.decode_min_recompute,
            timeout=DEFAULT_TIMEOUT_S if args.timeout is None else args.timeout,
        )
        return 0
    if args.command == "demo":
        from pd_connector import demo as demo_mod

        result = demo_mod.main(args)
        return result if isinstance(result, int) else 0
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
