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

__all__ = [
    "Assessment",
    "Counts",
    "Moment",
    "ServerView",
    "assess",
    "connections_text",
    "describe_server",
    "event_line",
    "server_json",
]

Risk = Literal["risk", "possible", "ok", "unknown"]
#: What a count of connections is: ``now``, one look; ``watching``, the first look of a ``--watch`` (so no hint
#: to watch); ``watched``, the most seen during a ``--watch`` (what the exit status is judged on).
Moment = Literal["now", "watching", "watched"]

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
class Counts:
    """A server's client connections in one sample of ``/proc/net/tcp*``, by state. A CLOSE-WAIT one was closed
    by its client and not yet by the server: a request still in it is unread, but nobody waits for the answer."""

    established: int = 0
    established_unread: int = 0
    close_wait: int = 0
    close_wait_unread: int = 0

    @property
    def unread(self) -> int:
        return self.established_unread + self.close_wait_unread


@dataclass(frozen=True)
class Assessment:
    risk: Risk
    base_threads: int | None
    message: str


def assess(view: ServerView, connections: int, cpus: int, when: Moment = "now") -> Assessment:
    """The risk of the pool defect for a server holding ``connections`` established client connections."""
    base = view.command.base_http_threads(cpus) if view.command is not None else None
    number = build_number(view.build_info)
    defect = build_has_pool_defect(view.build_info)
    # After a watch the verdict is on the most seen, which may not be what the first look printed: say so.
    held = f"{connections} client connections"
    if when == "watched":
        held = f"up to {held} during the watch"
    if base is None:
        return Assessment("unknown", None, f"{held}; base HTTP threads unknown")
    over = connections > base
    counted = f"{held} {'>' if over else '<='} {base} base HTTP threads"
    if not over:
        return Assessment("ok", base, f"ok: {counted}")
    if defect is None:
        hint = " (watch with --watch SECONDS to see stalls)" if when == "now" else ""  # not while watching
        return Assessment(
            "possible",
            base,
            f"possible risk: {counted}, and the build is unknown, so the pool defect of builds before "
            f"b{FIRST_FIXED_BUILD} cannot be ruled out{hint}",
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


def connections_text(counts: Counts) -> str:
    """``client connections: 6 established, 4 of them with request bytes unread right now``, and the CLOSE-WAIT
    ones apart: counted with the established ones, unread ones could outnumber the connections."""
    text = (
        f"client connections: {counts.established} established, "
        f"{counts.established_unread} of them with request bytes unread right now"
    )
    if counts.close_wait:
        text += (
            f"; {counts.close_wait} more closed by their client (CLOSE-WAIT), "
            f"{counts.close_wait_unread} of them with request bytes unread"
        )
    return text


def describe_server(view: ServerView, counts: Counts, cpus: int, when: Moment = "now") -> list[str]:
    """The lines ``watch`` prints for one server."""
    assessment = assess(view, counts.established, cpus, when)
    base = view.command.explain_base(cpus) if view.command is not None else "unknown (process not readable)"
    return [
        view.name,
        f"  build: {_build_text(view)}",
        f"  base HTTP threads: {base}",
        f"  {connections_text(counts)}",
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


def server_json(view: ServerView, counts: Counts, max_connections: int, cpus: int, when: Moment) -> dict[str, Any]:
    """One server for ``--json`` (never the full command line: it may hold an ``--api-key``). ``connections`` and
    ``unread_now`` keep their first meaning (established ones; unread ones of either state); the fields that
    count by state came later."""
    assessment = assess(view, max_connections, cpus, when)
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
        "connections": counts.established,
        "max_connections": max_connections,
        "unread_now": counts.unread,
        "established_unread_now": counts.established_unread,
        "close_wait_now": counts.close_wait,
        "close_wait_unread_now": counts.close_wait_unread,
        "risk": assessment.risk,
        "message": assessment.message,
    }
