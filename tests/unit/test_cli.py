"""The ``pd-connector`` command line: ``--help`` of every command (the proxy's and check's
options are tested with them). The benchmarks' command: tests/unit/test_benchmarks_command.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pd_connector import cli

COMMANDS = ("proxy", "check")


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
