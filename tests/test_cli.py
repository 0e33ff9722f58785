"""The llama-guard command: the demo end to end, every command's help, and clear errors for bad arguments.

doctor and watch are driven end to end in tests/test_doctor.py and tests/test_watch.py."""

from __future__ import annotations

import argparse
import importlib.metadata
import io
import itertools
import platform
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpcore
import httpx
import pytest

import llama_guard
from llama_guard._cli import versions
from llama_guard._cli.demo import _burst, demo_rows, format_table
from llama_guard._cli.load import LoadRow, proxy_load, run_threads
from llama_guard._cli.main import COMMANDS, build_parser, main
from llama_guard.testing import Fault, LlamaServerEmulator

_CLI_DOCS = Path(__file__).resolve().parents[1] / "docs" / "cli.md"


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
    err = capsys.readouterr().err
    assert "[4/4] burst, guard" in err  # progress on the terminal
    table = format_table(list(rows.values()))
    assert "  lost  stuck  " in table
    assert "max first byte" in table
    # A stuck connection is in the max first byte figure: beyond the run, not left out.
    assert "> 2 s (12 stuck)" in table.splitlines()[4]
    # The final figures are those of each step's last progress line.
    done = [line for line in err.splitlines() if line.lstrip().startswith("done in")]
    assert len(done) == 4
    for line, row in zip(done, rows.values(), strict=True):
        assert line.endswith(f"{row.requests} requests, {row.errors} lost, {row.stuck} stuck"), (line, row)


def test_demo_command_exits_zero_and_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--requests", "100", "--clients", "8", "--seconds", "1"]) == 0
    out = capsys.readouterr().out
    assert "The guard lost 0 and left 0 stuck" in out
    # The choice the guard made for the emulator's origin (GuardPolicy.connection="auto" on loopback).
    assert re.search(r"connection strategy .* for the emulator at http://127\.0\.0\.1:\d+: close \(", out), out
    assert "Next: guard your own client" in out


def test_the_demo_burst_s_progress_counts_only_requests_that_ended(capsys: pytest.CaptureFixture[str]) -> None:
    """Plain httpx, 8 new connections on the emulator's 4 threads: 4 first requests wait unread to the run's end.
    Each progress line counts the requests that ended ("ended"); the last line adds the 4 stuck ones, which end
    with the run, and its total is what the table shows: answered + lost + stuck."""
    row = _burst(False, clients=8, seconds=1.5)
    lines = capsys.readouterr().err.splitlines()
    progress = [line for line in lines if " s of 1.5: " in line]
    assert progress, lines
    for line in progress:
        assert re.search(r": 4 of 8 connections answered, \d+ requests ended, 0 lost, 0 stuck; waiting for", line), line
    done = re.fullmatch(r" +done in [\d.]+ s: 4 of 8 connections answered, (\d+) requests, 0 lost, 4 stuck", lines[-1])
    assert done is not None, lines
    assert int(done.group(1)) == row.requests == row.answered + row.errors + row.stuck


