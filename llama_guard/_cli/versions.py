"""``llama-guard --version``: llama_guard's version on its first line (as before), then Python's and each HTTP library
the guard covers as installed here: whether the guard was tested with that version (its hooks are on) or what it
does without them.

What a bug report needs, and what a user checks after upgrading httpx or aiohttp: an untested version works, with one
warning at run time, but with less (see each ``internals.py``'s version gate). A library is imported only here, when
asked, so that ``--help`` and the other commands stay fast.
"""

from __future__ import annotations

import importlib.metadata
import platform
from collections.abc import Callable

__all__ = ["library_lines", "version_text"]


def _installed(*names: str) -> str | None:
    """``name version`` for each of ``names`` installed, joined; None when the first is not installed."""
    found = []
    for name in names:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            if not found:
                return None
    return ", ".join(found)


def _httpx_gate() -> str | None:
    from .._httpx.internals import untested_versions

    return untested_versions()


def _httpx2_gate() -> str | None:
    from .._httpx2.internals import untested_versions

    return untested_versions()


def _aiohttp_gate() -> str | None:
    from .._aiohttp.internals import unsupported_version, untested_version

    why = untested_version()
    if why is not None and unsupported_version() is None:  # untested, not unusable: install() differs from guard()
        why += "; install() and llama-guard run leave its sessions alone"
    return why


def _urllib3_gate() -> str | None:
    version = importlib.metadata.version("urllib3")
    return None if version.startswith("2.") else f"urllib3 {version} is not 2.x, the requests extra's pin"


# (packages as listed, the extra that brings them or None, the version gate: None when tested, else why not and
# what the guard does then; what it does on a tested version)
_LIBRARIES: tuple[tuple[tuple[str, ...], str | None, Callable[[], str | None], str], ...] = (
    (("httpx", "httpcore"), None, _httpx_gate, "tested, so the guard hooks its connection pool"),
    (("httpx2", "httpcore2"), "httpx2", _httpx2_gate, "tested, so the guard hooks its connection pool"),
    (("aiohttp",), "aiohttp", _aiohttp_gate, "tested, so the guard hooks its connector"),
    # urllib3 first: the guard covers its pools used directly too, with or without requests.
    (("urllib3", "requests"), "requests", _urllib3_gate, "urllib3 2.x, so the guard hooks its pools"),
)


def library_lines() -> list[str]:
    """One line per library the guard covers: installed or not, and what the guard does with that version."""
    lines = []
    for names, extra, gate, tested in _LIBRARIES:
        installed = _installed(*names)
        if installed is None:
            how = f"pip install 'llama-guard[{extra}]'" if extra is not None else "pip install httpx"
            lines.append(f"{names[0]}: not installed ({how})")
            continue
        try:
            reason = gate()
        except ImportError as exc:  # installed, but broken (a missing dependency of its own)
            lines.append(f"{installed}: cannot be imported ({exc})")
            continue
        lines.append(f"{installed}: {tested if reason is None else reason}")
    return lines


def version_text() -> str:
    from .. import __version__

    lines = [f"Python {platform.python_version()}", *library_lines()]
    return "\n".join([f"llama-guard {__version__}", *(f"  {line}" for line in lines)])
