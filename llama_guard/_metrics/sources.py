"""`stats_of()` and `result_of()`: a guarded client's counters and a response's account, whatever the stack.

A client guarded by `guard()` keeps its guard in private attributes (its transports, its mounts); these functions
reach them through the internals modules, so that user code needs neither ``client._transport`` nor to know which
stack it holds.
"""

from __future__ import annotations

import sys
from typing import Any

from .._core.result import EXTENSION, GuardResult
from .._core.stats import GuardStats

__all__ = ["SOURCE_KINDS", "kind_of", "result_of", "stats_of"]

#: What `stats_of` (and the exporters' ``sources``) take, in the plural.
SOURCE_KINDS = (
    "guarded httpx/httpx2 clients, aiohttp or requests sessions, guard transports or adapters, GuardMiddleware, "
    "Installations or GuardStats"
)


def kind_of(value: object) -> str:
    """``value``'s type as an error message names it: ``httpx.Client``, ``str``, ``llama_guard.GuardStats``."""
    cls = type(value)
    library = cls.__module__.partition(".")[0]
    return cls.__qualname__ if library == "builtins" else f"{library}.{cls.__qualname__}"


def stats_of(target: object) -> GuardStats:
    """The `GuardStats` that counts what the guard does for ``target``.

    ``target``: a client guarded with `guard()` or built with a guard transport (`httpx.Client`,
    `httpx.AsyncClient`, or their httpx2 twins), a guard transport, an aiohttp `ClientSession` guarded with
    ``llama_guard.aiohttp``, a `GuardMiddleware`, a `requests.Session` guarded with `guard()` or with a mounted
    ``GuardAdapter``, a ``GuardAdapter``, an `Installation`, or a `GuardStats`. A client or session that
    only `install()` guards gives the installation's counters. Raises `ValueError` for a client without a guard,
    and `TypeError` for anything else.
    """
    if isinstance(target, GuardStats):
        return target
    stats = getattr(target, "stats", None)
    if isinstance(stats, GuardStats):  # a transport of either flavour, GuardMiddleware, Installation
        return stats
    library = type(target).__module__.partition(".")[0]
    if library in ("httpx", "httpx2"):
        return _client_stats(target, library)
    if library == "aiohttp" and "llama_guard._aiohttp.session" in sys.modules:
        from .._aiohttp.session import guard_of

        guard = guard_of(target)  # type: ignore[arg-type]
        if guard is not None:
            return guard.stats
        return _installed_or_fail(target, "guard it with llama_guard.aiohttp.guard_session(session)")
    if library == "aiohttp":
        return _installed_or_fail(target, "guard it with llama_guard.aiohttp.guard_session(session)")
    requests = sys.modules.get("requests")
    if requests is not None and isinstance(target, requests.Session):
        from .._requests.adapter import guard_of as requests_guard_of

        found = requests_guard_of(target)
        if found is not None:
            return found
        return _installed_or_fail(target, "guard it with llama_guard.guard(session)")
    raise TypeError(
        "stats_of() takes a guarded httpx/httpx2 client, an aiohttp or requests session, a guard transport or "
        f"adapter, an Installation or a GuardStats; got {type(target).__name__}"
    )


def _client_stats(client: Any, library: str) -> GuardStats:
    if library == "httpx":
        from .._httpx.internals import client_transports
    else:
        from .._httpx2.internals import client_transports
    try:
        transport, mounts = client_transports(client)
    except AttributeError:  # not a client: a request, a response...
        raise TypeError(f"stats_of() takes a client, not an {library} {type(client).__name__}") from None
    found: list[GuardStats] = []
    for candidate in (transport, *mounts.values()):
        stats = getattr(candidate, "stats", None)
        if isinstance(stats, GuardStats) and not any(stats is seen for seen in found):
            found.append(stats)
    if len(found) == 1:
        return found[0]
    if found:
        raise ValueError(
            f"this client has {len(found)} guard transports with counters of their own (its transport and mounts): "
            "read each transport's stats, or guard the client with llama_guard.guard(client), whose transports "
            "share one GuardStats"
        )
    return _installed_or_fail(client, "guard it with llama_guard.guard(client)")


def _installed_or_fail(target: object, how: str) -> GuardStats:
    from .._install.patching import installation

    current = installation()
    if current is not None:
        return current.stats
    raise ValueError(f"this {type(target).__name__} has no guard: {how}, or call llama_guard.install()")


def result_of(response: object) -> GuardResult | None:
    """The guard's account (`GuardResult`) for ``response``, an httpx/httpx2 ``Response``, an aiohttp
    ``ClientResponse``, a `requests.Response` or a urllib3 response; None for a response the guard let by (another
    origin)."""
    extensions = getattr(response, "extensions", None)
    if isinstance(extensions, dict):
        result = extensions.get(EXTENSION)
        return result if isinstance(result, GuardResult) else None
    if type(response).__module__.partition(".")[0] == "aiohttp":
        if "llama_guard._aiohttp.middleware" not in sys.modules:
            return None  # no aiohttp guard was ever made in this process
        from .._aiohttp.middleware import guard_result

        return guard_result(response)  # type: ignore[arg-type]
    if type(response).__module__.partition(".")[0] in ("requests", "urllib3"):
        if "llama_guard._requests.pool_guard" not in sys.modules:
            return None  # no requests/urllib3 guard was ever made in this process
        from .._requests.adapter import result_of as requests_result_of

        return requests_result_of(response)
    raise TypeError(
        "result_of() takes an httpx/httpx2 Response, an aiohttp ClientResponse, a requests Response or a urllib3 "
        f"response; got {type(response).__name__}"
    )
