"""``llama-guard watch``: look at running llama-servers from their own host, through ``/proc``.

Finds the servers (every process named llama-server, or ``--pid``/``--port``), reads their settings from the
command line, counts their client connections and flags the pool defect's risk. With ``--watch SECONDS`` it
samples the servers' sockets every second and reports each connection whose request stays unread (Recv-Q > 0,
never shrinking) for ``--stall-seconds``. Exit status: 0 nothing found, 1 a stall or a risk, 2 could not run,
130 interrupted.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

from ..exits import EXIT_INTERRUPTED, run_command
from .cmdline import ServerCommand, is_llama_server, parse_server_command
from .proc import (
    ProcessInfo,
    WatchError,
    check_proc,
    list_pids,
    owners_of,
    read_process,
    read_sockets,
    running_build_info,
    socket_inodes,
)
from .procnet import CLOSE_WAIT, ESTABLISHED, LISTEN, TcpSocket
from .report import Counts, Moment, ServerView, assess, describe_server, event_line, server_json
from .stall import ConnectionKey, QueueSample, StallEvent, StallTracker

__all__ = ["WatchOptions", "run_watch"]


@dataclass(frozen=True)
class WatchOptions:
    pids: tuple[int, ...] = ()
    ports: tuple[int, ...] = ()
    #: Watch for this long; None: one look, no stall detection.
    seconds: float | None = None
    stall_seconds: float = 5.0
    interval: float = 1.0
    json: bool = False
    proc: Path = field(default_factory=lambda: Path("/proc"))


def _view_of(info: ProcessInfo, listen: Iterable[TcpSocket], proc: Path) -> ServerView:
    command = parse_server_command(info.argv, info.env, info.exe)
    if command.kind == "llama-server":
        build, source = running_build_info(info, proc)
    elif command.kind == "emulator":
        build, source = command.build_info, "the emulator's command line"
    else:
        build, source = None, "not a llama-server process"
    endpoints = tuple(sorted({sock.local for sock in listen}))
    return ServerView(info.pid, command, endpoints, build, source)


def _listeners_by_port(command: ServerCommand, listeners: list[TcpSocket]) -> list[TcpSocket]:
    port = command.port.value
    return [sock for sock in listeners if port is not None and sock.local.port == port]


def find_servers(options: WatchOptions, sockets: list[TcpSocket]) -> list[ServerView]:
    """The servers to watch; WatchError when there is none, or one asked for cannot be found."""
    proc = options.proc
    listeners = [sock for sock in sockets if sock.state == LISTEN]
    views: list[ServerView] = []
    for pid in dict.fromkeys(options.pids):  # each asked for once, in the order given
        info = read_process(pid, proc)
        if info is None:
            raise WatchError(f"no process with pid {pid}")
        try:
            inodes = socket_inodes(pid, proc)
        except PermissionError as exc:
            raise WatchError(f"cannot read {proc}/{pid}/fd: permission denied (run as root or as its user)") from exc
        except FileNotFoundError as exc:
            raise WatchError(f"no process with pid {pid}") from exc
        listen = [sock for sock in listeners if sock.inode in inodes]
        if not listen:
            raise WatchError(f"pid {pid} has no listening TCP socket (a server on a UNIX socket cannot be watched)")
        views.append(_view_of(info, listen, proc))
    for port in dict.fromkeys(options.ports):
        listen = [sock for sock in listeners if sock.local.port == port]
        if not listen:
            raise WatchError(f"nothing listens on TCP port {port}")
        owners = owners_of({sock.inode for sock in listen}, proc)
        pids = sorted({owners[sock.inode] for sock in listen if sock.inode in owners})
        infos = [info for pid in pids if (info := read_process(pid, proc)) is not None]
        if not infos:  # another user's server: its sockets are still visible, its settings are not
            endpoints = tuple(sorted({sock.local for sock in listen}))
            views.append(ServerView(None, None, endpoints, None, "process not readable"))
        for info in infos:
            views.append(_view_of(info, [sock for sock in listen if owners.get(sock.inode) == info.pid], proc))
    if options.pids or options.ports:
        return _one_view_per_process(views)
    for pid in list_pids(proc):
        info = read_process(pid, proc)
        if info is None or not is_llama_server(info.argv, info.exe):
            continue
        try:
            inodes = socket_inodes(pid, proc)
            listen = [sock for sock in listeners if sock.inode in inodes]
        except PermissionError:  # fall back on the port of its command line
            listen = _listeners_by_port(parse_server_command(info.argv, info.env, info.exe), listeners)
        except FileNotFoundError:
            continue
        views.append(_view_of(info, listen, proc))
    if not views:
        raise WatchError(
            "no running llama-server found (looked for processes whose executable is named llama-server); "
            "name one with --pid PID or --port PORT"
        )
    return views


def _one_view_per_process(views: list[ServerView]) -> list[ServerView]:
    """``--pid P --port X`` of the same process is one server (one thread pool), listening on all it was found on."""
    merged: list[ServerView] = []
    index_of: dict[int, int] = {}
    for view in views:
        if view.pid is None or view.pid not in index_of:
            if view.pid is not None:
                index_of[view.pid] = len(merged)
            merged.append(view)
            continue
        first = merged[index_of[view.pid]]
        merged[index_of[view.pid]] = replace(first, listen=tuple(sorted({*first.listen, *view.listen})))
    return merged


def _connections(view: ServerView, sockets: list[TcpSocket]) -> dict[ConnectionKey, TcpSocket]:
    """The server's client connections: its end matches one of its listening endpoints."""
    found: dict[ConnectionKey, TcpSocket] = {}
    for sock in sockets:
        if sock.state in (ESTABLISHED, CLOSE_WAIT) and any(ep.accepts(sock.local) for ep in view.listen):
            found[ConnectionKey(sock.local, sock.remote)] = sock
    return found


