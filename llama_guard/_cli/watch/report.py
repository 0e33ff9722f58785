"""What ``watch`` concludes about a server and how it says it (no I/O).

The risk rule: a build before b11737 (when the build is known) serving more client connections than its base
HTTP threads. Each base thread owns one keep-alive connection for that connection's whole life; the connections
beyond them depend on dynamic threads, which the defective pool fails to start when connections arrive in a burst.
Fewer connections than base threads cannot stall, whatever the build.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ..._core.llama_server import FIRST_FIXED_BUILD, build_has_pool_defect, build_number
from .cmdline import ServerCommand
from .procnet import Endpoint
from .stall import StallEvent

__all__ = ["Assessment", "ServerView", "assess", "describe_server", "event_line", "server_json"]

Risk = Literal["risk", "possible", "ok", "unknown"]

FIX = (
    f"upgrade llama-server to b{FIRST_FIXED_BUILD} or later, or start it with --threads-http above the number of "
    "connections its clients keep open; on the client side, llama_guard.GuardTransport moves unread connections aside"
)


@dataclass(frozen=True)
class ServerView:
    """One watched server as found: who it is and where it listens."""

    pid: int | None
    command: ServerCommand | None
    listen: tuple[Endpoint, ...]
    build_info: str | None
    #: How the build is known ("--version", "emulator command line") or why it is not.
    build_source: str

    @property
    def name(self) -> str:
        kind = self.command.kind if self.command is not None else "process"
        if kind == "other":
            kind = "process"
        who = f"{kind} pid {self.pid}" if self.pid is not None else "unknown process"
        where = ", ".join(str(endpoint) for endpoint in self.listen) or "no TCP listening socket"
        return f"{who} on {where}"


@dataclass(frozen=True)
class Assessment:
    risk: Risk
    base_threads: int | None
    message: str


def assess(view: ServerView, connections: int, cpus: int) -> Assessment:
    """The risk of the pool defect for a server holding ``connections`` established client connections."""
    base = view.command.base_http_threads(cpus) if view.command is not None else None
    number = build_number(view.build_info)
    defect = build_has_pool_defect(view.build_info)
    if base is None:
        return Assessment("unknown", None, f"{connections} client connections; base HTTP threads unknown")
    over = connections > base
    counted = f"{connections} client connections {'>' if over else '<='} {base} base HTTP threads"
    if not over:
        return Assessment("ok", base, f"ok: {counted}")
    if defect is None:
        return Assessment(
            "possible",
            base,
            f"possible risk: {counted}, and the build is unknown, so the pool defect of builds before "
            f"b{FIRST_FIXED_BUILD} cannot be ruled out (watch with --watch SECONDS to see stalls)",
        )
    if defect:
        return Assessment(
            "risk",
            base,
            f"RISK: build b{number} (before b{FIRST_FIXED_BUILD}) with {counted}: a burst of new connections can "
            f"leave requests unread. Fix: {FIX}",
        )
    return Assessment("ok", base, f"ok: {counted}, and build {view.build_info} has the fixed pool")


def _build_text(view: ServerView) -> str:
    if view.build_info is None:
        return f"unknown ({view.build_source})"
    number = build_number(view.build_info)
    if number is None:
        return f"{view.build_info} (from {view.build_source}): a build that does not know its number; unknown"
    verdict = "has the pool defect" if build_has_pool_defect(view.build_info) else "has the fixed pool"
    return f"{view.build_info} (from {view.build_source}): {verdict}"


def describe_server(view: ServerView, connections: int, unread: int, cpus: int) -> list[str]:
    """The lines ``watch`` prints for one server."""
    assessment = assess(view, connections, cpus)
    base = view.command.explain_base(cpus) if view.command is not None else "unknown (process not readable)"
    return [
        view.name,
        f"  build: {_build_text(view)}",
        f"  base HTTP threads: {base}",
        f"  client connections: {connections} established, {unread} with request bytes unread right now",
        f"  {assessment.message}",
    ]


def event_line(event: StallEvent) -> str:
    """``STALLED 127.0.0.1:18089<-127.0.0.1:54264: request unread for 38 s`` and its follow-ups."""
    gave_up = " (the client gave up and closed its end)" if event.client_gave_up else ""
    seconds = f"{int(event.seconds)} s"  # whole seconds, rounded down: "unread for 5 s" means at least 5 s
    if event.kind == "stalled":
        return f"STALLED {event.key}: request unread for {seconds}{gave_up}"
    if event.kind == "read":
        return f"SERVED {event.key}: request read after {seconds} unread{gave_up}"
    return f"GONE {event.key}: connection closed after {seconds} unread{gave_up}"


def server_json(view: ServerView, connections: int, max_connections: int, unread: int, cpus: int) -> dict[str, Any]:
    """One server for ``--json`` (never the full command line: it may hold an ``--api-key``)."""
    assessment = assess(view, max_connections, cpus)
    command = view.command
    return {
        "pid": view.pid,
        "kind": command.kind if command is not None else None,
        "listen": [str(endpoint) for endpoint in view.listen],
        "build_info": view.build_info,
        "build_source": view.build_source,
        "build_number": build_number(view.build_info),
        "build_has_pool_defect": build_has_pool_defect(view.build_info),
        "threads_http": None if command is None else command.threads_http.value,
        "parallel": None if command is None else command.parallel.value,
        "base_http_threads": assessment.base_threads,
        "base_http_threads_explained": None if command is None else command.explain_base(cpus),
        "connections": connections,
        "max_connections": max_connections,
        "unread_now": unread,
        "risk": assessment.risk,
        "message": assessment.message,
    }
