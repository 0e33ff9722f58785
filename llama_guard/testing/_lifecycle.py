"""What the test tooling's servers, relays and helper processes share: ``with`` around ``start()``/``stop()``,
helper processes that end on their own when their parent dies, and ending a child process in bounded time.

Each of them (the emulator, a real llama-server, nginx, the relays, the CPU hogs) used to carry its own copy of
these; a fix to how a child is reaped or orphaned now lands in all of them at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

__all__ = ["StartStop", "end_process", "spawn_watcher"]

_S = TypeVar("_S", bound="StartStop")


class StartStop(ABC):
    """``with thing as started:`` is ``started = thing.start()`` and ``thing.stop()`` on the way out, exception
    or not. ``start()`` returns the object itself; ``stop()`` is idempotent (it also runs after a failed start)."""

    @abstractmethod
    def start(self: _S) -> _S: ...

    @abstractmethod
    def stop(self) -> object: ...

    def __enter__(self: _S) -> _S:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def spawn_watcher(
    script: str, *args: str, stdout: int = subprocess.DEVNULL, new_session: bool = False
) -> subprocess.Popen[bytes]:
    """``python -c script PARENT *args``: a helper process that watches this one, ``PARENT`` (its pid), and ends
    once it is re-parented, so a test run killed without cleanup (SIGKILL, a crash) leaves nothing running.

    The pid is passed, not read by the child at start: a parent killed before the child's interpreter is up would
    be missed. ``new_session``: out of the terminal's process group, so a Ctrl-C does not end it early.
    """
    return subprocess.Popen(
        [sys.executable, "-c", script, str(os.getpid()), *args],
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=subprocess.DEVNULL,
        start_new_session=new_session,
    )


def _terminate(process: subprocess.Popen[Any]) -> None:
    process.send_signal(signal.SIGTERM)


def end_process(
    process: subprocess.Popen[Any],
    *,
    grace: float | None,
    ask: Callable[[subprocess.Popen[Any]], None] = _terminate,
    kill: Callable[[subprocess.Popen[Any]], None] = subprocess.Popen.kill,
    reap_timeout: float | None = None,
) -> int | None:
    """Ask ``process`` to end (``ask``: SIGTERM by default), give it ``grace`` seconds (None: as long as it takes),
    then ``kill`` it (SIGKILL by default) and reap it, waiting at most ``reap_timeout`` seconds (None: for ever).
    Closes the pipes this side holds to it; returns its exit code (None only if ``reap_timeout`` ran out).

    A process that has already exited is only reaped: ``Popen.send_signal`` signals nothing once it has.
    """
    with contextlib.suppress(ProcessLookupError):
        ask(process)
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            kill(process)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=reap_timeout)
    for pipe in (process.stdin, process.stdout, process.stderr):
        if pipe is not None:
            with contextlib.suppress(OSError):  # stdin flushes what it buffered: the child may have closed its end
                pipe.close()
    return process.returncode
