"""The I/O half of ``watch``: read ``/proc`` (sockets, processes) and ask a llama-server binary its version.

Everything here is a thin read of one file or directory; the parsing lives in the pure modules
(``_procnet``, ``_watch_cmdline``, ``_core/llama_server.py``). ``/proc/net/tcp*`` shows the sockets of the network
namespace ``watch`` itself runs in: run it in the server's container or host namespace.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..._core.llama_server import version_build_info
from .procnet import TcpSocket, parse_tcp_table, socket_inode

__all__ = [
    "ProcessInfo",
    "WatchError",
    "check_proc",
    "list_pids",
    "owners_of",
    "read_process",
    "read_sockets",
    "running_build_info",
    "socket_inodes",
]

#: ``--version`` exits at once, before loading anything; more than this means something is wrong with it.
VERSION_TIMEOUT = 5.0


class WatchError(Exception):
    """watch cannot do its job here (not Linux, /proc unreadable, no server found); the message says why."""


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    argv: tuple[str, ...]
    #: The executable's path, or None when it cannot be read (another user's process without root).
    exe: str | None
    #: The environment, empty when it cannot be read.
    env: dict[str, str] = field(default_factory=dict)


def check_proc(proc: Path) -> None:
    """Raise WatchError unless this is Linux with a readable ``/proc/net/tcp``."""
    if not sys.platform.startswith("linux"):
        raise WatchError(f"watch reads Linux's /proc/net/tcp; this system is {sys.platform}")
    try:
        (proc / "net" / "tcp").read_bytes()
    except OSError as exc:
        raise WatchError(f"cannot read {proc / 'net' / 'tcp'}: {exc.strerror or exc}") from exc


def read_sockets(proc: Path) -> list[TcpSocket]:
    """Every TCP socket, IPv4 and IPv6 (``tcp6`` is absent when IPv6 is off)."""
    sockets: list[TcpSocket] = []
    for name in ("tcp", "tcp6"):
        try:
            text = (proc / "net" / name).read_text("ascii")
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise WatchError(f"cannot read {proc / 'net' / name}: {exc.strerror or exc}") from exc
        sockets.extend(parse_tcp_table(text))
    return sockets


def list_pids(proc: Path) -> list[int]:
    return sorted(int(entry.name) for entry in os.scandir(proc) if entry.name.isdigit())


def read_process(pid: int, proc: Path) -> ProcessInfo | None:
    """argv, executable and environment of ``pid``; None when it is gone (or a kernel thread, with no argv)."""
    base = proc / str(pid)
    try:
        raw = (base / "cmdline").read_bytes()
    except OSError:
        return None
    # NUL-separated, normally NUL-terminated (a process that rewrote its title may drop the last NUL).
    argv = tuple(part.decode("utf-8", "replace") for part in raw.rstrip(b"\0").split(b"\0")) if raw else ()
    if not argv:
        return None
    exe: str | None = None
    with contextlib.suppress(OSError):
        exe = os.readlink(base / "exe")
    env: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for item in (base / "environ").read_bytes().split(b"\0"):
            name, sep, value = item.decode("utf-8", "replace").partition("=")
            if sep and name.startswith("LLAMA_ARG_"):  # keep only what we read; never hold other secrets
                env[name] = value
    return ProcessInfo(pid, argv, exe, env)


def socket_inodes(pid: int, proc: Path) -> set[int]:
    """The inodes of the sockets ``pid`` holds; raises PermissionError for another user's process without root,
    FileNotFoundError when it is gone."""
    inodes: set[int] = set()
    fd_dir = proc / str(pid) / "fd"
    for entry in os.scandir(fd_dir):
        with contextlib.suppress(OSError):  # an fd closed while we look
            inode = socket_inode(os.readlink(entry.path))
            if inode is not None:
                inodes.add(inode)
    return inodes


def owners_of(inodes: set[int], proc: Path) -> dict[int, int]:
    """Which process holds each socket inode (those we may look at)."""
    owners: dict[int, int] = {}
    for pid in list_pids(proc):
        try:
            held = socket_inodes(pid, proc)
        except OSError:
            continue
        for inode in held & inodes:
            owners.setdefault(inode, pid)
    return owners


def running_build_info(info: ProcessInfo, proc: Path) -> tuple[str | None, str]:
    """The running llama-server's build (``b4589-1d1e6a90``) from ``--version``, and how we know or why not.

    Only for a process named llama-server (the caller checks), whose binary has not been replaced since it
    started. It runs ``/proc/PID/exe``, the very file the server runs, even when another file now has its path
    (an upgrade in place, another mount namespace). ``--version`` prints and exits before it reads any model or
    opens any port.
    """
    if info.exe is None:
        return None, "executable not readable (another user's process? run as root)"
    if info.exe.endswith(" (deleted)"):
        return None, "the binary was replaced since the server started"
    try:
        env = {key: value for key, value in os.environ.items() if not key.startswith("LLAMA_ARG_")}
        done = subprocess.run(
            [str(proc / str(info.pid) / "exe"), "--version"],
            capture_output=True,
            timeout=VERSION_TIMEOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"'{os.path.basename(info.exe)} --version' failed: {exc}"
    output = (done.stdout + done.stderr).decode("utf-8", "replace")
    build = version_build_info(output)
    if build is None:
        return None, f"'{os.path.basename(info.exe)} --version' printed no build"
    return build, "--version"
