"""What llama-server does that the guard depends on, in one place: its keep-alive, its health path, the statuses it
retries with, and its build numbers (read from ``/props`` or ``--version``, compared with the pool fix). No I/O.

llama-server reports its build as ``build_info`` in ``GET /props`` (``b11434-1a2b3c4d``: ``b``, the build number,
the commit) and prints it with ``--version``. Builds made from a source archive without git (PyPI's sdist, some
distribution packages) know neither: they say ``b0-unknown``, and ``--version`` prints ``build 0, commit unknown``.
Such a build number tells nothing, so callers get None for it and must judge by behaviour.

A build whose commit field is ``fixedpool`` (``b11434-fixedpool``) carries cpp-httplib's thread-pool fix whatever
its number: ``scripts/get_llama_server.py --fixed-pool`` builds b11434 with the fix applied and names it so, as
the comparison server of the tests and benchmarks.
"""

from __future__ import annotations

import re

__all__ = [
    "CLIENT_KEEPALIVE",
    "FIRST_FIXED_BUILD",
    "HEALTH_PATH",
    "RETRIED_STATUSES",
    "SERVER_KEEPALIVE",
    "POOL_FIX_TAG",
    "build_has_pool_defect",
    "build_number",
    "has_pool_defect",
    "pool_fix_applied",
    "version_build_info",
]

#: How long llama-server keeps an idle keep-alive connection (``Keep-Alive: timeout=5``, cpp-httplib's default).
SERVER_KEEPALIVE = 5.0
#: How long the guard's pools keep one: a second less, so that a pool never picks a connection at the moment the
#: server closes it (httpx's default expiry is 5 s too, aiohttp's 15 s).
CLIENT_KEEPALIVE = SERVER_KEEPALIVE - 1.0
#: What the probe asks for: cheap, answered while a model loads (503), and on every build.
HEALTH_PATH = "/health"
#: The statuses a request may be retried on: 503 while a model loads (or no slot is free), 429 (a proxy's limit).
RETRIED_STATUSES = frozenset({429, 503})

#: The first llama.cpp build whose cpp-httplib thread pool starts the threads a burst of connections needs.
FIRST_FIXED_BUILD = 11737

#: The commit field of a build patched with the thread-pool fix (``b11434-fixedpool``).
POOL_FIX_TAG = "fixedpool"

_BUILD_INFO = re.compile(r"^b(\d+)(?:-|$)")
# "version: 0.6.0-dev (build 11434, commit 1a2b3c4d)" (recent) and "version: 4589 (1d1e6a90)" (older builds).
_VERSION_NEW = re.compile(r"^version: .*\(build (\d+), commit ([^)\s]*)\)", re.MULTILINE)
_VERSION_OLD = re.compile(r"^version: (\d+) \(([^)\s]*)\)", re.MULTILINE)


def build_number(build_info: str | None) -> int | None:
    """``b11434-1a2b3c4d`` -> 11434; None when absent, malformed or ``b0`` (a build that does not know itself)."""
    if not build_info:
        return None
    match = _BUILD_INFO.match(build_info.strip())
    if match is None:
        return None
    number = int(match.group(1))
    return number if number > 0 else None


def version_build_info(output: str) -> str | None:
    """The ``build_info`` string (``b4589-1d1e6a90``) that ``llama-server --version`` printed, or None."""
    for pattern in (_VERSION_NEW, _VERSION_OLD):
        match = pattern.search(output)
        if match is not None:
            return f"b{match.group(1)}-{match.group(2)}"
    return None


def has_pool_defect(number: int | None) -> bool | None:
    """True for builds before the fix, False from it on, None when the build is unknown."""
    if number is None:
        return None
    return number < FIRST_FIXED_BUILD


def pool_fix_applied(build_info: str | None) -> bool:
    """True for ``b<N>-fixedpool``: an older build with the thread-pool fix applied (see the module docstring)."""
    if not build_info:
        return False
    return re.fullmatch(rf"b\d+-{POOL_FIX_TAG}", build_info.strip()) is not None


def build_has_pool_defect(build_info: str | None) -> bool | None:
    """``has_pool_defect`` for a ``build_info`` string, a patched build counting as fixed."""
    if pool_fix_applied(build_info):
        return False
    return has_pool_defect(build_number(build_info))
