"""The llama-guard command: the demo end to end, every command's help, and clear errors for bad arguments.

doctor and watch are driven end to end in tests/test_doctor.py and tests/test_watch.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from llama_guard._cli.demo import demo_rows, format_table
from llama_guard._cli.main import COMMANDS, main


@pytest.mark.slow  # the whole demo, 15 s or more
def test_demo_shows_the_defects_and_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    """Plain httpx loses requests and leaves burst connections stuck; the guard does neither."""
    rows = {(row.scenario, row.client): row for row in demo_rows(requests=200, clients=16, seconds=2.0)}
    assert rows[("proxy-like load", "plain httpx")].errors > 0
    assert rows[("burst", "plain httpx")].stuck == 16 - 4  # the connections after the emulator's 4 pool threads
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


def test_help_lists_every_command() -> None:
    result = subprocess.run([sys.executable, "-m", "llama_guard", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    assert set(COMMANDS) == {"demo", "doctor", "watch", "run"}
    for name in COMMANDS:
        assert f"    {name} " in result.stdout, result.stdout


@pytest.mark.parametrize(
    ("command", "phrases"),
    [
        ("doctor", ["exit status: 0 no defect found, 1 affected by a defect, 2 could not run", "--burst N"]),
        ("watch", ["exit status: 0 nothing found, 1 a stall or a risk, 2 could not run", "--stall-seconds"]),
    ],
)
def test_command_help_documents_exit_status(command: str, phrases: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines to the terminal
    for phrase in phrases:
        assert phrase in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--requests", "0"], "must be a whole number >= 1"),
        (["demo", "--seconds", "-1"], "must be a number of seconds > 0"),
        (["nonsense"], "invalid choice"),
        (["doctor"], "the following arguments are required: URL"),
        (["doctor", "http://127.0.0.1:8080", "--requests", "-1"], "must be a whole number >= 0"),
        (["doctor", "http://127.0.0.1:8080", "--timeout", "0"], "must be a number of seconds > 0"),
        (["doctor", "http://127.0.0.1:8080", "--burst", "many"], "invalid"),
        (["watch", "--watch", "0"], "must be a number of seconds > 0"),
        (["watch", "--pid", "0"], "must be a whole number >= 1"),
        (["watch", "--port", "65536"], "must be a TCP port from 1 to 65535"),
    ],
)
def test_bad_arguments_are_clear_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err
    assert message in err
