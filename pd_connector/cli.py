"""``pd-connector`` command line: ``proxy`` (serve the P/D proxy) and ``check`` (test a P/D pair).

The benchmarks and the demo run from a checkout (``python -m benchmarks``, ``make demo``): they
are not part of what pip installs. aiohttp is imported only by ``proxy``, so ``--help`` works on
a bare install.
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


def _nonneg_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _pos_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _prompt_tokens(text: str) -> int:
    value = int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be >= 2, got {value}")
    return value


# Kept here (not imported from pd_connector.proxy.routing) so that --help needs no aiohttp.
POLICIES = ("least-loaded", "round-robin")
RESUME_MODES = ("first-token", "replay")  # pd_connector.proxy.first_token.RESUME_MODES


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pd-connector",
        description="Prefill/decode disaggregation tools for vLLM.",
    )
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging level (default: INFO)",
    )
    sub = parser.add_subparsers(dest="command", metavar="{proxy,check}")

    proxy = sub.add_parser(
        "proxy",
        help="serve the P/D HTTP proxy",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="OpenAI-compatible proxy: prefill on a P instance (max_tokens=1), then decode "
        "on a D instance\nwith P's kv_transfer_params (/v1/completions, /v1/chat/completions).",
        epilog="""\
Several --prefill/--decode URLs form a pool each; --policy picks an instance per request.
Instances failing their /health poll or a request (connection refused/reset, timeout) are
skipped until they answer again; when a whole pool is down they are all tried anyway.
A prefill failing with a connection error, timeout or 5xx is retried on another P; a 4xx from P
goes back to the client as is. A decode that fails before D answered (connection error or 5xx)
goes once to another D, without kv_transfer_params (that D computes the prompt itself).

Endpoints besides the OpenAI routes:
  GET /health    each upstream's state; 503 when every P or every D is down
  GET /v1/models  the decode instances' model list
  GET /metrics   the proxy's own counters, Prometheus text (pd_proxy_*)

example:
  pd-connector proxy --prefill http://10.0.0.5:8100 --prefill http://10.0.0.7:8100 \\
      --decode http://10.0.0.6:8200 --port 8000""",
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
    proxy.add_argument("--timeout", type=_pos_float, default=None, metavar="S",
                       help="seconds for P's request, D's non-streamed request, and the gap "
                       "between D's streamed chunks (default: 600)")
    proxy.add_argument(
        "--policy", choices=POLICIES, default="least-loaded",
        help="how an instance is picked, separately for the P and the D pool: least-loaded = "
        "fewest requests in flight at this proxy, ties round-robin; round-robin = in turn "
        "(default: least-loaded)")
    proxy.add_argument(
        "--health-interval", type=_nonneg_float, default=5.0, metavar="S",
        help="seconds between /health polls of every upstream; 0 disables polling (an "
        "instance that failed a request is then tried again after 5 s) (default: 5)")
    proxy.add_argument(
        "--health-timeout", type=_pos_float, default=2.0, metavar="S",
        help="seconds an upstream has to answer a /health probe (default: 2)")
    proxy.add_argument(
        "--prefill-retries", type=_nonneg_int, default=2, metavar="N",
        help="extra prefill attempts after a P connection error, timeout or 5xx, each on "
        "another P while there is one (default: 2)")
    proxy.add_argument(
        "--resume", choices=RESUME_MODES, default="first-token",
        help="how D continues after P: first-token = zero replay (P's first token goes to the "
        "client at once and D, given the prompt's token ids plus it, computes from the second; "
        "requests it cannot serve exactly, e.g. n > 1, tools or reasoning, take the standard "
        "flow); replay = always the standard flow (D recomputes the last prompt token(s) and "
        "samples the first token) (default: first-token)")

    check = sub.add_parser(
        "check",
        help="check that a P/D pair hands prompts over correctly",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Talk to one P and one D vLLM server directly and check the handoff:\n"
        "  1. both answer /health and /v1/models and serve the same model;\n"
        "  2. a prefill on P (do_remote_decode, a token-id prompt) returns pd_connector's\n"
        "     kv_transfer_params (replay_offset, pd_protocol_version);\n"
        "  3. D decodes greedily with those params, and again without them (computing the\n"
        "     prompt itself); the first tokens must match.\n"
        "Reports the replay offset, tokens D recomputes, blocks per KV-cache group, P's latency,\n"
        "D's latency with and without the handoff, and D's pd_connector events when it\n"
        "exports them. Exit code 0 when everything passed, 1 otherwise, with one line per\n"
        "problem saying what to do.",
        epilog="example:\n  pd-connector check --prefill http://10.0.0.5:8100 "
        "--decode http://10.0.0.6:8200",
    )
    check.add_argument("--prefill", required=True, metavar="URL",
                       help="prefill (P) instance base URL")
    check.add_argument("--decode", required=True, metavar="URL",
                       help="decode (D) instance base URL")
    check.add_argument("--model", default=None, metavar="NAME",
                       help="served model name to use (default: the first one both serve)")
    check.add_argument("--prompt-tokens", type=_prompt_tokens, default=64, metavar="N",
                       help="prompt length in tokens (ids 4..999) (default: 64)")
    check.add_argument("--timeout", type=_pos_float, default=120.0, metavar="S",
                       help="seconds allowed for each request (default: 120)")

    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.command == "proxy":
        from pd_connector.proxy.server import DEFAULT_TIMEOUT_S, run_proxy

        run_proxy(
            args.prefill, args.decode, host=args.host, port=args.port,
            decode_min_recompute=args.decode_min_recompute,
            timeout=DEFAULT_TIMEOUT_S if args.timeout is None else args.timeout,
            policy=args.policy, health_interval=args.health_interval,
            health_timeout=args.health_timeout, prefill_retries=args.prefill_retries,
            resume=args.resume,
        )
        return 0
    if args.command == "check":
        from pd_connector.check import run as check_mod

        return check_mod.main(args)
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
