"""Wall time per test module, printed at the end of every run (CI's breakdown, docs/testing.md);
the checkout's root on sys.path for the rig (rig/) and the benchmarks; and each test's outcome recorded for the correctness matrix
(rig/correctness_matrix.py: merged into .artifacts/test-outcomes.json at session end,
``PD_TEST_OUTCOMES`` names another file or ``off``; ``make matrix`` renders
docs/correctness-matrix.md from it).

A module's time is the sum of its tests' setup, call and teardown phases, so a session or module
fixture (a server stack) counts for the module whose test started it, and a fixture torn down in
a test's teardown counts for that test's module."""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

# The rig (rig/) and the benchmarks are imported from the checkout, whatever pytest's import mode.
ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Outcomes by node id for docs/correctness-matrix.md (stdlib only: no vLLM is imported).
pytest_plugins = ["rig.correctness_matrix"]

_module_seconds: dict[str, float] = defaultdict(float)
_module_tests: dict[str, int] = defaultdict(int)
_session_start = time.monotonic()


def pytest_sessionstart(session) -> None:
    global _session_start
    _session_start = time.monotonic()


def pytest_runtest_logreport(report) -> None:
    module = report.nodeid.split("::", 1)[0]
    _module_seconds[module] += report.duration
    if report.when == "call" or (report.when == "setup" and report.skipped):
        _module_tests[module] += 1


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter) -> None:
    if not _module_seconds:
        return
    tr = terminalreporter
    tr.write_sep("=", "wall time per test module")
    for module, seconds in sorted(_module_seconds.items(), key=lambda kv: -kv[1]):
        tr.write_line(f"{seconds:8.1f} s  {_module_tests[module]:4d} tests  {module}")
    tests = sum(_module_seconds.values())
    tr.write_line(f"{tests:8.1f} s  in tests, {time.monotonic() - _session_start:.1f} s session wall time")
