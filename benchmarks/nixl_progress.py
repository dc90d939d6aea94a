"""NIXL progress-thread poll delay: CPU taken by two connected idle agents, and a loopback READ.

    python -m benchmarks nixl_progress                     # delays 0, 100, 1000 µs

For each delay, two UCX agents (P and D, DRAM) are connected in a process of their own; it
prints the CPU ticks (1/100 s) each busy thread used over 3 s while idle, then the time of a
4 MiB READ in 64 KiB descriptors that only D polls (P's progress thread alone serves P's side).
Why ``nixl_progress_delay_us`` defaults to 100 over DRAM: docs/benchmarks.md, "NIXL progress
thread".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import numpy as np

from benchmarks import report
from pd_connector.transport.backends import import_nixl
from pd_connector.transport.nixl import create_agent

MiB = 1 << 20
# Run by name, not __name__: that is "__main__" under python -m.
_MODULE = "benchmarks.nixl_progress"


def _thread_ticks() -> dict[str, int]:
    out = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        out[tid] = int(fields[11]) + int(fields[12])  # utime + stime
    return out


def measure(delay_us: int, idle_s: float = 3.0, reps: int = 20) -> tuple[list[int], float]:
    nixl_agent, nixl_agent_config = import_nixl()
    p = create_agent(nixl_agent, f"p{delay_us}", nixl_agent_config(backends=["UCX"]), delay_us)
    d = create_agent(nixl_agent, f"d{delay_us}", nixl_agent_config(backends=["UCX"]), delay_us)
    src = np.arange(4 * MiB, dtype=np.uint8)
    dst = np.zeros(4 * MiB, dtype=np.uint8)
    p.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
    d.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
    d.add_remote_agent(p.get_agent_metadata())
    p.add_remote_agent(d.get_agent_metadata())
    d.make_connection(p.name)
    before = _thread_ticks()
    time.sleep(idle_s)
    after = _thread_ticks()
    busy = sorted((after[t] - before.get(t, 0) for t in after if after[t] > before.get(t, 0)), reverse=True)
    n, size = 64, 64 * 1024
    local = d.get_xfer_descs([(dst.ctypes.data + i * size, size, 0) for i in range(n)], "DRAM")
    remote = p.get_xfer_descs([(src.ctypes.data + i * size, size, 0) for i in range(n)], "DRAM")
    started = time.perf_counter()
    for _ in range(reps):
        handle = d.initialize_xfer("READ", local, remote, p.name, b"")
        state = d.transfer(handle)
        while (state := d.check_xfer_state(handle)) == "PROC":
            pass
        if state != "DONE":
            raise RuntimeError(f"READ ended {state}")
        d.release_xfer_handle(handle)
    seconds = (time.perf_counter() - started) / reps
    if not (dst == src).all():
        raise RuntimeError("READ moved the wrong bytes")
    return busy, seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--delays", default="0,100,1000", help="comma-separated delays in µs")
    ap.add_argument("--out", default=report.DEFAULT_OUT, help="directory for nixl_progress.json")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one is not None:
        busy, seconds = measure(args.one)
        print(json.dumps({"delay_us": args.one, "idle_ticks": busy, "read_ms": seconds * 1e3,
                          "gbps": 4 * MiB / seconds / 1e9}), flush=True)
        return 0
    rows = []
    for delay in args.delays.split(","):
        # One process per delay: agents are never destroyed here, and a spinning pair left
        # behind would slow the next measurement.
        done = subprocess.run([sys.executable, "-m", _MODULE, "--one", delay], check=True,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    report.print_table(rows, [("delay_us", "delay µs"), ("idle_ticks", "idle ticks/3 s per busy thread"),
                              ("read_ms", "READ 4 MiB ms", ".2f"), ("gbps", "GB/s", ".2f")])
    print(report.write_json("nixl_progress", {"rows": rows, "environment": report.environment()}, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
