"""``python -m benchmarks NAME ...``: dispatch to a benchmark's ``main(argv)`` and each real
benchmark's own ``--help`` (run from the checkout's root, where the benchmarks live)."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest

from benchmarks import __main__ as command

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(command.BENCHMARKS))
def test_every_remaining_argument_goes_to_the_benchmark(name, monkeypatch):
    calls = []

    def fake_main(argv):
        calls.append((argv, sys.argv[0]))
        return 7

    module = types.ModuleType(f"benchmarks.{name}")
    module.main = fake_main
    monkeypatch.setitem(sys.modules, module.__name__, module)
    argv = ["--quick", "--out", "x", "--help", "positional"]
    assert command.main([name, *argv]) == 7
    # Options after the name belong to the benchmark, --help included; its parser names itself
    # after the command the user typed.
    assert calls == [(argv, f"python -m benchmarks {name}")]
    assert sys.argv[0] != f"python -m benchmarks {name}"  # restored
    assert command.main([name]) == 7 and calls[-1][0] == []


def test_an_unknown_benchmark_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        command.main(["nope"])
    assert e.value.code == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_help_lists_every_benchmark(capsys):
    with pytest.raises(SystemExit) as e:
        command.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in command.BENCHMARKS)


@pytest.mark.parametrize("name", sorted(command.BENCHMARKS))
def test_help_is_the_benchmarks_own(name):
    """The real benchmark's ``--help``, in a subprocess (it imports torch/vLLM/NIXL)."""
    done = subprocess.run([sys.executable, "-m", "benchmarks", name, "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(f"usage: python -m benchmarks {name}")
