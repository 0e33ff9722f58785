"""The llama-guard command: the demo end to end, and clear errors for bad arguments."""

from __future__ import annotations

import subprocess
import sys

import pytest

from llama_guard._cli import main
from llama_guard._demo import demo_rows, format_table


def test_demo_shows_the_defects_and_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    """Plain httpx loses requests and leaves burst connections stuck; the guard does neither."""
    rows = {(row.scenario, row.client): row for row in demo_rows(requests=200, clients=16, seconds=2.0)}
    assert rows[("proxy-like load", "plain httpx")].errors > 0
    assert rows[("burst", "plain httpx")].stuck > 0
    for scenario in ("proxy-like load", "burst"):
        guard = rows[(scenario, "guard")]
        assert (guard.errors, guard.stuck) == (0, 0), scenario
        assert guard.requests > 0
    assert "[4/4] burst, guard" in capsys.readouterr().err  # progress on the terminal
    table = format_table(list(rows.values()))
    assert "stuck conns" in table
    assert "max first byte" in table


def test_demo_command_exits_zero_and_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--requests", "100", "--clients", "8", "--seconds", "1"]) == 0
    assert "The guard lost 0 requests" in capsys.readouterr().out


def test_python_m_llama_guard_help() -> None:
    result = subprocess.run([sys.executable, "-m", "llama_guard", "demo", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    assert "built-in" in result.stdout


@pytest.mark.parametrize("argv", [["demo", "--requests", "0"], ["demo", "--seconds", "-1"], ["nonsense"]])
def test_bad_arguments_are_clear_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "error:" in capsys.readouterr().err
