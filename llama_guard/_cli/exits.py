"""How a command ends when interrupted (Ctrl-C prints one line and exits 130) or when it cannot run (one line,
exit 2); each command's own statuses are in docs/cli.md. Its own module so that the commands and the entry point
share it without importing each other."""

from __future__ import annotations

import contextlib
import json
import json as json_module  # `json` is also run_command's parameter
import os
import signal
import sys
from collections.abc import Callable
from typing import TextIO

__all__ = [
    "EXIT_COULD_NOT_RUN",
    "EXIT_INTERRUPTED",
    "EXIT_READER_GONE",
    "failed",
    "interrupted",
    "reader_gone",
    "run_command",
    "streams",
]

EXIT_COULD_NOT_RUN = 2
EXIT_INTERRUPTED = 130


def streams(out: TextIO | None, err: TextIO | None) -> tuple[TextIO, TextIO]:
    """A command's output and error streams: the ones given (tests), else the process's at the time of the call."""
    return (out if out is not None else sys.stdout), (err if err is not None else sys.stderr)


def failed(command: str, message: str, *, err: TextIO, json_out: TextIO | None = None, **context: object) -> int:
    """What stopped ``command`` (never a traceback): one line on ``err``, and with ``--json`` (``json_out``) also
    ``{**context, "error": message, "exit_code": 2}``; returns 2."""
    if json_out is not None:
        print(json.dumps({**context, "error": message, "exit_code": EXIT_COULD_NOT_RUN}), file=json_out)
    print(f"llama-guard {command}: {message}", file=err)
    return EXIT_COULD_NOT_RUN


def interrupted(command: str) -> int:
    """Ctrl-C: one line, no traceback. A second Ctrl-C while this returns is ignored, so it stays one line."""
    from .load import join_stragglers

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    left = join_stragglers()
    extra = f" ({len(left)} thread(s) still waiting on the network are abandoned)" if left else ""
    print(f"llama-guard {command}: interrupted{extra}", file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED


#: The exit status of a command whose output's reader went away (128 + SIGPIPE, as shells report a pipe's writer).
EXIT_READER_GONE = 141


def reader_gone() -> int:
    """The output's reader went away (``llama-guard doctor URL | head -1``): nothing more to say, and no traceback
    for it. Standard output is pointed at /dev/null so that Python's own flush at exit does not fail again."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return EXIT_READER_GONE


def run_command(
    command: str,
    body: Callable[[TextIO, TextIO], int],
    stops: type[Exception],
    *,
    out: TextIO | None,
    err: TextIO | None,
    json: bool,
    **context: object,
) -> int:
    """Run a command's ``body(out, err)`` with the promises every command keeps: what stops it (``stops``, its own
    error class, or a bug of ours) is one line on ``err`` and exit 2 (with ``json``, a JSON error on ``out`` too,
    with ``context``); Ctrl-C is one line and 130. Returns the exit status."""
    out, err = streams(out, err)
    try:
        return body(out, err)
    except stops as exc:
        message = str(exc)
    except BrokenPipeError:  # the reader went away: `main` ends quietly (reader_gone)
        raise
    except KeyboardInterrupt:
        if json:
            print(json_module.dumps({**context, "error": "interrupted", "exit_code": EXIT_INTERRUPTED}), file=out)
        return interrupted(command)
    except Exception as exc:  # a bug of ours: still one line, as promised, with enough to report it
        message = f"unexpected error {type(exc).__name__}: {exc} (please report this)"
    return failed(command, message, err=err, json_out=out if json else None, **context)
