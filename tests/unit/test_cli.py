"""The ``pd-connector`` command line: ``--help`` of every command and subcommand, and dispatch to
the demo and the benchmarks (the proxy's and check's options are tested with them)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import types

import pytest

from pd_connector import cli

COMMANDS = ("proxy", "check", "bench", "demo")


def help_of(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 0
    return capsys.readouterr().out


def test_top_level_help_lists_every_command(capsys):
    out = help_of(["--help"], capsys)
    for command in COMMANDS:
        assert command in out


@pytest.mark.parametrize("command, words", [
    ("proxy", ["--prefill", "--decode", "--decode-min-recompute", "--policy", "--health-interval",
               "--prefill-retries", "/metrics"]),
    ("check", ["--prefill", "--decode", "--model", "--prompt-tokens", "--timeout"]),
    ("bench", [*cli.BENCHMARKS, "pd-connector bench transfer --help"]),
    ("demo", ["--device", "--keep-going"]),
])
def test_every_command_has_help_naming_its_options(command, words, capsys):
    out = help_of([command, "--help"], capsys)
    assert out.startswith(f"usage: pd-connector {command}")
    for word in words:
        assert word in out, word


def test_help_works_without_the_heavy_imports():
    """``--help`` of every command on an interpreter that has not imported aiohttp, torch, vLLM
    or NIXL, and does not afterwards (they are imported by the command that runs)."""
    code = (
        "import sys\n"
        "from pd_connector import cli\n"
        f"for argv in [['--help']] + [[c, '--help'] for c in {COMMANDS!r}]:\n"
        "    try:\n"
        "        cli.main(argv)\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0, (argv, e.code)\n"
        "heavy = [m for m in ('aiohttp', 'torch', 'vllm', 'nixl') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=60)


def test_without_subcommand_prints_help(capsys):
    assert cli.main([]) == 2
    assert "proxy" in capsys.readouterr().err


def test_demo_dispatch(monkeypatch):
    seen = []
    fake = types.ModuleType("pd_connector.dev.demo")
    fake.main = lambda args: seen.append(args) or 3
    monkeypatch.setitem(sys.modules, "pd_connector.dev.demo", fake)
    monkeypatch.setattr(sys.modules["pd_connector"], "demo", fake, raising=False)
    assert cli.main(["demo", "--device", "cuda", "--keep-going"]) == 3
    assert seen[0].device == "cuda" and seen[0].keep_going is True
    assert cli.main(["demo"]) == 3
    assert seen[1].device == "cpu" and seen[1].keep_going is False


# ---- bench -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(cli.BENCHMARKS))
def test_bench_passes_every_remaining_argument_to_the_benchmark(name, monkeypatch):
    calls = []

    def fake_main(argv):
        calls.append((argv, sys.argv[0]))
        return 7

    module = types.ModuleType(f"pd_connector.dev.benchmarks.{name}")
    module.main = fake_main
    monkeypatch.setitem(sys.modules, module.__name__, module)
    argv = ["--quick", "--out", "x", "--help", "positional"]
    assert cli.main(["--log-level", "WARNING", "bench", name, *argv]) == 7
    # Options after the name belong to the benchmark, --help included; its parser names itself
    # after the command the user typed.
    assert calls == [(argv, f"pd-connector bench {name}")]
    assert sys.argv[0] != f"pd-connector bench {name}"  # restored
    assert cli.main(["bench", name]) == 7 and calls[-1][0] == []


def test_bench_refuses_an_unknown_benchmark(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "nope"])
    assert e.value.code == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_bench_names_a_benchmark_module_that_is_not_installed(monkeypatch, capsys):
    def missing(name):
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(cli.importlib, "import_module", missing)
    assert cli.main(["bench", "e2e"]) == 2
    assert "pd_connector.dev.benchmarks.e2e is not installed" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(cli.BENCHMARKS))
def test_bench_help_is_the_benchmarks_own(name):
    """The real benchmark's ``--help``, in a subprocess (it imports torch/vLLM/NIXL)."""
    if importlib.util.find_spec(f"pd_connector.dev.benchmarks.{name}") is None:
        pytest.skip(f"pd_connector.dev.benchmarks.{name} does not exist in this tree yet")
    done = subprocess.run([sys.executable, "-m", "pd_connector.cli", "bench", name, "--help"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(f"usage: pd-connector bench {name}")
