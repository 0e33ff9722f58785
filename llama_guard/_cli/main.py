"""The ``llama-guard`` command (also ``python -m llama_guard``).

Each subcommand is a pair: a function that adds its parser, and a function that runs it from the parsed
arguments and returns the exit status. To add one, write the pair and list it in ``COMMANDS``. The commands'
modules are imported only when they run, so ``llama-guard --help`` stays fast.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["COMMANDS", "EXIT_INTERRUPTED", "build_parser", "interrupted", "main"]

from .._burst import MAX_BURST
from .exits import EXIT_INTERRUPTED, interrupted, reader_gone

Adder = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], argparse.ArgumentParser]
Runner = Callable[[argparse.Namespace], int]


def _whole(text: str, accepted: str, low: int, high: int | None = None) -> int:
    """``text`` as a whole number in [low, high]; else an error saying what is accepted (argparse names the
    argument: ``argument --requests: expected a whole number of at least 1, got 'abc'``)."""
    try:
        value = int(text.strip())
    except ValueError:
        value = None
    if value is None or value < low or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"expected {accepted}, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    return _whole(text, "a whole number of at least 1", 1)


def _count(text: str) -> int:
    return _whole(text, "a whole number of at least 0 (0 turns it off)", 0)


def _burst(text: str) -> int:
    return _whole(text, f"a whole number from 0 (off) to {MAX_BURST:,}", 0, MAX_BURST)


def _clients(text: str) -> int:
    return _whole(text, f"a whole number from 1 to {MAX_BURST:,}", 1, MAX_BURST)


def _port(text: str) -> int:
    return _whole(text, "a TCP port, a whole number from 1 to 65535", 1, 65535)


#: Parsed arguments that are no command's options: the subcommand's name, and ``-v`` (`main` sets up logging).
_NOT_OPTIONS = frozenset({"command", "verbose"})


def _options(args: argparse.Namespace, **given: Any) -> dict[str, Any]:
    """A command's options from its parsed arguments: each argument's dest is the name of the option it sets
    (``--max-tokens`` -> ``max_tokens``), so an argument the options lack is a TypeError, not silently dropped.
    ``given``: options that are not an argument as parsed (a list made a tuple)."""
    return {**{name: value for name, value in vars(args).items() if name not in _NOT_OPTIONS}, **given}


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a number of seconds above 0 (e.g. 2.5), got {text!r}")
    return value


def _described(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], name: str, help: str, description: str
) -> argparse.ArgumentParser:
    """A command whose ``--help`` shows its ``description`` as written (line breaks and lists kept)."""
    return commands.add_parser(
        name, help=help, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )


# -- demo -------------------------------------------------------------------------------------------------------


def _add_demo(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    demo = commands.add_parser(
        "demo",
        help="show both llama-server defects and the guard's fix on the built-in emulator (no server needed)",
        description="Runs a proxy-like load and a connection burst against the built-in llama-server emulator, "
        "with plain httpx and with the guard, and prints a table. Exit status 0 when the guard lost nothing and left "
        "nothing stuck, 1 when it did, 2 could not run, 130 interrupted.",
    )
    demo.add_argument("--requests", type=_positive_int, default=600, help="requests in the proxy-like load (600)")
    demo.add_argument("--clients", type=_clients, default=32, help="connections in the burst (32; at most 4096)")
    demo.add_argument("--seconds", type=_positive_float, default=2.5, help="length of each burst run (2.5)")
    demo.add_argument("-v", "--verbose", action="store_true", help="show the guard's warnings as it recovers")
    return demo


def _command_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(**_options(args))


# -- doctor -----------------------------------------------------------------------------------------------------


DOCTOR_HELP = "examine a running llama-server from the client side: which defects it has, and the fix"
DOCTOR_DESCRIPTION = """\
Examines a running llama-server over HTTP and says, for each defect, affected / not affected / could not tell,
with the evidence and the fix:
  - its identity and build (GET /props);
  - whether a streamed response announces keep-alive yet closes the connection after the final chunk;
  - whether a non-streamed response keeps the connection as announced;
  - a short pooled load with plain httpx and with the guard (--requests each; 0 skips it): what a client
    here without the guard loses, and why;
  - with --burst N: N connections opened at once, to see whether their first requests are left unread
    (the thread-pool defect of builds before b11737). Off by default: it loads the server.
