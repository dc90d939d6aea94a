"""Record the speculative-decoding skew matrix (P config x D config) for a connector.

    .venv/bin/python scripts/spec_skew_matrix.py --connector PDConnector
    .venv/bin/python scripts/spec_skew_matrix.py --connector NixlConnector

Starts one kv_both vLLM CPU instance per configuration ({off, ngram, MTP 1/2/3 tokens} on the
tiny bf16 Qwen3-Next with 3 MTP modules), hands each prompt from every instance to every other
(and to itself), and compares D's output with D's own aggregated output (margin-aware, bf16).
Prints one row per cell: how many prompts matched, diverged (with the first differing token),
or failed with an HTTP error, and writes the table to ``.artifacts/bench/skew_<connector>.json``
after every cell (a partial run still leaves its record).
A correctness record, not a benchmark and not a test: tests/e2e/test_speculative.py asserts the
PDConnector matrix; the NixlConnector record (docs/bench/skew_NixlConnector.json) is discussed
in docs/benchmarks.md. Instances, cells and the bf16 oracle: ``rig.spec_matrix``.
It starts vLLM servers: on a shared box run it under ``flock /tmp/pd-e2e.lock``.

vLLM's NixlConnector cannot hand a request to its own instance (``register_remote_engine``:
"Cannot register local engine ... as remote"), so its diagonal cells are skipped by default
(``--diagonal`` forces them; they answer HTTP 500). ``--twin NAME`` adds a second instance of
setup NAME and runs NAME -> its twin: the agreeing-config control, through two instances.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

# The rig (rig/) is imported from the checkout this script runs from.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rig.cpu_matrix import random_prompt
from rig.oracle import CompletionError
from rig.spec_matrix import SETUPS, InstanceSpec, check_bf16, handoff, make_instances, running
from rig.tiny_models import build_model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connector", default="PDConnector", choices=["PDConnector", "NixlConnector"])
    ap.add_argument("--setups", default="off,mtp1,mtp2,mtp3", help="comma-separated subset of " + ",".join(SETUPS))
    ap.add_argument("--lengths", default="33,64,65,100,129,160,200,255", help="prompt lengths")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--models", type=Path, default=None, help="tiny model root (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=Path(".artifacts/bench"))
    ap.add_argument("--diagonal", action="store_true", help="also run P = D cells with NixlConnector")
    ap.add_argument("--twin", default="", help="also start a second instance of this setup and hand to it")
    args = ap.parse_args(argv)

    names = args.setups.split(",")
    lengths = [int(x) for x in args.lengths.split(",")]
    root = args.models or Path(tempfile.mkdtemp(prefix="pd-models-"))
    spec = InstanceSpec(
        model=str(build_model("qwen3_next_mtp", root)),
        log_dir=args.out / f"skew-{args.connector}-logs",
        kv_connector=args.connector,
    )
    setups = [SETUPS[n] for n in names]
    twin = f"{args.twin}-twin" if args.twin else ""
    if twin:
        setups.append(dataclasses.replace(SETUPS[args.twin], name=twin))
        names = [*names, twin]
    insts = make_instances(spec, setups)
    cells = []
    with running(insts):
        refs = {(d, n): insts[d].reference(random_prompt(n, 60), args.max_tokens) for d in names for n in lengths}
        args.out.mkdir(parents=True, exist_ok=True)
        out = args.out / f"skew_{args.connector}.json"
        for p_name in names:
            for d_name in names:
                if p_name == d_name and args.connector != "PDConnector" and not args.diagonal:
                    continue
                if twin and twin in (p_name, d_name) and (p_name, d_name) != (args.twin, twin):
                    continue
                cell = {"prefill": p_name, "decode": d_name, "match": 0, "diverged": [], "errors": []}
                for n in lengths:
                    prompt = random_prompt(n, 60)
                    try:
                        _, got = handoff(insts[p_name], insts[d_name], prompt, args.max_tokens)
                    except CompletionError as exc:
                        cell["errors"].append(f"n={n}: HTTP {exc.status}")
                        continue
                    verdict = check_bf16(refs[(d_name, n)], got)
                    if verdict.ok:
                        cell["match"] += 1
                    else:
                        cell["diverged"].append(f"n={n}@{verdict.first_diff}")
                cells.append(cell)
                print(
                    f"P={p_name:6} D={d_name:6} match {cell['match']}/{len(lengths)}"
                    + (f"  diverged {', '.join(cell['diverged'])}" if cell["diverged"] else "")
                    + (f"  errors {', '.join(cell['errors'])}" if cell["errors"] else ""),
                    flush=True,
                )
                out.write_text(json.dumps({"connector": args.connector, "lengths": lengths, "cells": cells}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