def test_python_m_llama_guard_help() -> None:
    result = subprocess.run([sys.executable, "-m", "llama_guard", "demo", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    assert "built-in" in result.stdout


def _actions(parser: argparse.ArgumentParser, name: str) -> Iterator[tuple[str, argparse.Action]]:
    """Every action of ``parser`` and of its subcommands' parsers, with the command it belongs to."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command, subparser in action.choices.items():
                yield from _actions(subparser, f"{name} {command}")
        else:
            yield name, action


def _parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    from llama_guard.testing.__main__ import PROG
    from llama_guard.testing.__main__ import _parser as emulator_parser

    return [("llama-guard", build_parser()), (PROG, emulator_parser())]


def test_every_flag_of_every_command_has_help() -> None:
    """Walks every argparse action of llama-guard's commands and of the emulator's command: each has a help text
    (argparse.SUPPRESS, a flag hidden on purpose, counts as one)."""
    missing = [
        f"{command}: {'/'.join(action.option_strings) or action.dest}"
        for name, parser in _parsers()
        for command, action in _actions(parser, name)
        if not (action.help or "").strip()
    ]
    walked = sum(1 for name, parser in _parsers() for _ in _actions(parser, name))
    assert walked > 40  # the walk reached the subcommands' flags
    assert not missing, missing


def test_version() -> None:
    """The first line is llama_guard's version, as before; then Python's, and one line for each library the guard
    covers, on stdout."""
    result = subprocess.run([sys.executable, "-m", "llama_guard", "--version"], capture_output=True, text=True)
    assert result.returncode == 0
    assert result.stderr == ""
    lines = result.stdout.splitlines()
    assert lines[0] == f"llama-guard {llama_guard.__version__}"
    assert lines[1] == f"  Python {platform.python_version()}"
    assert [line.split()[0].rstrip(":") for line in lines[2:]] == ["httpx", "httpx2", "aiohttp", "urllib3"]
    httpx_line = f"  httpx {httpx.__version__}, httpcore {httpcore.__version__}: "
    assert lines[2] == httpx_line + "tested, so the guard hooks its connection pool"


def test_version_says_what_the_guard_does_on_an_untested_library(monkeypatch: pytest.MonkeyPatch) -> None:
    """A version outside the gate's list is named with what the guard does without its hooks; the others stay."""
    pytest.importorskip("aiohttp")
    import aiohttp

    monkeypatch.setattr(httpx, "__version__", "0.99.0")
    monkeypatch.setattr(aiohttp, "__version__", "3.99.0")
    lines = {line.split()[0].rstrip(":"): line for line in versions.library_lines()}
    assert "httpx 0.99.0 is not a version llama_guard was tested with (0.27.0, " in lines["httpx"]
    assert lines["httpx"].endswith("the guard patches nothing private and follows requests through the trace extension")
    assert "aiohttp 3.99.0 is not a version llama_guard was tested with" in lines["aiohttp"]
    assert "new connections are not probed" in lines["aiohttp"]
    assert lines["aiohttp"].endswith("; install() and llama-guard run leave its sessions alone")
    assert lines["urllib3"].endswith("urllib3 2.x, so the guard hooks its pools")


def test_version_says_an_aiohttp_the_guard_cannot_run_on_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """An aiohttp without Payload.as_bytes() (3.12.0): every entry point refuses it, so it is said once, pin and all."""
    pytest.importorskip("aiohttp")
    import aiohttp.payload

    monkeypatch.setattr(aiohttp, "__version__", "3.12.0")
    monkeypatch.delattr(aiohttp.payload.Payload, "as_bytes")
    line = {line.split()[0].rstrip(":"): line for line in versions.library_lines()}["aiohttp"]
    assert ": the guard needs aiohttp's client middlewares and Payload.as_bytes()" in line
    assert line.endswith("this is aiohttp 3.12.0 (pip install 'aiohttp>=3.12.4,<3.15')")


def test_version_names_the_extra_of_a_library_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    installed = importlib.metadata.version

    def version(name: str) -> str:
        if name in ("httpx2", "aiohttp"):
            raise importlib.metadata.PackageNotFoundError(name)
        return installed(name)

    monkeypatch.setattr(versions.importlib.metadata, "version", version)
    lines = versions.library_lines()
    assert "httpx2: not installed (pip install 'llama-guard[httpx2]')" in lines
    assert "aiohttp: not installed (pip install 'llama-guard[aiohttp]')" in lines


def test_the_version_sample_in_the_docs_is_what_the_command_prints(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/cli.md's sample: httpx2 not installed and an untested aiohttp, as the command words them."""
    pytest.importorskip("aiohttp")
    import aiohttp

    installed = importlib.metadata.version

    def version(name: str) -> str:
        if name == "httpx2":
            raise importlib.metadata.PackageNotFoundError(name)
        return "3.99.0" if name == "aiohttp" else installed(name)

    monkeypatch.setattr(versions.importlib.metadata, "version", version)
    monkeypatch.setattr(aiohttp, "__version__", "3.99.0")
    sample = _CLI_DOCS.read_text().partition("\nllama-guard 0.1.0\n")[2].partition("```")[0].splitlines()
    printed = {line.split()[0].rstrip(":"): f"  {line}" for line in versions.library_lines()}
    for name in ("httpx2", "aiohttp"):
        assert printed[name] in sample, name


def test_help_lists_every_command() -> None:
    result = subprocess.run([sys.executable, "-m", "llama_guard", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    assert set(COMMANDS) == {"demo", "doctor", "watch", "run"}
    for name in COMMANDS:
        assert f"    {name} " in result.stdout, result.stdout


def test_help_and_docs_name_every_library_install_guards() -> None:
    """``llama-guard run`` guards what install() patches; its help, the command's description and docs/cli.md's row
    name each of those libraries (they once said httpx/httpx2 while requests and aiohttp were guarded too)."""
    from llama_guard._install.patching import LIBRARIES

    parser = build_parser()
    commands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    run_help = next(choice.help for choice in commands._choices_actions if choice.dest == "run")
    docs_row = next(line for line in _CLI_DOCS.read_text().splitlines() if line.startswith("| `llama-guard run"))
    assert {"httpx", "httpx2", "aiohttp", "requests", "urllib3"} <= set(LIBRARIES)
    for text in (run_help or "", parser.description or "", docs_row):
        named = set(re.findall(r"[a-z0-9]+", text))
        assert set(LIBRARIES) <= named, (text, set(LIBRARIES) - named)


@pytest.mark.parametrize(
    ("command", "phrases"),
    [
        (
            "doctor",
            [
                "exit status: 0 every defect examined and found absent and plain httpx lost nothing, "
                "1 a client here is exposed",
                "--burst N",
            ],
        ),
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
        (["demo", "--requests", "0"], "argument --requests: expected a whole number of at least 1, got '0'"),
        (["demo", "--seconds", "-1"], "argument --seconds: expected a number of seconds above 0 (e.g. 2.5), got '-1'"),
        (["nonsense"], "invalid choice"),
        ([], "llama-guard: error: give a command: demo, doctor, watch, run (llama-guard COMMAND --help)"),
        # A command's unknown argument is that command's error, under its own usage line.
        (["doctor", "http://127.0.0.1:8080", "extra"], "usage: llama-guard doctor [-h]"),
        (["doctor", "http://127.0.0.1:8080", "extra"], "llama-guard doctor: error: unrecognized arguments: extra"),
        (["doctor"], "the following arguments are required: URL"),
        (
            ["doctor", "http://127.0.0.1:8080", "--requests", "-1"],
            "argument --requests: expected a whole number of at least 0",
        ),
        (
            ["doctor", "http://127.0.0.1:8080", "--timeout", "0"],
            "argument --timeout: expected a number of seconds above 0",
        ),
        (
            ["doctor", "http://127.0.0.1:8080", "--burst", "many"],
            "argument --burst: expected a whole number from 0 (off) to 4,096, got 'many'",
        ),
        # Past what one burst can open: refused here, not an "unexpected error" (doctor) or a traceback (demo).
        (
            ["doctor", "http://127.0.0.1:8080", "--burst", "100000"],
            "argument --burst: expected a whole number from 0 (off) to 4,096, got '100000'",
        ),
        (["demo", "--clients", "5000"], "argument --clients: expected a whole number from 1 to 4,096, got '5000'"),
        (["watch", "--watch", "0"], "argument --watch: expected a number of seconds above 0"),
        (["watch", "--pid", "0"], "argument --pid: expected a whole number of at least 1"),
        (["watch", "--port", "65536"], "argument --port: expected a TCP port, a whole number from 1 to 65535"),
        (["demo", "--requests", "abc"], "argument --requests: expected a whole number of at least 1, got 'abc'"),
        (["watch", "--port", "x"], "argument --port: expected a TCP port, a whole number from 1 to 65535, got 'x'"),
        (["watch", "--stall-seconds", "soon"], "argument --stall-seconds: expected a number of seconds above 0"),
    ],
)
def test_bad_arguments_are_clear_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err
    assert message in err
    assert "invalid _" not in err  # never the name of our own parsing function


def test_long_waits_show_progress_every_few_seconds() -> None:
    """run_threads calls its tick while the jobs run (here every 50 ms, until the third tick lets them end)."""
    release = threading.Event()
    ticks: list[float] = []

    def tick() -> None:
        ticks.append(time.monotonic())
        if len(ticks) == 3:
            release.set()

    run_threads([lambda: release.wait(10)] * 4, tick=tick, every=0.05)
    assert len(ticks) == 3
    assert all(later - earlier >= 0.04 for earlier, later in itertools.pairwise(ticks))


def test_the_load_reports_its_progress_on_the_given_stream() -> None:
    """A load that lasts over 2 s (a slow emulator) prints "N s: K of M requests, L lost" lines."""
    progress = io.StringIO()
    row = LoadRow("pooled load", "plain httpx")
    with (
        LlamaServerEmulator(token_interval=0.05, n_tokens=20, parallel=4) as server,
        httpx.Client(base_url=server.url) as client,
    ):
        body = {"messages": [], "max_tokens": 20, "stream": False}
        proxy_load(
            client, row, requests=12, workers=4, path="/v1/chat/completions", body_for=lambda _: body, progress=progress
        )
    lines = progress.getvalue().splitlines()
    assert len(lines) >= 2, "no progress during a load of about 3 s"
    assert all(
        re.fullmatch(r" +\d+ s: \d+ of 12 requests, \d+ lost, \d+ stuck(, \d+ in flight|; waiting for .*)?", line)
        for line in lines[:-1]
    ), lines
    assert re.fullmatch(r" +done in [\d.]+ s: 12 of 12 requests, 0 lost, 0 stuck", lines[-1]), lines


def test_a_request_without_an_answer_is_counted_as_stuck_not_waited_out_silently() -> None:
    """One request of the load is read and never answered (the client's own timeout is 10 s): the load counts it
    as stuck after the stated bound, its progress says what it waits for, and its last line holds the final
    figures. Fails when the request is waited out for the client's timeout, or waited for without a word."""
    progress = io.StringIO()
    row = LoadRow("pooled load", "plain httpx")
    with (
        LlamaServerEmulator() as server,
        httpx.Client(base_url=server.url, timeout=10.0) as client,
    ):
        rule = server.inject(Fault.HEADERS_NEVER, path="/v1/chat/completions")
        body = {"messages": [], "max_tokens": 2, "stream": False}
        started = time.monotonic()
        proxy_load(
            client,
            row,
            requests=20,
            workers=4,
            path="/v1/chat/completions",
            body_for=lambda _: body,
            progress=progress,
            stuck_after=1.0,
            every=0.2,
        )
        seconds = time.monotonic() - started
    assert rule.triggered == 1  # the cause was there
    assert seconds < 5.0, "the unanswered request was waited out for the client's timeout"
    assert (row.requests, row.errors, row.stuck, row.answered) == (20, 0, 1, 19)
    lines = progress.getvalue().splitlines()
    waiting = "waiting for the last 1 in flight (no answer within 1 s counts as stuck)"
    assert any(line.endswith(waiting) for line in lines), lines
    assert lines[-1].split(": ", 1)[1] == f"20 of 20 requests, {row.counts()}" == "20 of 20 requests, 0 lost, 1 stuck"


def test_the_load_counts_another_librarys_errors_as_lost_when_given_them() -> None:
    """The load on an httpx2 client (``benchmarks/client_versions.py``): a request reset after its headers raises
    httpx2's error, not httpx's; with httpx2's error classes given it is one request lost, by its kind, and the load
    goes on. Fails when the load catches httpx's classes only (the error then ends a worker's thread)."""
    httpx2 = pytest.importorskip("httpx2")
    from llama_guard._cli.load import ClientErrors

    row = LoadRow("pooled load", "plain httpx2")
    with LlamaServerEmulator() as server, httpx2.Client(base_url=server.url, timeout=10.0) as client:
        rule = server.inject(Fault.RESET_AFTER_HEADERS, path="/v1/chat/completions")
        body = {"messages": [], "max_tokens": 2, "stream": False}
        proxy_load(
            client,
            row,
            requests=6,
            workers=1,
            path="/v1/chat/completions",
            body_for=lambda _: body,
            errors=ClientErrors(httpx2.HTTPError, httpx2.TimeoutException),
        )
    assert rule.triggered == 1
    assert (row.requests, row.errors, row.answered) == (6, 1, 5)
    [kind] = row.error_kinds
    assert kind.split(":")[0] in {name for name in dir(httpx2) if name.endswith("Error")}, kind


@pytest.mark.parametrize("argv", [["--version"], ["watch", "--port", "1", "--json"]])
def test_a_reader_gone_ends_the_command_quietly(argv: list[str]) -> None:
    """``llama-guard ... | head -1``: once the reader has gone, the command exits 141 (128 + SIGPIPE, as a shell's
    own tools) with nothing on stderr; it printed a BrokenPipeError traceback, or "unexpected error ... (please
    report this)". The pipe's read end is closed before the command starts, so every write fails."""
    import os

    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        process = subprocess.run(
            [sys.executable, "-m", "llama_guard", *argv],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert (process.returncode, process.stderr) == (141, "")


def test_the_demo_asks_for_no_more_open_files_than_it_may_have() -> None:
    """Each burst client takes two open files (its socket and the in-process emulator's): a demo that may not open
    enough says so in one line and exits 2, before it starts (it failed mid-run with EMFILE, or with select()'s
    limit)."""
    import resource

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (300, 300))

    process = subprocess.run(
        [sys.executable, "-m", "llama_guard", "demo", "--clients", "200"],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=low_limit,
    )
    assert process.returncode == 2, process.stderr
    assert process.stderr == (
        "llama-guard demo: --clients 200 needs about 656 open files, and this process may open at most 300 "
        "(ulimit -Hn): ask for at most 22 clients, or raise the limit\n"
    )


def test_a_load_that_hits_its_time_limit_says_how_many_it_did_not_send() -> None:
    """Each request takes at least 0.2 s (4 tokens, 0.05 s apart) on one worker, so a load of 10 with a 0.3 s limit
    sends at most 2: the last line says the others were not sent and why (they read as vanished: "2 of 10")."""
    progress = io.StringIO()
    row = LoadRow("pooled load", "plain httpx")
    with (
        LlamaServerEmulator(token_interval=0.05, n_tokens=4) as server,
        httpx.Client(base_url=server.url) as client,
    ):
        body = {"messages": [], "max_tokens": 4, "stream": False}
        proxy_load(
            client,
            row,
            requests=10,
            workers=1,
            path="/v1/chat/completions",
            body_for=lambda _: body,
            progress=progress,
            deadline=time.monotonic() + 0.3,
        )
    last = progress.getvalue().splitlines()[-1]
    sent = row.requests
    assert 1 <= sent <= 2, last
    assert last.endswith(
        f": {sent} of 10 requests, 0 lost, 0 stuck; {10 - sent} not sent: "
        "the load sends no request after its 0.3 s limit"
    ), last