It runs a few tiny completions (--max-tokens tokens each) on the server.

The URL may be the server's base URL as clients use it (http://HOST:PORT/v1): doctor looks for llama-server
under its path, then under each shorter path down to the root, and says where it found it.

exit status: 0 every defect examined and found absent and plain httpx lost nothing, 1 a client here is exposed
(the server has a defect, or plain httpx lost requests in the pooled load), 2 could not run (bad URL,
unreachable, no llama-server found, timeout), 3 nothing found but at least one verdict could not be told,
130 interrupted (Ctrl-C)."""


def _add_doctor(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    doctor = _described(commands, "doctor", DOCTOR_HELP, DOCTOR_DESCRIPTION)
    doctor.add_argument(
        "url", metavar="URL", help="the server, e.g. http://127.0.0.1:8080, or a URL under it such as its /v1 base URL"
    )
    doctor.add_argument(
        "--requests", type=_count, default=100, help="requests of the pooled load, per client kind (100; 0: skip)"
    )
    doctor.add_argument(
        "--burst",
        type=_burst,
        default=0,
        metavar="N",
        help="also open N connections at once (e.g. 32; at most 4096; off: 0)",
    )
    doctor.add_argument(
        "--timeout", type=_positive_float, default=10.0, help="seconds to wait for a connection or an answer (10)"
    )
    doctor.add_argument("--max-tokens", type=_positive_int, default=4, help="tokens per test completion (4)")
    doctor.add_argument(
        "--api-key", default=None, help="the server's --api-key, if it has one (default: $LLAMA_API_KEY)"
    )
    doctor.add_argument("--json", action="store_true", help="print the findings as JSON on stdout")
    doctor.add_argument(
        "--report",
        type=Path,
        metavar="FILE",
        help="also write a report with the first-byte latency of every connection: FILE.html, or FILE.png "
        "(needs matplotlib)",
    )
    doctor.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    doctor.add_argument("-v", "--verbose", action="store_true", help="show the guard's warnings during the load")
    return doctor


def _command_doctor(args: argparse.Namespace) -> int:
    from .doctor.command import DoctorOptions, run_doctor

    return run_doctor(DoctorOptions(**_options(args)))


# -- watch ------------------------------------------------------------------------------------------------------


WATCH_HELP = "on the server's host: find llama-servers, flag the pool defect's risk, catch stalled connections"
WATCH_DESCRIPTION = """\
Runs on the server's own host (Linux; reads /proc, needs no ss). Finds running llama-server processes (or the
ones named by --pid / --port), reads their --threads-http, --parallel and port, counts their established client
connections, and flags a build before b11737 holding more connections than its base HTTP threads (default
max(parallel + 4, CPUs - 1)). With --watch SECONDS it samples the servers' sockets every second and reports
every connection whose request sits unread (Recv-Q > 0) for --stall-seconds:
  STALLED 127.0.0.1:8080<-127.0.0.1:54264: request unread for 5 s

