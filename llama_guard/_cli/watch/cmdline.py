"""What a running server was started with: its HTTP thread pool, slots and address, from argv and env (no I/O).

The pool defect of builds before b11737 bites when a server holds more client connections than its *base* HTTP
threads (the threads that always run; cpp-httplib adds dynamic ones only when it notices none is idle, which is
what goes wrong). llama-server's base is ``--threads-http`` when that is 1 or more, otherwise
``max(parallel + 4, CPUs - 1)``, where ``parallel`` is ``--parallel``/``-np`` and its "auto" (-1, the default)
means 4. Every flag can also come from a ``LLAMA_ARG_*`` environment variable; the command line wins.

The built-in emulator (``python -m llama_guard.testing``) is recognised too, so that ``watch`` can be tried and
tested without a real server: its pool has ``--http-threads`` base threads (4), and it models build b11434 unless
started with ``--fixed-pool``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from ..._core.llama_server import FIRST_FIXED_BUILD

__all__ = ["AUTO_PARALLEL", "ServerCommand", "is_llama_server", "parse_server_command"]

#: What llama-server makes of ``--parallel -1`` (auto, the default).
AUTO_PARALLEL = 4

Kind = Literal["llama-server", "emulator", "other"]

_EMULATOR_MODULES = ("llama_guard.testing", "llama_guard.testing.__main__")


@dataclass(frozen=True)
class Setting:
    """One integer setting and where it came from (``--threads-http``, ``LLAMA_ARG_THREADS_HTTP``, ``default``)."""

    value: int | None
    source: str


@dataclass(frozen=True)
class ServerCommand:
    """The settings of one server process that matter to the pool defect."""

    kind: Kind
    threads_http: Setting
    parallel: Setting
    port: Setting
    hosts: tuple[str, ...]
    #: A build known from the command line alone (the emulator's); None for a real llama-server.
    build_info: str | None = None

    def base_http_threads(self, cpus: int) -> int | None:
        """The pool's base threads, or None when the process is not a server whose defaults we know."""
        if self.kind == "other":
            return None
        if self.threads_http.value is not None and self.threads_http.value >= 1:
            return self.threads_http.value
        if self.kind == "emulator":
            return 4
        parallel = self.parallel.value if self.parallel.value is not None and self.parallel.value >= 1 else None
        return max((parallel or AUTO_PARALLEL) + 4, cpus - 1)

    def explain_base(self, cpus: int) -> str:
        """How :meth:`base_http_threads` was worked out, for people."""
        base = self.base_http_threads(cpus)
        if base is None:
            return "unknown (not a llama-server command line)"
        if self.threads_http.value is not None and self.threads_http.value >= 1:
            return f"{base} ({self.threads_http.source} {self.threads_http.value})"
        if self.kind == "emulator":
            return f"{base} (the emulator's default)"
        parallel = self.parallel.value if self.parallel.value is not None and self.parallel.value >= 1 else None
        shown = f"parallel {parallel}" if parallel is not None else f"parallel auto = {AUTO_PARALLEL}"
        return f"{base} (default: max({shown} + 4, {cpus} CPUs - 1))"


def is_llama_server(argv: Sequence[str], exe: str | None) -> bool:
    """Is this process llama-server, by its executable's or its argv[0]'s file name?"""
    names = [os.path.basename(exe.removesuffix(" (deleted)"))] if exe else []
    if argv:
        names.append(os.path.basename(argv[0]))
    return "llama-server" in names


def _is_emulator(argv: Sequence[str]) -> bool:
    return any(argv[i] == "-m" and argv[i + 1] in _EMULATOR_MODULES for i in range(len(argv) - 1))


def _flag_values(argv: Sequence[str], names: Sequence[str]) -> list[str]:
    """Values given to any of the flags ``names``, in order: ``--flag VALUE`` and ``--flag=VALUE``."""
    values: list[str] = []
    for index, arg in enumerate(argv):
        name, equals, value = arg.partition("=")
        if name in names:
            if equals:
                values.append(value)
            elif index + 1 < len(argv):
                values.append(argv[index + 1])
    return values


def _int_setting(argv: Sequence[str], flags: Sequence[str], env: Mapping[str, str], var: str | None) -> Setting:
    for value in reversed(_flag_values(argv, flags)):  # the last one given wins, as in llama-server
        try:
            return Setting(int(value), flags[-1])
        except ValueError:
            continue
    if var is not None and var in env:
        try:
            return Setting(int(env[var]), var)
        except ValueError:
            pass
    return Setting(None, "default")


def parse_server_command(argv: Sequence[str], env: Mapping[str, str], exe: str | None = None) -> ServerCommand:
    """Read a server's settings from its argv and environment (``env`` may be empty when it cannot be read)."""
    if _is_emulator(argv):
        fixed = "--fixed-pool" in argv
        port = _int_setting(argv, ["--port"], {}, None)
        return ServerCommand(
            kind="emulator",
            threads_http=_int_setting(argv, ["--http-threads"], {}, None),
            parallel=_int_setting(argv, ["--parallel"], {}, None),
            port=port if port.value is not None else Setting(8080, "default"),
            hosts=tuple(_flag_values(argv, ["--host"])[-1:]) or ("127.0.0.1",),
            build_info=f"b{FIRST_FIXED_BUILD}-emulated" if fixed else "b11434-emulated",
        )
    if not is_llama_server(argv, exe):
        return ServerCommand("other", Setting(None, "unknown"), Setting(None, "unknown"), Setting(None, "unknown"), ())
    port = _int_setting(argv, ["--port"], env, "LLAMA_ARG_PORT")
    hosts_text = (_flag_values(argv, ["--host"])[-1:] or [env.get("LLAMA_ARG_HOST", "127.0.0.1")])[0]
    return ServerCommand(
        kind="llama-server",
        threads_http=_int_setting(argv, ["--threads-http"], env, "LLAMA_ARG_THREADS_HTTP"),
        parallel=_int_setting(argv, ["-np", "--parallel"], env, "LLAMA_ARG_N_PARALLEL"),
        port=port if port.value is not None else Setting(8080, "default"),
        hosts=tuple(host.strip() for host in hosts_text.split(",") if host.strip()),
    )
