"""Ctrl-C on every long-running command: it stops promptly, says one line, exits 130, leaves no traceback.

Each command runs as a real process; the test waits for its progress line of the phase to interrupt (so the
signal lands mid-phase, not during start-up), sends SIGINT, and bounds every wait. A leftover non-daemon thread
or an unclosed server would keep the process alive past the bound."""

from __future__ import annotations

import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest

from llama_guard.testing import LlamaServerEmulator

from .test_watch import emulator_process

#: From SIGINT to the process's exit: the commands join their threads for at most 2 s, and the interpreter's
#: exit is fast; 10 s leaves room for a loaded 2-core machine without hiding a hang on a 10 s network timeout.
STOP_WITHIN = 10.0


@dataclass
class Running:
    process: subprocess.Popen[str]
    lines: queue.Queue[str] = field(default_factory=queue.Queue)
    seen: list[str] = field(default_factory=list)

    def wait_for(self, pattern: str, within: float) -> str:
        """The first output line matching ``pattern``; fails after ``within`` s or when the process ends."""
        deadline = time.monotonic() + within
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if line == "":
                break
            self.seen.append(line)
            if re.search(pattern, line):
                return line
        pytest.fail(f"no output line matching {pattern!r} within {within} s; saw {self.seen!r}")

    def interrupt(self) -> tuple[int, str, float]:
        """SIGINT; the exit status, the whole output (stdout and stderr), and how long it took to exit."""
        sent = time.monotonic()
        self.process.send_signal(signal.SIGINT)
        code = self.process.wait(timeout=STOP_WITHIN + 5)
        took = time.monotonic() - sent
        rest: list[str] = []
        while (line := self.lines.get(timeout=5)) != "":
            rest.append(line)
        return code, "".join(self.seen + rest), took


# Runs ``python -m <module> <args>`` with Python's own Ctrl-C handler installed first. A process started in the
# background by a shell without job control (``cmd &`` in a script, nohup) ignores SIGINT, its children inherit
# that, and Python then installs no KeyboardInterrupt handler: the command under test would never see the signal
# this test sends, whoever runs the suite.
_WITH_CTRL_C = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv = sys.argv[1:]; runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)"
)


@contextmanager
def running(*command: str) -> Iterator[Running]:
    assert command[0] == "-m", command
    process = subprocess.Popen(
        [sys.executable, "-c", _WITH_CTRL_C, *command[1:]],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    run = Running(process)

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            run.lines.put(line)
        run.lines.put("")  # end of stream

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield run
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)
        reader.join(timeout=5)
        assert process.stdout is not None
        process.stdout.close()


def _assert_clean_interrupt(code: int, err: str, took: float, command: str) -> None:
    assert code == 130, err
    assert "Traceback" not in err, err
    assert "Exception in thread" not in err, err
    assert took < STOP_WITHIN, f"{command} took {took:.1f} s to stop"
    interrupted = [line for line in err.splitlines() if "interrupted" in line]
    assert len(interrupted) == 1, err
    assert interrupted[0].startswith(f"llama-guard {command}: interrupted"), err


def test_ctrl_c_stops_the_demo_during_its_load() -> None:
    with running("-m", "llama_guard", "demo", "--requests", "100000") as run:
        run.wait_for(r"^\[1/4\] proxy-like load", within=60)
        time.sleep(1.0)  # into the load: threads are sending
        code, err, took = run.interrupt()
    _assert_clean_interrupt(code, err, took, "demo")


def test_ctrl_c_stops_doctor_during_its_load() -> None:
    with (
        LlamaServerEmulator(token_interval=0.01, n_tokens=8) as server,
        running("-m", "llama_guard", "doctor", "--requests", "100000", server.url) as run,
    ):
        run.wait_for(r"pooled load with plain httpx", within=60)
        time.sleep(1.0)
        code, err, took = run.interrupt()
    _assert_clean_interrupt(code, err, took, "doctor")


def test_ctrl_c_stops_watch_and_still_reports() -> None:
    with (
        emulator_process("--http-threads", "2") as server,
        running("-m", "llama_guard", "watch", "--port", str(server.port), "--watch", "30") as run,
    ):
        run.wait_for(r"^watching ", within=30)
        time.sleep(1.0)
        code, err, took = run.interrupt()
    _assert_clean_interrupt(code, err, took, "watch")


def test_ctrl_c_stops_the_emulator_command_with_its_counts() -> None:
    with running("-m", "llama_guard.testing", "--port", "0") as run:
        run.wait_for(r"listening on http://127\.0\.0\.1:\d+", within=30)
        code, err, took = run.interrupt()
    assert code == 130, err
    assert "Traceback" not in err, err
    assert took < STOP_WITHIN
    (stopped,) = [line for line in err.splitlines() if "interrupted" in line]
    assert "requests: none;" in stopped  # what the server saw, on the same one line