exit status: 0 nothing found, 1 a stall or a risk, 2 could not run (not Linux, /proc unreadable, no server),
130 interrupted (Ctrl-C; what was seen so far is still reported)."""


def _add_watch(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    watch = _described(commands, "watch", WATCH_HELP, WATCH_DESCRIPTION)
    # dest: the WatchOptions field each sets (see _options); metavar: what --help shows.
    watch.add_argument(
        "--pid", type=_positive_int, action="append", default=[], dest="pids", metavar="PID", help="watch this process"
    )
    watch.add_argument(
        "--port",
        type=_port,
        action="append",
        default=[],
        dest="ports",
        metavar="PORT",
        help="watch the server on this port",
    )
    watch.add_argument(
        "--watch",
        type=_positive_float,
        default=None,
        dest="seconds",
        metavar="SECONDS",
        help="sample the sockets for SECONDS",
    )
    watch.add_argument(
        "--stall-seconds",
        type=_positive_float,
        default=5.0,
        help="how long a request must sit unread to count as stalled (5)",
    )
    watch.add_argument("--interval", type=_positive_float, default=1.0, help=argparse.SUPPRESS)
    watch.add_argument("--json", action="store_true", help="print the findings as JSON on stdout")
    return watch


def _command_watch(args: argparse.Namespace) -> int:
    from .watch.command import WatchOptions, run_watch

    return run_watch(WatchOptions(**_options(args, pids=tuple(args.pids), ports=tuple(args.ports))))


#: name -> (add the parser, run it). Insertion order is the order of ``--help``.
# -- run --------------------------------------------------------------------------------------------------------


def _add_run(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    run = commands.add_parser(
        "run",
        help="run a program with every httpx, httpx2, aiohttp, requests and urllib3 client in it guarded (no code "
        "change)",
        description="Runs COMMAND with llama_guard.install() active in its Python processes (through PYTHONPATH). "
        "Origins come from --origins, else from $LLAMA_GUARD_ORIGINS, else 'auto' (servers that identify as "
        "llama.cpp). The command replaces this process: its exit status is the command's. "
        "Example: llama-guard run --origins http://127.0.0.1:8080 -- python app.py",
    )
    run.add_argument(
        "--origins",
        metavar="ORIGINS",
        help="'auto' or comma-separated origins such as http://127.0.0.1:8080 (default: $LLAMA_GUARD_ORIGINS, "
        "else auto)",
    )
    run.add_argument("program", nargs=argparse.REMAINDER, metavar="-- COMMAND ...", help="the program to run")
    return run


def _command_run(args: argparse.Namespace) -> int:
    from .launch import exec_guarded

    return exec_guarded(args.program, origins=args.origins)


COMMANDS: dict[str, tuple[Adder, Runner]] = {
    "demo": (_add_demo, _command_demo),
    "doctor": (_add_doctor, _command_doctor),
    "watch": (_add_watch, _command_watch),
    "run": (_add_run, _command_run),
}


class _VersionAction(argparse.Action):
    """``--version``: worked out when asked (it imports the HTTP libraries), then exit."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        from .versions import version_text

        print(version_text())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    return _build_parsers()[0]


def _build_parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser, and each command's by name."""
    parser = argparse.ArgumentParser(
        prog="llama-guard",
        description="Make pooled HTTP clients (httpx, httpx2, aiohttp, requests and urllib3) safe against llama.cpp's "
        "llama-server.",
    )
    parser.add_argument(
        "--version",
        action=_VersionAction,
        help="print the version, and the version of each HTTP library the guard covers (tested or not), and exit",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    return parser, {name: add(commands) for name, (add, _) in COMMANDS.items()}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The arguments, or exit 2 with an error from the parser they belong to: a command's unknown option gets that
    command's usage line (argparse gives the top level's), and no command at all lists the commands."""
    parser, command_parsers = _build_parsers()
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        parser.print_usage(sys.stderr)
        parser.exit(2, f"{parser.prog}: error: give a command: {', '.join(COMMANDS)} (llama-guard COMMAND --help)\n")
    args, extra = parser.parse_known_args(argv)
    if extra:
        command_parsers[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parse(argv)  # --version prints here
        verbose = getattr(args, "verbose", False)
        logging.basicConfig(level=logging.WARNING if verbose else logging.ERROR, format="%(message)s")
        _, run = COMMANDS[args.command]
        try:
            return run(args)
        except KeyboardInterrupt:
            return interrupted(args.command)
    except BrokenPipeError:
        return reader_gone()


#: The exit status of a command stopped by Ctrl-C (128 + SIGINT, as shells report it).
if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