def _counts(connections: dict[ConnectionKey, TcpSocket]) -> Counts:
    socks = connections.values()
    return Counts(
        established=sum(1 for sock in socks if sock.state == ESTABLISHED),
        established_unread=sum(1 for sock in socks if sock.state == ESTABLISHED and sock.unread > 0),
        close_wait=sum(1 for sock in socks if sock.state == CLOSE_WAIT),
        close_wait_unread=sum(1 for sock in socks if sock.state == CLOSE_WAIT and sock.unread > 0),
    )


def _alive(view: ServerView, proc: Path) -> bool:
    return view.pid is None or (proc / str(view.pid)).exists()


@dataclass
class _Watched:
    view: ServerView
    max_established: int = 0
    last: Counts = field(default_factory=Counts)
    exited: bool = False


def run_watch(options: WatchOptions, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run ``watch``; returns the exit status. Problems that stop it are one line on ``err`` and status 2."""

    def body(out: TextIO, err: TextIO) -> int:
        return _watch_servers(options, out, err)

    return run_command("watch", body, WatchError, out=out, err=err, json=options.json)


def _watch_servers(options: WatchOptions, out: TextIO, err: TextIO) -> int:
    check_proc(options.proc)
    cpus = os.cpu_count() or 1
    sockets = read_sockets(options.proc)
    watched = [_Watched(view) for view in find_servers(options, sockets)]
    first_look: Moment = "now" if options.seconds is None else "watching"
    for item in watched:
        item.last = _counts(_connections(item.view, sockets))
        item.max_established = item.last.established
        if not options.json:
            print("\n".join(describe_server(item.view, item.last, cpus, first_look)), file=out)
    events: list[tuple[float, StallEvent]] = []
    tracker = StallTracker(options.stall_seconds)
    started = time.monotonic()
    was_interrupted = False
    if options.seconds is not None:
        print(
            f"watching {len(watched)} server(s) for {options.seconds:g} s: sampling every {options.interval:g} s, "
            f"a request unread for {options.stall_seconds:g} s is a stall ...",
            file=err,
            flush=True,
        )
        if options.seconds < options.stall_seconds:
            print(
                f"llama-guard watch: note: --watch {options.seconds:g} s is shorter than --stall-seconds "
                f"{options.stall_seconds:g} s: no stall can be seen in this watch, only the connection counts",
                file=err,
                flush=True,
            )
        try:
            _sample_loop(options, watched, tracker, events, started, out)
        except KeyboardInterrupt:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            print("llama-guard watch: interrupted; what was seen so far follows", file=err, flush=True)
            was_interrupted = True
    last_look: Moment = "now" if options.seconds is None else "watched"
    risks = [assess(item.view, item.max_established, cpus, last_look) for item in watched]
    at_risk = sum(1 for risk in risks if risk.risk == "risk")
    code = EXIT_INTERRUPTED if was_interrupted else 1 if at_risk or tracker.stalled else 0
    if options.json:
        document: dict[str, Any] = {
            "servers": [server_json(item.view, item.last, item.max_established, cpus, last_look) for item in watched],
            "watch": None
            if options.seconds is None
            else {
                "seconds": options.seconds,
                "stall_seconds": options.stall_seconds,
                "events": [
                    {
                        "at": round(at, 3),
                        "kind": event.kind,
                        "server": str(event.key.server),
                        "client": str(event.key.client),
                        "seconds": round(event.seconds, 3),
                        "client_gave_up": event.client_gave_up,
                    }
                    for at, event in events
                ],
                "stalled": [
                    {"server": str(key.server), "client": str(key.client), "longest_unread": round(seconds, 3)}
                    for key, seconds in sorted(tracker.stalled.items())
                ],
            },
            "exit_code": code,
        }
        print(json.dumps(document, indent=2), file=out)
    elif options.seconds is not None:
        # The exit status is judged on the most connections seen, which the first look may not have shown: each
        # server's verdict on them, then the summary, so that the last line says what the exit status says.
        for item, risk in zip(watched, risks, strict=True):
            print(f"{item.view.name}: {risk.message}", file=out)
        # The time asked for (or less, when interrupted), not what the last slow read of /proc stretched it to.
        elapsed = min(time.monotonic() - started, options.seconds)
        print(_summary(tracker, elapsed, options.stall_seconds, at_risk), file=out)
    elif len(watched) > 1:  # one look at several servers: the last one's verdict is not the exit status's
        print(f"{len(watched)} servers, {at_risk or 'none'} at RISK", file=out)
    return code


def _sample_loop(
    options: WatchOptions,
    watched: list[_Watched],
    tracker: StallTracker,
    events: list[tuple[float, StallEvent]],
    started: float,
    out: TextIO,
) -> None:
    assert options.seconds is not None
    end = started + options.seconds
    tick = 0
    while True:
        now = time.monotonic()
        sockets = read_sockets(options.proc)
        samples: dict[ConnectionKey, QueueSample] = {}
        for item in watched:
            if item.exited:
                continue
            if not _alive(item.view, options.proc):
                item.exited = True
                print(f"{item.view.name}: the process exited", file=out, flush=True)
                continue
            connections = _connections(item.view, sockets)
            item.last = _counts(connections)
            item.max_established = max(item.max_established, item.last.established)
            samples.update({key: QueueSample(sock.unread, sock.state) for key, sock in connections.items()})
        for event in tracker.update(now, samples):
            events.append((now - started, event))
            if not options.json:
                print(event_line(event), file=out, flush=True)
        if now >= end or all(item.exited for item in watched):
            return
        tick += 1
        # On a fixed grid from the start, so a slow read does not stretch the threshold.
        time.sleep(max(0.0, min(started + tick * options.interval, end) - time.monotonic()))


def _summary(tracker: StallTracker, elapsed: float, stall_seconds: float, at_risk: int) -> str:
    """The last line of a watch: the stalls seen, and the servers at risk (either one makes the exit status 1)."""
    risk = f"{at_risk} server(s) at RISK (above)" if at_risk else ""
    if not tracker.stalled:
        text = f"no stalled connection in {elapsed:.0f} s"
        if elapsed < stall_seconds:
            text += f" (too short to see one: a stall takes --stall-seconds {stall_seconds:g} s)"
        return f"{text}, but {risk}" if risk else text
    still = len(tracker.unread_now())
    longest = max(tracker.stalled.values())
    text = (
        f"{len(tracker.stalled)} stalled connection(s) in {elapsed:.0f} s (longest unread {longest:.0f} s, "
        f"{still} still unread at the end)"
    )
    return f"{text}, and {risk}" if risk else text
