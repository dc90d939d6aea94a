"""The GPU check (``scripts/gpu_check.sh``): the connector's own GPU part, without vLLM, in one
run that writes everything to one folder.

Steps, each a subprocess with its own time limit (a crash in NIXL or CUDA ends one step, not the
run), all on one device (``--device``; auto: cuda where torch sees one):
  tests     pytest over tests/nixl with the buffers in VRAM or DRAM (``PD_TEST_DEVICE``,
            ``rig/devices.py``), counted in two parts: transfers (real agents, Senders
            and Receivers over real side channels, unequal TP included) and digest (the
            recurrent-state digest over real READs, test_state_digest.py); tests that cannot
            apply on the device are skipped and say why
  bench     ``python -m benchmarks transfer`` (--quick's sections but the DRAM-only ones): the
            connector vs raw NIXL on the same bytes vs a torch copy between the same two buffers
            (on CUDA a device-to-device copy: the ceiling), descriptors per request, the longest
            call into NIXL on D's engine thread (stall)
  bench_tp  ``python -m benchmarks transfer_tp``: per D rank of unequal TP pairs, the connector vs raw NIXL

It lives in scripts/ (not in the package) because it runs tests/nixl from the checkout.

``--smoke``: a tiny subset (one transfer, one unequal-TP handoff, the digest with its negative
control, one small benchmark case) to check the plumbing; CI runs it on CPU.

Output (``--out``): ``summary.json`` (device, versions, per-step wall time, pass/fail counts with
skip reasons, the benchmark's figures), ``tables.md``, one log per step, ``junit.xml``, the
benchmarks' JSON.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEVICE_ENV = "PD_TEST_DEVICE"  # read by rig/devices.py
DIGEST_TESTS = "tests/nixl/test_state_digest.py"
SMOKE_TESTS = [
    "tests/nixl/test_transport.py::test_read_moves_exactly_the_paired_pages[layer_major_dense-scattered]",
    "tests/nixl/test_tp_transfer.py::test_every_byte_of_every_d_rank_page_comes_from_the_p_rank_that_holds_it[mamba2_g1_kv2-2-1]",
    f"{DIGEST_TESTS}::test_d_digest_of_the_state_it_read_is_p_digest_and_a_flipped_page_changes_it",
    f"{DIGEST_TESTS}::test_a_handoff_whose_state_d_corrupted_fails_on_the_digest",
]
# Time limits per step (s) on a GPU host: the whole run stays under 8 minutes there. Over DRAM
# on a small box everything is slower: CPU_SLOWER times these.
CPU_SLOWER = 4
LIMITS = {"tests": 240, "bench": 150, "bench_tp": 40}
SMOKE_LIMITS = {"tests": 150, "bench": 90}


def pick_device(asked: str) -> str:
    import torch

    if asked == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if asked == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"gpu_check: --device cuda, but torch {torch.__version__} sees no CUDA device")
    return asked


def version(*dists: str) -> str | None:
    for dist in dists:
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def environment(device: str) -> dict:
    import torch

    env = {
        "device": device,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "nixl": version("nixl-cu13", "nixl-cu12", "nixl"),
        "msgspec": version("msgspec"),
        "pyzmq": version("pyzmq"),
        "vllm_installed": importlib.util.find_spec("vllm") is not None,
        "cpus": os.cpu_count(),
        "host": platform.node(),
        "UCX_TLS": os.environ.get("UCX_TLS", "(unset)"),
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1), gpus=torch.cuda.device_count())
    return env


def _empty_counts() -> dict:
    return {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "xfailed": 0, "skip_reasons": {}, "failures": []}


def junit_counts(path: Path) -> dict[str, dict]:
    """Per part (``digest``: test_state_digest.py; ``transfers``: the rest) of one pytest junit
    XML: pass/fail/skip counts, the failing tests and the distinct skip reasons."""
    out = {"transfers": _empty_counts(), "digest": _empty_counts()}
    if not path.exists():
        return out
    for case in ET.parse(path).getroot().iter("testcase"):
        classname = case.get("classname", "")
        part = out["digest" if classname.endswith("test_state_digest") else "transfers"]
        name = f"{classname}::{case.get('name', '')}"
        if case.find("failure") is not None or case.find("error") is not None:
            part["failed" if case.find("failure") is not None else "errors"] += 1
            part["failures"].append(name)
        elif (skip := case.find("skipped")) is not None:
            if skip.get("type") == "pytest.xfail":
                part["xfailed"] += 1
                continue
            part["skipped"] += 1
            reason = (skip.get("message") or "").strip()
            part["skip_reasons"][reason] = part["skip_reasons"].get(reason, 0) + 1
        else:
            part["passed"] += 1
    return out


def _tee(stream, f) -> None:
    for line in stream:
        f.write(line)
        sys.stdout.write(line)
    sys.stdout.flush()


def run_step(name: str, cmd: list[str], out: Path, limit_s: int, env: dict) -> dict:
    """Run one step, its output to ``<name>.log`` (and echoed), killed after ``limit_s``."""
    print(f"\n== gpu_check {name}: {' '.join(cmd)} (limit {limit_s} s) ==", flush=True)
    started = time.monotonic()
    log = out / f"{name}.log"
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        tee = threading.Thread(target=_tee, args=(proc.stdout, f), daemon=True)
        tee.start()
        try:
            rc = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its whole session: pytest's and NIXL's threads and children
            proc.wait()
            rc = None
        tee.join(timeout=5)
        if rc is None:
            f.write(f"\ngpu_check: {name} killed after {limit_s} s\n")
    wall = time.monotonic() - started
    print(f"== gpu_check {name}: {'timed out' if rc is None else f'rc {rc}'} in {wall:.0f} s ==", flush=True)
    return {"name": name, "command": cmd, "rc": rc, "timed_out": rc is None, "wall_s": round(wall, 1),
            "ok": rc == 0, "log": log.name}


def pytest_cmd(targets: list[str], junit: Path) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", f"--junitxml={junit}", *targets]


def bench_cmd(device: str, smoke: bool, out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "benchmarks", "transfer", "--device", device, "--out", str(out)]
    if smoke:
        small = {"cpu": "32", "cuda": "16"}[device]
        return cmd + ["--models", "llama-8b", "--tokens", "1024", "--blocks", small, "--sections", "main",
                      "--reps", "1", "--warmup", "0", "--budget-mib", "8"]
    # --quick's sections but perdesc and tcp (DRAM and root only): the same on both devices.
    return cmd + ["--quick", "--sections", "main", "layout", "stall", "first"]


def bench_figures(path: Path) -> dict:
    """The benchmark's tables and, per case, what the issue asks for: GB/s of the connector,
    raw NIXL and the torch copy, descriptors, and the longest call into NIXL (ms)."""
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    cases = []
    for section in ("main", "layout", "stall"):
        for r in data.get(section, []):
            gbps = {v: round(r["nbytes"] / (sorted(s)[len(s) // 2]) / 1e9, 3) for v, s in r["samples"].items() if s}
            cases.append({
                "section": section, "model": r["model"], "tokens": r["tokens"], "block_size": r["block_size"],
                "blocks": r["blocks"], "MiB": round(r["nbytes"] / 2**20, 2), "descriptors": r["desc"], "runs": r["runs"],
                "gbps": gbps, "stall_ms": round(r["stages_ms"].get("connector", {}).get("post", 0.0), 3),
                "threads": r["knobs"].get("num_threads"), "verified": r["verified"],
            })
    return {"cases": cases, "tables": data.get("tables", {}), "first_request": data.get("first_request"),
            "missing_notifications": data.get("missing_notifications")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/gpu_check.sh", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--out", help="results folder (default .artifacts/gpu_check-<device>)")
    ap.add_argument("--smoke", action="store_true", help="a tiny subset of every step (the plumbing)")
    args = ap.parse_args(argv)
    started = time.monotonic()
    device = pick_device(args.device)
    out = Path(args.out or ROOT / ".artifacts" / f"gpu_check-{device}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    env_facts = environment(device)
    where = env_facts.get("gpu", f"{env_facts['cpus']} CPUs")
    print(f"gpu_check: running on {device} ({where}; {'VRAM' if device == 'cuda' else 'DRAM'} buffers), "
          f"torch {env_facts['torch']}, {env_facts['nixl']}, vLLM {'installed' if env_facts['vllm_installed'] else 'absent'}; "
          f"results in {out}", flush=True)
    env = {**os.environ, DEVICE_ENV: device, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    limits = {k: v * (1 if device == "cuda" else CPU_SLOWER) for k, v in (SMOKE_LIMITS if args.smoke else LIMITS).items()}
    junit = out / "junit.xml"
    tests_step = run_step("tests", pytest_cmd(SMOKE_TESTS if args.smoke else ["tests/nixl"], junit), out,
                          limits["tests"], env)
    counts = junit_counts(junit)
    tests_step["parts"] = counts
    tests_step["ok"] = tests_step["ok"] and all(c["passed"] > 0 for c in counts.values())
    steps = [tests_step]
    steps.append(run_step("bench", bench_cmd(device, args.smoke, out), out, limits["bench"], env))
    figures = bench_figures(out / "bench_transfer.json")
    if not args.smoke:
        # One layout keeps the step inside its limit; the others differ in segments, not path.
        tp = [sys.executable, "-m", "benchmarks", "transfer_tp",
              "--kinds", "mamba2", "--attention", "gqa", "--reps", "3", "--out", str(out)]
        steps.append(run_step("bench_tp", tp, out, limits["bench_tp"], env))
    tests = {k: sum(c[k] for c in counts.values()) for k in ("passed", "failed", "errors", "skipped", "xfailed")}
    summary = {
        "ok": all(s["ok"] for s in steps) and bool(figures.get("cases")),
        "device": device,
        "smoke": args.smoke,
        "environment": env_facts,
        "tests": tests,
        "steps": steps,
        "bench": figures,
        "wall_s": round(time.monotonic() - started, 1),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    (out / "tables.md").write_text(tables_md(summary, out))
    print(f"\ngpu_check on {device}: {'OK' if summary['ok'] else 'FAILED'}; tests {tests}; "
          + ", ".join(f"{s['name']} {'ok' if s['ok'] else 'FAILED'} {s['wall_s']:.0f} s" for s in steps)
          + f"; {summary['wall_s']:.0f} s in all; {out / 'summary.json'}", flush=True)
    return 0 if summary["ok"] else 1


def tables_md(summary: dict, out: Path) -> str:
    lines = [f"# gpu_check on {summary['device']}", "", "```", json.dumps(summary["environment"], indent=1), "```", ""]
    lines += ["| step | ok | wall s |", "|---|---|--:|"]
    lines += [f"| {s['name']} | {'yes' if s['ok'] else 'NO'} | {s['wall_s']} |" for s in summary["steps"]]
    lines += ["", "| tests | passed | failed | skipped | xfailed |", "|---|--:|--:|--:|--:|"]
    for part, c in summary["steps"][0]["parts"].items():
        lines.append(f"| {part} | {c['passed']} | {c['failed'] + c['errors']} | {c['skipped']} | {c['xfailed']} |")
        lines += [f"|   skipped ({n}): {reason} | | | | |" for reason, n in c["skip_reasons"].items()]
    for name, table in summary["bench"].get("tables", {}).items():
        lines += ["", f"## bench transfer: {name}", "", table]
    tp = out / "transfer_tp.json"
    if tp.exists():
        rows = json.loads(tp.read_text()).get("rows", [])
        if rows:
            keys = list(rows[0])
            lines += ["", "## bench transfer_tp", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
            lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
